"""Admission partitioned by team (services/admission/domain.py ``Partition``): the partitions
together take exactly the decisions one admission takes, each for its own teams, and refuse the
job ids and service names another partition's team holds."""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.teams import partition_of
from schemas import Event, JobAdmitted, JobRejected, JobSubmitted, RejectReason, new_event
from schemas.service import ReplicaRequested
from services.admission.domain import AdmissionCore, Partition, PoisonCommand
from tests.unit.builders import T0, node, queue, sender, service_spec, spec_dict, submit_payload

TEAMS = ("team-a", "team-b", "team-c", "team-d", "team-e", "team-f")
IDS = ("x1", "x2", "x3", "x4")
SERVICES = ("chat", "web")
CONFIG = (queue("research", TEAMS, {"a100": 64}), node("n1", "a100", 8))


def partitions_of(count: int) -> list[AdmissionCore]:
    cores = [AdmissionCore(partition=Partition(count, k)) for k in range(count)]
    for core in cores:
        for e in CONFIG:
            core.evolve(e)
    return cores


def owner(cores: list[AdmissionCore], team: str) -> AdmissionCore:
    return cores[partition_of(team, len(cores))]


def test_teams_spread_over_two_partitions():
    """The cases below need teams on both partitions."""
    assert {partition_of(t, 2) for t in TEAMS} == {0, 1}


def handle(core: AdmissionCore, verb: str, team: str, body: dict, seq: int) -> list[Event] | str:
    """The events of one command, or "poison"."""
    raw = json.dumps(body).encode()
    who = sender(team, verb=verb)
    try:
        if verb == "submit":
            return core.handle_submit(raw, who, seq, T0)
        if verb == "cancel":
            return core.handle_cancel(raw, who, T0)
        return getattr(core, f"handle_{verb}")(raw, who, seq, T0)
    except PoisonCommand:
        return "poison"


def comparable(outcome: list[Event] | str) -> object:
    """What must be equal: the events but a rejection's message (which says where a taken id was
    seen: the intake sequence here, another team there)."""
    if isinstance(outcome, str):
        return outcome
    return [e.model_dump(exclude={"message"} if isinstance(e, JobRejected) else set()) for e in outcome]


command = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(TEAMS),
              st.one_of(st.sampled_from(IDS), st.none()), st.one_of(st.sampled_from(("k1", "k2")), st.none())),
    st.tuples(st.just("cancel"), st.sampled_from(TEAMS), st.sampled_from(IDS), st.none()),
    st.tuples(st.just("deploy"), st.sampled_from(TEAMS), st.sampled_from(SERVICES), st.none()),
    st.tuples(st.just("scale"), st.sampled_from(TEAMS), st.sampled_from(SERVICES), st.none()),
    st.tuples(st.just("delete"), st.sampled_from(TEAMS), st.sampled_from(SERVICES), st.none()),
    st.tuples(st.just("decide"), st.just(""), st.none(), st.none()),
)


def body(verb: str, team: str, name: str | None, key: str | None) -> dict:
    if verb == "submit":
        return submit_payload(spec_dict(team=team, **({"idempotency_key": key} if key else {})), job_id=name)
    if verb == "cancel":
        return {"job_id": name}
    if verb == "deploy":
        return {"spec": service_spec(name=name, team=team).model_dump(mode="json")}
    if verb == "scale":
        return {"service": name, "replicas": 3}
    return {"service": name}


@settings(max_examples=150, deadline=None)
@given(st.lists(command, max_size=40), st.sampled_from((2, 3)))
def test_partitions_decide_what_one_admission_decides(commands, count):
    """Commands in log order, each handled by its team's partition after every partition folded the
    log so far: each gets the answer one admission gives (a submission of an id another team took:
    duplicate-job-id; a service name another team took: refused), and the partitions' decisions
    together are one admission's, each taken once."""
    one = partitions_of(1)[0]
    cores = partitions_of(count)
    log: list[Event] = []

    def append(events: list[Event]) -> None:
        for e in events:
            log.append(e)
            one.evolve(e)
            for core in cores:
                core.evolve(e)

    for seq, (verb, team, name, key) in enumerate(commands, start=1):
        if verb == "decide":
            expected = one.decide(T0)
            got = [e for core in cores for e in core.decide(T0)]
            assert sorted(comparable(expected), key=str) == sorted(comparable(got), key=str)
            append(expected)
            continue
        expected = handle(one, verb, team, body(verb, team, name, key), seq)
        got = handle(owner(cores, team), verb, team, body(verb, team, name, key), seq)
        assert comparable(got) == comparable(expected), (verb, team, name)
        if not isinstance(expected, str):
            append(expected)
        for svc in one.state.services.values():  # the serving controller asks for one replica each
            request = new_event(ReplicaRequested, aggregate_id=svc.spec.name, producer="serving", occurred_at=T0,
                                key=f"r/{svc.generation}", job_id=f"{svc.spec.name}-g{svc.generation}-r0",
                                generation=svc.generation, index=0, spec=svc.spec.replica, submitter="alice",
                                reason="scale-up")
            if not svc.deleted and request.job_id not in one.state.jobs:
                append([request])
    for core in cores:  # each holds its own teams' jobs only
        assert all(core.state.partition.owns(job.team) for job in core.state.jobs.values())
    assert sorted(j for core in cores for j in core.state.jobs) == sorted(one.state.jobs)


