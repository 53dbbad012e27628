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

Simulated telemetry (``telemetry_s`` > 0; the sim executor's ``GPUSCHED_TELEMETRY_INTERVAL_S``):
every node with GPUs reports a NodeTelemetryReported with ``source`` ``simulated`` per window of
``telemetry_s`` platform seconds, windows aligned to multiples of it since the Unix epoch (so a
restarted executor names the same windows, with the same event ids). A window holds
:data:`TELEMETRY_SAMPLES` virtual samples; at each, a GPU's utilization is the sum over the
attempts holding it then of their share of it (``gpu_milli`` / 1000, else 1) times their modelled
utilization (:func:`attempt_utilization`), at most 1; a GPU nobody holds is at 0. Everything is a
function of the attempts' placements, starts and ends, the services' load reports and the window:
no wall clock, no randomness but hashes of the job id, attempt and window.

* ``sim.gpusched.io/utilization`` on the job (a number in [0, 1]): the attempt's utilization, as is;
* a service's replica, once the service's load was reported (ServiceLoadReported): the load shared
  by the replicas running at that instant, over ``sim.gpusched.io/replica-capacity-rps`` (the
  requests per second one replica serves at utilization 1, default 10), at most 1;
* otherwise its kind's mean (:data:`KIND_UTILIZATION`), moved by up to ±0.1 per attempt (seeded by
  job id and attempt) and ±0.05 per window (seeded by job id, attempt and window start).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from schemas import Event, FailureReason, JobKind, JobSpec, ServiceLoadReported
from schemas.node import GpuTelemetry, NodeInfo
from schemas.service import SERVICE_ANNOTATION, replica_service
from services.executor.lifecycle import BackendCore, Observation, Phase, Plan, TelemetryReport, Workload, reconcile

DEFAULT_RUNTIME_S = 60.0
SERVICE_RUNTIME_S = 10 * 365 * 86_400.0
"""A replica of a service runs this long unless stopped: for as long as the platform runs."""
ANN_EXIT = "sim.gpusched.io/exit-code"
ANN_FAIL_ATTEMPTS = "sim.gpusched.io/fail-attempts"
ANN_REASON = "sim.gpusched.io/failure-reason"
NOT_IN_SPEC = "not in the cluster spec"

# Simulated telemetry (module docstring).
ANN_UTILIZATION = "sim.gpusched.io/utilization"
ANN_REPLICA_RPS = "sim.gpusched.io/replica-capacity-rps"
REPLICA_CAPACITY_RPS = 10.0
"""Requests per second one replica serves at utilization 1, unless its spec says otherwise."""
KIND_UTILIZATION = {JobKind.TRAINING: 0.85, JobKind.EVALUATION: 0.6, JobKind.BATCH: 0.5, JobKind.INFERENCE: 0.35}
"""Mean utilization of an attempt of each kind, without a hint in its spec."""
ATTEMPT_JITTER, WINDOW_JITTER = 0.1, 0.05
TELEMETRY_SAMPLES = 60
"""Virtual samples per window, at the middle of each 1/60 of it."""
MEMORY_SHARE = 0.8
"""Device memory an attempt holds, as a share of what it was given, unless ``min_gpu_memory_mib`` says."""
DEFAULT_GPU_MEMORY_MIB = 16_384
"""Device memory of a node whose spec gives none."""
MAX_WINDOWS_BEHIND = 60
"""Windows one pass reports at most; older ones are skipped (a pass that came very late)."""


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


def _unit(*parts: object) -> float:
    """A number in [-1, 1) from ``parts``: the same on every run and host (no Python hash())."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 63 - 1.0


def _fraction(ann: dict[str, str], key: str) -> float | None:
    """A number in [0, 1] (a malformed or out-of-range value counts as absent)."""
    try:
        value = float(ann[key])
    except (KeyError, ValueError):
        return None
    return value if 0.0 <= value <= 1.0 else None


def _positive(ann: dict[str, str], key: str, default: float) -> float:
    try:
        value = float(ann.get(key) or default)
    except ValueError:
        return default
    return value if 0 < value < math.inf else default


def attempt_utilization(job_id: str, spec: JobSpec, attempt: int, window_start: datetime) -> float:
    """An attempt's modelled utilization in the window starting at ``window_start``, without a
    service's load: its spec's hint, else its kind's mean with its jitter (module docstring)."""
    hint = _fraction(spec.annotations, ANN_UTILIZATION)
    if hint is not None:
        return hint
    mean = KIND_UTILIZATION.get(spec.kind, 0.5) + ATTEMPT_JITTER * _unit(job_id, attempt)
    return min(1.0, max(0.0, mean + WINDOW_JITTER * _unit(job_id, attempt, window_start.isoformat())))


