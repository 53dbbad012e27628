"""Snapshots (runtime/snapshot.py): a core restored from a snapshot and fed the rest of the log
holds the same state, and decides the same, as a core that folded the whole log.

The log is 100,000+ events the decision cores wrote themselves: a synthetic openb-shaped trace
replayed through quota, the scheduler and the sim backend (gpusched.sim.trace), each job submitted,
admitted, reserved, scheduled, started, succeeded and released; the cluster is small for the load,
so most of the time jobs wait (quota holds, the scheduler has heads that do not fit)."""

from __future__ import annotations

import dataclasses
import pickle
from datetime import timedelta

import pytest
from sortedcontainers import SortedList

from gpusched.sim import trace as tracesim
from runtime import snapshot
from services.admission.domain import AdmissionCore
from services.quota.domain import QuotaCore
from services.scheduler.domain import SchedulerCore
from services.scheduler.placement import Policy
from tests.unit.datacache import built_once

# The event after which each core has something to decide: a cut just after it asks a restart
# for decisions, not only for state.
UNDECIDED_AFTER = {"admission": "JobSubmitted", "quota": "JobAdmitted", "scheduler": "QuotaReserved"}

CORES = {
    "admission": AdmissionCore,
    "quota": QuotaCore,
    "scheduler": lambda: SchedulerCore(Policy.BEST_FIT),  # explaining, preemption on: the service's defaults
}


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> list:
    """The events of a 15,000-task replay, in log order (105,013: seven a task, just above the
    100,000 asked for below); kept between sessions while the code that wrote them is unchanged
    (tests/unit/datacache.py)."""

    def replay() -> list:
        trace = tracesim.load_trace(tracesim.write_synthetic_trace(tmp_path_factory.mktemp("trace"), nodes=12,
                                                                   tasks=15_000))
        events: list = []
        fold = tracesim.Platform.feed

        def recording(platform, batch):
            batch = list(batch)
            events.extend(batch)
            fold(platform, batch)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tracesim.Platform, "feed", recording)
            tracesim.replay(trace, Policy.BEST_FIT)
        return events

    return built_once("snapshot-log-15000", replay)


def canonical(value):
    """A comparable form of a state: plain objects (the inventory's nodes) by their attributes,
    leaving out the inventory's copy-on-write bookkeeping, which differs between equal states."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, {f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, SortedList)):
        return [canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, value))
    if hasattr(value, "__dict__") and not hasattr(value, "model_dump"):
        return (type(value).__name__, {k: canonical(v) for k, v in vars(value).items() if k not in ("_origin", "_copied")})
    return value


def fold(core, events) -> None:
    for event in events:
        core.evolve(event)


def run_live(core, events, decide_every: int = 500) -> list:
    """Fold events in as the service does, deciding now and then: its reasons go to the log and
    come back (their marks on the state are the log's); its other decisions are refused, so some
    were decided and never recorded when the snapshot is taken. Returns the log it saw."""
    seen = []
    for i, event in enumerate(events, 1):
        core.evolve(event)
        seen.append(event)
        if i % decide_every == 0:
            decided = core.decide(event.occurred_at)
            reasons = [e for e in decided if e.type.endswith("PendingReasonChanged")]
            fold(core, reasons)
            seen += reasons
            if len(reasons) < len(decided):
                core.decisions_refused()
    return seen


def through_snapshot(core, factory):
    """A new core from ``core``'s snapshot, pickled as the service saves it."""
    saved = snapshot.Snapshot("v", "log", 1, {}, core.snapshot_state())
    restored = factory()
    restored.restore_state(snapshot.Snapshot.decode("v", "log", 1, saved.encode()).state)
    return restored


def decisions(core, now) -> list[str]:
    return sorted(e.model_dump_json() for e in core.decide(now))


def test_the_log_is_large_and_varied(log):
    assert len(log) >= 100_000
    assert len({type(e).__name__ for e in log}) >= 8


@pytest.mark.parametrize("service", sorted(CORES))
@pytest.mark.parametrize("cut", [0.3, 0.75])
def test_snapshot_plus_tail_equals_the_full_fold(log, service, cut):
    factory = CORES[service]
    k = next(i for i in range(int(len(log) * cut), len(log)) if type(log[i - 1]).__name__ == UNDECIDED_AFTER[service])
    head, tail = log[:k], log[k:]

    live = factory()  # the service's core: it decided along the way
    seen = run_live(live, head)
    cold = factory()  # a start without a snapshot: the log up to the cut, folded
    fold(cold, seen)
    restored = through_snapshot(live, factory)
    assert canonical(restored.state) == canonical(cold.state)
    at = head[-1].occurred_at + timedelta(seconds=1)
    first = decisions(cold, at)  # what a restart decides first
    assert first and decisions(restored, at) == first

    whole = factory()
    fold(whole, seen + tail)
    again = through_snapshot(live, factory)
    fold(again, tail)
    assert canonical(again.state) == canonical(whole.state)
    end = log[-1].occurred_at + timedelta(seconds=1)
    assert decisions(again, end) == decisions(whole, end)


def test_the_states_hold_live_work_only(log):
    """Quota forgets a job once its quota is back and no attempt follows; so a snapshot's size
    follows the work in flight, not the history."""
    quota = QuotaCore()
    fold(quota, log)
    assert quota.state.jobs == {}
