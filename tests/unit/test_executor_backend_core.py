"""BackendCore, the executor's lifecycle core for every backend: the log plus the backend's
observations -> events and a plan (what must run, stop, or is an orphan); and the port the
backends implement."""

from __future__ import annotations

from datetime import timedelta

from schemas import (
    FailureReason,
    JobCancelled,
    JobFailed,
    JobPreempted,
    JobReady,
    JobStarted,
    JobSucceeded,
    NodeLost,
    NodeRegistered,
)
from services.executor.lifecycle import BackendCore, Observation, Phase
from tests.unit.builders import (
    T0,
    admitted,
    at,
    cancel_requested,
    node_info,
    preemption_requested,
    reclaim_requested,
    scheduled,
    spec,
    started,
    submitted,
)


def core_with(*events) -> BackendCore:
    c = BackendCore()
    for e in events:
        c.evolve(e)
    return c


def settle(c: BackendCore, now=T0) -> list:
    """decide, fold the decisions back in, until nothing new (like the service loop)."""
    out, seen = [], set()
    while True:
        new = [e for e in c.decide(now) if e.event_id not in seen]
        if not new:
            return out
        for e in new:
            seen.add(e.event_id)
            c.evolve(e)
        out += new


def obs(phase, *, attempt=1, at_=at(5), started_at=at(1), **kw) -> Observation:
    return Observation("j", attempt, phase, at_, started_at=started_at, **kw)


def test_scheduled_attempt_is_planned_to_run_with_deterministic_name():
    c = core_with(submitted("j"), admitted("j", priority=700), scheduled("j", {"n1": (0,)}))
    plan = c.plan()
    assert [(w.name, w.priority, w.resume) for w in plan.run] == [("j-a1", 700, False)]
    assert plan.keep == {("j", 1)} and not plan.stop


def test_running_then_succeeded_with_the_backends_timestamps():
    c = core_with(submitted("j"), scheduled("j"))
    c.observe(obs(Phase.RUNNING, at_=at(1)))
    [s] = settle(c)
    assert isinstance(s, JobStarted) and s.occurred_at == at(1)
    c.observe(obs(Phase.SUCCEEDED, at_=at(9)))
    [done] = settle(c)
    assert isinstance(done, JobSucceeded) and (done.occurred_at, done.started_at) == (at(9), at(1))
    assert c.plan().keep == frozenset()  # finished: its Job is no longer the log's concern


def test_a_job_that_finished_unseen_still_gets_started_first():
    c = core_with(submitted("j"), scheduled("j"))
    c.observe(obs(Phase.SUCCEEDED))
    assert [type(e) for e in settle(c)] == [JobStarted, JobSucceeded]


def test_a_stale_observation_does_not_move_an_attempt_backwards():
    c = core_with(submitted("j"), scheduled("j"))
    c.observe(obs(Phase.SUCCEEDED))
    c.observe(obs(Phase.RUNNING))
    assert [type(e) for e in settle(c)] == [JobStarted, JobSucceeded]


def test_observations_of_attempts_not_live_are_ignored():
    c = core_with(submitted("j"), scheduled("j", attempt=2))
    c.observe(obs(Phase.FAILED, attempt=1, reason=FailureReason.EXIT_CODE, exit_code=1))
    assert settle(c) == []


def test_failure_is_retryable_per_the_jobs_policy():
    policy = {"max_attempts": 3, "retry_on": ["oom-killed"]}
    c = core_with(submitted("j", spec(retry=policy)), scheduled("j"), started("j"))
    c.observe(obs(Phase.FAILED, reason=FailureReason.OOM_KILLED, exit_code=137, message="out of memory"))
    [f] = settle(c)
    assert isinstance(f, JobFailed) and (f.reason, f.exit_code, f.retryable) == (FailureReason.OOM_KILLED, 137, True)


def test_an_attempt_that_disappears_is_a_backend_error():
    c = core_with(submitted("j"), scheduled("j"), started("j"))
    c.observe(obs(Phase.GONE))
    [f] = settle(c)
    assert f.reason == FailureReason.BACKEND_ERROR and f.retryable  # in the default retry_on


def test_cancel_stops_then_reports_once_gone():
    c = core_with(submitted("j"), scheduled("j"), started("j"), cancel_requested("j"))
    plan = c.plan()
    assert [s.why for s in plan.stop] == ["cancel"] and not plan.run
    assert settle(c) == []  # still stopping
    c.observe(obs(Phase.GONE, at_=at(40)))
    [e] = settle(c)
    assert isinstance(e, JobCancelled) and e.attempt == 1 and e.occurred_at == at(40)


def test_cancel_of_a_queued_job_needs_no_backend():
    c = core_with(submitted("j"), cancel_requested("j"))
    [e] = settle(c)
    assert isinstance(e, JobCancelled) and e.attempt is None


def test_preemption_stops_with_its_grace_and_reports_preempted():
    c = core_with(submitted("j"), scheduled("j"), started("j"), preemption_requested("j", grace_seconds=45))
    [stop] = c.plan().stop
    assert (stop.why, stop.grace_seconds) == ("preempt", 45)
    c.observe(obs(Phase.FAILED, reason=FailureReason.EXIT_CODE, exit_code=143))  # killed by SIGTERM
    [e] = settle(c)
    assert isinstance(e, JobPreempted) and e.preempted_by == "urgent"


def test_reclaim_is_a_preemption_with_its_own_grace():
    c = core_with(submitted("j"), scheduled("j"), started("j"), reclaim_requested("j"))
    assert c.plan().stop[0].grace_seconds == 30


