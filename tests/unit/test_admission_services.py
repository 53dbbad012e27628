"""Admission's part in inference services: the deploy, scale and delete commands of a team
validated into service events (its replicas must be admissible, identity from the subject), and
the replica jobs the serving controller asks for submitted and cancelled."""

from __future__ import annotations

import json

import pytest

from schemas import JobAdmitted, JobCancelRequested, JobSubmitted, new_event
from schemas.service import ReplicaRequested, ReplicaRetired
from services.admission.domain import AdmissionCore, PoisonCommand
from tests.unit.builders import T0, queue, sender, service_spec


def core_with(*events) -> AdmissionCore:
    core = AdmissionCore()
    for e in (queue("research", ("team-a",), {"a100": 8}), queue("other", ("team-b",), {"a100": 8}), *events):
        core.evolve(e)
    return core


def deploy(core, s=None, *, who=None, seq=1, **extra):
    raw = json.dumps({"spec": (s or service_spec()).model_dump(mode="json"), **extra}).encode()
    out = core.handle_deploy(raw, who or sender("team-a", "alice", verb="deploy"), seq, T0)
    for e in out:
        core.evolve(e)
    return out


def command(core, verb, seq=2, who=None, **body):
    handle = {"scale": core.handle_scale, "delete": core.handle_delete}[verb]
    out = handle(json.dumps(body).encode(), who or sender("team-a", "alice", verb=verb), seq, T0)
    for e in out:
        core.evolve(e)
    return out


def test_a_deploy_becomes_service_deployed_for_the_sender():
    (e,) = deploy(core_with())
    assert (e.type, e.aggregate_id, e.deployed_by, e.generation, e.intake_sequence) == (
        "ServiceDeployed", "chat", "alice", 1, 1)


@pytest.mark.parametrize("spec_, message", [
    (service_spec(team="team-b", queue_="other"),
     "DeployService: spec.team 'team-b' does not match the intake subject's team 'team-a'; accepted: 'team-a'"),
    (service_spec(queue_="nope"), "DeployService: its replicas would not be admitted: spec.replica.queue: "
                                  "spec.queue 'nope' does not exist; accepted: the queues of team 'team-a': research"),
    (service_spec(priority_class="gold"), "DeployService: its replicas would not be admitted: "
                                          "spec.replica.priority_class: spec.priority_class 'gold' is not accepted"),
])
def test_a_deploy_the_team_may_not_make_is_refused_with_the_field(spec_, message):
    with pytest.raises(PoisonCommand) as refused:
        deploy(core_with(), spec_)
    assert str(refused.value).startswith(message)


def test_a_malformed_deploy_names_the_field():
    raw = json.dumps({"spec": {**service_spec().model_dump(mode="json"), "replicas": {"min": 3, "desired": 1,
                                                                                     "max": 4}}}).encode()
    with pytest.raises(PoisonCommand, match="min <= desired <= max"):
        core_with().handle_deploy(raw, sender("team-a", verb="deploy"), 1, T0)


def test_the_operator_deploys_only_on_behalf_of_a_user():
    with pytest.raises(PoisonCommand, match="on_behalf_of is required"):
        deploy(core_with(), who=sender("team-a", operator=True, verb="deploy"))
    (e,) = deploy(core_with(), who=sender("team-a", operator=True, verb="deploy"), on_behalf_of="carol")
    assert e.deployed_by == "carol"


def test_redeploys_same_spec_nothing_new_template_new_generation_counts_same_generation():
    core = core_with()
    deploy(core)
    assert deploy(core, seq=2) == []
    (counts,) = deploy(core, service_spec(desired=3), seq=3)
    assert (counts.type, counts.generation) == ("ServiceUpdated", 1)
    (image,) = deploy(core, service_spec(desired=3, image="srv:2"), seq=4)
    assert (image.type, image.generation) == ("ServiceUpdated", 2)


def test_scale_and_delete_of_the_teams_own_service_only():
    core = core_with()
    deploy(core)
    (scaled,) = command(core, "scale", service="chat", replicas=3)
    assert (scaled.type, scaled.replicas, scaled.by, scaled.requested_by) == ("ScaleRequested", 3, "user", "alice")
    with pytest.raises(PoisonCommand, match=r"service 'chat' does not exist \(among the services of team 'team-b'\)"):
        command(core, "scale", who=sender("team-b", verb="scale"), service="chat", replicas=1)
    with pytest.raises(PoisonCommand, match="service 'nope' does not exist"):
        command(core, "delete", service="nope")
    (deleted,) = command(core, "delete", seq=3, service="chat")
    assert deleted.type == "ServiceDeleted"
    (again,) = deploy(core, seq=4)
    assert (again.type, again.generation) == ("ServiceDeployed", 2)  # new replica job ids