@dataclass
class _Span:
    """Where and when an attempt held GPUs, for the telemetry windows."""

    job_id: str
    attempt: int
    spec: JobSpec
    started: datetime
    gpus: dict[str, tuple[tuple[int, float], ...]]  # node -> (GPU index, share of it)
    service: str | None  # the service it is a replica of
    ended: datetime | None = None  # None: it runs


@dataclass
class _Telemetry:
    """The sim's telemetry state: the window being filled, the attempts' spans, the services' load."""

    interval_s: float
    window: int | None = None  # index of the next window to close (its start: window * interval_s)
    spans: dict[tuple[str, int], _Span] = field(default_factory=dict)
    load: dict[str, list[tuple[datetime, float]]] = field(default_factory=dict)  # service -> (at, rps), in order

    def start_of(self, window: int) -> datetime:
        return datetime.fromtimestamp(0, UTC) + timedelta(seconds=window * self.interval_s)


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

    def __init__(self, nodes: list[NodeInfo], outcome: Outcome | None = None, notice: Notice | None = None,
                 telemetry_s: float = 0.0) -> None:
        """``notice``: where a preempt stop's deadline counts from (the request's time in the
        log); without one, from the pass that first sees the stop. ``telemetry_s``: the window
        of the simulated telemetry reports, platform seconds (0: none)."""
        self.nodes = nodes
        self._outcome = outcome or (lambda job_id, spec, attempt: planned_outcome(spec, attempt))
        self._notice = notice or (lambda job_id, attempt: None)
        self._runs: dict[tuple[str, int], _Run] = {}  # attempts running now
        self._ends: list[tuple[datetime, str, int]] = []  # planned ends, a heap; stopped runs' entries are stale
        self._seen: list[Observation] = []  # what happened since the last observe()
        if telemetry_s < 0 or telemetry_s > 86_400:
            raise ValueError(f"telemetry_s {telemetry_s:g}; accepted: 0 (no telemetry) or up to 86400 s")
        self._telemetry = _Telemetry(telemetry_s) if telemetry_s > 0 else None

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
            self._add(w.job_id, w.spec, w.attempt, started)
            self._span(w, started)
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

    def _span(self, w: Workload, started: datetime) -> None:
        t = self._telemetry
        if t is None or (w.job_id, w.attempt) in t.spans:
            return
        gpus = {a.node: tuple((i, (a.gpu_milli or 1000) / 1000.0) for i in (a.gpu_indices or range(a.gpus)))
                for a in w.placement if a.gpus}
        if gpus:
            t.spans[(w.job_id, w.attempt)] = _Span(w.job_id, w.attempt, w.spec, started, gpus,
                                                   replica_service(w.job_id, w.spec))

    def _ended(self, key: tuple[str, int], at: datetime) -> None:
        """The attempt no longer runs from ``at``: its span ends there."""
        if self._telemetry is not None and (span := self._telemetry.spans.get(key)) is not None and span.ended is None:
            span.ended = at

    def stop(self, plan: Plan, now: datetime) -> int:
        for s in plan.stop:
            w = s.workload
            key = (w.job_id, w.attempt)
            if s.why == "preempt" and s.grace_seconds > 0:
                run = self._runs.get(key)
                if run is None and w.started_at is not None:
                    # a restarted executor: the log says it started; it runs on until its deadline
                    run = self._add(w.job_id, w.spec, w.attempt, w.started_at)
                    self._span(w, w.started_at)
                if run is not None:
                    deadline = (self._notice(w.job_id, w.attempt) or now) + timedelta(seconds=s.grace_seconds)
                    if run.deadline is None or deadline < run.deadline:
                        run = self._runs[key] = replace(run, deadline=deadline)
                        heapq.heappush(self._ends, (run.until, w.job_id, w.attempt))
                    continue  # observe() reports its end
            run = self._runs.pop(key, None)
            self._ended(key, now)
            started = run.started if run is not None else w.started_at
            self._seen.append(Observation(w.job_id, w.attempt, Phase.GONE, now, started_at=started,
                                          message=f"stopped ({s.why})"))
        orphans = [k for k in self._runs if k not in plan.keep] if plan.complete else []
        for key in orphans:
            del self._runs[key]
            self._ended(key, now)
        return len(plan.stop) + len(orphans)

    def observe(self, plan: Plan, now: datetime) -> tuple[list[Observation], list[TelemetryReport]]:
        ends = self._ends
        while ends and ends[0][0] <= now:
            at, job_id, attempt = heapq.heappop(ends)
            run = self._runs.get((job_id, attempt))
            if run is None or run.until != at:
                continue  # stopped before its end, or its end moved (a stop deadline)
            del self._runs[(job_id, attempt)]
            self._ended((job_id, attempt), at)
            self._seen.append(_outcome(job_id, attempt, run))
        seen, self._seen = self._seen, []
        return seen, self._close_windows(now)

    def quiet(self, now: datetime) -> bool:
        """Nothing to report at ``now``: the same nodes, no run created or stopped since the last
        observe, none past its planned end, no telemetry window ended."""
        return not (self._nodes_changed or self._seen or (self._ends and self._ends[0][0] <= now)
                    or ((end := self.next_window_end()) is not None and end <= now))

    # -- simulated telemetry -------------------------------------------------------------------
    def load_reported(self, service: str, at: datetime, requests_per_second: float) -> None:
        """A service's load from the log (ServiceLoadReported): its replicas' utilization follows it."""
        if self._telemetry is None:
            return
        history = self._telemetry.load.setdefault(service, [])
        bisect.insort(history, (at, requests_per_second))

    def next_window_end(self) -> datetime | None:
        """When the telemetry window being filled ends (None: no telemetry, or no pass yet)."""
        t = self._telemetry
        return None if t is None or t.window is None else t.start_of(t.window + 1)

    def _close_windows(self, now: datetime) -> list[TelemetryReport]:
        """A report per node with GPUs for each window that ended by ``now``. The first window
        starts at the first boundary after the first pass."""
        t = self._telemetry
        if t is None:
            return []
        if t.window is None:
            t.window = math.ceil(now.timestamp() / t.interval_s)
            return []
        last = math.floor(now.timestamp() / t.interval_s) - 1  # the last window ended by now
        t.window = max(t.window, last + 1 - MAX_WINDOWS_BEHIND)
        if t.window > last:
            return []
        reports: list[TelemetryReport] = []
        while t.window <= last:
            start, end = t.start_of(t.window), t.start_of(t.window + 1)
            reports.extend(self._window(start, end))
            t.window += 1
        # What ended before the next window is of no further use; of the load, what is in force at
        # its start and what follows.
        since = t.start_of(t.window)
        t.spans = {k: s for k, s in t.spans.items() if s.ended is None or s.ended > since}
        for history in t.load.values():
            del history[:max(0, bisect.bisect_right(history, (since, math.inf)) - 1)]
        return reports

    def _window(self, start: datetime, end: datetime) -> list[TelemetryReport]:
        t = self._telemetry
        step = (end - start) / TELEMETRY_SAMPLES
        times = [start + step * (i + 0.5) for i in range(TELEMETRY_SAMPLES)]
        spans = [s for s in t.spans.values() if s.started < end and (s.ended is None or s.ended > start)]
        utilization = {(s.job_id, s.attempt): attempt_utilization(s.job_id, s.spec, s.attempt, start) for s in spans}
        serving: dict[str, list[_Span]] = {}
        for s in spans:
            if s.service is not None and t.load.get(s.service):
                serving.setdefault(s.service, []).append(s)
        held: dict[tuple[str, int], list[tuple[_Span, float]]] = {}  # (node, GPU index) -> who held it, how much
        for s in spans:
            for node_name, gpus in s.gpus.items():
                for index, share in gpus:
                    held.setdefault((node_name, index), []).append((s, share))
        reports = []
        for node in self._nodes:
            if node.gpu_count < 1:
                continue
            total = node.gpu_memory_mib or DEFAULT_GPU_MEMORY_MIB
            gpus = []
            for index in range(node.gpu_count):
                holders = held.get((node.name, index))
                if not holders:  # idle all through the window
                    gpus.append(GpuTelemetry(index=index, samples=TELEMETRY_SAMPLES, utilization=0.0, memory_used_mib=0,
                                             memory_total_mib=total))
                    continue
                steady = all(h.started <= start and (h.ended is None or h.ended >= end) and h.service not in serving
                             for h, _ in holders)
                busy, allocated, memory = 0.0, 0, 0  # (a sample with nothing on the GPU adds 0)
                for at in (times[:1] if steady else times):  # the same holders and figures all through: one sample
                    on = [(s, share) for s, share in holders if s.started <= at and (s.ended is None or at < s.ended)]
                    if not on:
                        continue
                    u = min(1.0, sum(share * self._utilization(s, at, utilization, serving) for s, share in on))
                    busy, allocated = busy + u, allocated + 1
                    memory = max(memory, sum(_memory(s.spec, share, total) for s, share in on))
                if steady:
                    busy, allocated = busy * TELEMETRY_SAMPLES, TELEMETRY_SAMPLES
                gpus.append(GpuTelemetry(
                    index=index, samples=TELEMETRY_SAMPLES, utilization=_ratio(busy / TELEMETRY_SAMPLES),
                    memory_used_mib=min(memory, total), memory_total_mib=total, allocated_samples=allocated,
                    allocated_utilization=_ratio(busy / allocated) if allocated else None))
            reports.append(TelemetryReport(node=node.name, window_start=start, window_end=end,
                                           gpu_count=node.gpu_count, gpus=tuple(gpus), source="simulated"))
        return reports

    def _utilization(self, span: _Span, at: datetime, modelled: dict, serving: dict[str, list[_Span]]) -> float:
        """A replica of a service whose load was reported: the load at ``at`` shared by the
        replicas running then; any other attempt: its model (unless its spec gives a hint)."""
        replicas = serving.get(span.service) if span.service is not None else None
        if replicas is None or _fraction(span.spec.annotations, ANN_UTILIZATION) is not None:
            return modelled[(span.job_id, span.attempt)]
        history = self._telemetry.load[span.service]
        i = bisect.bisect_right(history, (at, math.inf)) - 1
        if i < 0:
            return modelled[(span.job_id, span.attempt)]  # no load reported yet at that instant
        running = sum(1 for r in replicas if r.started <= at and (r.ended is None or at < r.ended))
        capacity = _positive(span.spec.annotations, ANN_REPLICA_RPS, REPLICA_CAPACITY_RPS)
        return min(1.0, history[i][1] / (max(1, running) * capacity))

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


