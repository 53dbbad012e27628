"""AdmissionCore: intake (handle_submit / handle_cancel) and decide."""

from __future__ import annotations

import copy
import json

import pytest

from schemas import DEFAULT_PRIORITY_CLASSES, FailureReason, JobAdmitted, JobCancelRequested, JobRejected, JobSubmitted, RejectReason
from schemas.commands import MAX_COMMAND_BYTES, job_id_for_key
from services.admission.domain import AdmissionCore, PoisonCommand
from tests.unit.builders import (
    sender,
    T0,
    at,
    cancelled,
    drive,
    failed,
    node,
    node_lost,
    node_updated,
    preempted,
    queue,
    spec_dict,
    submit_payload,
    succeeded,
)


def raw(payload) -> bytes:
    return json.dumps(payload).encode()


def core_with(*events) -> AdmissionCore:
    core = AdmissionCore()
    for e in events:
        core.evolve(e)
    return core


def submit(core: AdmissionCore, payload, *, team: str = "team-a", user: str | None = None, seq: int = 1,
           evolve: bool = True):
    out = core.handle_submit(payload if isinstance(payload, bytes) else raw(payload), sender(team, user), seq, T0)
    if evolve:
        for e in out:
            core.evolve(e)
    return out


def only_rejection(out) -> JobRejected:
    assert len(out) == 1
    (event,) = out
    assert isinstance(event, JobRejected)
    return event


# -- handle_submit -----------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"not json", b"{", b"\xff\xfe\x00", b""])
def test_non_json_is_poison(data):
    with pytest.raises(PoisonCommand, match="not JSON"):
        AdmissionCore().handle_submit(data, sender("team-a"), 1, T0)


@pytest.mark.parametrize(
    "payload, field, fragment",
    [
        ([1, 2, 3], "(root)", "(root): Input should be an object"),
        ("just a string", "(root)", "should be an object"),
        (submit_payload(spec_dict(gpus=-1)), "spec.gpus", "spec.gpus: Input should be greater than or equal to 0; got -1"),
        (submit_payload(spec_dict(gpus=65)), "spec.gpus", "less than or equal to 64"),
        (submit_payload(spec_dict(queue="Bad_Queue")), "spec.queue", "spec.queue: String should match pattern"),
        (submit_payload(spec_dict(gpus="eight")), "spec.gpus", "valid integer"),
        ({"spec": spec_dict(), "submitter": 7}, "submitter", "submitter: Input should be a valid string"),
        (submit_payload(spec_dict(), job_id="Has.Dots"), "job_id", "job_id: String should match pattern"),
        (submit_payload(spec_dict(retry={"max_attempts": 99})), "spec.retry.max_attempts", "less than or equal to 20"),
        (submit_payload(spec_dict(max_runtime_seconds=10, expected_runtime_seconds=20)), "spec",
         "expected_runtime_seconds 20.0 exceeds max_runtime_seconds 10"),
        (submit_payload(spec_dict(), extra_field=1), "extra_field", "Extra inputs are not permitted"),
    ],
)
def test_schema_invalid(payload, field, fragment):
    event = only_rejection(AdmissionCore().handle_submit(raw(payload), sender("team-a"), 12, T0))
    assert event.reason == RejectReason.SCHEMA_INVALID
    assert event.field == field
    assert fragment in event.message
    assert event.aggregate_id == "rejected-12"
    assert event.intake_sequence == 12
    assert event.occurred_at == T0


def test_schema_invalid_keeps_the_requested_job_id_and_counts_more_errors():
    payload = submit_payload(spec_dict(gpus=-1, gang_size=0), job_id="my-job")
    event = only_rejection(AdmissionCore().handle_submit(raw(payload), sender("team-a"), 3, T0))
    assert event.requested_job_id == "my-job"
    assert event.message.endswith("(and 1 more error(s))")


