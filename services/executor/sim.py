"""The sim backend as a pure core: virtual nodes from a cluster spec, and attempts that run for
their declared duration on the platform clock.

Every outcome is a function of the log and the clock, so a restarted executor re-derives exactly
the outcomes it missed while down, with the same event ids, and stamps each with the time it
happened (start + duration), not the time it was noticed.

Annotations a job can carry to rehearse failures:

* ``sim.gpusched.io/exit-code``: the attempt exits with this code (default 0);
* ``sim.gpusched.io/fail-attempts``: only the first N attempts fail (default: all of them);
* ``sim.gpusched.io/failure-reason``: a :class:`FailureReason` (default ``exit-code``).

A malformed value counts as absent.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from schemas import (
    Event,
    FailureReason,
    JobCancelled,
    JobCancelRequested,
    JobFailed,
    JobPreempted,
    JobScheduled,
    JobSpec,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeLost,
    PreemptionRequested,
    ReclaimRequested,
    NodeRegistered,
    NodeUpdated,
    new_event,
)
from schemas.node import NodeInfo

PRODUCER = "executor"
DEFAULT_RUNTIME_S = 60.0
ANN_EXIT = "sim.gpusched.io/exit-code"
ANN_FAIL_ATTEMPTS = "sim.gpusched.io/fail-attempts"
ANN_REASON = "sim.gpusched.io/failure-reason"


@dataclass
class Attempt:
    scheduled: JobScheduled
    started: JobStarted | None = None
    ends_at: datetime | None = None  # started + planned runtime


@dataclass
class SimJob:
    spec: JobSpec
    submitted: JobSubmitted
    attempt: Attempt | None = None  # the live attempt, if any
    finished: bool = False
    cancel_requested: JobCancelRequested | None = None
    reclaim: ReclaimRequested | PreemptionRequested | None = None  # for the live attempt


@dataclass
class SimState:
    nodes: dict[str, NodeInfo] = field(default_factory=dict)  # as registered in the log
    registrations: dict[str, int] = field(default_factory=dict)  # NodeRegistered count per node
    jobs: dict[str, SimJob] = field(default_factory=dict)
    due: dict[str, None] = field(default_factory=dict)  # jobs with something to do now
    ends: list[tuple[datetime, str]] = field(default_factory=list)  # running attempts by planned end, sorted


def planned_outcome(spec: JobSpec, attempt: int) -> tuple[float, FailureReason | None, int]:
    """(runtime seconds, failure reason or None, exit code) of one attempt."""
    runtime = spec.expected_runtime_seconds or DEFAULT_RUNTIME_S
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


def _int_annotation(ann: dict[str, str], key: str, default: int) -> int:
    """A malformed value counts as absent: raising here would stall decide() for every job."""
    try:
        return int(ann.get(key) or default)
    except ValueError:
        return default


class SimExecutorCore:
    def __init__(self, cluster: list[NodeInfo]) -> None:
        self.desired = {n.name: n for n in cluster}
        self.state = SimState()
        self._inventory_dirty = True  # only node events can change the inventory decisions

    def decisions_refused(self) -> None:
        """Outcomes are re-derived from state on every cycle; the inventory is compared again."""
        self._inventory_dirty = True

    def _end_attempt(self, job_id: str, job: SimJob) -> None:
        job.reclaim = None
        a = job.attempt
        if a is not None and a.ends_at is not None:
            i = bisect.bisect_left(self.state.ends, (a.ends_at, job_id))
            if i < len(self.state.ends) and self.state.ends[i] == (a.ends_at, job_id):
                del self.state.ends[i]
        job.attempt = None
        self.state.due.pop(job_id, None)

    def evolve(self, event: Event) -> None:
        s = self.state
        match event:
            case NodeRegistered() | NodeUpdated():
                s.nodes[event.node.name] = event.node
                if isinstance(event, NodeRegistered):
                    s.registrations[event.node.name] = s.registrations.get(event.node.name, 0) + 1
                self._inventory_dirty = True
                return
            case NodeLost():
                s.nodes.pop(event.name, None)
                self._inventory_dirty = True
                s.due.update(dict.fromkeys(
                    j for j, job in s.jobs.items()
                    if job.attempt is not None and any(p.node == event.name for p in job.attempt.scheduled.placement)
                ))
                return
            case JobSubmitted():
                s.jobs[event.aggregate_id] = SimJob(spec=event.spec, submitted=event)
                return
        job = s.jobs.get(event.aggregate_id)
        if job is None:
            return
        job_id = event.aggregate_id
        match event:
            case JobScheduled():
                self._end_attempt(job_id, job)
                job.attempt = Attempt(event)
                s.due[job_id] = None
            case JobStarted():
                a = job.attempt
                if a is not None and a.scheduled.attempt == event.attempt:
                    a.started = event
                    a.ends_at = event.occurred_at + timedelta(seconds=planned_outcome(job.spec, event.attempt)[0])
                    bisect.insort(s.ends, (a.ends_at, job_id))
                    if job.cancel_requested is None:
                        s.due.pop(job_id, None)
            case JobSucceeded() | JobFailed() | JobPreempted():
                if job.attempt is not None and job.attempt.scheduled.attempt == event.attempt:
                    self._end_attempt(job_id, job)
                if isinstance(event, JobSucceeded):
                    job.finished = True  # terminal: a late cancel request has nothing to stop
            case JobCancelled():
                self._end_attempt(job_id, job)
                job.finished = True
            case ReclaimRequested() | PreemptionRequested():
                if job.attempt is not None and job.attempt.scheduled.attempt == event.attempt:
                    job.reclaim = event
                    s.due[job_id] = None
            case JobCancelRequested():
                job.cancel_requested = event
                if not job.finished:
                    s.due[job_id] = None

    def decide(self, now: datetime) -> list[Event]:
        """Inventory changes, then what is due now (starts, cancels, lost nodes), then the
        running attempts whose planned end has passed, earliest first."""
        out: list[Event] = []
        if self._inventory_dirty:
            out.extend(self._inventory(now))
            self._inventory_dirty = bool(out)  # compare again until the log agrees
        for job_id in self.state.due:
            if (event := self._next(job_id, self.state.jobs[job_id], now)) is not None:
                out.append(event)
        for ends_at, job_id in self.state.ends:
            if ends_at > now:
                break
            if job_id not in self.state.due and (event := self._next(job_id, self.state.jobs[job_id], now)):
                out.append(event)
        return out

    def _inventory(self, now: datetime) -> list[Event]:
        out: list[Event] = []
        for name, info in self.desired.items():
            seen = self.state.nodes.get(name)
            if seen == info:
                continue
            cls = NodeRegistered if seen is None else NodeUpdated
            out.append(new_event(cls, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                                 key=info.model_dump_json(), node=info))
        for name in self.state.nodes.keys() - self.desired.keys():
            out.append(new_event(NodeLost, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                                 key=f"removed-{self.state.registrations.get(name, 0)}", name=name,
                                 reason="not in the cluster spec"))
        return out

    def _next(self, job_id: str, job: SimJob, now: datetime) -> Event | None:
        a = job.attempt
        if job.cancel_requested is not None:
            return new_event(
                JobCancelled, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key="cancelled",
                cause=job.cancel_requested, attempt=a.scheduled.attempt if a else None,
                started_at=a.started.occurred_at if a and a.started else None, reason=job.cancel_requested.reason,
            )
        if a is None:
            return None
        n = a.scheduled.attempt
        if job.reclaim is not None and job.reclaim.attempt == n:
            # The sim stops at once; a real backend waits out grace_seconds after SIGTERM.
            return new_event(
                JobPreempted, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key=str(n), cause=job.reclaim,
                attempt=n, started_at=a.started.occurred_at if a.started else None, preempted_by=job.reclaim.for_job,
                reason=job.reclaim.message,
            )
        lost = [p.node for p in a.scheduled.placement if p.node not in self.state.nodes]
        if lost:
            return new_event(
                JobFailed, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key=str(n),
                cause=a.started or a.scheduled, attempt=n, started_at=a.started.occurred_at if a.started else None,
                reason=FailureReason.NODE_LOST, message=f"node(s) {lost} lost", retryable=True,
            )
        if a.started is None:
            return new_event(
                JobStarted, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key=str(n), cause=a.scheduled,
                attempt=n, nodes=tuple(p.node for p in a.scheduled.placement),
            )
        runtime, reason, exit_code = planned_outcome(job.spec, n)
        end = a.started.occurred_at + timedelta(seconds=runtime)
        if end > now:
            return None
        if reason is None:
            return new_event(
                JobSucceeded, aggregate_id=job_id, producer=PRODUCER, occurred_at=end, key=str(n), cause=a.started,
                attempt=n, started_at=a.started.occurred_at,
            )
        return new_event(
            JobFailed, aggregate_id=job_id, producer=PRODUCER, occurred_at=end, key=str(n), cause=a.started,
            attempt=n, started_at=a.started.occurred_at, reason=reason, exit_code=exit_code,
            message=f"exited with code {exit_code}" if reason == FailureReason.EXIT_CODE else reason.value,
            retryable=reason in job.spec.retry.retry_on,
        )