def _ratio(value: float) -> float:
    return min(1.0, max(0.0, round(value, 6)))


def _memory(spec: JobSpec, share: float, total: int) -> int:
    """Device memory an attempt holds on one GPU: its ``min_gpu_memory_mib``, else
    :data:`MEMORY_SHARE` of its share of the device."""
    given = share * total
    return int(min(given, spec.min_gpu_memory_mib) if spec.min_gpu_memory_mib else given * MEMORY_SHARE)


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

    def __init__(self, nodes: list[NodeInfo], outcome: Outcome | None = None, *, telemetry_s: float = 0.0,
                 **clusters) -> None:
        """``clusters``: BackendCore's ``cluster``, ``heartbeat_s`` and ``cluster_flavors``.
        ``telemetry_s``: window of the simulated telemetry (module docstring), platform seconds;
        0 (the trace simulator's, the what-if's): none."""
        self.core = BackendCore(node_lost_reason=NOT_IN_SPEC, **clusters)
        self.backend = SimBackend(nodes, outcome, notice=self._notice, telemetry_s=telemetry_s)
        # The core's own methods: the trace simulator calls these for every event.
        self.evolve = self.core.evolve if telemetry_s <= 0 else self._evolve
        self.decisions_refused = self.core.decisions_refused

    def _evolve(self, event: Event) -> None:
        if isinstance(event, ServiceLoadReported):
            self.backend.load_reported(event.aggregate_id, event.occurred_at, event.requests_per_second)
        self.core.evolve(event)

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
        readiness, a telemetry window's end."""
        times = [t for t in (self.backend.next_end(), self.core.next_wake(), self.backend.next_window_end())
                 if t is not None]
        return min(times, default=None)