def test_oversize_payload():
    payload = submit_payload(spec_dict(annotations={"pad": "x" * 4000, **{f"k{i}": "y" * 4000 for i in range(20)}}))
    data = raw(payload)
    assert len(data) > MAX_COMMAND_BYTES
    event = only_rejection(AdmissionCore().handle_submit(data, sender("team-a"), 5, T0))
    assert event.reason == RejectReason.PAYLOAD_TOO_LARGE
    assert event.field == "(root)"
    assert f"command is {len(data)} bytes; accepted: at most {MAX_COMMAND_BYTES} bytes" == event.message
    # checked before parsing: even non-JSON of that size is a rejection, not poison
    junk = b"x" * (MAX_COMMAND_BYTES + 1)
    assert only_rejection(AdmissionCore().handle_submit(junk, sender("team-a"), 6, T0)).reason == RejectReason.PAYLOAD_TOO_LARGE
    # exactly at the limit is parsed
    exact = b" " * (MAX_COMMAND_BYTES - 2) + b"[]"
    assert only_rejection(AdmissionCore().handle_submit(exact, sender("team-a"), 7, T0)).reason == RejectReason.SCHEMA_INVALID


def test_team_must_match_subject():
    event = only_rejection(AdmissionCore().handle_submit(raw(submit_payload(job_id="j1")), sender("team-b"), 2, T0))
    assert event.reason == RejectReason.FORBIDDEN
    assert event.field == "spec.team"
    assert event.accepted == ("team-b",)
    assert event.requested_job_id == "j1"
    assert "'team-a' does not match the intake subject's team 'team-b'" in event.message


def test_valid_submit_becomes_job_submitted():
    core = AdmissionCore()
    (event,) = core.handle_submit(raw(submit_payload(job_id="j1", submitter="bob")), sender("team-a", "bob"), 9, T0)
    assert isinstance(event, JobSubmitted)
    assert event.aggregate_id == "j1"
    assert event.submitter == "bob"
    assert event.intake_sequence == 9
    assert event.spec.gpus == 1 and event.spec.team == "team-a"
    assert event.producer == "admission"


@pytest.mark.parametrize(
    "job_id, key, seq, expected",
    [
        ("given", None, 4, "given"),
        (None, None, 4, "j-4"),
        (None, "run-1", 4, job_id_for_key("team-a", "run-1")),
        ("given", "run-1", 4, "given"),
    ],
)
def test_job_id_assignment(job_id, key, seq, expected):
    s = spec_dict(idempotency_key=key) if key else spec_dict()
    (event,) = AdmissionCore().handle_submit(raw(submit_payload(s, job_id=job_id)), sender("team-a"), seq, T0)
    assert event.aggregate_id == expected
    assert job_id_for_key("team-a", "run-1").startswith("j-") and len(job_id_for_key("team-a", "run-1")) == 22


# -- idempotency -------------------------------------------------------------------------------


def test_same_key_same_spec_is_an_idempotent_resubmission():
    core = AdmissionCore()
    payload = submit_payload(spec_dict(idempotency_key="k1"))
    (first,) = submit(core, payload, seq=1)
    assert submit(core, payload, seq=2) == []
    assert core.state.jobs[first.aggregate_id].intake_sequence == 1


def test_same_key_different_spec_is_rejected():
    core = AdmissionCore()
    (first,) = submit(core, submit_payload(spec_dict(idempotency_key="k1")), seq=1)
    event = only_rejection(submit(core, submit_payload(spec_dict(idempotency_key="k1", gpus=2)), seq=2))
    assert event.reason == RejectReason.DUPLICATE_IDEMPOTENCY_KEY
    assert event.field == "spec.idempotency_key"
    assert event.aggregate_id == "rejected-2"
    assert first.aggregate_id in event.message and "intake sequence 1" in event.message


def test_same_key_same_spec_different_job_id_is_rejected():
    core = AdmissionCore()
    submit(core, submit_payload(spec_dict(idempotency_key="k1"), job_id="a1"), seq=1)
    event = only_rejection(submit(core, submit_payload(spec_dict(idempotency_key="k1"), job_id="a2"), seq=2))
    assert event.reason == RejectReason.DUPLICATE_IDEMPOTENCY_KEY
    assert event.requested_job_id == "a2"


