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
* **prices**: the price books, to cost GPU time.

The replay starts at the log's first event, so that the cluster at the window's start holds
what it held then; the report covers the jobs submitted within the window, up to its end, in
both columns. Checkpoints are not replayed: work lost counts every GPU-second of a preempted
attempt, in both columns.

Pure: no I/O. The same recording, file and options give byte-identical output.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gpusched.sim.trace import decide_until_quiet
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
    QueueDeleted,
    QuotaReserved,
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
    _started: dict[tuple[str, int], datetime] = field(default_factory=dict)

    def add(self, seq: int, event: Event) -> None:
        at = event.occurred_at
        self._learn_run(event)  # past the window too: a job's runtime does not end with it
        if self._past_end(seq, at):
            return
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


class Replay:
    """The four cores and the log between them on a virtual clock (the sim executor runs each
    attempt for its recorded run)."""

    def __init__(self, recording: Recording, options: Options, keep_log: bool = False) -> None:
        self.recording = recording
        self.window = recording.window
        self.admission = AdmissionCore()
        self.quota = QuotaCore()
        self.scheduler = SchedulerCore(options.policy, preemption=options.limits,
                                       flavor_policies=options.flavor_policies)
        nodes = [recording.nodes[name] for name in sorted(recording.nodes)]
        self.executor = SimExecutorCore(nodes, outcome=self._outcome)
        self.cores = (self.admission, self.quota, self.scheduler, self.executor)
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

    def feed(self, events: Iterable[Event]) -> None:
        start, end = self.window
        for event in events:
            if self.log is not None:
                self.log.append(event)
            for core in self.cores:
                core.evolve(event)
            if event.aggregate == "job" and event.occurred_at <= end:
                self.outcomes.add(event, counted=event.occurred_at >= start)
            match event:
                case JobSucceeded() | JobCancelled() | JobRejected():
                    self.ended.add(event.aggregate_id)
                case JobFailed():
                    self.failures[event.aggregate_id] = self.failures.get(event.aggregate_id, 0) + 1

    def settle(self, now: datetime) -> None:
        if not decide_until_quiet(self.cores, self.feed, now, MAX_ROUNDS):
            raise WhatIfError(f"the cores are still deciding at {now.isoformat()} after {MAX_ROUNDS} rounds")

    def next_step(self, now: datetime) -> datetime | None:
        """The next instant a core may decide something without a new input."""
        times = [self.executor.next_end(), self.quota.next_wake(), self.scheduler.next_wake()]
        later = [t for t in times if t is not None and t > now]
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


def report(recording: Recording, replayed: dict[str, JobOutcome], *,
           changes: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """Per team, per queue and in all: the recorded figures beside the replay's, and how many of
    the jobs got the same decisions."""
    start, end = recording.window
    span_s = (end - start).total_seconds()
    capacity = float(sum(n.gpu_count for n in recording.nodes.values()))
    prices = PriceBook(recording.prices)
    actual, whatif = recording.actual.jobs, replayed

    def columns(key) -> dict[str, dict[str, Any]]:
        groups: dict[str, tuple[list[JobOutcome], list[JobOutcome]]] = {}
        for jobs, side in ((actual, 0), (whatif, 1)):
            for job in jobs.values():
                groups.setdefault(key(job), ([], []))[side].append(job)
        return {name: {"actual": _figures(a, end, capacity, span_s, prices),
                       "whatif": _figures(w, end, capacity, span_s, prices)}
                for name, (a, w) in sorted(groups.items())}

    same = [j for j in actual if j in whatif and _decisions(actual[j]) == _decisions(whatif[j])]
    timed = [j for j in same if _timed(actual[j]) == _timed(whatif[j])]
    differing = sorted(j for j in actual if j not in same)
    return {
        "window": {"from": start.isoformat(), "to": end.isoformat(), "seconds": round(span_s, 3),
                   "capacity_gpus": capacity, "log_events": recording.events},
        "changes": changes or [],
        "decisions": ({"jobs": len(actual), "same": len(same), "same_with_times": len(timed),
                       "first_different": differing[:5]} if recording.decisions_recorded else None),
        "total": columns(lambda j: "all")["all"] if actual else {},
        "teams": columns(lambda j: j.team),
        "queues": columns(lambda j: j.queue),
    }


def whatif(recording: Recording, changes: list[Event], overridden: set[tuple[str, str]], options: Options,
           described: list[dict[str, str]] | None = None, *,
           keep_log: bool = False) -> tuple[dict[str, Any], list[Event] | None]:
    """Replay the recording under ``changes`` (applied at the window's start); the report and,
    with ``keep_log``, every event the replay made."""
    replay = Replay(recording, options, keep_log)
    replay.run(changes, overridden)
    return report(recording, replay.outcomes.jobs, changes=described), replay.log


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
