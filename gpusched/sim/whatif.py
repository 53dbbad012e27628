"""What-if replay of recorded history (``gpusched whatif``): the recorded submissions re-run
through the platform's own decision cores — admission, quota, scheduler and the sim executor —
on a virtual clock, under a changed configuration, and reported beside what actually happened.

What is taken from the recorded log:

* **configuration**: every queue, cohort and policy event, fed at its recorded time; the file's
  changes (a queues file: ``gpusched apply``'s format) take effect at the window's start, and a
  recorded configuration event after that for something the file defines is left out (the file
  wins for what it names);
* **nodes**: every node the log registered, with its latest description, from the start (the
  sim executor's cluster); NodeLost and cordons are not replayed;
* **submissions**: each JobSubmitted at its recorded time, and each JobCancelRequested at its
  recorded time unless the job has already ended in the replay;
* **runtimes and failures**: each attempt that ended by itself (JobSucceeded, JobFailed) in the
  log is a *run*: its duration, failure reason and exit code. In the replay a job's attempts
  take its runs in order (a preempted or cancelled attempt takes none: it did not end by
  itself); a job with no run left runs for its ``expected_runtime_seconds``, or past the window
  when it has none;
* **prices**: the price books, to cost GPU time;
* **the services' lag**: when each service made each decision and read each input, and when the
  executor's reports were appended; the replay with no change (the baseline) makes each decision
  then, the replay with a change after the lag it had in the baseline (:class:`Lag`).

The report sets what happened, the baseline and the change's replay side by side, with the
baseline's fidelity to the log first: the model's error apart from the change's effect.

The replay starts at the log's first event, so that the cluster at the window's start holds
what it held then; the report covers the jobs submitted within the window, up to its end, in
every column. Checkpoints are not replayed: work lost counts every GPU-second of a preempted
attempt, in every column.

Pure: no I/O. The same recording, file and options give byte-identical output.
"""

from __future__ import annotations

import bisect
import heapq
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from gpusched.userinput import UserError
from schemas import (
    CohortConfigured,
    Event,
    FailureReason,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobFailed,
    JobPreempted,
    JobRejected,
    JobRetryScheduled,
    JobScheduled,
    JobSpec,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeRegistered,
    NodeUpdated,
    PolicyConfigured,
    PreemptionRequested,
    PriceBookUpdated,
    QueueConfigured,
    QuotaPendingReasonChanged,
    QueueDeleted,
    QuotaReleased,
    QuotaReserved,
    ReclaimRequested,
    SchedulingPendingReasonChanged,
)
from schemas.node import NodeInfo
from services.accounting.chargeback import PriceBook, PriceVersion
from services.admission.domain import AdmissionCore
from services.executor.sim import SimExecutorCore
from services.quota.domain import QuotaCore
from services.scheduler.domain import PreemptionLimits, SchedulerCore
from services.scheduler.placement import Policy

CONFIG_TYPES = (QueueConfigured, QueueDeleted, CohortConfigured, PolicyConfigured)
"""Configuration the replay feeds at its recorded time (unless the file overrides it)."""
MAX_ROUNDS = 1_000
"""Decide-and-feed rounds at one instant before the replay gives up (a core that never settles)."""


class WhatIfError(UserError):
    """A what-if that cannot be run; says why and what is accepted (the CLI shows it as is)."""


# -- the recording -----------------------------------------------------------------------------


def decision_key(event: Event) -> tuple | None:
    """What a service decided, as the same decision is named in the log and in the replay: the
    service's decision type, the job and the attempt. None: not a decision whose time the replay
    takes from the log (a run's end is the run's; reasons and telemetry are not decisions)."""
    match event:
        case JobAdmitted() | JobRejected():
            return ("admission", event.aggregate_id)
        case QuotaReserved():
            return ("reserve", event.aggregate_id, event.attempt)
        case ReclaimRequested():
            return ("reclaim", event.aggregate_id, event.attempt)
        case QuotaReleased():
            return ("release", event.aggregate_id, event.attempt)
        case JobRetryScheduled():
            return ("retry", event.aggregate_id, event.next_attempt)
        case JobScheduled():
            return ("schedule", event.aggregate_id, event.attempt)
        case PreemptionRequested():
            return ("preempt", event.aggregate_id, event.attempt)
        case JobStarted():
            return ("start", event.aggregate_id, event.attempt)
        case JobCancelled():
            return ("cancel", event.aggregate_id)
    return None


def report_key(event: Event) -> tuple | None:
    """An executor's report of what happened to an attempt, whose event time is when it happened
    (a run's end, a stop at its deadline), appended to the log when the executor noticed it."""
    if event.producer != "executor" or event.aggregate != "job":
        return None
    return ("report", event.type, event.aggregate_id, getattr(event, "attempt", None))


