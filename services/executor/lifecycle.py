"""The pure core every real executor backend (kubernetes, local) shares.

It knows two things and does no I/O:

* what the log says: which attempt of which job is live, which must stop (cancel, reclaim,
  preemption, with their checkpoint windows), which outcomes are already recorded;
* what the backend last reported: one :class:`Observation` per attempt (pending, running,
  succeeded, failed, gone) and the node inventory, fed in by the adapter through
  :meth:`BackendCore.observe` and :meth:`BackendCore.observe_inventory`.

From those it derives

* the events that follow (:meth:`BackendCore.decide`): JobStarted once the whole gang runs,
  JobSucceeded, JobFailed with the classified reason and whether the job's retry policy retries
  it, JobPreempted / JobCancelled once the stopped attempt is gone, NodeRegistered / NodeUpdated /
  NodeLost, and JobFailed(node-lost) for attempts on a lost node, and NodeTelemetryReported for
  each telemetry window the backend closed (:meth:`BackendCore.observe_telemetry`), until it is
  in the log;
* the backend actions (:meth:`BackendCore.plan`): which workloads must exist (created under a
  deterministic name, so a restarted executor adopts what it finds instead of creating it twice),
  which must be stopped and with what grace period, and which the backend holds that the log does
  not want (orphans).

Event ids are derived from (job, attempt) only, and timestamps from what the backend reported
(e.g. a Pod's start and finish times), so an executor that restarts and observes the same world
derives the same events with the same ids, and JetStream drops the repeats.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from schemas import (
    Event,
    FailureReason,
    JobAdmitted,
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
    NodeRegistered,
    NodeTelemetryReported,
    NodeUpdated,
    PreemptionRequested,
    ReclaimRequested,
    new_event,
)
from schemas.job import NodeAssignment
from schemas.node import GpuTelemetry, NodeInfo

PRODUCER = "executor"
NAME_MAX = 63  # a Job's name ends up in a label value on its Pods
MAX_PENDING_REPORTS = 1000  # telemetry not yet in the log (NATS away); the oldest are dropped beyond


class Phase(StrEnum):
    PENDING = "pending"  # created, not (all) running yet
    RUNNING = "running"  # every gang member runs
    SUCCEEDED = "succeeded"  # every gang member exited 0
    FAILED = "failed"  # a member failed (the observation says why)
    GONE = "gone"  # the backend holds nothing for the attempt any more


@dataclass(frozen=True)
class Observation:
    """What the backend reports about one attempt, all gang members together."""

    job_id: str
    attempt: int
    phase: Phase
    at: datetime  # when it happened, as the backend says (start or finish time), else when seen
    started_at: datetime | None = None
    reason: FailureReason | None = None  # for FAILED
    exit_code: int | None = None
    message: str = ""


def workload_name(job_id: str, attempt: int, member: int | None = None) -> str:
    """Deterministic backend name of an attempt (and gang member): the same decision always
    names the same object, so creating it again finds it instead of running it twice."""
    suffix = f"-a{attempt}" + (f"-m{member}" if member is not None else "")
    base = job_id
    if len(base) + len(suffix) > NAME_MAX:
        digest = hashlib.sha256(job_id.encode()).hexdigest()[:8]
        base = f"{job_id[: NAME_MAX - len(suffix) - 9].rstrip('-')}-{digest}"
    return re.sub(r"[^a-z0-9-]", "-", f"{base}{suffix}")


@dataclass(frozen=True)
class TelemetryReport:
    """A telemetry window the backend closed: the payload of one NodeTelemetryReported."""

    node: str
    window_start: datetime
    window_end: datetime
    gpu_count: int
    gpus: tuple[GpuTelemetry, ...]


@dataclass(frozen=True)
class Workload:
    """One attempt as the backend must run it."""

    job_id: str
    attempt: int
    spec: JobSpec
    flavor: str
    placement: tuple[NodeAssignment, ...]
    priority: int | None = None
    resume: bool = False  # an earlier attempt ran: the job should resume from its checkpoint

    @property
    def name(self) -> str:
        return workload_name(self.job_id, self.attempt)


@dataclass(frozen=True)
class Stop:
    """An attempt to stop: SIGTERM, then ``grace_seconds`` to checkpoint, then kill."""

    workload: Workload
    grace_seconds: float
    why: str  # "cancel", "preempt", "node-lost", "failed"


@dataclass(frozen=True)
class Plan:
    run: tuple[Workload, ...]  # must exist (create if missing, adopt if present)
    stop: tuple[Stop, ...]  # must be stopped gracefully
    keep: frozenset[tuple[str, int]]  # (job, attempt) the log still cares about; others are orphans
    started: frozenset[tuple[str, int]] = frozenset()  # attempts the log says started


@dataclass
class _Attempt:
    scheduled: JobScheduled
    started: JobStarted | None = None
    stop: ReclaimRequested | PreemptionRequested | None = None
    failed_on_node: str | None = None  # a placement node was lost


@dataclass
class _Job:
    spec: JobSpec
    priority: int | None = None
    attempt: _Attempt | None = None  # live attempt, if any
    ran_before: bool = False
    finished: bool = False  # succeeded or cancelled
    cancel: JobCancelRequested | None = None


@dataclass
class _State:
    jobs: dict[str, _Job] = field(default_factory=dict)
    nodes: dict[str, NodeInfo] = field(default_factory=dict)  # as the log has them
    registrations: dict[str, int] = field(default_factory=dict)
    observed: dict[tuple[str, int], Observation] = field(default_factory=dict)
    inventory: dict[str, NodeInfo] | None = None  # as the backend reports them; None: not listed yet
    telemetry: dict[str, NodeTelemetryReported] = field(default_factory=dict)  # by event id, not yet in the log


class BackendCore:
    """A :class:`runtime.loop.Core` for backends whose outcomes come from the outside world."""

    def __init__(self) -> None:
        self.state = _State()

    # -- inputs ------------------------------------------------------------------------------
    def evolve(self, event: Event) -> None:
        s = self.state
        match event:
            case NodeRegistered() | NodeUpdated():
                s.nodes[event.node.name] = event.node
                if isinstance(event, NodeRegistered):
                    s.registrations[event.node.name] = s.registrations.get(event.node.name, 0) + 1
                return
            case NodeTelemetryReported():
                s.telemetry.pop(event.event_id, None)
                return
            case NodeLost():
                s.nodes.pop(event.name, None)
                for job in s.jobs.values():
                    a = job.attempt
                    if a is not None and a.failed_on_node is None and any(p.node == event.name for p in a.scheduled.placement):
                        a.failed_on_node = event.name
                return
            case JobSubmitted():
                s.jobs.setdefault(event.aggregate_id, _Job(spec=event.spec))
                return
        job = s.jobs.get(event.aggregate_id)
        if job is None:
            return
        a = job.attempt
        match event:
            case JobAdmitted():
                job.priority = event.priority
            case JobScheduled():
                if a is not None:
                    self._forget(event.aggregate_id, a.scheduled.attempt)
                job.attempt = _Attempt(event)
            case JobStarted():
                if a is not None and a.scheduled.attempt == event.attempt:
                    a.started = event
                    job.ran_before = True
            case JobSucceeded() | JobFailed() | JobPreempted():
                if a is not None and a.scheduled.attempt == event.attempt:
                    job.attempt = None
                if isinstance(event, JobSucceeded):
                    job.finished = True
            case JobCancelled():
                job.attempt = None
                job.finished = True
            case ReclaimRequested() | PreemptionRequested():
                if a is not None and a.scheduled.attempt == event.attempt and a.stop is None:
                    a.stop = event
            case JobCancelRequested():
                if job.cancel is None:
                    job.cancel = event

    def _forget(self, job_id: str, attempt: int) -> None:
        self.state.observed.pop((job_id, attempt), None)

    def observe(self, obs: Observation) -> None:
        """The backend's latest word on one attempt (the adapter calls this from its watches)."""
        job = self.state.jobs.get(obs.job_id)
        if job is None or job.attempt is None or job.attempt.scheduled.attempt != obs.attempt:
            return  # not live in the log: the plan treats it as an orphan
        prev = self.state.observed.get((obs.job_id, obs.attempt))
        if prev is not None and _rank(prev.phase) > _rank(obs.phase) and obs.phase != Phase.GONE:
            return  # a stale watch event must not move an attempt backwards
        self.state.observed[(obs.job_id, obs.attempt)] = obs

    def observe_inventory(self, nodes: list[NodeInfo]) -> None:
        """The backend's full node list (after a list or any node watch event)."""
        self.state.inventory = {n.name: n for n in nodes}

    def observe_telemetry(self, report: TelemetryReport) -> None:
        """A closed telemetry window; decided as NodeTelemetryReported (id from node and window
        start) until the log has it. Raises ValueError (pydantic's) for an invalid report."""
        event = new_event(NodeTelemetryReported, aggregate_id=report.node, producer=PRODUCER,
                          occurred_at=report.window_end, key=report.window_start.isoformat(), node=report.node,
                          window_start=report.window_start, window_end=report.window_end,
                          gpu_count=report.gpu_count, gpus=report.gpus)
        pending = self.state.telemetry
        pending[event.event_id] = event
        while len(pending) > MAX_PENDING_REPORTS:
            del pending[next(iter(pending))]

    def decisions_refused(self) -> None:
        """Everything is re-derived from state on each cycle."""

    # -- outputs -----------------------------------------------------------------------------
    def decide(self, now: datetime) -> list[Event]:
        out = self._inventory(now)
        out.extend(self.state.telemetry.values())  # after the node's own inventory events
        for job_id, job in self.state.jobs.items():
            if (event := self._next(job_id, job, now)) is not None:
                out.append(event)
        return out

    def plan(self) -> Plan:
        run: list[Workload] = []
        stop: list[Stop] = []
        keep: set[tuple[str, int]] = set()
        started: set[tuple[str, int]] = set()
        for job_id, job in self.state.jobs.items():
            a = job.attempt
            if a is None:
                continue
            n = a.scheduled.attempt
            keep.add((job_id, n))
            if a.started is not None:
                started.add((job_id, n))
            w = Workload(job_id=job_id, attempt=n, spec=job.spec, flavor=a.scheduled.flavor,
                         placement=a.scheduled.placement, priority=job.priority,
                         resume=n > 1 and job.ran_before)
            obs = self.state.observed.get((job_id, n))
            if job.cancel is not None:
                stop.append(Stop(w, float(_grace(job.spec, None)), "cancel"))
            elif a.stop is not None:
                stop.append(Stop(w, float(a.stop.grace_seconds), "preempt"))
            elif a.failed_on_node is not None:
                stop.append(Stop(w, 0.0, "node-lost"))
            elif obs is not None and obs.phase == Phase.FAILED:
                stop.append(Stop(w, 0.0, "failed"))  # e.g. the rest of a gang, or an image that never pulls
            elif obs is None or obs.phase in (Phase.PENDING, Phase.RUNNING):
                run.append(w)
        return Plan(tuple(run), tuple(stop), frozenset(keep), frozenset(started))

    def _inventory(self, now: datetime) -> list[Event]:
        inv = self.state.inventory
        if inv is None:
            return []  # never report nodes lost before the backend was listed once
        out: list[Event] = []
        for name, info in inv.items():
            seen = self.state.nodes.get(name)
            if seen == info:
                continue
            cls = NodeRegistered if seen is None else NodeUpdated
            out.append(new_event(cls, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                                 key=info.model_dump_json(), node=info))
        for name in self.state.nodes.keys() - inv.keys():
            out.append(new_event(NodeLost, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                                 key=f"removed-{self.state.registrations.get(name, 0)}", name=name,
                                 reason="the node is gone from the cluster"))
        return out

    def _next(self, job_id: str, job: _Job, now: datetime) -> Event | None:
        a = job.attempt
        if job.cancel is not None and not job.finished:
            if a is None:
                return new_event(JobCancelled, aggregate_id=job_id, producer=PRODUCER, occurred_at=now,
                                 key="cancelled", cause=job.cancel, attempt=None, reason=job.cancel.reason)
            obs = self.state.observed.get((job_id, a.scheduled.attempt))
            if obs is None or obs.phase != Phase.GONE and obs.phase not in (Phase.SUCCEEDED, Phase.FAILED):
                return None  # still stopping; the adapter deletes it with the grace period
            return new_event(JobCancelled, aggregate_id=job_id, producer=PRODUCER, occurred_at=obs.at,
                             key="cancelled", cause=job.cancel, attempt=a.scheduled.attempt,
                             started_at=_started_at(a, obs), reason=job.cancel.reason)
        if a is None:
            return None
        n = a.scheduled.attempt
        obs = self.state.observed.get((job_id, n))
        if a.failed_on_node is not None:
            if a.stop is None:
                return new_event(JobFailed, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key=str(n),
                                 cause=a.started or a.scheduled, attempt=n, started_at=_started_at(a, obs),
                                 reason=FailureReason.NODE_LOST, message=f"node {a.failed_on_node} lost",
                                 retryable=FailureReason.NODE_LOST in job.spec.retry.retry_on)
        if obs is None:
            return None
        if a.stop is not None:
            if obs.phase in (Phase.GONE, Phase.SUCCEEDED, Phase.FAILED):
                return new_event(JobPreempted, aggregate_id=job_id, producer=PRODUCER, occurred_at=obs.at,
                                 key=str(n), cause=a.stop, attempt=n, started_at=_started_at(a, obs),
                                 preempted_by=a.stop.for_job, reason=a.stop.message)
            return None
        if obs.phase == Phase.RUNNING or (obs.phase == Phase.SUCCEEDED and a.started is None):
            if a.started is None:
                return new_event(JobStarted, aggregate_id=job_id, producer=PRODUCER,
                                 occurred_at=obs.started_at or obs.at, key=str(n), cause=a.scheduled, attempt=n,
                                 nodes=tuple(p.node for p in a.scheduled.placement))
            return None
        if obs.phase == Phase.SUCCEEDED:
            return new_event(JobSucceeded, aggregate_id=job_id, producer=PRODUCER, occurred_at=obs.at, key=str(n),
                             cause=a.started, attempt=n, started_at=_started_at(a, obs))
        if obs.phase == Phase.FAILED:
            reason = obs.reason or FailureReason.BACKEND_ERROR
            return new_event(JobFailed, aggregate_id=job_id, producer=PRODUCER, occurred_at=obs.at, key=str(n),
                             cause=a.started or a.scheduled, attempt=n, started_at=_started_at(a, obs),
                             reason=reason, exit_code=obs.exit_code, message=obs.message[:4096] or reason.value,
                             retryable=reason in job.spec.retry.retry_on)
        if obs.phase == Phase.GONE:
            # Nobody here asked for it to stop: someone else deleted it.
            return new_event(JobFailed, aggregate_id=job_id, producer=PRODUCER, occurred_at=obs.at, key=str(n),
                             cause=a.started or a.scheduled, attempt=n, started_at=_started_at(a, obs),
                             reason=FailureReason.BACKEND_ERROR, message=obs.message or "the workload disappeared",
                             retryable=FailureReason.BACKEND_ERROR in job.spec.retry.retry_on)
        return None


def _rank(phase: Phase) -> int:
    return {Phase.PENDING: 0, Phase.RUNNING: 1, Phase.SUCCEEDED: 2, Phase.FAILED: 2, Phase.GONE: 3}[phase]


def _started_at(a: _Attempt, obs: Observation | None) -> datetime | None:
    if a.started is not None:
        return a.started.occurred_at
    return obs.started_at if obs is not None else None


def _grace(spec: JobSpec, default: float | None) -> float:
    """Checkpoint window of a cancel: the job may ask for one by annotation."""
    raw = spec.annotations.get("gpusched.io/cancel-grace-seconds")
    try:
        return max(0.0, float(raw)) if raw else (default if default is not None else 30.0)
    except ValueError:
        return default if default is not None else 30.0
