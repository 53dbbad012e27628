"""The serving controller's pure core: replicas asked for up to desired, scale requests clamped,
what happened to each replica told once, lost replicas replaced only when their job ended for
good, rollouts within surge and unavailability, deletion, and a restart deciding nothing new."""

from __future__ import annotations

from datetime import timedelta

import pytest

from schemas import FailureReason, JobRejected, RejectReason, new_event
from schemas.service import (
    SERVICE_ANNOTATION,
    Replicas,
    ReplicaLost,
    ReplicaReady,
    ReplicaRequested,
    ReplicaRetired,
    ReplicaScheduled,
    ScaledTo,
    ScaleRequested,
    ServiceDeleted,
    Autoscaling,
    ServiceDeployed,
    ServiceLoadReported,
    ServiceSpec,
    ServiceUpdated,
    replica_job_id,
)
from services.serving.domain import REPLICA_RETRY, ServingCore, service_of
from tests.unit.builders import (
    T0, Log, cancelled, drive, failed, gpu, preempted, ready, retry_scheduled, scheduled, service_deployed,
    service_spec, started, succeeded, telemetry,
)


def deployed(s: ServiceSpec | None = None) -> ServiceDeployed:
    return service_deployed(s)


def scale(n: int, key: str = "1", name: str = "chat") -> ScaleRequested:
    return new_event(ScaleRequested, aggregate_id=name, producer="admission", occurred_at=T0, key=f"scale/{key}",
                     replicas=n, by="user", requested_by="alice", intake_sequence=9)


def of(events, cls) -> list:
    return [e for e in events if isinstance(e, cls)]


def job(i: int, generation: int = 1) -> str:
    return replica_job_id("chat", generation, i)


def up(core, log, *indexes, generation: int = 1, at_s: float = 0):
    """Replicas placed and started at ``at_s``, and ready (their executor's JobReady) 10 s later."""
    when = T0 + timedelta(seconds=at_s)
    events = [e for i in indexes for e in (scheduled(job(i, generation), when=when),
                                          started(job(i, generation), when=when),
                                          ready(job(i, generation), when=when + timedelta(seconds=10)))]
    return drive(core, events, when + timedelta(seconds=10), log=log)


def test_a_deployed_service_asks_for_its_desired_replicas():
    core, log = ServingCore(), Log()
    out = drive(core, [deployed()], T0, log=log)
    requests = of(out, ReplicaRequested)
    assert [(r.job_id, r.generation, r.index, r.reason) for r in requests] == [
        (job(0), 1, 0, "scale-up"), (job(1), 1, 1, "scale-up")]
    r = requests[0]
    assert (r.submitter, r.spec.annotations[SERVICE_ANNOTATION], r.spec.retry) == ("alice", "chat", REPLICA_RETRY)
    assert r.spec.expected_runtime_seconds is None and service_of(r.job_id) == "chat"


def test_replicas_are_told_scheduled_then_ready_when_their_executor_says_so():
    core, log = ServingCore(), Log()
    drive(core, [deployed()], T0, log=log)
    out = drive(core, [scheduled(job(0), {"n7": (0,)}), started(job(0))], T0 + timedelta(seconds=60), log=log)
    assert [(e.type, e.nodes) for e in of(out, ReplicaScheduled)] == [("ReplicaScheduled", ("n7",))]
    assert not of(out, ReplicaReady)  # started long ago, but no readiness check has passed
    out = drive(core, [ready(job(0), attempt=2, when=T0)], T0 + timedelta(seconds=61), log=log)
    assert not of(out, ReplicaReady)  # another attempt's
    out = drive(core, [ready(job(0), when=T0 + timedelta(seconds=42))], T0 + timedelta(seconds=62), log=log)
    assert [(e.job_id, e.occurred_at) for e in of(out, ReplicaReady)] == [(job(0), T0 + timedelta(seconds=42))]