KINDS: dict[str, tuple[str, str | None]] = {
    "admission": ("admission", "admission"), "cancel": ("admission", "admission"),
    "reserve": ("quota", "quota"), "reclaim": ("quota", "quota"), "release": ("quota", "quota"),
    "retry": ("quota", "quota"), "quota-read": ("quota-read", "quota"),
    "schedule": ("scheduler", "scheduler"), "preempt": ("scheduler", "scheduler"),
    "scheduler-read": ("scheduler-read", "scheduler"),
    "start": ("start", "executor"), "report": ("report", None),
}
"""Per kind of decision (or read): whose recorded lags one new to the log draws from, and the
service whose decisions in the log are the cycles it waits for (an executor's report: none)."""
APPENDED_AFTER = timedelta(microseconds=1)
"""An executor's report appended after events of a later time is read this long after the latest
of them: after what the other services decided at that instant."""
SERVICES = frozenset(service for _, service in KINDS.values() if service is not None)


@dataclass(frozen=True)
class Run:
    """One attempt that ended by itself in the recorded log."""

    seconds: float
    reason: FailureReason | None  # None: it succeeded
    exit_code: int


@dataclass
class Recording:
    """A recorded log as the what-if needs it: fold its events in log order with :meth:`add`.

    The report's window: from ``start`` (an event time) or ``from_seq`` (the event at that stream
    sequence), to ``end`` or ``to_seq``; an open end is the log's first or last event. The
    replay itself runs from the log's first event."""

    start: datetime | None = None
    end: datetime | None = None
    from_seq: int | None = None
    to_seq: int | None = None
    first: datetime | None = None  # the log's first event time
    last: datetime | None = None  # its last, within the window
    inputs: list[tuple[datetime, int, Event]] = field(default_factory=list)  # fed to the cores
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    runs: dict[str, list[Run]] = field(default_factory=dict)
    actual: Outcomes = field(default_factory=lambda: Outcomes())  # what happened, for the report
    prices: list[PriceVersion] = field(default_factory=list)
    events: int = 0
    decisions_recorded: bool = True  # False: a trace (gpusched/sim/whatif_trace.py), no decisions to compare
    decided_at: dict[tuple, datetime] = field(default_factory=dict)  # decision key -> its recorded time
    reported_at: dict[tuple, datetime] = field(default_factory=dict)  # executor report -> when it was in the log
    lags: dict[str, list[float]] = field(default_factory=dict)  # service -> its recorded reaction lags, seconds
    active: dict[str, list[datetime]] = field(default_factory=dict)  # service -> when it decided something
    _started: dict[tuple[str, int], datetime] = field(default_factory=dict)
    _inputs_at: dict[tuple, datetime] = field(default_factory=dict)  # what a service reacts to, when it was logged
    _reserved: dict[str, int] = field(default_factory=dict)  # job -> its latest reserved attempt
    _stop_at: dict[tuple[str, int | None], datetime] = field(default_factory=dict)  # the first stop asked of an attempt
    _log_clock: datetime | None = None  # the latest event time read so far: no event is appended before it

    def add(self, seq: int, event: Event) -> None:
        at = event.occurred_at
        self._learn_run(event)  # past the window too: a job's runtime does not end with it
        if self._past_end(seq, at):
            return
        self._learn_lag(event)
        if self.from_seq is not None and self.start is None and seq >= self.from_seq:
            self.start = at
        self.events += 1
        self.first = at if self.first is None else min(self.first, at)
        self.last = at if self.last is None else max(self.last, at)
        match event:
            case NodeRegistered() | NodeUpdated():
                self.nodes[event.node.name] = event.node
                return
            case PriceBookUpdated():
                if event.name == "default":
                    self.prices.append(PriceVersion(
                        effective_from=event.effective_from, sequence=seq, currency=event.currency,
                        gpu_prices={p.flavor: p.gpu_hour for p in event.gpu_prices}))
                return
            case QueueConfigured() | QueueDeleted() | CohortConfigured() | PolicyConfigured():
                self.inputs.append((at, seq, event))
                return
            case JobSubmitted() | JobCancelRequested():
                self.inputs.append((at, seq, event))
        if event.aggregate == "job":
            self.actual.add(event, counted=self._opened(seq, at))

    def _past_end(self, seq: int, at: datetime) -> bool:
        """A sequence bound is the event time of the event there (the latest up to it): events
        logged after it at that same time are in the window, as they are in the replay's."""
        if self.to_seq is not None and seq > self.to_seq and self.end is None:
            self.end = self.last
        return self.end is not None and at > self.end

    def _opened(self, seq: int, at: datetime) -> bool:
        """Whether a job submitted here is in the window."""
        if self.from_seq is not None:
            return seq >= self.from_seq
        return self.start is None or at >= self.start

    def _learn_run(self, event: Event) -> None:
        match event:
            case JobStarted():
                self._started[(event.aggregate_id, event.attempt)] = event.occurred_at
            case JobSucceeded() | JobFailed():
                at = event.occurred_at
                recorded_start = self._started.pop((event.aggregate_id, event.attempt), None)
                started = event.started_at or recorded_start or at
                reason = event.reason if isinstance(event, JobFailed) else None
                code = (event.exit_code or 0) if isinstance(event, JobFailed) else 0
                self.runs.setdefault(event.aggregate_id, []).append(
                    Run(max(0.0, (at - started).total_seconds()), reason, code))

    def _learn_lag(self, event: Event) -> None:
        """Each service decision's recorded time (the baseline replays it then), and each
        service's reaction lags: from an input to the decision it asks for at once (admission:
        submitted -> admitted or rejected; quota: an attempt's end -> its release; scheduler:
        reserved -> scheduled; executor: scheduled -> started)."""
        job, at = event.aggregate_id, event.occurred_at
        self._log_clock = at if self._log_clock is None else max(self._log_clock, at)
        if event.producer in SERVICES and event.aggregate == "job":
            self.active.setdefault(event.producer, []).append(at)
        key = decision_key(event)
        if key is not None:
            self.decided_at.setdefault(key, at)
        report = report_key(event)
        if report is not None:  # its time is when it happened (a run's end); it was appended later:
            # after the events before it in the log (a microsecond after the latest of them)
            seen = self._log_clock + APPENDED_AFTER if self._log_clock > at else at
            self.reported_at.setdefault(report, seen)
            self.lags.setdefault("report", []).append((seen - at).total_seconds())
        match event:
            case JobSubmitted():
                self._inputs_at[("submitted", job)] = at
            case JobAdmitted() | JobRejected():
                self._lag("admission", ("submitted", job), at)
                if isinstance(event, JobAdmitted):
                    self._inputs_at[("admitted", job)] = at
            case QuotaReserved() | QuotaPendingReasonChanged() if event.attempt == 1:
                self._read("quota-read", ("quota-read", job), ("admitted", job), at)
            case ReclaimRequested():
                self._read("quota-read", ("quota-read", event.for_job), ("admitted", event.for_job), at)
        match event:
            case QuotaReserved():
                self._inputs_at[("reserved", job, event.attempt)] = at
                self._reserved[job] = event.attempt
            case JobScheduled() | SchedulingPendingReasonChanged():
                self._read("scheduler-read", ("scheduler-read", job, event.attempt), ("reserved", job, event.attempt), at)
            case PreemptionRequested() if event.for_job in self._reserved:
                n = self._reserved[event.for_job]
                self._read("scheduler-read", ("scheduler-read", event.for_job, n), ("reserved", event.for_job, n), at)
        match event:
            case JobScheduled():
                self._inputs_at[("scheduled", job, event.attempt)] = at
            case JobStarted():
                self._lag("start", ("scheduled", job, event.attempt), at)
            case ReclaimRequested() | PreemptionRequested():
                self._stop_at.setdefault((job, event.attempt), at)
            case JobCancelRequested():
                self._stop_at.setdefault((job, None), at)
            case JobSucceeded() | JobFailed() | JobPreempted() | JobCancelled():
                if event.attempt is not None:
                    self._inputs_at[("ended", job, event.attempt)] = at
                    if ("scheduled", job, event.attempt) in self._inputs_at:
                        # It ended without a start: the executor read the attempt no sooner than
                        # the stop asked of it (having read it sooner, it would have started it).
                        stop = self._stop_at.get((job, event.attempt)) or self._stop_at.get((job, None)) or at
                        self.decided_at.setdefault(("start", job, event.attempt), stop)
            case QuotaReleased():
                self._lag("quota", ("ended", job, event.attempt), at)

    def _read(self, service: str, key: tuple, cause: tuple, at: datetime) -> None:
        """A core's first decision about an input (a reservation, a reason it waits, a reclaim for
        it) is when it had read it."""
        if key in self.decided_at:
            return
        self.decided_at[key] = at
        since = self._inputs_at.get(cause)
        if since is not None:
            self.lags.setdefault(service, []).append(max(0.0, (at - since).total_seconds()))

    def _lag(self, service: str, cause: tuple, at: datetime) -> None:
        since = self._inputs_at.pop(cause, None)
        if since is not None:
            self.lags.setdefault(service, []).append(max(0.0, (at - since).total_seconds()))

    @property
    def window(self) -> tuple[datetime, datetime]:
        if self.first is None or self.last is None:
            raise WhatIfError("the log holds no event in the range; accepted: a range with events in it")
        return (self.start or self.first), (self.end or self.last)


