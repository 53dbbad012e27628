"""What a chaos run must not break, checked from the log: pure functions over the events in
stream order, ``(sequence, event)`` pairs, each returning its violations as one-line texts that
name the job, attempt and sequences at fault (an empty list: the invariant holds)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from schemas import (
    Event,
    JobAdmitted,
    JobCancelled,
    JobFailed,
    JobPreempted,
    JobRetryScheduled,
    JobScheduled,
    JobSpec,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeRegistered,
    NodeUpdated,
    RetryPolicy,
)

Logged = tuple[int, Event]

PER_ATTEMPT = ("QuotaReserved", "QuotaReleased", "JobScheduled", "JobSucceeded", "JobFailed", "JobPreempted",
               "ReclaimRequested", "PreemptionRequested")
"""Decisions (and outcomes) a job's attempt gets at most once."""
PER_JOB = ("JobSubmitted", "JobCancelRequested", "JobCancelled")
"""Events a job gets at most once; JobAdmitted and JobRejected together at most once too."""
ATTEMPT_ENDS = (JobSucceeded, JobFailed, JobPreempted)


def job_histories(logged: Iterable[Logged]) -> dict[str, list[Logged]]:
    """Each job's events, in stream order."""
    out: dict[str, list[Logged]] = defaultdict(list)
    for seq, event in logged:
        if type(event).aggregate == "job":
            out[event.aggregate_id].append((seq, event))
    return out


def terminal_events(history: list[Logged]) -> list[tuple[str, int]]:
    """(state, sequence) of every event that ends the job: JobSucceeded, JobCancelled, and a
    JobFailed that ends it by quota's retry rule (docs/events.md, job state machine): not
    retryable, a reason the spec does not retry, or the spec's last attempt. A JobFailed that
    could be retried but is not (a cancel was requested first) is no end: the JobCancelled is."""
    spec = next((e.spec for _, e in history if isinstance(e, JobSubmitted)), None)
    retried = {e.failed_attempt for _, e in history if isinstance(e, JobRetryScheduled)}
    out, failures = [], 0
    for seq, e in history:
        if isinstance(e, JobSucceeded):
            out.append(("succeeded", seq))
        elif isinstance(e, JobCancelled):
            out.append(("cancelled", seq))
        elif isinstance(e, JobFailed):
            failures += 1
            if e.attempt not in retried and _failure_is_final(spec, e, failures):
                out.append(("failed", seq))
    return out


def _failure_is_final(spec: JobSpec | None, e: JobFailed, failures: int) -> bool:
    retry = spec.retry if spec is not None else RetryPolicy()
    return not e.retryable or e.reason not in retry.retry_on or failures >= retry.max_attempts


def admitted(history: list[Logged]) -> bool:
    return any(isinstance(e, JobAdmitted) for _, e in history)


def terminal_once(histories: dict[str, list[Logged]]) -> tuple[dict[str, str], list[str]]:
    """Every admitted job ends in exactly one terminal state: (job -> that state, violations)."""
    states, violations = {}, []
    for job, history in histories.items():
        if not admitted(history):
            continue
        ends = terminal_events(history)
        if len(ends) == 1:
            states[job] = ends[0][0]
            continue
        seq, last = history[-1]
        if not ends:
            violations.append(f"job {job} never ended; its last event is {last.type} (seq {seq})")
        else:
            listed = ", ".join(f"{state} (seq {s})" for state, s in ends)
            violations.append(f"job {job} ended {len(ends)} times: {listed}")
    return states, violations


def started_once(logged: Iterable[Logged]) -> list[str]:
    """No attempt has two JobStarted."""
    seen: dict[tuple[str, int], int] = {}
    violations = []
    for seq, e in logged:
        if isinstance(e, JobStarted):
            key = (e.aggregate_id, e.attempt)
            if key in seen:
                violations.append(f"job {key[0]} attempt {key[1]} started twice (seq {seen[key]} and {seq})")
            seen.setdefault(key, seq)
    return violations


def decision_key(e: Event) -> tuple | None:
    """What a decision is unique by; None for events that may repeat (wait reasons, nodes, ...)."""
    if e.type in PER_ATTEMPT:
        return (e.type, e.aggregate_id, e.attempt)
    if isinstance(e, JobRetryScheduled):
        return (e.type, e.aggregate_id, e.failed_attempt)
    if e.type in PER_JOB:
        return (e.type, e.aggregate_id)
    if e.type in ("JobAdmitted", "JobRejected"):
        return ("JobAdmitted or JobRejected", e.aggregate_id)
    return None