@pytest.mark.parametrize("asked, got, message", [
    (3, 3, ""),
    (9, 4, "9 replicas asked; the spec allows 1 to 4: scaled to 4"),
    (0, 1, "0 replicas asked; the spec allows 1 to 4: scaled to 1"),
])
def test_a_scale_request_is_clamped_to_min_and_max(asked, got, message):
    core, log = ServingCore(), Log()
    drive(core, [deployed()], T0, log=log)
    out = drive(core, [scale(asked)], T0, log=log)
    (scaled,) = of(out, ScaledTo)
    assert (scaled.replicas, scaled.requested, scaled.message) == (got, asked, message)
    live = [r for r in core.services["chat"].replicas.values() if r.live]
    assert len(live) == got


def test_scale_down_retires_replicas_not_ready_first_then_the_newest():
    core, log = ServingCore(), Log()
    drive(core, [deployed(service_spec(desired=4))], T0, log=log)
    up(core, log, 0, 1, 3)
    out = drive(core, [scale(1)], T0 + timedelta(seconds=20), log=log)
    assert [(e.job_id, e.reason) for e in of(out, ReplicaRetired)] == [
        (job(2), "scale-down"), (job(3), "scale-down"), (job(1), "scale-down")]


def test_a_preempted_replica_is_lost_and_comes_back_as_its_own_job():
    core, log = ServingCore(), Log()
    drive(core, [deployed(service_spec(desired=1))], T0, log=log)
    up(core, log, 0)
    out = drive(core, [preempted(job(0), when=T0 + timedelta(seconds=30))], T0 + timedelta(seconds=30), log=log)
    assert [(e.job_id, e.replaced) for e in of(out, ReplicaLost)] == [(job(0), False)]
    assert not of(out, ReplicaRequested)
    out = drive(core, [retry_scheduled(job(0)), scheduled(job(0), attempt=2), started(job(0), attempt=2),
                       ready(job(0), attempt=2)], T0 + timedelta(seconds=60), log=log)
    assert [(e.type, e.attempt) for e in out] == [("ReplicaScheduled", 2), ("ReplicaReady", 2)]


@pytest.mark.parametrize("ending", [
    lambda j: [succeeded(j)],
    lambda j: [cancelled(j, reason="by hand")],
    lambda j: [failed(j, FailureReason.EXIT_CODE, attempt=a, retryable=True) if a == REPLICA_RETRY.max_attempts
               else e for a in range(1, REPLICA_RETRY.max_attempts + 1)
               for e in ([failed(j, FailureReason.EXIT_CODE, attempt=a, retryable=True)]
                         + ([retry_scheduled(j, a)] if a < REPLICA_RETRY.max_attempts else []))],
], ids=["succeeded", "cancelled-not-by-the-controller", "failed-20-times"])
def test_a_replica_whose_job_ends_for_good_is_replaced(ending):
    core, log = ServingCore(), Log()
    drive(core, [deployed(service_spec(desired=1))], T0, log=log)
    up(core, log, 0)
    out = drive(core, ending(job(0)), T0 + timedelta(seconds=600), log=log)
    lost = of(out, ReplicaLost)
    assert lost[-1].job_id == job(0) and lost[-1].replaced
    assert [(r.job_id, r.reason) for r in of(out, ReplicaRequested)] == [(job(1), "scale-up")]


def test_replicas_that_keep_ending_are_replaced_ever_more_slowly():
    """A server that exits at once: each replacement waits twice as long as the one before."""
    core, log = ServingCore(), Log()
    drive(core, [deployed(service_spec(desired=1))], T0, log=log)
    waits, now = [], T0
    for i in range(4):
        ended = now + timedelta(seconds=5)
        drive(core, [scheduled(job(i), when=now), started(job(i), when=now),
                     succeeded(job(i), started_at=now, when=ended)], ended, log=log)
        assert core.next_wake() is not None
        now = core.next_wake()
        (request,) = of(drive(core, [], now, log=log), ReplicaRequested)
        assert request.job_id == job(i + 1)
        waits.append((now - ended).total_seconds())
    assert waits == [1, 2, 4, 8]