def test_same_key_other_team_is_a_different_job():
    core = AdmissionCore()
    (a,) = submit(core, submit_payload(spec_dict(idempotency_key="k1")), seq=1)
    (b,) = submit(core, submit_payload(spec_dict(idempotency_key="k1", team="team-b")), team="team-b", seq=2)
    assert isinstance(b, JobSubmitted) and a.aggregate_id != b.aggregate_id


def test_reused_job_id_is_rejected():
    core = AdmissionCore()
    submit(core, submit_payload(job_id="j1"), seq=1)
    event = only_rejection(submit(core, submit_payload(spec_dict(gpus=4), job_id="j1"), seq=2))
    assert event.reason == RejectReason.DUPLICATE_JOB_ID
    assert event.field == "job_id"
    assert event.requested_job_id == "j1"
    assert event.aggregate_id == "rejected-2"
    assert "'j1' already exists (intake sequence 1)" in event.message


@pytest.mark.parametrize(
    "payload",
    [
        submit_payload(job_id="j1"),
        submit_payload(),
        submit_payload(spec_dict(idempotency_key="k1")),
        submit_payload(spec_dict(idempotency_key="k1"), job_id="j1"),
    ],
    ids=["job-id", "assigned", "keyed", "keyed-with-id"],
)
def test_redelivery_of_the_same_intake_sequence_decides_nothing(payload):
    core = AdmissionCore()
    (first,) = submit(core, payload, seq=7)
    assert isinstance(first, JobSubmitted)
    assert submit(core, payload, seq=7) == []


def test_redelivered_malformed_command_gets_the_same_rejection_id():
    a = AdmissionCore().handle_submit(b"[]", sender("team-a"), 3, T0)
    b = AdmissionCore().handle_submit(b"[]", sender("team-a"), 3, at(99))
    assert a[0].event_id == b[0].event_id


# -- decide ------------------------------------------------------------------------------------


def submitted_core(*config, payload=None, seq: int = 1, user: str = "alice") -> tuple[AdmissionCore, str]:
    core = core_with(*config)
    (event,) = submit(core, payload or submit_payload(job_id="j1"), user=user, seq=seq)
    return core, event.aggregate_id


QUEUES = (
    queue("research", ("team-a", "team-b"), {"a100": 8, "h100": 16}),
    queue("product", ("team-p",), {"l4": 4}, allowed_priority_classes=("inference-sla", "training")),
    queue("vip", ("team-a",), {"a100": 8}, allowed_users=("carol",)),
)


@pytest.mark.parametrize(
    "spec_overrides, reason, field, accepted, fragment",
    [
        # a team is told of its own queues only: never of another team's queue, nor of other teams
        ({"queue": "nope"}, RejectReason.UNKNOWN_QUEUE, "spec.queue", ("research", "vip"),
         "spec.queue 'nope' does not exist; accepted: the queues of team 'team-a': research, vip"),
        ({"queue": "product"}, RejectReason.FORBIDDEN, "spec.queue", ("research", "vip"),
         "team 'team-a' may not submit to queue 'product'; accepted: the queues of team 'team-a': research, vip"),
        ({"queue": "vip"}, RejectReason.FORBIDDEN, "submitter", ("carol",),
         "user 'alice' may not submit to queue 'vip'; accepted users: carol"),
        ({"priority_class": "nonexistent"}, RejectReason.SCHEMA_INVALID, "spec.priority_class",
         tuple(sorted(DEFAULT_PRIORITY_CLASSES)), "spec.priority_class 'nonexistent' is not accepted"),
        ({"gpu_flavors": ["a100", "tpu-v5"]}, RejectReason.UNKNOWN_FLAVOR, "spec.gpu_flavors", ("a100", "h100"),
         "includes flavor(s) ['tpu-v5'] that queue 'research' has no quota for; accepted: a100, h100"),
    ],
)
def test_decide_rejections(spec_overrides, reason, field, accepted, fragment):
    core, job_id = submitted_core(*QUEUES, payload=submit_payload(spec_dict(**spec_overrides), job_id="j1"))
    (event,) = core.decide(at(1))
    assert isinstance(event, JobRejected)
    assert (event.reason, event.field, event.accepted) == (reason, field, accepted)
    assert fragment in event.message
    assert event.aggregate_id == job_id
    assert event.intake_sequence == 1
    assert event.occurred_at == at(1)
    assert event.causation_id == core.state.jobs[job_id].submitted.event_id


