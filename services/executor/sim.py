"""The sim backend: virtual nodes from a cluster spec, and attempts that run for their planned
duration on the clock each reconcile pass is given; and :class:`SimExecutorCore`, the lifecycle
core driving it in-line, which is what the sim executor (and the trace simulator) run.

An attempt runs from its creation (one the log says started: from its JobStarted) for its planned
duration, so every outcome is a function of the log and the clock: a restarted executor
re-derives exactly the outcomes it missed while down, with the same event ids, and stamps each
with the time it happened (start + duration), not the time it was noticed.

A preemption or reclaim (a ``preempt`` stop) gives the attempt its checkpoint window: it runs on
until its deadline, the request's time in the log plus its ``grace_seconds`` on the platform
clock, and is stopped then (the end is stamped at the deadline, however late the pass that sees
it); one whose planned end comes first ends then, with its planned outcome (JobSucceeded or JobFailed,
not JobPreempted: it ended on its own). The deadline is
derived from the request in the log, so a restarted executor stops the attempt at the same time.
Any other stop (cancel, node lost, the rest of a failed gang) ends the attempt at once.

Annotations a job can carry to rehearse failures:

* ``sim.gpusched.io/exit-code``: the attempt exits with this code (default 0);
* ``sim.gpusched.io/fail-attempts``: only the first N attempts fail (default: all of them);
* ``sim.gpusched.io/failure-reason``: a :class:`FailureReason` (default ``exit-code``).

A malformed value counts as absent. A service's replica (annotated ``gpusched.io/service``, with
no expected runtime) runs until it is stopped: scaled down, preempted or its node lost; it is
ready (JobReady) its service's readiness delay after its start.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from schemas import Event, FailureReason, JobSpec
from schemas.node import NodeInfo
from schemas.service import SERVICE_ANNOTATION
from services.executor.lifecycle import BackendCore, Observation, Phase, Plan, TelemetryReport, reconcile

DEFAULT_RUNTIME_S = 60.0
SERVICE_RUNTIME_S = 10 * 365 * 86_400.0
"""A replica of a service runs this long unless stopped: for as long as the platform runs."""
ANN_EXIT = "sim.gpusched.io/exit-code"
ANN_FAIL_ATTEMPTS = "sim.gpusched.io/fail-attempts"
ANN_REASON = "sim.gpusched.io/failure-reason"
NOT_IN_SPEC = "not in the cluster spec"


def planned_outcome(spec: JobSpec, attempt: int) -> tuple[float, FailureReason | None, int]:
    """(runtime seconds, failure reason or None, exit code) of one attempt."""
    default = SERVICE_RUNTIME_S if SERVICE_ANNOTATION in spec.annotations else DEFAULT_RUNTIME_S
    runtime = spec.expected_runtime_seconds or default
    if spec.max_runtime_seconds is not None and runtime > spec.max_runtime_seconds:
        return float(spec.max_runtime_seconds), FailureReason.DEADLINE_EXCEEDED, 137
    ann = spec.annotations
    exit_code = _int_annotation(ann, ANN_EXIT, 0)
    fail_attempts = _int_annotation(ann, ANN_FAIL_ATTEMPTS, 1_000_000)
    if exit_code == 0 or attempt > fail_attempts:
        return runtime, None, 0
    try:
        reason = FailureReason(ann.get(ANN_REASON) or FailureReason.EXIT_CODE.value)
    except ValueError:
        reason = FailureReason.EXIT_CODE
    return runtime, reason, exit_code


Outcome = Callable[[str, JobSpec, int], tuple[float, FailureReason | None, int]]
"""(job id, spec, attempt) -> (runtime seconds, failure reason or None, exit code): how an
attempt ends. The default reads the spec (:func:`planned_outcome`); a what-if replay gives each
attempt the runtime and outcome it had in the recorded log."""


def _int_annotation(ann: dict[str, str], key: str, default: int) -> int:
    """A malformed value counts as absent: raising here would stall decide() for every job."""
    try:
        return int(ann.get(key) or default)
    except ValueError:
        return default


@dataclass(frozen=True)
class _Run:
    started: datetime
    ends: datetime  # its planned end
    reason: FailureReason | None
    exit_code: int
    deadline: datetime | None = None  # asked to stop (preempt): stopped then unless its planned end comes first

    @property
    def until(self) -> datetime:
        """When it ends: its planned end, or its stop deadline if that comes first."""
        return self.ends if self.deadline is None or self.ends <= self.deadline else self.deadline


Notice = Callable[[str, int], datetime | None]
"""(job id, attempt) -> the time of the stop request (ReclaimRequested / PreemptionRequested)
the log holds for it; None: none."""


class SimBackend:
    """A :class:`~services.executor.lifecycle.Backend` with nothing behind it. It remembers what
    it was told, so it takes partial plans, and reports only what changed since the last call."""

    def __init__(self, nodes: list[NodeInfo], outcome: Outcome | None = None, notice: Notice | None = None) -> None:
        """``notice``: where a preempt stop's deadline counts from (the request's time in the
        log); without one, from the pass that first sees the stop."""
        self.nodes = nodes
        self._outcome = outcome or (lambda job_id, spec, attempt: planned_outcome(spec, attempt))
        self._notice = notice or (lambda job_id, attempt: None)
        self._runs: dict[tuple[str, int], _Run] = {}  # attempts running now
        self._ends: list[tuple[datetime, str, int]] = []  # planned ends, a heap; stopped runs' entries are stale
        self._seen: list[Observation] = []  # what happened since the last observe()

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def nodes(self) -> list[NodeInfo]:
        """The inventory (the cluster spec's nodes); assigning a new list changes it."""
        return self._nodes

    @nodes.setter
    def nodes(self, nodes: list[NodeInfo]) -> None:
        self._nodes = list(nodes)
        self._nodes_changed = True

    def reachable(self) -> bool:
        """Virtual nodes: always."""
        return True

    def inventory(self) -> list[NodeInfo]:
        self._nodes_changed = False
        return self._nodes  # the same list until it changes: the core does not compare it again

    def create(self, plan: Plan, now: datetime) -> int:
        created = 0
        for w in plan.run:
            key = (w.job_id, w.attempt)
            if key in self._runs:
                continue
            started = w.started_at or now
            run = self._add(w.job_id, w.spec, w.attempt, started)
            # nothing to probe: ready from the start (a replica counts as ready after its service's delay)
            self._seen.append(Observation(w.job_id, w.attempt, Phase.RUNNING, started, started_at=started,
                                          ready_at=started))
            created += 1
        return created

    def _add(self, job_id: str, spec: JobSpec, attempt: int, started: datetime) -> _Run:
        runtime, reason, exit_code = self._outcome(job_id, spec, attempt)
        run = self._runs[(job_id, attempt)] = _Run(started, started + timedelta(seconds=runtime), reason, exit_code)
        heapq.heappush(self._ends, (run.ends, job_id, attempt))
        return run

    def stop(self, plan: Plan, now: datetime) -> int:
        for s in plan.stop:
            w = s.workload
            key = (w.job_id, w.attempt)
            if s.why == "preempt" and s.grace_seconds > 0:
                run = self._runs.get(key)
                if run is None and w.started_at is not None:
                    # a restarted executor: the log says it started; it runs on until its deadline
                    run = self._add(w.job_id, w.spec, w.attempt, w.started_at)
                if run is not None:
                    deadline = (self._notice(w.job_id, w.attempt) or now) + timedelta(seconds=s.grace_seconds)
                    if run.deadline is None or deadline < run.deadline:
                        run = self._runs[key] = replace(run, deadline=deadline)
                        heapq.heappush(self._ends, (run.until, w.job_id, w.attempt))
                    continue  # observe() reports its end
            run = self._runs.pop(key, None)
            started = run.started if run is not None else w.started_at
            self._seen.append(Observation(w.job_id, w.attempt, Phase.GONE, now, started_at=started,
                                          message=f"stopped ({s.why})"))
        orphans = [k for k in self._runs if k not in plan.keep] if plan.complete else []
        for key in orphans:
            del self._runs[key]
        return len(plan.stop) + len(orphans)

    def observe(self, plan: Plan, now: datetime) -> tuple[list[Observation], list[TelemetryReport]]:
        ends = self._ends
        while ends and ends[0][0] <= now:
            at, job_id, attempt = heapq.heappop(ends)
            run = self._runs.get((job_id, attempt))
            if run is None or run.until != at:
                continue  # stopped before its end, or its end moved (a stop deadline)
            del self._runs[(job_id, attempt)]
            self._seen.append(_outcome(job_id, attempt, run))
        seen, self._seen = self._seen, []
        return seen, []

    def quiet(self, now: datetime) -> bool:
        """Nothing to report at ``now``: the same nodes, no run created or stopped since the last
        observe, none past its planned end."""
        return not (self._nodes_changed or self._seen or (self._ends and self._ends[0][0] <= now))

    def next_end(self) -> datetime | None:
        """The earliest planned end of a running attempt."""
        ends = self._ends
        while ends:
            at, job_id, attempt = ends[0]
            run = self._runs.get((job_id, attempt))
            if run is not None and run.until == at:
                return at
            heapq.heappop(ends)
        return None


def _outcome(job_id: str, attempt: int, run: _Run) -> Observation:
    if run.until != run.ends:
        return Observation(job_id, attempt, Phase.GONE, run.until, started_at=run.started,
                           message="stopped (preempt) at its deadline")
    if run.reason is None:
        return Observation(job_id, attempt, Phase.SUCCEEDED, run.ends, started_at=run.started, exit_code=0,
                           on_its_own=True)
    message = f"exited with code {run.exit_code}" if run.reason == FailureReason.EXIT_CODE else run.reason.value
    return Observation(job_id, attempt, Phase.FAILED, run.ends, started_at=run.started, reason=run.reason,
                       exit_code=run.exit_code, message=message, on_its_own=True)


class SimExecutorCore:
    """The sim executor as a :class:`runtime.loop.Core`: each ``decide(now)`` is a reconcile pass
    of the lifecycle core's changes against the sim backend at ``now`` (none when neither has
    anything new), then the core's decisions. Pure: no I/O, no wall clock."""

    def __init__(self, nodes: list[NodeInfo], outcome: Outcome | None = None, **clusters) -> None:
        """``clusters``: BackendCore's ``cluster``, ``heartbeat_s`` and ``cluster_flavors``."""
        self.core = BackendCore(node_lost_reason=NOT_IN_SPEC, **clusters)
        self.backend = SimBackend(nodes, outcome, notice=self._notice)
        # The core's own methods: the trace simulator calls these for every event.
        self.evolve = self.core.evolve
        self.decisions_refused = self.core.decisions_refused

    def decide(self, now: datetime) -> list[Event]:
        plan = self.core.changes()
        if plan.run or plan.stop or not self.backend.quiet(now):
            self.core.apply(reconcile(self.backend, plan, now))
        else:
            self.core.contact()  # the sim is always there: its heartbeat goes on
        return self.core.decide(now)

    def _notice(self, job_id: str, attempt: int) -> datetime | None:
        """The time of the stop request the log holds for the attempt (a preempt stop's deadline
        counts from it, so a restarted executor keeps the same deadline)."""
        job = self.core.state.jobs.get(job_id)
        a = job.attempt if job is not None else None
        if a is None or a.scheduled.attempt != attempt or a.stop is None:
            return None
        return a.stop.occurred_at

    def next_end(self) -> datetime | None:
        """When the next running attempt ends or is stopped at its deadline (None: none runs):
        the trace simulator's next step."""
        return self.backend.next_end()

    def next_wake(self) -> datetime | None:
        """The next time something happens by the clock alone: an attempt's end, a replica's
        readiness."""
        times = [t for t in (self.backend.next_end(), self.core.next_wake()) if t is not None]
        return min(times, default=None)