def test_a_requested_replica_is_submitted_admitted_and_cancelled_when_retired():
    core = core_with()
    deploy(core)
    replica = service_spec().replica
    request = new_event(ReplicaRequested, aggregate_id="chat", producer="serving", occurred_at=T0,
                        key="replica-chat-1-0", job_id="replica-chat-1-0", generation=1, index=0, spec=replica,
                        submitter="alice", reason="scale-up")
    core.evolve(request)
    (submitted,) = core.decide(T0)
    assert isinstance(submitted, JobSubmitted)
    assert (submitted.aggregate_id, submitted.submitter, submitted.intake_sequence, submitted.spec) == (
        "replica-chat-1-0", "alice", None, replica)
    core.evolve(submitted)
    (admitted,) = core.decide(T0)
    assert isinstance(admitted, JobAdmitted) and (admitted.priority, admitted.preemptible) == (1000, False)
    core.evolve(admitted)
    retired = new_event(ReplicaRetired, aggregate_id="chat", producer="serving", occurred_at=T0,
                        key="replica-chat-1-0/retired", job_id="replica-chat-1-0", reason="scale-down")
    core.evolve(retired)
    (cancel,) = core.decide(T0)
    assert isinstance(cancel, JobCancelRequested)
    assert (cancel.requested_by, cancel.reason) == ("serving", "replica of service chat retired: scale-down")
    core.evolve(cancel)
    assert core.decide(T0) == []


def test_a_replica_retired_before_it_was_submitted_is_never_submitted():
    core = core_with()
    deploy(core)
    for cls, fields in ((ReplicaRequested, {"generation": 1, "index": 0, "spec": service_spec().replica,
                                            "submitter": "alice", "reason": "scale-up"}),
                        (ReplicaRetired, {"reason": "scale-down"})):
        core.evolve(new_event(cls, aggregate_id="chat", producer="serving", occurred_at=T0, key=cls.__name__,
                              job_id="replica-chat-1-0", **fields))
    assert core.decide(T0) == []


def test_a_submitted_job_id_may_not_take_the_replicas_prefix():
    raw = json.dumps({"job_id": "replica-chat-1-0", "spec": service_spec().replica.model_dump(mode="json")}).encode()
    (rejected,) = core_with().handle_submit(raw, sender("team-a"), 5, T0)
    assert rejected.type == "JobRejected" and "reserved for the replicas of services" in rejected.message


def test_a_load_report_of_the_teams_service_is_recorded_with_the_reporter():
    core = core_with()
    deploy(core)
    who = sender("team-a", "ingress", verb="load")
    (e,) = core.handle_load(json.dumps({"service": "chat", "requests_per_second": 42.5}).encode(), who, 7, T0)
    assert (e.type, e.requests_per_second, e.reported_by, e.intake_sequence) == ("ServiceLoadReported", 42.5,
                                                                                 "ingress", 7)
    with pytest.raises(PoisonCommand, match="requests_per_second"):
        core.handle_load(json.dumps({"service": "chat", "requests_per_second": -1}).encode(), who, 8, T0)
    with pytest.raises(PoisonCommand, match=r"does not exist \(among the services of team"):
        core.handle_load(json.dumps({"service": "chat", "requests_per_second": 1}).encode(),
                         sender("team-b", verb="load"), 9, T0)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["spec"].update(name="9chat"), "spec.name"),  # a Kubernetes Service name starts with a letter
    (lambda d: d["spec"]["replica"].update(annotations={f"k{i}": "v" for i in range(61)}), "at most 60 entries"),
    (lambda d: d["spec"].update(autoscaling={"metric": "requests_per_replica", "target": 1e-9}), "autoscaling.target"),
])
def test_a_spec_the_platform_could_not_carry_out_is_refused(mutate, message):
    doc = {"spec": service_spec().model_dump(mode="json")}
    mutate(doc)
    with pytest.raises(PoisonCommand, match=message):
        core_with().handle_deploy(json.dumps(doc).encode(), sender("team-a", verb="deploy"), 1, T0)


def test_a_replica_retired_before_its_submission_was_folded_is_cancelled_once_it_is():
    core = core_with()
    deploy(core)
    request = new_event(ReplicaRequested, aggregate_id="chat", producer="serving", occurred_at=T0,
                        key="replica-chat-1-0", job_id="replica-chat-1-0", generation=1, index=0,
                        spec=service_spec().replica, submitter="alice", reason="scale-up")
    core.evolve(request)
    (submitted,) = core.decide(T0)  # appended; the retirement lands in the log before it
    core.evolve(new_event(ReplicaRetired, aggregate_id="chat", producer="serving", occurred_at=T0,
                          key="replica-chat-1-0/retired", job_id="replica-chat-1-0", reason="scale-down"))
    core.evolve(submitted)
    out = core.decide(T0)
    assert [e.type for e in out] == ["JobAdmitted", "JobCancelRequested"]