def test_unknown_queue_with_no_queues_configured():
    core, _ = submitted_core()
    (event,) = core.decide(T0)
    assert event.reason == RejectReason.UNKNOWN_QUEUE
    assert event.accepted == ()
    assert "accepted: the queues of team 'team-a': (none configured)" in event.message


def test_priority_class_not_allowed_on_queue_is_forbidden():
    core = core_with(*QUEUES)
    submit(core, submit_payload(spec_dict(queue="product", team="team-p", priority_class="batch-low"), job_id="j1"),
           team="team-p")
    (event,) = core.decide(T0)
    assert event.reason == RejectReason.FORBIDDEN
    assert event.field == "spec.priority_class"
    assert event.accepted == ("inference-sla", "training")


def test_queue_without_quotas_is_unknown_flavor_for_gpu_jobs_but_fine_for_cpu_jobs():
    core = core_with(queue("cpu", ("team-a",), {}))
    submit(core, submit_payload(spec_dict(queue="cpu"), job_id="gpu-job"), seq=1)
    submit(core, submit_payload(spec_dict(queue="cpu", gpus=0), job_id="cpu-job"), seq=2)
    by_job = {e.aggregate_id: e for e in core.decide(T0)}
    assert by_job["gpu-job"].reason == RejectReason.UNKNOWN_FLAVOR
    assert isinstance(by_job["cpu-job"], JobAdmitted)


@pytest.mark.parametrize(
    "spec_overrides, nodes, at_fault",
    [
        ({"gpus": 8}, [node("n1", "a100", 8)], None),
        ({"gpus": 9, "gpu_flavors": ["a100"]}, [node("n1", "a100", 8)], "spec.gpus"),
        # no h100 node registered yet: the benefit of the doubt
        ({"gpus": 9}, [node("n1", "a100", 8)], None),
        ({"gpus": 1}, [node("x1", "l4", 64)], None),
        # every allowed flavor known: one big enough suffices, all too small rejects
        ({"gpus": 9}, [node("n1", "a100", 8), node("h1", "h100", 16)], None),
        ({"gpus": 17}, [node("n1", "a100", 8), node("h1", "h100", 16)], "spec.gpus"),
        ({"gpus": 9, "gpu_flavors": ["a100"]}, [node("n1", "a100", 8), node("h1", "h100", 16)], "spec.gpus"),
        # gang of two, one node
        ({"gpus": 4, "gang_size": 2, "gpu_flavors": ["a100"]}, [node("n1", "a100", 8)], "spec.gang_size"),
        ({"gpus": 4, "gang_size": 2, "gpu_flavors": ["a100"]}, [node("n1", "a100", 8), node("n2", "a100", 4)], None),
        ({"gpus": 1, "min_gpu_memory_mib": 100_000, "gpu_flavors": ["a100"]}, [node("n1", "a100", 8)],
         "spec.min_gpu_memory_mib"),
        ({"gpus": 1, "node_features": ["rdma"], "gpu_flavors": ["a100"]}, [node("n1", "a100", 8)],
         "spec.node_features"),
        ({"gpus": 1, "node_features": ["rdma"], "gpu_flavors": ["a100"]},
         [node("n1", "a100", 8, features=("rdma", "nvlink"))], None),
        ({"gpus": 0}, [node("n1", "a100", 1)], None),  # CPU-only work is not checked
        # GPU models: any one of them will do
        ({"gpus": 1, "gpu_models": ["T4", "A10"], "gpu_flavors": ["a100"]},
         [node("n1", "a100", 8, gpu_product="NVIDIA-A100")], "spec.gpu_models"),
        ({"gpus": 1, "gpu_models": ["T4", "NVIDIA-A100"], "gpu_flavors": ["a100"]},
         [node("n1", "a100", 8, gpu_product="NVIDIA-A100")], None),
    ],
)
def test_unsatisfiable(spec_overrides, nodes, at_fault):
    core, _ = submitted_core(*QUEUES, *nodes, payload=submit_payload(spec_dict(**spec_overrides), job_id="j1"))
    (event,) = core.decide(T0)
    if at_fault is None:
        assert isinstance(event, JobAdmitted), event
    else:
        assert isinstance(event, JobRejected)
        assert (event.reason, event.field) == (RejectReason.UNSATISFIABLE, at_fault)
        assert event.message.startswith(f"{at_fault}: ")