def test_a_rejected_replica_is_not_asked_for_again_until_the_template_changes():
    core, log = ServingCore(), Log()
    drive(core, [deployed(service_spec(desired=1))], T0, log=log)
    rejected = new_event(JobRejected, aggregate_id=job(0), producer="admission", occurred_at=T0, key="decision",
                         reason=RejectReason.UNSATISFIABLE, message="no node fits", field="spec.gpus")
    out = drive(core, [rejected], T0, log=log)
    assert [e.type for e in out] == ["ReplicaLost"] and out[0].reason == "JobRejected: no node fits"
    update = new_event(ServiceUpdated, aggregate_id="chat", producer="admission", occurred_at=T0, key="update/1/1",
                       spec=service_spec(desired=1, image="srv:2"), generation=2, updated_by="alice", intake_sequence=9)
    out = drive(core, [update], T0, log=log)
    assert [r.job_id for r in of(out, ReplicaRequested)] == [job(0, 2)]


def test_a_rollout_keeps_desired_ready_and_stays_within_the_surge():
    core, log = ServingCore(), Log()
    drive(core, [deployed(service_spec(desired=2, surge=1, unavailable=0))], T0, log=log)
    up(core, log, 0, 1)
    update = new_event(ServiceUpdated, aggregate_id="chat", producer="admission", occurred_at=T0, key="update/1/1",
                       spec=service_spec(desired=2, image="srv:2", surge=1, unavailable=0), generation=2,
                       updated_by="alice", intake_sequence=9)
    out = drive(core, [update], T0 + timedelta(seconds=20), log=log)
    assert [e.type for e in out] == ["ReplicaRequested"] and out[0].job_id == job(0, 2)  # one above desired
    out = up(core, log, 0, generation=2, at_s=30)
    assert [(e.type, getattr(e, "job_id", None)) for e in out] == [
        ("ReplicaScheduled", job(0, 2)), ("ReplicaReady", job(0, 2)),
        ("ReplicaRetired", job(0)), ("ReplicaRequested", job(1, 2))]
    drive(core, [cancelled(job(0))], T0 + timedelta(seconds=41), log=log)
    out = up(core, log, 1, generation=2, at_s=50)
    assert [e.job_id for e in of(out, ReplicaRetired)] == [job(1)]
    assert sorted(r.job_id for r in core.services["chat"].live()) == [job(0, 2), job(1, 2)]


def test_a_deleted_service_retires_every_replica():
    core, log = ServingCore(), Log()
    drive(core, [deployed()], T0, log=log)
    up(core, log, 0)
    deleted = new_event(ServiceDeleted, aggregate_id="chat", producer="admission", occurred_at=T0, key="delete/1",
                        deleted_by="alice", intake_sequence=9)
    out = drive(core, [deleted], T0 + timedelta(seconds=20), log=log)
    assert sorted((e.job_id, e.reason) for e in out) == [(job(0), "service deleted"), (job(1), "service deleted")]
    assert drive(core, [cancelled(job(0)), cancelled(job(1))], T0 + timedelta(seconds=30), log=log) == []


def test_a_restarted_controller_decides_nothing_new():
    core, log = ServingCore(), Log()
    drive(core, [deployed(service_spec(desired=3))], T0, log=log)
    up(core, log, 0, 1)
    drive(core, [scale(4), preempted(job(1), when=T0 + timedelta(seconds=30))], T0 + timedelta(seconds=30), log=log)
    fresh = ServingCore()
    for e in log.events:
        fresh.evolve(e)
    assert [e for e in fresh.decide(T0 + timedelta(seconds=30)) if e.event_id not in log.ids] == []


# -- autoscaling ----------------------------------------------------------------------------------


def autoscaled(metric="requests_per_replica", target=10.0, up=0.0, down=300.0, desired=2, hi=8):
    s = service_spec(desired=desired, hi=hi).model_copy(update={"autoscaling": Autoscaling(
        metric=metric, target=target, scale_up_stabilization_seconds=up, scale_down_stabilization_seconds=down)})
    core, log = ServingCore(), Log()
    drive(core, [deployed(s)], T0, log=log)
    return core, log