# -- the replay --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    policy: Policy = Policy.BEST_FIT
    flavor_policies: dict[str, Policy] = field(default_factory=dict)
    limits: PreemptionLimits = PreemptionLimits()  # until a policy in the log sets them


class Lag:
    """When each service's decision is made in a replay: the live services decided each input
    not at once but after their lag, and the baseline reproduces it.

    * **baseline** (no ``measured``): a decision the log holds is made no sooner than its recorded
      time; one the log does not hold waits for its service's next decision in the log, at most
      the service's longest recorded lag (after its last one: a lag drawn from its recorded
      lags, the same decision always drawing the same lag);
    * **with a change** (``measured``: the baseline's): a decision waits the lag it waited in the
      baseline, counted from the instant the replay could first make it; one the baseline did
      not make waits as one the log does not hold.

    Each decision's wait is fixed the first time a core would make it. On a log decided without
    lag every decision is recorded at the instant the replay can make it, and nothing waits."""

    def __init__(self, recording: Recording, measured: dict[tuple, float] | None = None) -> None:
        self.decided_at = recording.decided_at
        self.reported_at = recording.reported_at
        self.samples = {service: sorted(lags) for service, lags in recording.lags.items()}
        self.active = {service: sorted(times) for service, times in recording.active.items()}
        self.measured = measured
        self.release: dict[tuple, datetime] = {}  # decision -> when the replay makes it
        self.waited: dict[tuple, float] = {}  # decision -> seconds from the first instant it could be made

    def at(self, key: tuple, now: datetime) -> datetime:
        """When the decision ``key``, which a core would make at ``now``, is made."""
        release = self.release.get(key)
        if release is None:
            if self.measured is not None and key in self.measured:
                release = now + timedelta(seconds=self.measured[key])
            elif self.measured is None and key in self.decided_at:
                release = max(now, self.decided_at[key])
            elif self.measured is None and key in self.reported_at:
                release = max(now, self.reported_at[key])
            else:
                release = self.unrecorded(key, now)
            self.release[key] = release
            self.waited[key] = (release - now).total_seconds()
        return release

    def unrecorded(self, key: tuple, now: datetime) -> datetime:
        """A decision the log does not hold: made at its service's next recorded decision (the
        live service decided in cycles; it would have seen this one in its next), but no later
        than its longest recorded lag; a service with no recorded decision after ``now`` waits a
        drawn lag."""
        lags, service = KINDS[key[0]]
        times = self.active.get(service, []) if service is not None else []
        i = bisect.bisect_left(times, now)
        if i == len(times):
            return now + timedelta(seconds=self.drawn(key))
        samples = self.samples.get(lags)
        return min(times[i], now + timedelta(seconds=samples[-1] if samples else 0.0))

    def drawn(self, key: tuple) -> float:
        samples = self.samples.get(KINDS[key[0]][0])
        if not samples:
            return 0.0
        return samples[zlib.crc32(repr(key).encode()) % len(samples)]