def test_unsatisfiable_message_names_the_largest_node():
    core, _ = submitted_core(*QUEUES, node("n1", "a100", 8), node("h1", "h100", 16),
                             payload=submit_payload(spec_dict(gpus=32), job_id="j1"))
    (event,) = core.decide(T0)
    assert event.reason == RejectReason.UNSATISFIABLE
    assert "spec.gpus 32 × gang_size 1" in event.message
    assert "largest node per flavor: a100: 8 GPUs, " in event.message and "; h100: 16 GPUs, " in event.message


def test_a_memory_rejection_names_memory_not_gpu_counts():
    core, _ = submitted_core(*QUEUES, node("n1", "a100", 8, gpu_memory_mib=40960),
                             payload=submit_payload(spec_dict(gpus=1, gpu_flavors=["a100"], min_gpu_memory_mib=81920),
                                                    job_id="j1"))
    (event,) = core.decide(T0)
    assert event.field == "spec.min_gpu_memory_mib"
    assert "a100: 8 GPUs, 40960 MiB each" in event.message


def test_no_inventory_means_no_unsatisfiable_check_and_lost_nodes_are_forgotten():
    core, _ = submitted_core(*QUEUES, payload=submit_payload(spec_dict(gpus=32), job_id="j1"))
    assert isinstance(core.decide(T0)[0], JobAdmitted)
    core = core_with(*QUEUES, node("n1", "a100", 8), node("n2", "a100", 8), node_lost("n2"))
    submit(core, submit_payload(spec_dict(gpus=8, gang_size=2, gpu_flavors=["a100"]), job_id="j1"))
    assert core.decide(T0)[0].reason == RejectReason.UNSATISFIABLE


def test_the_check_counts_nodes_of_one_shape_and_follows_every_change_of_the_nodes():
    """The check reads the nodes by shape (a count per shape, worked out again after any change)."""
    gang = spec_dict(gpus=8, gang_size=2, gpu_flavors=["a100"])
    core = core_with(*QUEUES, node("n1", "a100", 8))
    submit(core, submit_payload(gang, job_id="j1"), seq=1)
    assert core.decide(T0)[0].field == "spec.gang_size"
    core.evolve(node("n2", "a100", 8))  # a second node of the same shape
    submit(core, submit_payload(gang, job_id="j2"), seq=2)
    assert isinstance(core.decide(T0)[-1], JobAdmitted)
    two_nodes = copy.deepcopy(core.snapshot_state())
    core.evolve(node_lost("n2"))
    submit(core, submit_payload(gang, job_id="j3"), seq=3)
    assert core.decide(T0)[-1].field == "spec.gang_size"
    core.evolve(node_updated("n1", "a100", 4))
    submit(core, submit_payload(spec_dict(gpus=8, gpu_flavors=["a100"]), job_id="j4"), seq=4)
    assert core.decide(T0)[-1].field == "spec.gpus"
    core.restore_state(two_nodes)  # a snapshot's nodes
    submit(core, submit_payload(gang, job_id="j5"), seq=5)
    assert isinstance(core.decide(T0)[-1], JobAdmitted)