def test_node_lost_fails_the_attempt_and_stops_it():
    c = core_with(submitted("j"), scheduled("j", {"n1": (0,)}), started("j"))
    c.observe_inventory([node_info("n1")])
    settle(c)
    c.observe_inventory([])
    events = settle(c)
    assert [type(e) for e in events] == [NodeLost, JobFailed]
    assert events[1].reason == FailureReason.NODE_LOST and events[1].retryable
    assert c.plan().stop == () and c.plan().keep == frozenset()


def test_inventory_only_after_the_first_list():
    c = BackendCore()
    assert settle(c) == []  # nothing listed yet: never report nodes lost
    c.observe_inventory([node_info("n1")])
    [r] = settle(c)
    assert isinstance(r, NodeRegistered)
    c.observe_inventory([node_info("n1")])
    assert settle(c) == []


def test_a_retry_resumes_from_its_checkpoint():
    c = core_with(submitted("j"), scheduled("j"), started("j"))
    c.observe(obs(Phase.FAILED, reason=FailureReason.EVICTED))
    settle(c)
    c.evolve(scheduled("j", attempt=2, when=T0 + timedelta(seconds=60)))
    [w] = c.plan().run
    assert (w.name, w.resume) == ("j-a2", True)


def test_decisions_are_deterministic():
    def run():
        c = core_with(submitted("j"), scheduled("j"))
        c.observe(obs(Phase.SUCCEEDED))
        return [e.event_id for e in settle(c)]

    assert run() == run()


def test_an_attempt_placed_on_a_node_the_log_lost_fails_at_once():
    c = core_with(submitted("j"))
    c.observe_inventory([node_info("n1")])
    for e in settle(c):
        c.evolve(e)
    c.observe_inventory([])
    settle(c)  # NodeLost(n1)
    c.evolve(scheduled("j", {"n1": (0,)}))  # decided before the scheduler saw the NodeLost
    [f] = settle(c)
    assert isinstance(f, JobFailed) and (f.reason, f.message) == (FailureReason.NODE_LOST, "node n1 lost")
    assert [s.why for s in c.plan().stop] == []  # the attempt ended with the JobFailed


def test_the_first_terminal_observation_is_final():
    c = core_with(submitted("j"), scheduled("j"), started("j"))
    c.observe(obs(Phase.FAILED, at_=at(7), reason=FailureReason.EXIT_CODE, exit_code=2))
    c.observe(obs(Phase.GONE, at_=at(9)))  # e.g. the Job's TTL ran out, or a stop of what already ended
    [f] = settle(c)
    assert (f.reason, f.exit_code, f.occurred_at) == (FailureReason.EXIT_CODE, 2, at(7))


def test_changes_name_only_what_a_remembering_backend_must_act_on():
    c = core_with(submitted("j"), scheduled("j"), submitted("k"), scheduled("k"))
    assert [w.job_id for w in c.changes().run] == ["j", "k"]
    assert c.changes() == c.changes() and not c.changes().run  # nothing since
    c.evolve(started("j"))  # the backend saw the start itself
    assert not c.changes().run
    c.evolve(cancel_requested("k"))
    part = c.changes()
    assert ([s.why for s in part.stop], part.complete) == (["cancel"], False)
    assert [w.job_id for w in c.plan().run] == ["j"] and c.plan().complete


def test_every_backend_implements_the_port():
    from services.executor.kubernetes import KubernetesBackend
    from services.executor.lifecycle import Backend
    from services.executor.local import LocalBackend
    from services.executor.sim import SimBackend

    port = {name for name in vars(Backend) if not name.startswith("_")}
    assert port == {"start", "close", "reachable", "inventory", "create", "stop", "observe"}
    for cls in (SimBackend, LocalBackend, KubernetesBackend):
        assert port <= set(dir(cls)), cls


def replica(delay="10"):
    job = "replica-chat-1-0"
    return job, spec(annotations={"gpusched.io/service": "chat", "gpusched.io/readiness-delay": delay})


def test_a_replica_is_ready_once_its_backend_says_so_and_its_delay_has_passed():
    job, s = replica()
    c = core_with(submitted(job, s), scheduled(job))
    c.observe(Observation(job, 1, Phase.RUNNING, at(1), started_at=at(1)))  # running, its probe not passing yet
    assert [type(e) for e in settle(c, at(1))] == [JobStarted]
    assert c.next_wake() == at(11)
    assert settle(c, at(30)) == []  # past the delay, still not ready
    c.observe(Observation(job, 1, Phase.RUNNING, at(1), started_at=at(1), ready_at=at(4)))
    [r] = settle(c, at(31))
    assert isinstance(r, JobReady) and (r.attempt, r.occurred_at) == (1, at(11))  # ready at 4 s, but the delay is 10 s
    assert settle(c, at(60)) == [] and c.next_wake() is None  # once per attempt


def test_a_replica_ready_from_its_start_is_ready_when_its_delay_ends():
    job, s = replica("5")
    c = core_with(submitted(job, s), scheduled(job))
    c.observe(Observation(job, 1, Phase.RUNNING, at(1), started_at=at(1), ready_at=at(1)))
    assert [type(e) for e in settle(c, at(2))] == [JobStarted]
    assert settle(c, at(5.9)) == []
    [r] = settle(c, at(6))
    assert isinstance(r, JobReady) and r.occurred_at == at(6)


def test_a_job_that_is_no_replica_is_never_ready():
    for job, s in [("j", spec()), ("j", spec(annotations={"gpusched.io/service": "chat"})),
                   ("replica-chat-1-0", spec())]:  # a replica's id and annotation, both
        c = core_with(submitted(job, s), scheduled(job))
        c.observe(Observation(job, 1, Phase.RUNNING, at(1), started_at=at(1), ready_at=at(1)))
        assert [type(e) for e in settle(c, at(100))] == [JobStarted] and c.next_wake() is None