GATED = {
    "admission": (JobAdmitted, JobRejected, JobCancelled),
    "quota": (QuotaReserved, ReclaimRequested, QuotaReleased, JobRetryScheduled),
    "scheduler": (JobScheduled, PreemptionRequested, JobCancelled),
}
"""The decisions each pure core makes that wait their service's lag. The sim executor acts on its
backend as it decides, so its lag is on its input instead: it is given a JobScheduled (and what
follows it for that job) when it started the attempt in the log."""


READ_LATE: dict[type, tuple[int, Any]] = {
    JobAdmitted: (1, lambda e: ("quota-read", e.aggregate_id)),
    QuotaReserved: (2, lambda e: ("scheduler-read", e.aggregate_id, e.attempt)),
    JobScheduled: (3, lambda e: ("start", e.aggregate_id, e.attempt)),
}
"""The inputs a core (by its place in :attr:`Replay.cores`) reads after its service's lag: quota
an admitted job, the scheduler a reservation, the executor an attempt to start (the sim executor
acts on its backend as it decides, so its lag is on its input only)."""


class Replay:
    """The four cores and the log between them on a virtual clock (the sim executor runs each
    attempt for its recorded run); each service's decisions wait that service's lag
    (:class:`Lag`)."""

    def __init__(self, recording: Recording, options: Options, keep_log: bool = False,
                 measured: dict[tuple, float] | None = None) -> None:
        self.recording = recording
        self.window = recording.window
        self.admission = AdmissionCore()
        self.quota = QuotaCore()
        self.scheduler = SchedulerCore(options.policy, preemption=options.limits,
                                       flavor_policies=options.flavor_policies)
        nodes = [recording.nodes[name] for name in sorted(recording.nodes)]
        self.executor = SimExecutorCore(nodes, outcome=self._outcome)
        self.cores = (self.admission, self.quota, self.scheduler, self.executor)
        self.gated = ((self.admission, GATED["admission"]), (self.quota, GATED["quota"]),
                      (self.scheduler, GATED["scheduler"]), (self.executor, ()))
        self.lag = Lag(recording, measured)
        self.held: dict[tuple, datetime] = {}  # decisions waiting their lag -> when they are made
        self.on_the_way: list[tuple[datetime, int, int, str]] = []  # (when, order, core, job): an input read late
        self.inbox: list[dict[str, list[Event]]] = [{} for _ in self.cores]  # per core: job -> events not read yet
        self.reports: list[tuple[datetime, int, Event]] = []  # the executor's events the others have not read yet
        self._order = 0
        self.outcomes = Outcomes()
        self.log: list[Event] | None = [] if keep_log else None  # every event the replay made (tests)
        self.failures: dict[str, int] = {}  # job -> JobFailed in the replay so far
        self.ended: set[str] = set()  # jobs that ended for good in the replay

    def _outcome(self, job_id: str, spec: JobSpec, attempt: int) -> tuple[float, FailureReason | None, int]:
        """The job's next recorded run (the one after those that failed in the replay so far: a
        preempted attempt ends no run); with none left, its declared runtime, or past the window."""
        runs = self.recording.runs.get(job_id, [])
        i = self.failures.get(job_id, 0)
        if i < len(runs):
            return runs[i].seconds, runs[i].reason, runs[i].exit_code
        if spec.expected_runtime_seconds is not None:
            return float(spec.expected_runtime_seconds), None, 0
        start, end = self.window
        return (end - start).total_seconds() + 86_400.0, None, 0  # still running when the window ends

    def feed(self, events: Iterable[Event], *, executor: bool = True) -> None:
        """Give ``events`` to every core (``executor``: to the executor too; False: it has them)."""
        start, end = self.window
        for event in events:
            if self.log is not None:
                self.log.append(event)
            for i, core in enumerate(self.cores):
                if executor or core is not self.executor:
                    self._give(i, event)
            if event.aggregate == "job" and event.occurred_at <= end:
                self.outcomes.add(event, counted=event.occurred_at >= start)
            match event:
                case JobSucceeded() | JobCancelled() | JobRejected():
                    self.ended.add(event.aggregate_id)

    def _reported(self, events: list[Event], now: datetime) -> None:
        """The executor's own events: it knows them at once (its next run is the one after those
        that failed); the other cores read them once the executor has appended them."""
        ready = []
        for event in events:
            self.executor.evolve(event)
            if isinstance(event, JobFailed):
                self.failures[event.aggregate_id] = self.failures.get(event.aggregate_id, 0) + 1
            key = report_key(event)
            when = self.lag.at(key, event.occurred_at) if key is not None else now
            if when <= now:
                ready.append(event)
            else:
                self._order += 1
                heapq.heappush(self.reports, (when, self._order, event))
        self.feed(ready, executor=False)

    def _deliver_reports(self, now: datetime) -> bool:
        ready = []
        while self.reports and self.reports[0][0] <= now:
            ready.append(heapq.heappop(self.reports)[2])
        self.feed(ready, executor=False)
        return bool(ready)

    def _give(self, i: int, event: Event) -> None:
        """Core ``i`` reads a job's input after its service's lag (:data:`READ_LATE`); what comes
        after for the same job waits behind it, in order."""
        core = self.cores[i]
        inbox = self.inbox[i]
        job = event.aggregate_id if event.aggregate == "job" else None
        if job is not None and job in inbox:
            inbox[job].append(event)
            return
        late = READ_LATE.get(type(event))
        if late is not None and late[0] == i:
            when = self.lag.at(late[1](event), event.occurred_at)
            if when > event.occurred_at:
                inbox[event.aggregate_id] = [event]
                self._order += 1
                heapq.heappush(self.on_the_way, (when, self._order, i, event.aggregate_id))
                return
        core.evolve(event)

    def _deliver(self, now: datetime) -> None:
        while self.on_the_way and self.on_the_way[0][0] <= now:
            _, _, i, job = heapq.heappop(self.on_the_way)
            for event in self.inbox[i].pop(job):
                self.cores[i].evolve(event)

    def settle(self, now: datetime) -> None:
        """Let each core decide at ``now`` and feed what it decided to all of them, until none
        decides anything new; a decision still waiting its lag is not fed, and its core is told
        so (it decides it again later)."""
        for _ in range(MAX_ROUNDS):
            self._deliver(now)
            decided = self._deliver_reports(now)
            for core, gated in self.gated:
                out = core.decide(now)
                if not out:
                    continue
                if core is self.executor:
                    decided = True
                    self._reported(out, now)
                    continue
                passed, held = [], False
                for event in out:
                    key = decision_key(event) if isinstance(event, gated) else None
                    if key is not None:
                        when = self.lag.at(key, now)
                        if when > now:
                            self.held[key] = when
                            held = True
                            continue
                        self.held.pop(key, None)
                    passed.append(event)
                if held:
                    core.decisions_refused()
                if passed:
                    decided = True
                    self.feed(passed)
            if not decided:
                return
        raise WhatIfError(f"the cores are still deciding at {now.isoformat()} after {MAX_ROUNDS} rounds")

    def next_step(self, now: datetime) -> datetime | None:
        """The next instant a core may decide something without a new input."""
        times = [self.executor.next_end(), self.quota.next_wake(), self.scheduler.next_wake()]
        if self.on_the_way:
            times.append(self.on_the_way[0][0])
        if self.reports:
            times.append(self.reports[0][0])
        later = [t for t in times if t is not None and t > now]
        later.extend(t for t in self.held.values() if t > now)
        return min(later) if later else None

    def run(self, changes: list[Event], overridden: set[tuple[str, str]]) -> None:
        """Feed the recorded inputs in time order (ties: log order), the ``changes`` at the
        window's start, and let the cores decide at every instant something happens, up to the
        window's end."""
        start, end = self.window
        inputs = [(at, seq, e) for at, seq, e in self.recording.inputs
                  if not (at >= start and isinstance(e, CONFIG_TYPES) and (e.aggregate, e.aggregate_id) in overridden)]
        inputs.sort(key=lambda x: (x[0], x[1]))
        pending = [(start, -1, e) for e in changes]  # before anything recorded at the same instant
        queue = list(heapq.merge(pending, inputs, key=lambda x: (x[0], x[1])))
        first = self.recording.first
        assert first is not None
        now = min(first, start)
        self.settle(now)  # the sim executor registers its nodes
        i = 0
        while True:
            next_input = queue[i][0] if i < len(queue) else None
            step = self.next_step(now)
            candidates = [t for t in (next_input, step) if t is not None]
            if not candidates:
                break
            now = max(now, min(candidates))
            if now > end:
                break
            batch = []
            while i < len(queue) and queue[i][0] <= now:
                event = queue[i][2]
                i += 1
                if isinstance(event, JobCancelRequested) and event.aggregate_id in self.ended:
                    continue  # it ended sooner in the replay: nothing to cancel
                batch.append(event)
            self.feed(batch)
            self.settle(now)