def test_a_gang_must_fit_in_one_cluster():
    """A gang's members run in one cluster (the scheduler never splits one): two clusters of two
    nodes each cannot host a gang of three, though four nodes are known."""
    nodes = [node(f"n{i}.{c}", "a100", 8, cluster=c) for c in ("east", "west") for i in range(2)]
    core = core_with(*QUEUES, *nodes)
    submit(core, submit_payload(spec_dict(gpus=8, gang_size=3, gpu_flavors=["a100"]), job_id="j1"), seq=1)
    (event,) = core.decide(T0)
    assert (event.reason, event.field) == (RejectReason.UNSATISFIABLE, "spec.gang_size")
    assert "in one cluster" in event.message
    core.evolve(node("n2.east", "a100", 8, cluster="east"))  # a third in one of them
    submit(core, submit_payload(spec_dict(gpus=8, gang_size=3, gpu_flavors=["a100"]), job_id="j2"), seq=2)
    assert isinstance(core.decide(T0)[-1], JobAdmitted)


@pytest.mark.parametrize("pc", sorted(DEFAULT_PRIORITY_CLASSES))
def test_admitted_with_priority_of_class(pc):
    core, job_id = submitted_core(*QUEUES, payload=submit_payload(spec_dict(priority_class=pc), job_id="j1"))
    (event,) = core.decide(at(2))
    assert isinstance(event, JobAdmitted)
    assert event.queue == "research"
    assert event.priority == DEFAULT_PRIORITY_CLASSES[pc].value
    assert event.preemptible is DEFAULT_PRIORITY_CLASSES[pc].preemptible
    assert event.occurred_at == at(2)
    sub = core.state.jobs[job_id].submitted
    assert event.causation_id == sub.event_id and event.correlation_id == sub.event_id


def test_default_priority_values():
    core, _ = submitted_core(*QUEUES)
    (event,) = core.decide(T0)
    assert (event.priority, event.preemptible) == (500, True)  # "training"
    core, _ = submitted_core(*QUEUES, payload=submit_payload(spec_dict(priority_class="inference-sla"), job_id="j1"))
    assert (core.decide(T0)[0].priority, core.decide(T0)[0].preemptible) == (1000, False)


def test_decide_is_repeatable_until_the_decision_is_in_the_log():
    core, _ = submitted_core(*QUEUES)
    first = core.decide(T0)
    again = core.decide(at(5))
    assert [e.event_id for e in first] == [e.event_id for e in again]
    core.evolve(first[0])
    assert core.decide(T0) == []


def test_decide_order_follows_submission_order():
    core = core_with(*QUEUES)
    for seq, jid in enumerate(["zz", "aa", "mm"], start=1):
        submit(core, submit_payload(job_id=jid), seq=seq)
    assert [e.aggregate_id for e in drive(core)] == ["zz", "aa", "mm"]
    assert core.decide(T0) == []


def test_queue_deleted_after_submission_rejects():
    from schemas import QueueDeleted, new_event

    core = core_with(*QUEUES)
    submit(core, submit_payload(job_id="j1"))
    core.evolve(new_event(QueueDeleted, aggregate_id="research", producer="config", occurred_at=T0, key="d",
                          name="research"))
    (event,) = core.decide(T0)
    assert event.reason == RejectReason.UNKNOWN_QUEUE
    assert event.accepted == ("vip",)  # team-a's; product is team-p's


# -- cancel ------------------------------------------------------------------------------------


def cancel_raw(job_id: str = "j1", by: str | None = None, reason: str = "") -> bytes:
    return raw({"job_id": job_id, "reason": reason} | ({"requested_by": by} if by else {}))


def test_cancel_unknown_job_is_poison():
    with pytest.raises(PoisonCommand, match="job_id 'ghost' does not exist"):
        AdmissionCore().handle_cancel(cancel_raw("ghost"), sender("team-a"), T0)


@pytest.mark.parametrize("data", [b"nope", b"{}", raw({"job_id": "Bad.Id", "requested_by": "x"})])
def test_malformed_cancel_is_poison(data):
    with pytest.raises(PoisonCommand, match="invalid CancelJob"):
        AdmissionCore().handle_cancel(data, sender("team-a"), T0)