def load(rps: float, at_s: float, n: int) -> ServiceLoadReported:
    return new_event(ServiceLoadReported, aggregate_id="chat", producer="admission",
                     occurred_at=T0 + timedelta(seconds=at_s), key=f"load/{n}", requests_per_second=rps,
                     reported_by="ingress", intake_sequence=100 + n)


def autoscaled_to(events) -> list[tuple[int, int]]:
    return [(e.replicas, e.requested) for e in of(events, ScaledTo) if e.by == "autoscaler"]


def test_load_above_target_scales_up_at_once_without_an_up_window():
    core, log = autoscaled()
    out = drive(core, [load(35, 1, 1)], T0 + timedelta(seconds=1), log=log)
    assert autoscaled_to(out) == [(4, 4)]
    assert [r.job_id for r in of(out, ReplicaRequested)] == [job(2), job(3)]
    assert of(out, ScaledTo)[0].message.startswith("autoscaler: requests per second recommend 4 replicas")


def test_a_drop_in_load_waits_for_the_down_window_then_takes_its_highest():
    """A recommendation holds until the next one: 4 replicas held until the drop at 100 s, so the
    5-minute down window keeps them until 400 s (reports may be sparser than the window)."""
    core, log = autoscaled(down=300)
    drive(core, [load(35, 0, 1)], T0, log=log)
    out = drive(core, [load(5, 100, 2)], T0 + timedelta(seconds=100), log=log)
    assert autoscaled_to(out) == [] and core.next_wake() == T0 + timedelta(seconds=400)
    assert autoscaled_to(drive(core, [], T0 + timedelta(seconds=399), log=log)) == []
    out = drive(core, [], T0 + timedelta(seconds=400), log=log)
    assert autoscaled_to(out) == [(1, 1)]  # 5 requests/s at 10 per replica: 1 (the spec's min)
    assert len(of(out, ReplicaRetired)) == 3


def test_a_spike_must_hold_for_the_up_window():
    core, log = autoscaled(up=60)
    drive(core, [load(20, 0, 1)], T0, log=log)  # 2 replicas: as deployed
    out = drive(core, [load(50, 30, 2)], T0 + timedelta(seconds=30), log=log)
    assert autoscaled_to(out) == [] and core.next_wake() == T0 + timedelta(seconds=90)  # 2 held until 30 s
    out = drive(core, [], T0 + timedelta(seconds=90), log=log)
    assert autoscaled_to(out) == [(5, 5)]


def test_a_users_scale_stands_until_the_rule_recommends_anew_clamped_to_max():
    core, log = autoscaled(hi=3)
    out = drive(core, [load(1000, 1, 1), scale(2)], T0 + timedelta(seconds=1), log=log)
    assert [(e.by, e.replicas, e.requested) for e in of(out, ScaledTo)] == [("user", 2, 2)]
    out = drive(core, [load(1000, 2, 2)], T0 + timedelta(seconds=2), log=log)
    assert [(e.by, e.replicas, e.requested) for e in of(out, ScaledTo)] == [("autoscaler", 3, 3)]


def test_a_lowered_max_clamps_what_was_recommended_before():
    core, log = autoscaled(hi=8)
    drive(core, [load(60, 0, 1)], T0, log=log)  # 6 replicas
    lower = new_event(ServiceUpdated, aggregate_id="chat", producer="admission", occurred_at=T0, key="update/1/1",
                      spec=core.services["chat"].spec.model_copy(update={"replicas": Replicas(min=1, max=4, desired=4)}),
                      generation=1, updated_by="alice", intake_sequence=9)
    drive(core, [lower], T0 + timedelta(seconds=1), log=log)
    out = drive(core, [load(60, 2, 2)], T0 + timedelta(seconds=2), log=log)
    assert all(e.replicas <= 4 for e in of(out, ScaledTo))
    assert len(core.services["chat"].live()) == 4