def test_a_job_id_another_partitions_team_holds_is_refused():
    a, b = "team-a", next(t for t in TEAMS if partition_of(t, 2) != partition_of("team-a", 2))
    cores = partitions_of(2)
    (sub,) = owner(cores, a).handle_submit(json.dumps(submit_payload(job_id="x1")).encode(), sender(a), 1, T0)
    for core in cores:
        core.evolve(sub)
    theirs = owner(cores, b)
    (rejected,) = theirs.handle_submit(json.dumps(submit_payload(spec_dict(team=b), job_id="x1")).encode(),
                                       sender(b), 2, T0)
    assert rejected.reason == RejectReason.DUPLICATE_JOB_ID and rejected.field == "job_id"
    assert "another team" in rejected.message
    assert theirs.foreign("job", "x1") and not owner(cores, a).foreign("job", "x1")
    with pytest.raises(PoisonCommand, match=rf"does not exist \(among the jobs of team '{b}'\)"):
        theirs.handle_cancel(json.dumps({"job_id": "x1"}).encode(), sender(b, verb="cancel"), T0)


def test_another_partitions_job_events_change_nothing():
    a = "team-a"
    mine, other = owner(partitions_of(2), a), None
    cores = partitions_of(2)
    mine, other = owner(cores, a), next(c for c in cores if c is not owner(cores, a))
    sub = new_event(JobSubmitted, aggregate_id="x1", producer="admission", occurred_at=T0, key="1",
                    spec=spec_dict(team=a), submitter=a, intake_sequence=1)
    before = pickle.dumps(other.snapshot_state())
    other.evolve(sub)
    assert other.state.foreign_jobs == {"x1": a} and not other.state.undecided
    after_submission = pickle.dumps(other.snapshot_state())
    other.evolve(new_event(JobAdmitted, aggregate_id="x1", producer="admission", occurred_at=T0, key="decision",
                           queue="research", priority=500, preemptible=True))
    assert pickle.dumps(other.snapshot_state()) == after_submission != before
    mine.evolve(sub)
    assert [e.aggregate_id for e in mine.decide(T0)] == ["x1"] and other.decide(T0) == []


def test_a_service_name_another_partitions_team_holds_is_refused():
    a, b = "team-a", next(t for t in TEAMS if partition_of(t, 2) != partition_of("team-a", 2))
    cores = partitions_of(2)
    deployed = handle(owner(cores, a), "deploy", a, body("deploy", a, "chat", None), 1)
    for core in cores:
        for e in deployed:
            core.evolve(e)
    theirs = owner(cores, b)
    assert handle(theirs, "deploy", b, body("deploy", b, "chat", None), 2) == "poison"
    with pytest.raises(PoisonCommand, match=rf"does not exist \(among the services of team '{b}'\)"):
        theirs.handle_scale(json.dumps({"service": "chat", "replicas": 2}).encode(), sender(b, verb="scale"), 3, T0)


def test_a_snapshot_of_another_partitioning_is_not_restored():
    saved = AdmissionCore(partition=Partition(2, 0)).snapshot_state()
    with pytest.raises(ValueError, match="partition 0 of 2"):
        AdmissionCore(partition=Partition(3, 0)).restore_state(saved)
    with pytest.raises(ValueError):
        AdmissionCore().restore_state(saved)
    AdmissionCore(partition=Partition(2, 0)).restore_state(saved)


@pytest.mark.parametrize("count, index", [(2, 2), (1, 1), (2, -1)])
def test_a_partition_out_of_range_is_refused(count, index):
    with pytest.raises(ValueError, match="accepted"):
        Partition(count, index)


def test_two_teams_deploying_one_name_at_once_append_different_events():
    """Each partition grants the name before it folds the other's ServiceDeployed. The events
    differ in id (their key names the command), so the log refuses the second as a conflict on
    the service's subjects instead of taking it for a duplicate of the first (JetStream drops a
    message whose id it has seen before it checks the expected sequence) and acknowledging it."""
    a, b = "team-a", next(t for t in TEAMS if partition_of(t, 2) != partition_of("team-a", 2))
    cores = partitions_of(2)
    (first,) = handle(owner(cores, a), "deploy", a, body("deploy", a, "chat", None), 1)
    (second,) = handle(owner(cores, b), "deploy", b, body("deploy", b, "chat", None), 2)
    assert first.aggregate_id == second.aggregate_id == "chat" and first.generation == second.generation == 1
    assert first.event_id != second.event_id