def test_cancel_of_other_teams_job_is_poison():
    core, _ = submitted_core(*QUEUES)
    with pytest.raises(PoisonCommand, match=r"does not exist \(among the jobs of team 'team-b'\)"):
        core.handle_cancel(cancel_raw(), sender("team-b"), T0)


def test_cancel_valid_then_idempotent():
    core, job_id = submitted_core(*QUEUES)
    drive(core)
    (event,) = core.handle_cancel(cancel_raw(by="bob", reason="wrong lr"), sender("team-a", "bob"), at(3))
    assert isinstance(event, JobCancelRequested)
    assert (event.aggregate_id, event.requested_by, event.reason) == (job_id, "bob", "wrong lr")
    assert event.occurred_at == at(3)
    assert event.causation_id == core.state.jobs[job_id].submitted.event_id
    # until it is in the log a redelivered cancel gets the same id
    assert core.handle_cancel(cancel_raw(by="bob"), sender("team-a", "bob"), at(4))[0].event_id == event.event_id
    core.evolve(event)
    assert core.handle_cancel(cancel_raw(), sender("team-a"), at(5)) == []


@pytest.mark.parametrize(
    "ending, cancellable",
    [
        (lambda j: succeeded(j), False),
        (lambda j: cancelled(j), False),
        # a failure ends the job when quota will not retry it (chaos: a cancel after a final
        # failure ended the job a second time, as cancelled)
        (lambda j: failed(j), False),  # exit-code: not retried by default
        (lambda j: failed(j, FailureReason.NODE_LOST), False),  # retried, but max_attempts is 1
        (lambda j: preempted(j), True),  # requeued
    ],
    ids=["succeeded", "cancelled", "failed", "failed-no-attempts-left", "preempted"],
)
def test_cancel_after_the_job_ended(ending, cancellable):
    core, job_id = submitted_core(*QUEUES)
    drive(core)
    core.evolve(ending(job_id))
    assert bool(core.handle_cancel(cancel_raw(), sender("team-a"), T0)) is cancellable


def test_a_cancel_while_a_failed_attempt_will_be_retried_is_taken():
    core, job_id = submitted_core(*QUEUES, payload=submit_payload(spec_dict(retry={"max_attempts": 2}), job_id="j1"))
    drive(core)
    core.evolve(failed(job_id, FailureReason.NODE_LOST))
    assert [type(e).__name__ for e in core.handle_cancel(cancel_raw(), sender("team-a"), T0)] == ["JobCancelRequested"]
    core.evolve(failed(job_id, FailureReason.NODE_LOST, attempt=2))
    assert core.handle_cancel(cancel_raw(), sender("team-a"), T0) == []


def test_a_job_cancelled_before_its_decision_is_still_decided():
    """The executor may cancel a job before admission has decided it (JobCancelled with no
    attempt): admission still decides it, with its spec (decide raised on a record whose spec a
    finish had let go, every cycle, holding up every other decision)."""
    core, job_id = submitted_core(*QUEUES)
    core.evolve(cancelled(job_id))
    (decision,) = core.decide(T0)
    assert isinstance(decision, JobAdmitted)
    core.evolve(decision)
    assert core.decide(T0) == []


def test_cancel_of_a_rejected_job_does_nothing():
    core, job_id = submitted_core(payload=submit_payload(spec_dict(queue="nope"), job_id="j1"))
    (rej,) = drive(core)
    assert rej.reason == RejectReason.UNKNOWN_QUEUE
    assert core.handle_cancel(cancel_raw(), sender("team-a"), T0) == []


