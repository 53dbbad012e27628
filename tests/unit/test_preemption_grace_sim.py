"""Notice, then grace, then stop, in the sim executor (issue 44 item 2): a preempted or reclaimed
attempt runs on until its deadline (the request's time in the log + its grace, on the platform
clock) and is stopped then; a cancel still stops at once; a restarted executor keeps the deadline."""

from __future__ import annotations

import pytest

from schemas import JobCancelled, JobPreempted, JobSucceeded
from services.executor.sim import SimExecutorCore
from tests.unit.builders import (
    T0,
    Log,
    at,
    cancel_requested,
    checkpointed,
    drive,
    preemption_requested,
    reclaim_requested,
    scheduled,
    spec,
    submitted,
)
from tests.unit.test_executor_sim import CLUSTER, Harness


def _reclaim(job_id, *, grace, when):
    return reclaim_requested(job_id, when=when).model_copy(update={"grace_seconds": grace})


def _stops(events):
    return [(e.type, e.aggregate_id, e.occurred_at) for e in events if isinstance(e, (JobPreempted, JobCancelled))]


@pytest.mark.parametrize("request_", [
    lambda: preemption_requested("j1", grace_seconds=60, when=at(10)),
    lambda: _reclaim("j1", grace=60, when=at(10)),
])
def test_a_preempted_attempt_runs_until_its_deadline(request_):
    h = Harness()
    h.run("j1", expected_runtime_seconds=1000)
    assert h.feed(request_(), now=at(10)) == []  # the notice: nothing stops yet
    assert h.core.next_wake() == at(70)  # the loop (and the trace simulator) wake at the deadline
    assert h.feed(now=at(69)) == []
    (stop,) = h.feed(now=at(70))
    assert (stop.type, stop.attempt, stop.started_at, stop.occurred_at) == ("JobPreempted", 1, T0, at(70))
    assert h.feed(now=at(2000)) == []  # and no success after it


def test_the_stop_is_stamped_at_the_deadline_however_late_the_pass():
    # a lagging executor (or a fast platform clock with a slow tick) stops it at its deadline, not at the pass
    h = Harness()
    h.run("j1", expected_runtime_seconds=1000)
    req = preemption_requested("j1", grace_seconds=60, when=at(10))
    assert _stops(h.feed(req, now=at(40))) == []  # first seen 30 s after the notice
    assert _stops(h.feed(now=at(500))) == [("JobPreempted", "j1", at(70))]


def test_no_grace_stops_at_once():
    h = Harness()
    h.run("j1", expected_runtime_seconds=1000)
    assert _stops(h.feed(preemption_requested("j1", grace_seconds=0, when=at(10)), now=at(10))) == [
        ("JobPreempted", "j1", at(10))]


def test_an_attempt_whose_planned_end_comes_first_ends_then():
    h = Harness()
    h.run("j1", expected_runtime_seconds=30)
    assert h.feed(preemption_requested("j1", grace_seconds=60, when=at(10)), now=at(10)) == []
    assert h.core.next_wake() == at(30)
    (end,) = h.feed(now=at(30))  # at its planned end, not at the deadline (70)
    assert (end.aggregate_id, end.occurred_at) == ("j1", at(30))


def test_an_attempt_that_completes_within_the_grace_keeps_its_success():
    h = Harness()
    h.run("j1", expected_runtime_seconds=30)
    h.feed(preemption_requested("j1", grace_seconds=60, when=at(10)), now=at(10))
    (end,) = h.feed(now=at(30))
    assert isinstance(end, JobSucceeded)


def test_a_checkpoint_within_the_grace_lands_before_the_stop():
    h = Harness()
    h.run("j1", expected_runtime_seconds=1000)
    h.feed(preemption_requested("j1", grace_seconds=60, when=at(10)), now=at(10))
    assert h.feed(checkpointed("j1", at_=at(40), when=at(40)), now=at(40)) == []  # still running
    (stop,) = h.feed(now=at(70))
    kinds = [e.type for e in h.log.events if e.type in ("JobCheckpointed", "JobPreempted")]
    assert kinds == ["JobCheckpointed", "JobPreempted"] and stop.occurred_at == at(70)


def test_a_cancel_during_the_grace_stops_at_once():
    h = Harness()
    h.run("j1", expected_runtime_seconds=1000)
    h.feed(preemption_requested("j1", grace_seconds=60, when=at(10)), now=at(10))
    (event,) = h.feed(cancel_requested("j1", when=at(20)), now=at(20))
    assert (event.type, event.occurred_at) == ("JobCancelled", at(20))
    assert h.feed(now=at(100)) == []


def test_a_cancel_alone_still_stops_at_once():
    h = Harness()
    h.run("j1", expected_runtime_seconds=1000)
    assert _stops(h.feed(cancel_requested("j1", when=at(5)), now=at(5))) == [("JobCancelled", "j1", at(5))]


@pytest.mark.parametrize("restart_at, decide_at", [(30, 100), (200, 200)])
def test_a_restarted_executor_keeps_the_deadline(restart_at, decide_at):
    """The deadline comes from the request in the log: an executor restarted within the grace,
    or after the deadline, stops the attempt at the same time, with the same event id."""
    h = Harness()
    h.run("j1", expected_runtime_seconds=1000)
    h.feed(preemption_requested("j1", grace_seconds=60, when=at(10)), now=at(10))
    prefix = list(h.log.events)
    (expected,) = h.feed(now=at(70))

    fresh, log = SimExecutorCore(CLUSTER), Log()
    for e in prefix:
        log.append(e)
        fresh.evolve(e)
    assert _stops(drive(fresh, (), at(restart_at), log=log)) == ([] if restart_at < 70 else
                                                                 [("JobPreempted", "j1", at(70))])
    if restart_at < 70:
        (again,) = _stops_events(drive(fresh, (), at(decide_at), log=log))
    else:
        (again,) = [e for e in log.events if isinstance(e, JobPreempted)]
    assert again.model_dump() == expected.model_dump()


def _stops_events(events):
    return [e for e in events if isinstance(e, JobPreempted)]


def test_the_deadline_is_one_per_attempt_and_the_next_attempt_runs_in_full():
    h = Harness()
    h.feed(submitted("j1", spec(expected_runtime_seconds=100)), scheduled("j1", {"n1": (0,)}), now=T0)
    h.feed(preemption_requested("j1", grace_seconds=20, when=at(10)), now=at(10))
    assert _stops(h.feed(now=at(30))) == [("JobPreempted", "j1", at(30))]
    h.feed(scheduled("j1", {"n1": (0,)}, attempt=2, when=at(40)), now=at(40))
    assert h.feed(now=at(139)) == []
    (done,) = h.feed(now=at(140))
    assert (done.type, done.attempt, done.occurred_at) == ("JobSucceeded", 2, at(140))