def decisions_once(logged: Iterable[Logged]) -> list[str]:
    """No event id twice in the log, and no decision twice for one job (or attempt)."""
    ids: dict[str, int] = {}
    keys: dict[tuple, int] = {}
    violations = []
    for seq, e in logged:
        if e.event_id in ids:
            violations.append(f"event id {e.event_id} ({e.type}) appended twice (seq {ids[e.event_id]} and {seq})")
        ids.setdefault(e.event_id, seq)
        key = decision_key(e)
        if key is None:
            continue
        if key in keys:
            what = " ".join(str(k) for k in key)
            violations.append(f"decision {what} appended twice (seq {keys[key]} and {seq})")
        keys.setdefault(key, seq)
    return violations


class _GpuLedger:
    """Which attempt holds each (node, GPU index), replayed from JobScheduled and attempt ends."""

    def __init__(self) -> None:
        self.holder: dict[tuple[str, int], tuple[str, int]] = {}
        self.held: dict[tuple[str, int], list[tuple[str, int]]] = {}  # attempt -> its GPUs
        self.capacity: dict[str, int] = {}
        self.violations: list[str] = []

    def apply(self, seq: int, e: Event) -> None:
        if isinstance(e, (NodeRegistered, NodeUpdated)):
            self.capacity[e.node.name] = e.node.gpu_count
        elif isinstance(e, JobScheduled):
            self.allocate(seq, (e.aggregate_id, e.attempt), e)
        elif isinstance(e, ATTEMPT_ENDS):
            self.release((e.aggregate_id, e.attempt))
        elif isinstance(e, JobCancelled):
            for attempt in [a for a in self.held if a[0] == e.aggregate_id]:
                self.release(attempt)

    def allocate(self, seq: int, attempt: tuple[str, int], e: JobScheduled) -> None:
        gpus = []
        for a in e.placement:
            if len(set(a.gpu_indices)) != a.gpus and a.gpu_milli is None:
                self.violations.append(f"job {attempt[0]} attempt {attempt[1]} (seq {seq}) asks {a.gpus} GPUs of "
                                       f"{a.node} but names indices {list(a.gpu_indices)}")
            for index in a.gpu_indices:
                if not 0 <= index < self.capacity.get(a.node, 0):
                    self.violations.append(f"job {attempt[0]} attempt {attempt[1]} (seq {seq}) placed on GPU "
                                           f"{a.node}/{index}, which the node does not have")
                other = self.holder.get((a.node, index))
                if other is not None and other != attempt and a.gpu_milli is None:
                    self.violations.append(f"GPU {a.node}/{index} given to job {attempt[0]} attempt {attempt[1]} "
                                           f"(seq {seq}) while job {other[0]} attempt {other[1]} holds it")
                gpus.append((a.node, index))
        for gpu in gpus:
            self.holder[gpu] = attempt
        self.held[attempt] = gpus

    def release(self, attempt: tuple[str, int]) -> None:
        for gpu in self.held.pop(attempt, []):
            if self.holder.get(gpu) == attempt:
                del self.holder[gpu]


def gpus_never_shared(logged: Iterable[Logged]) -> list[str]:
    """No GPU index of a node is held by two live attempts at once: an attempt holds its GPUs from
    its JobScheduled to its JobSucceeded / JobFailed / JobPreempted / the job's JobCancelled."""
    ledger = _GpuLedger()
    for seq, e in logged:
        ledger.apply(seq, e)
    return ledger.violations


def malformed_answered(sent: dict[int, str], rejected: set[int], dead_lettered: set[int],
                       submitted: set[int]) -> list[str]:
    """Every malformed command (intake sequence -> what it was) has a JobRejected naming its
    intake sequence or a dead letter of it, and none became a job."""
    violations = []
    for seq, kind in sorted(sent.items()):
        if seq in submitted:
            violations.append(f"malformed command ({kind}) at intake sequence {seq} was accepted (JobSubmitted)")
        elif seq not in rejected and seq not in dead_lettered:
            violations.append(f"malformed command ({kind}) at intake sequence {seq} has no JobRejected and no "
                              "dead letter")
    return violations


def counts(logged: Iterable[Logged]) -> Counter:
    """Event types, and ReclaimRequested by kind, for the run's summary."""
    out: Counter = Counter()
    for _, e in logged:
        out[e.type] += 1
        if e.type == "ReclaimRequested":
            out[f"ReclaimRequested:{e.kind}"] += 1
    return out