# -- the report --------------------------------------------------------------------------------


@dataclass
class AttemptOutcome:
    flavor: str | None = None
    gpus: float = 0.0
    borrowed_share: float = 0.0
    started_at: datetime | None = None
    ended_at: datetime | None = None
    preempted: bool = False


@dataclass
class JobOutcome:
    team: str
    queue: str
    submitted_at: datetime
    decision: tuple = ()
    attempts: dict[int, AttemptOutcome] = field(default_factory=dict)
    preemptions: list[tuple] = field(default_factory=list)
    first_start: datetime | None = None
    ended: bool = False  # rejected or cancelled (a job's other ends need a start first)

    def attempt(self, n: int) -> AttemptOutcome:
        return self.attempts.setdefault(n, AttemptOutcome())


class Outcomes:
    """What happened to the jobs submitted in the window, folded one job event at a time: the
    report reads only this, so neither the recording nor the replay keeps its events."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobOutcome] = {}

    def add(self, e: Event, *, counted: bool = True) -> None:
        """``counted``: a JobSubmitted here is in the window (its job is followed from then on)."""
        if isinstance(e, JobSubmitted):
            if counted:
                self.jobs[e.aggregate_id] = JobOutcome(e.spec.team, e.spec.queue, e.occurred_at)
            return
        job = self.jobs.get(e.aggregate_id)
        if job is None:
            return
        match e:
            case JobAdmitted():
                job.decision = ("admitted", e.queue, e.priority, e.preemptible)
            case JobRejected():
                job.decision = ("rejected", e.reason.value, e.field)
                job.ended = True
            case QuotaReserved():
                a = job.attempt(e.attempt)
                a.borrowed_share = e.milli_borrowed / e.milli_held if e.milli_held else 0.0
            case JobScheduled():
                a = job.attempt(e.attempt)
                a.flavor = e.flavor
                a.gpus = sum(p.gpus if p.gpu_milli is None else p.gpu_milli / 1000 for p in e.placement)
            case JobStarted():
                a = job.attempt(e.attempt)
                a.started_at = e.occurred_at
                if job.first_start is None:
                    job.first_start = e.occurred_at
            case PreemptionRequested():
                job.preemptions.append((e.attempt, e.for_job))
            case JobSucceeded() | JobFailed() | JobCancelled() | JobPreempted():
                job.ended = job.ended or isinstance(e, JobCancelled)
                if e.attempt is not None and e.attempt in job.attempts:
                    a = job.attempts[e.attempt]
                    a.ended_at = e.occurred_at
                    a.preempted = isinstance(e, JobPreempted)


def fold_jobs(events: Iterable[Event], start: datetime, end: datetime) -> dict[str, JobOutcome]:
    """The jobs submitted within [start, end] and what happened to them up to ``end``."""
    outcomes = Outcomes()
    for e in events:
        if e.occurred_at <= end:
            outcomes.add(e, counted=start <= e.occurred_at)
    return outcomes.jobs


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _figures(jobs: list[JobOutcome], end: datetime, capacity: float, span_s: float, prices: PriceBook) -> dict[str, Any]:
    """One column of the report for a group of jobs. Waits are from submission to the first
    start; a job still waiting when the window ends has waited until then (its wait is at least
    that); a job rejected or cancelled before it started has no wait."""
    waits, gpu_s, borrowed_s, lost_s, cost, preemptions = [], 0.0, 0.0, 0.0, 0.0, 0
    for job in jobs:
        if job.first_start is not None or not job.ended:
            waits.append(((job.first_start or end) - job.submitted_at).total_seconds())
        for a in job.attempts.values():
            if a.started_at is None or a.flavor is None:
                continue
            stop = min(a.ended_at or end, end)
            seconds = max(0.0, (stop - a.started_at).total_seconds())
            gpu_s += a.gpus * seconds
            borrowed_s += a.gpus * seconds * a.borrowed_share
            cost += prices.gpu_cost(a.flavor, a.gpus, a.started_at, stop)
            if a.preempted:
                preemptions += 1
                lost_s += a.gpus * seconds
    return {
        "jobs": len(jobs),
        "started": sum(1 for j in jobs if j.first_start is not None),
        "rejected": sum(1 for j in jobs if j.decision[:1] == ("rejected",)),
        "wait_p50_s": _round(_percentile(waits, 50), 1),
        "wait_p95_s": _round(_percentile(waits, 95), 1),
        "preemptions": preemptions,
        "work_lost_gpu_h": round(lost_s / 3600, 3),
        "gpu_h": round(gpu_s / 3600, 3),
        "utilization": round(gpu_s / (capacity * span_s), 4) if capacity and span_s else None,
        "borrowed_share": round(borrowed_s / gpu_s, 4) if gpu_s else None,
        "cost": round(cost, 2),
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


FIGURES = ("jobs", "started", "rejected", "wait_p50_s", "wait_p95_s", "preemptions", "work_lost_gpu_h", "gpu_h",
           "utilization", "borrowed_share", "cost")


def _decisions(job: JobOutcome) -> tuple:
    """What was decided for a job: admission, and per attempt its flavor, GPUs, borrowed share
    and whether it was preempted; preemptions asked of it."""
    return (job.decision,
            tuple((n, a.flavor, a.gpus, round(a.borrowed_share, 6), a.preempted) for n, a in sorted(job.attempts.items())),
            tuple(job.preemptions))


def _timed(job: JobOutcome) -> tuple:
    return (_decisions(job), tuple((n, a.started_at, a.ended_at) for n, a in sorted(job.attempts.items())))


def _delta(baseline: Any, changed: Any) -> Any:
    """What the change did to a figure: the change's replay less the baseline's."""
    if isinstance(baseline, (int, float)) and isinstance(changed, (int, float)):
        return round(changed - baseline, 6)
    return None


def _error(recorded: float | None, replayed: float | None) -> float | None:
    """The baseline's relative error on a recorded figure (0 where both are 0)."""
    if recorded is None or replayed is None:
        return None
    if recorded == 0:
        return 0.0 if replayed == 0 else None
    return round(abs(replayed - recorded) / abs(recorded), 4)


