"""The event contract: parsing, subjects, producers, ids, JSON Schema drift, spec validation."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas import QuotaWaitReason
from schemas import (
    ALL_EVENT_TYPES,
    PRODUCERS,
    CancelJob,
    CohortConfigured,
    FailureReason,
    JobAdmitted,
    JobRejected,
    JobSpec,
    QueueConfigured,
    QueueDeleted,
    RejectReason,
    SubmitJob,
    dumps,
    event_subject,
    new_event,
    parse_event,
    subject_suffix,
)
from schemas.envelope import derive_event_id
from schemas.export import OUT, rendered
from schemas.registry import EVENT_TYPES_BY_NAME, aggregate_subjects, producer_subjects
from tests.unit.builders import (
    T0,
    service_samples,
    admitted,
    ready,
    at,
    cancel_requested,
    cancelled,
    failed,
    gpu,
    node,
    node_lost,
    cluster_lost,
    cluster_reported,
    node_updated,
    preempted,
    queue,
    pending_reason,
    price_book,
    policy_configured,
    team_configured,
    token_issued,
    token_revoked,
    statement,
    reclaim_requested,
    sched_pending_reason,
    preemption_requested,
    checkpointed,
    released,
    reserved,
    retry_scheduled,
    scheduled,
    spec,
    started,
    submitted,
    succeeded,
    telemetry,
)

REPO = Path(__file__).resolve().parents[2]


def _full_spec() -> JobSpec:
    return spec(
        project="vision", priority_class="deadline-training", command=("python", "train.py"), args=("--lr", "3e-4"),
        env={"NCCL_DEBUG": "INFO"}, datasets=[{"uri": "s3://bucket/imagenet", "locality_hint": "rack-1"}],
        gpus=8, gpu_flavors=("h100-80gb", "a100"), min_gpu_memory_mib=40960, node_features=("rdma",), gang_size=4,
        max_runtime_seconds=7200, expected_runtime_seconds=3600.5,
        retry={"max_attempts": 3, "backoff_seconds": 12.5, "retry_on": ["node-lost", "oom-killed"],
               "backoff_factor": 2.0, "max_backoff_seconds": 600},
        idempotency_key="run-42", annotations={"sim.gpusched.io/exit-code": "3"},
    )


def sample_events():
    """One event of every type, with non-default values wherever the type has them."""
    rejected = new_event(
        JobRejected, aggregate_id="rejected-7", producer="admission", occurred_at=T0, key="7",
        reason=RejectReason.UNKNOWN_QUEUE, message="no such queue", field="spec.queue",
        accepted=("a", "b"), intake_sequence=7, requested_job_id="j7", team="team-a",
    )
    sub = submitted("j1", _full_spec(), seq=3, submitter="bob")
    return [
        sub,
        admitted("j1", priority=800),
        rejected,
        cancel_requested("j1", reason="oops"),
        reserved("j1", gpus=32, attempt=2),
        released("j1", gpus=32, attempt=2, reason="JobFailed"),
        pending_reason("j1", QuotaWaitReason.COHORT_EXHAUSTED, "cohort c has 0 free a100", position=3),
        reclaim_requested("j1", "j2", attempt=2),
        sched_pending_reason("j1", attempt=2, eta=at(900)),
        preemption_requested("j1", "j9", attempt=2, grace_seconds=120, work_lost=3600.0),
        checkpointed("j1", attempt=2, at_=at(40), step=1200, seq=9, when=at(41)),
        retry_scheduled("j1", 1, not_before=at(30)),
        scheduled("j1", {"n1": (0, 1), "n2": (4, 5)}, attempt=2),
        started("j1", ("n1", "n2"), attempt=2, when=at(5)),
        ready("replica-chat-1-0", attempt=2, when=at(6)),
        succeeded("j1", attempt=2, started_at=at(5)),
        failed("j1", FailureReason.OOM_KILLED, exit_code=137, message="oom", started_at=None),
        preempted("j1", by="j2"),
        cancelled("j1", attempt=2, started_at=at(5), reason="user"),
        node("gpu-1.rack-1.example", "a100", 8, features=("rdma",), labels={"rack": "r1"}, taints=("a=b:NoSchedule",)),
        node_updated("gpu-1.rack-1.example", "a100", 8, unschedulable=True),
        node_lost("gpu-1.rack-1.example"),
        cluster_reported("east", when=at(30), nodes=12, interval=10.0),
        cluster_lost("east", ("gpu-1.east", "gpu-2.east"), last_report=at(30), when=at(130)),
        telemetry("gpu-1.rack-1.example", [gpu(0, 0.9, power_w=350.5), gpu(3, 0.01, allocated=2, allocated_utilization=0.0)],
                  start=at(60), seconds=60),
        queue("research", ("team-a", "team-b"), {"a100": 8, "h100-80gb": 16}, cohort="shared", strict_fifo=True,
              allowed_priority_classes=("training",)),
        new_event(QueueDeleted, aggregate_id="old", producer="config", occurred_at=T0, key="x", name="old"),
        new_event(CohortConfigured, aggregate_id="shared", producer="config", occurred_at=T0, key="x",
                  name="shared", parent="org"),
        team_configured("team-a", ("https://hooks.example/a", "http://10.0.0.1:8080/x?y=1")),
        policy_configured(("gold", 900, False), ("bronze", 10, True), enabled=False, max_per_window=3),
        token_issued(), token_revoked(),
        price_book({"a100": 2.5, "h100-80gb": 6.0}, effective_from=at(-3600), cpu_core_hour=0.04,
                   memory_gib_hour=0.005, idle_quota="charge-owner", currency="EUR"),
        statement("2026-11", "project", lines=[{
            "key": "vision", "gpu_seconds": 7200.0, "borrowed_gpu_seconds": 3600.0, "lost_gpu_seconds": 60.0,
            "idle_gpu_seconds": 10.0, "usage_cost": 5.0, "idle_cost": 0.25, "total_cost": 5.25}]),
        *service_samples(),
    ]


def test_samples_cover_every_event_type():
    assert sorted(type(e).__name__ for e in sample_events()) == sorted(c.__name__ for c in ALL_EVENT_TYPES)
    assert len(ALL_EVENT_TYPES) == 45


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: e.type)
def test_json_round_trip(event):
    data = dumps(event)
    assert isinstance(data, bytes)
    back = parse_event(data)
    assert type(back) is type(event)
    assert back == event
    assert dumps(back) == data
    # str and already-decoded dict inputs parse the same
    assert parse_event(data.decode()) == event
    assert parse_event(json.loads(data)) == event


def test_parse_event_rejects_non_objects_and_unknown_types():
    with pytest.raises(ValueError, match="JSON object, got list"):
        parse_event(b"[1, 2]")
    with pytest.raises(ValueError):
        parse_event(b"not json")
    raw = json.loads(dumps(admitted("j1")))
    raw["type"] = "JobTeleported"
    with pytest.raises(ValidationError):
        parse_event(raw)


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: e.type)
def test_events_are_frozen_and_forbid_extra_fields(event):
    with pytest.raises(ValidationError):
        event.aggregate_id = "other"  # type: ignore[misc]
    raw = json.loads(dumps(event))
    raw["surprise"] = 1
    with pytest.raises(ValidationError) as err:
        parse_event(raw)
    assert any(e["type"] == "extra_forbidden" and e["loc"][-1] == "surprise" for e in err.value.errors())


def test_nested_models_forbid_extra_fields():
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({**spec().model_dump(), "gpu": 1})
    assert err.value.errors()[0]["type"] == "extra_forbidden"
    with pytest.raises(ValidationError):
        spec().gpus = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "event, subject",
    [
        (admitted("j1"), "gpusched.job.j1.admitted"),
        (submitted("j1"), "gpusched.job.j1.submitted"),
        (cancel_requested("j1"), "gpusched.job.j1.cancel_requested"),
        (reserved("j-9"), "gpusched.job.j-9.quota_reserved"),
        (released("j-9"), "gpusched.job.j-9.quota_released"),
        (pending_reason("j-9"), "gpusched.job.j-9.quota_pending"),
        (reclaim_requested("j-9"), "gpusched.job.j-9.reclaim_requested"),
        (retry_scheduled("j1"), "gpusched.job.j1.retry_scheduled"),
        (scheduled("j1"), "gpusched.job.j1.scheduled"),
        (node("gpu-1.rack-1.example"), "gpusched.node.gpu-1_rack-1_example.registered"),
        (node_updated("a.b"), "gpusched.node.a_b.updated"),
        (node_lost("a.b.c"), "gpusched.node.a_b_c.lost"),
        (telemetry("a.b"), "gpusched.node.a_b.telemetry"),
        (queue("research"), "gpusched.queue.research.configured"),
        (price_book(), "gpusched.pricebook.default.updated"),
        (statement("2026-11", "team", last_sequence=7), "gpusched.statement.2026-11-team-7.issued"),
        (new_event(CohortConfigured, aggregate_id="shared", producer="config", occurred_at=T0, key="k", name="shared"),
         "gpusched.cohort.shared.configured"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.type,
)
def test_event_subject(event, subject):
    assert event_subject(event) == subject


def test_event_subject_prefix_and_suffixes():
    assert event_subject(admitted("j1"), prefix="test1") == "test1.job.j1.admitted"
    assert subject_suffix("JobFailed") == "failed"
    assert subject_suffix("JobStarted") == "started"
    assert aggregate_subjects("node", "a.b") == "gpusched.node.a_b.>"


EXPECTED_PRODUCERS = {
    "JobSubmitted": "admission", "JobAdmitted": "admission", "JobRejected": "admission",
    "JobCancelRequested": "admission", "JobCheckpointed": "admission",
    "QuotaReserved": "quota", "QuotaReleased": "quota", "JobRetryScheduled": "quota",
    "QuotaPendingReasonChanged": "quota", "ReclaimRequested": "quota",
    "JobScheduled": "scheduler", "PreemptionRequested": "scheduler", "SchedulingPendingReasonChanged": "scheduler",
    "JobStarted": "executor", "JobReady": "executor", "JobSucceeded": "executor", "JobFailed": "executor", "JobPreempted": "executor",
    "JobCancelled": "executor", "NodeRegistered": "executor", "NodeUpdated": "executor", "NodeLost": "executor",
    "NodeTelemetryReported": "executor", "ClusterReported": "executor", "ClusterLost": "scheduler",
    "QueueConfigured": "config", "QueueDeleted": "config", "CohortConfigured": "config",
    "PriceBookUpdated": "config", "TeamConfigured": "config", "PolicyConfigured": "config", "ChargebackStatementIssued": "accounting",
    "ApiTokenIssued": "admin", "ApiTokenRevoked": "admin",
    "ServiceDeployed": "admission", "ServiceUpdated": "admission", "ScaleRequested": "admission",
    "ServiceDeleted": "admission", "ServiceLoadReported": "admission", "ScaledTo": "serving", "ReplicaRequested": "serving", "ReplicaRetired": "serving",
    "ReplicaScheduled": "serving", "ReplicaReady": "serving", "ReplicaLost": "serving",
}


def test_every_event_type_has_exactly_one_producer():
    names = [c.model_fields["type"].default for c in ALL_EVENT_TYPES]
    assert len(names) == len(set(names))  # a type name maps to one class
    assert PRODUCERS == EXPECTED_PRODUCERS
    assert set(EVENT_TYPES_BY_NAME) == set(names)


def test_builders_use_the_registered_producer():
    for event in sample_events():
        assert event.producer == PRODUCERS[event.type], event.type


def test_producer_subjects():
    assert producer_subjects("quota") == [
        "gpusched.job.*.quota_pending", "gpusched.job.*.quota_released", "gpusched.job.*.quota_reserved",
        "gpusched.job.*.reclaim_requested", "gpusched.job.*.retry_scheduled",
    ]
    assert producer_subjects("scheduler") == [
        "gpusched.cluster.*.lost", "gpusched.job.*.preemption_requested", "gpusched.job.*.sched_pending",
        "gpusched.job.*.scheduled",
    ]
    assert producer_subjects("config") == [
        "gpusched.cohort.*.configured", "gpusched.policy.*.configured", "gpusched.pricebook.*.updated", "gpusched.queue.*.configured",
        "gpusched.queue.*.deleted", "gpusched.team.*.configured",
    ]
    assert producer_subjects("executor") == [
        "gpusched.cluster.*.reported", "gpusched.job.*.cancelled", "gpusched.job.*.failed", "gpusched.job.*.preempted", "gpusched.job.*.ready",
        "gpusched.job.*.started",
        "gpusched.job.*.succeeded", "gpusched.node.*.lost", "gpusched.node.*.registered",
        "gpusched.node.*.telemetry", "gpusched.node.*.updated",
    ]
    assert producer_subjects("accounting") == ["gpusched.statement.*.issued"]
    assert producer_subjects("nobody") == []


def test_new_event_ids_are_deterministic():
    a = new_event(JobAdmitted, aggregate_id="j1", producer="admission", occurred_at=T0, key="decision",
                  queue="q", priority=1, preemptible=True)
    b = new_event(JobAdmitted, aggregate_id="j1", producer="admission", occurred_at=T0 + timedelta(hours=1),
                  key="decision", queue="other", priority=9, preemptible=False)
    assert a.event_id == b.event_id == derive_event_id("JobAdmitted", "j1", "decision")
    other_key = new_event(JobAdmitted, aggregate_id="j1", producer="admission", occurred_at=T0, key="decision2",
                          queue="q", priority=1, preemptible=True)
    other_job = new_event(JobAdmitted, aggregate_id="j2", producer="admission", occurred_at=T0, key="decision",
                          queue="q", priority=1, preemptible=True)
    assert len({a.event_id, other_key.event_id, other_job.event_id}) == 3
    # the type takes part too
    assert derive_event_id("JobRejected", "j1", "decision") != a.event_id


def test_event_id_namespace_is_stable():
    # Changing the namespace would change every re-derived id; pin one value.
    import uuid

    from schemas.envelope import EVENT_ID_NAMESPACE

    assert derive_event_id("JobAdmitted", "j1", "decision") == str(
        uuid.uuid5(uuid.UUID("6f1d7f3a-9a43-4c55-9a0e-2b8a5c6f0e11"), "JobAdmitted/j1/decision")
    )
    assert EVENT_ID_NAMESPACE == uuid.UUID("6f1d7f3a-9a43-4c55-9a0e-2b8a5c6f0e11")


def test_new_event_causal_links():
    sub = submitted("j1")
    adm = new_event(JobAdmitted, aggregate_id="j1", producer="admission", occurred_at=T0, key="d", cause=sub,
                    queue="q", priority=1, preemptible=True)
    assert adm.causation_id == sub.event_id
    assert adm.correlation_id == sub.event_id  # the submission starts the chain
    res = new_event(type(reserved("j1")), aggregate_id="j1", producer="quota", occurred_at=T0, key="1", cause=adm,
                    attempt=1, queue="q", flavor="a100", gpus=1)
    assert res.causation_id == adm.event_id
    assert res.correlation_id == sub.event_id
    assert submitted("j2").causation_id is None and submitted("j2").correlation_id is None


# -- JSON Schema drift -------------------------------------------------------------------------


def test_committed_json_schemas_match_the_models():
    files = rendered()
    committed = {p.name: p.read_text() for p in OUT.glob("*.json")}
    assert sorted(files) == sorted(committed)
    for name, text in files.items():
        assert committed[name] == text, f"schemas/json/{name} is stale; run `make schemas`"
    # + SubmitJob, CancelJob, ReportCheckpoint, DeployService, ScaleService, DeleteService, ReportServiceLoad;
    # JobNotification, NotificationDelivery, CommandRefused
    assert len(files) == len(ALL_EVENT_TYPES) + 10


def test_export_check_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "schemas.export", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_json_schema_shape():
    schema = json.loads(rendered()["JobAdmitted.json"])
    assert schema["$id"] == "https://gpusched.dev/schemas/JobAdmitted.json"
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["additionalProperties"] is False
    assert schema["properties"]["type"]["const"] == "JobAdmitted"


# -- JobSpec validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, loc, error_type",
    [
        ({"gpus": -1}, ("gpus",), "greater_than_equal"),
        ({"gpus": 65}, ("gpus",), "less_than_equal"),
        ({"queue": "Bad_Queue"}, ("queue",), "string_pattern_mismatch"),
        ({"queue": "-leading-dash"}, ("queue",), "string_pattern_mismatch"),
        ({"team": ""}, ("team",), "string_pattern_mismatch"),
        ({"kind": "gaming"}, ("kind",), "enum"),
        ({"gang_size": 0}, ("gang_size",), "greater_than_equal"),
        ({"env": {"1BAD": "x"}}, ("env", "1BAD", "[key]"), "string_pattern_mismatch"),
        ({"retry": {"max_attempts": 0}}, ("retry", "max_attempts"), "greater_than_equal"),
        ({"retry": {"retry_on": ["bored"]}}, ("retry", "retry_on", 0), "enum"),
        ({"expected_runtime_seconds": 0}, ("expected_runtime_seconds",), "greater_than"),
    ],
)
def test_jobspec_field_errors(overrides, loc, error_type):
    with pytest.raises(ValidationError) as err:
        spec(**overrides)
    errors = err.value.errors()
    assert len(errors) == 1
    assert errors[0]["loc"] == loc
    assert errors[0]["type"] == error_type


def test_jobspec_expected_runtime_must_not_exceed_max_runtime():
    with pytest.raises(ValidationError) as err:
        spec(max_runtime_seconds=60, expected_runtime_seconds=61)
    (error,) = err.value.errors()
    assert error["loc"] == ()
    assert "expected_runtime_seconds 61.0 exceeds max_runtime_seconds 60" in error["msg"]
    # equal is fine, and either alone is fine
    assert spec(max_runtime_seconds=60, expected_runtime_seconds=60).expected_runtime_seconds == 60
    assert spec(expected_runtime_seconds=10_000).max_runtime_seconds is None


def test_jobspec_boundaries_and_total_gpus():
    assert spec(gpus=0).gpus == 0
    assert spec(gpus=64).gpus == 64
    assert spec(gpus=8, gang_size=4).total_gpus == 32
    assert spec().retry.retry_on == (FailureReason.NODE_LOST, FailureReason.EVICTED, FailureReason.BACKEND_ERROR)


def test_queue_configured_rejects_duplicate_flavors():
    with pytest.raises(ValidationError, match=r"quotas lists flavor\(s\) \['a100'\] more than once"):
        QueueConfigured(event_id="x", aggregate_id="q", occurred_at=T0, producer="config", name="q",
                        quotas=[{"flavor": "a100", "nominal": 1}, {"flavor": "a100", "nominal": 2}])


def test_commands_validate():
    cmd = SubmitJob.model_validate({"submitter": "alice", "spec": spec().model_dump(mode="json")})
    assert cmd.job_id is None and cmd.spec == spec()
    with pytest.raises(ValidationError):
        SubmitJob.model_validate({"submitter": "alice", "spec": spec().model_dump(mode="json"), "job_id": "Bad.Id"})
    assert CancelJob.model_validate_json(b'{"job_id": "j1", "requested_by": "bob"}').reason == ""


def test_naive_datetimes_are_rejected():
    raw = json.loads(dumps(admitted("j1")))
    raw["occurred_at"] = "2026-01-01T00:00:00"
    with pytest.raises(ValidationError) as err:
        parse_event(raw)
    assert err.value.errors()[0]["loc"][-1] == "occurred_at"


# -- NodeTelemetryReported validation ----------------------------------------------------------


def _telemetry_raw(**overrides):
    raw = json.loads(dumps(telemetry("n1", [gpu(0, 0.5), gpu(1, 0.25)], gpu_count=2)))
    raw.update(overrides)
    return raw


def _gpu_raw(index=0, **overrides):
    raw = gpu(0).model_dump()
    raw.update(index=index, **overrides)
    return raw


@pytest.mark.parametrize(
    "overrides, loc, needle",
    [
        ({"gpus": [_gpu_raw(utilization=1.5)]}, ("gpus", 0, "utilization"), "less than or equal to 1"),
        ({"gpus": [_gpu_raw(utilization=-0.1)]}, ("gpus", 0, "utilization"), "greater than or equal to 0"),
        ({"gpus": [_gpu_raw(samples=0)]}, ("gpus", 0, "samples"), "greater than or equal to 1"),
        ({"gpus": [_gpu_raw(index=64)]}, ("gpus", 0, "index"), "less than or equal to 63"),
        ({"gpus": [_gpu_raw(power_w=-1)]}, ("gpus", 0, "power_w"), "greater than or equal to 0"),
        ({"gpus": [_gpu_raw(memory_used_mib=90000)]}, ("gpus", 0),
         "gpu 0: memory_used_mib 90000 exceeds memory_total_mib 81559"),
        ({"gpus": [_gpu_raw(allocated_samples=7)]}, ("gpus", 0), "allocated_samples 7 exceeds samples 6; accepted: 0..6"),
        ({"gpus": [_gpu_raw(allocated_samples=0)]}, ("gpus", 0),
         "allocated_utilization must be set exactly when allocated_samples > 0"),
        ({"gpus": []}, (), "gpus is empty; accepted: at least one GPU"),
        ({"gpus": [_gpu_raw(0), _gpu_raw(1), _gpu_raw(2)]}, (),
         "gpus has 3 entries but the node has gpu_count 2; accepted: at most one entry per GPU"),
        ({"gpus": [_gpu_raw(1), _gpu_raw(1)]}, (), "gpus: index 1 listed more than once"),
        ({"gpus": [_gpu_raw(5)]}, (), "gpus: index 5 out of range for gpu_count 2; accepted: 0..1"),
        ({"gpu_count": 0}, ("gpu_count",), "greater than or equal to 1"),
        ({"window_end": "2026-01-01T00:00:00Z"}, (), "window_end - window_start is 0 s; accepted: more than 0"),
        ({"window_end": "2026-01-03T00:00:00Z"}, (), "window_end - window_start is 172800 s"),
        ({"window_start": "2026-01-01T00:00:00"}, ("window_start",), "timezone"),
        ({"node": "n2"}, (), "node 'n2' differs from aggregate_id 'n1'"),
        ({"node": "Not A Node"}, ("node",), "should match pattern"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_telemetry_validation_says_what_is_wrong(overrides, loc, needle):
    with pytest.raises(ValidationError) as err:
        parse_event(_telemetry_raw(**overrides))
    errors = err.value.errors()
    assert len(errors) == 1, errors
    assert errors[0]["loc"][1:] == loc  # [0] is the discriminator's tag, NodeTelemetryReported
    assert needle in errors[0]["msg"], errors[0]["msg"]


def test_telemetry_of_some_gpus_of_a_node_is_valid():
    event = parse_event(_telemetry_raw(gpus=[_gpu_raw(1, utilization=0.0, allocated_samples=0,
                                                      allocated_utilization=None)]))
    assert [g.index for g in event.gpus] == [1] and event.gpus[0].allocated_utilization is None