def test_a_service_deleted_and_deployed_again_retires_what_still_ran_of_the_old_one():
    core, log = ServingCore(), Log()
    drive(core, [deployed(service_spec(desired=1))], T0, log=log)
    deleted = new_event(ServiceDeleted, aggregate_id="chat", producer="admission", occurred_at=T0, key="delete/1",
                        deleted_by="alice", intake_sequence=9)
    again = new_event(ServiceDeployed, aggregate_id="chat", producer="admission", occurred_at=T0, key="deploy/2",
                      spec=service_spec(desired=1), deployed_by="alice", generation=2, intake_sequence=10)
    core.evolve(deleted)  # folded together with the new deploy, before its retirement was decided
    log.append(deleted)
    out = drive(core, [again], T0, log=log)
    assert [(e.type, e.job_id) for e in out] == [("ReplicaRetired", job(0)), ("ReplicaRequested", job(0, 2))]


def test_gpu_utilization_of_the_ready_replicas_drives_the_rule():
    core, log = autoscaled(metric="gpu_utilization", target=0.6)
    when = T0 + timedelta(seconds=1)
    drive(core, [scheduled(job(0), {"n1": (0,)}, when=when), started(job(0), ["n1"], when=when),
                 ready(job(0), when=when), scheduled(job(1), {"n1": (1,)}, when=when),
                 started(job(1), ["n1"], when=when), ready(job(1), when=when)],
          when + timedelta(seconds=10), log=log)
    report = telemetry("n1", [gpu(0, 0.9), gpu(1, 0.9), gpu(2, 0.0, allocated=0)], start=when + timedelta(seconds=10))
    out = drive(core, [report], when + timedelta(seconds=70), log=log)
    assert autoscaled_to(out) == [(3, 3)]  # ceil(2 × 0.9 / 0.6)


def test_a_replica_with_a_readiness_probe_carries_it_to_the_backend():
    s = ServiceSpec.model_validate({**service_spec(desired=1).model_dump(),
                                    "readiness": {"delay_seconds": 20, "http_path": "/ok", "port": 8000}})
    (request,) = of(drive(ServingCore(), [deployed(s)], T0), ReplicaRequested)
    assert {k: v for k, v in request.spec.annotations.items() if k.startswith("gpusched.io/")} == {
        "gpusched.io/service": "chat", "gpusched.io/readiness-path": "/ok", "gpusched.io/readiness-port": "8000",
        "gpusched.io/readiness-delay": "20"}


def test_the_events_the_adapter_leaves_unparsed_change_nothing():
    """The adapter does not parse a job's events unless the job is a replica
    (services.serving.domain.passes_over): a core fed only the others holds the same state and
    decides the same as one fed the whole log, which here also has a team's own jobs, one of them
    named like a replica in all but its prefix."""
    from schemas.registry import event_subject, subject_parts
    from services.serving.domain import passes_over

    whole, log = ServingCore(), Log()
    drive(whole, [deployed(service_spec(desired=2))], T0, log=log)
    up(whole, log, 0, 1)
    t1 = T0 + timedelta(seconds=30)
    others = [e for j in ("train-1", "chat.v2-1-0", "xreplica-chat-1-0")
              for e in (scheduled(j, when=t1), started(j, when=t1), ready(j, when=t1),
                        preempted(j, when=t1), retry_scheduled(j), succeeded(j))]
    drive(whole, [*others, preempted(job(1), when=t1)], t1, log=log)
    drive(whole, [retry_scheduled(job(1)), scheduled(job(1), attempt=2), started(job(1), attempt=2)],
          t1 + timedelta(seconds=5), log=log)

    skipped = [e for e in log.events if passes_over(*subject_parts(event_subject(e))[:2])]
    assert {e.aggregate_id for e in skipped} == {"train-1", "chat.v2-1-0", "xreplica-chat-1-0"}
    filtered = ServingCore()
    for event in log.events:
        if event not in skipped:
            filtered.evolve(event)
    assert filtered.services == whole.services and filtered.wake_at == whole.wake_at
    later = t1 + timedelta(minutes=10)
    assert [e.event_id for e in filtered.decide(later)] == [e.event_id for e in whole.decide(later)]