@pytest.mark.parametrize(("raw", "field", "words"), [
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "(root)", "nested 5000 levels deep; accepted: at most 32"),
    (b'{"submitter": "al\\u0000ice", "spec": {}}', "submitter", "contains a NUL character at offset 2"),
    (b'{"submitter": "alice", "spec": {"env": {"K": "\\udc00"}}}', "spec.env.K", "an unpaired UTF-16 surrogate"),
])
def test_a_command_the_read_models_could_not_hold_is_rejected_naming_the_field(raw, field, words):
    rejected = only_rejection(AdmissionCore().handle_submit(raw, sender("team-a"), 7, T0))
    assert (rejected.reason.value, rejected.field) == ("schema-invalid", field)
    assert words in rejected.message


def test_a_byte_order_mark_is_not_json():
    with pytest.raises(PoisonCommand, match="byte order mark"):
        AdmissionCore().handle_submit(b'\xef\xbb\xbf{"submitter": "alice"}', sender("team-a"), 1, T0)


@pytest.mark.parametrize("raw", [b'{"job_id": "j", "requested_by": "a\\u0000"}', b"[" * 100 + b"]" * 100])
def test_a_cancel_the_read_models_could_not_hold_is_poison(raw):
    with pytest.raises(PoisonCommand, match="invalid CancelJob"):
        AdmissionCore().handle_cancel(raw, sender("team-a"), T0)


# -- identity ----------------------------------------------------------------------------------


def test_the_submitter_is_the_authenticated_user_not_the_document():
    core = core_with(*QUEUES)
    (event,) = submit(core, submit_payload(job_id="j1"), user="bob")
    assert (event.submitter, event.on_behalf_of) == ("bob", None)
    (team_event,) = submit(core, submit_payload(job_id="j2"), seq=2)
    assert team_event.submitter == "team-a"  # the team's own credential


@pytest.mark.parametrize("who, payload, field, fragment", [
    (sender("team-a"), submit_payload(submitter="carol"), "submitter",
     "submitter 'carol' is not the sender: this intake subject authenticates 'team-a'"),
    (sender("team-a", "bob"), submit_payload(submitter="carol"), "submitter", "authenticates 'bob'"),
    (sender("team-a", operator=True), submit_payload(), "on_behalf_of", "on_behalf_of is required"),
    (sender("team-a", "bob"), submit_payload(on_behalf_of="carol"), "on_behalf_of",
     "on_behalf_of is for the operator's commands"),
])
def test_a_document_that_contradicts_its_sender_is_rejected(who, payload, field, fragment):
    event = only_rejection(AdmissionCore().handle_submit(raw(payload), who, 4, T0))
    assert (event.reason, event.field, event.team) == (RejectReason.FORBIDDEN, field, "team-a")
    assert fragment in event.message


def test_the_operator_acts_for_a_user_and_that_user_is_checked():
    core = core_with(*QUEUES, node("n1"))
    operator = sender("team-a", operator=True)
    (event,) = core.handle_submit(raw(submit_payload(spec_dict(queue="vip"), job_id="j1", on_behalf_of="carol")),
                                  operator, 1, T0)
    core.evolve(event)
    assert (event.submitter, event.on_behalf_of) == ("operator", "carol")
    (decision,) = core.decide(at(1))
    assert isinstance(decision, JobAdmitted)
    core.evolve(decision)
    (other,) = core.handle_submit(raw(submit_payload(spec_dict(queue="vip"), job_id="j2", on_behalf_of="dave")),
                                  operator, 2, T0)
    core.evolve(other)
    (refused,) = core.decide(at(2))
    assert (refused.reason, refused.field) == (RejectReason.FORBIDDEN, "on_behalf_of")
    assert "user 'dave' may not submit to queue 'vip'" in refused.message


def test_a_cancel_records_who_sent_it():
    core, job_id = submitted_core(*QUEUES)
    (event,) = core.handle_cancel(raw({"job_id": job_id, "on_behalf_of": "alice"}), sender("team-a", operator=True),
                                  at(2))
    assert (event.requested_by, event.on_behalf_of) == ("operator", "alice")
    with pytest.raises(PoisonCommand, match="requested_by 'mallory' is not the sender"):
        core.handle_cancel(cancel_raw(job_id, by="mallory"), sender("team-a", "bob"), at(2))