def _compared(left: dict[str, JobOutcome], right: dict[str, JobOutcome]) -> tuple[list[str], list[str], list[str]]:
    """The jobs of ``left`` decided the same in ``right``, of those the ones at the same times,
    and the ones that differ."""
    same = [j for j in left if j in right and _decisions(left[j]) == _decisions(right[j])]
    timed = [j for j in same if _timed(left[j]) == _timed(right[j])]
    return same, timed, sorted(set(left) - set(same))


def report(recording: Recording, baseline: dict[str, JobOutcome], replayed: dict[str, JobOutcome], *,
           changes: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """Per team, per queue and in all: what happened (``actual``), the replay with no change
    (``baseline``: the model's error is the difference between these two), the replay with the
    change (``whatif``) and the change's effect (``delta``: whatif less baseline). ``fidelity``:
    how many jobs the baseline decided as the log did, and each team's waits beside the recorded
    ones; ``decisions``: the same for the change's replay; ``changed``: the jobs the change
    decided differently from the baseline."""
    start, end = recording.window
    span_s = (end - start).total_seconds()
    capacity = float(sum(n.gpu_count for n in recording.nodes.values()))
    prices = PriceBook(recording.prices)
    actual = recording.actual.jobs
    sides = (("actual", actual), ("baseline", baseline), ("whatif", replayed))

    def columns(key) -> dict[str, dict[str, Any]]:
        groups: dict[str, dict[str, list[JobOutcome]]] = {}
        for side, jobs in sides:
            for job in jobs.values():
                groups.setdefault(key(job), {name: [] for name, _ in sides})[side].append(job)
        out = {}
        for name, by_side in sorted(groups.items()):
            cols = {side: _figures(jobs, end, capacity, span_s, prices) for side, jobs in by_side.items()}
            cols["delta"] = {f: _delta(cols["baseline"][f], cols["whatif"][f]) for f in FIGURES}
            out[name] = cols
        return out

    teams = columns(lambda j: j.team)
    recorded = recording.decisions_recorded
    b_same, b_timed, b_diff = _compared(actual, baseline)
    w_same, w_timed, w_diff = _compared(actual, replayed)
    _, _, changed = _compared(baseline, replayed)
    return {
        "window": {"from": start.isoformat(), "to": end.isoformat(), "seconds": round(span_s, 3),
                   "capacity_gpus": capacity, "log_events": recording.events},
        "changes": changes or [],
        "fidelity": {
            "decisions": ({"jobs": len(actual), "same": len(b_same), "same_with_times": len(b_timed),
                           "share": round(len(b_same) / len(actual), 4) if actual else None,
                           "first_different": b_diff[:5]} if recorded else None),
            "waits": {team: {f: {"actual": cols["actual"][f], "baseline": cols["baseline"][f],
                                 "error": _error(cols["actual"][f], cols["baseline"][f])}
                             for f in ("wait_p50_s", "wait_p95_s")}
                      for team, cols in teams.items()},
        },
        "decisions": ({"jobs": len(actual), "same": len(w_same), "same_with_times": len(w_timed),
                       "first_different": w_diff[:5]} if recorded else None),
        "changed": {"jobs": len(baseline), "different": len(changed), "first_different": changed[:5]},
        "total": columns(lambda j: "all")["all"] if actual else {},
        "teams": teams,
        "queues": columns(lambda j: j.queue),
    }


def whatif(recording: Recording, changes: list[Event], overridden: set[tuple[str, str]], options: Options,
           described: list[dict[str, str]] | None = None, *,
           keep_log: bool = False) -> tuple[dict[str, Any], list[Event] | None]:
    """Replay the recording with no change (the baseline: each service's recorded lag
    replayed), then under ``changes`` (applied at the window's start; each decision waits the lag
    it waited in the baseline); the report and, with ``keep_log``, every event the change's replay
    made. With no change the baseline is the change's replay."""
    baseline = Replay(recording, options, keep_log and not changes)
    baseline.run([], set())
    replay = baseline
    if changes:
        replay = Replay(recording, options, keep_log, measured=baseline.lag.waited)
        replay.run(changes, overridden)
    return report(recording, baseline.outcomes.jobs, replay.outcomes.jobs, changes=described), replay.log


def overridden_by(events: Iterable[Event]) -> set[tuple[str, str]]:
    """The (aggregate, id) pairs a changes file defines: recorded configuration of those after
    the window's start is left out."""
    return {(e.aggregate, e.aggregate_id) for e in events}


def at_start(recording: Recording) -> list[Event]:
    """The configuration events recorded up to the window's start, in log order: what
    ``gpusched apply``'s plan compares the changes file with. (Those at the start itself for
    what the file defines are replaced by the file's.)"""
    start, _ = recording.window
    return [e for at, _, e in sorted(recording.inputs, key=lambda x: x[1]) if at <= start and isinstance(e, CONFIG_TYPES)]
