"""How a job's events read to a person: one plain sentence per event, a duration in human units
and a time. The one wording every door that tells a person about a job uses (the notifier's
notification summaries, the console's timeline), so the two never tell one event two ways.

A sentence starts lower-case and names no attempt: the reader shows the attempt beside it (the
notifier's summary is ``attempt <n>: <sentence>``). It names no event type and dumps no fields.
An event that a team reads with another team's job unnamed (:func:`schemas.tenant.unnamed`)
reads "a higher-priority job of another team", never that job. Pure: imports only the contract."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from .envelope import Event
from .job import (
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointed,
    JobFailed,
    JobPreempted,
    JobReady,
    JobRejected,
    JobRetryScheduled,
    JobScheduled,
    JobSpec,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    PreemptionRequested,
    QuotaPendingReasonChanged,
    QuotaReleased,
    QuotaReserved,
    ReclaimRequested,
    SchedulingPendingReasonChanged,
)
from .tenant import OTHER_TEAMS_JOB

HIGHER_PRIORITY_ELSEWHERE = "a higher-priority job of another team"
"""What a team reads of the job that preempts its attempt when that job is another team's."""

ENDED = {"JobSucceeded": "succeeded", "JobFailed": "failed", "JobPreempted": "preempted", "JobCancelled": "cancelled"}
"""How an attempt ended, in a word, by the event that ended it (QuotaReleased.reason, the usage
ledger's ``outcome``)."""


def ended(outcome: str) -> str:
    """:data:`ENDED`'s word for ``outcome``; ``ended`` for one it does not know."""
    return ENDED.get(outcome, "ended")


def duration(seconds: float | timedelta | None) -> str:
    """``seconds`` in the two largest units that matter: ``7.2 s``, ``45 s``, ``2 min 5 s``,
    ``2 h 0 min``, ``3 d 4 h``; ``–`` for None or not a number. Rounded to the smaller unit
    shown (7199.8 s is ``2 h 0 min``), a negative one with a minus sign."""
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    if seconds is None or math.isnan(seconds) or math.isinf(seconds):
        return "–"
    sign, s = ("-" if seconds < 0 else ""), abs(float(seconds))
    tenths = _round(s * 10) / 10
    if tenths < 10:
        return f"{sign}{tenths:g} s"
    whole = _round(s)
    if whole < 60:
        return f"{sign}{whole} s"
    if whole < 3600:
        return f"{sign}{whole // 60} min {whole % 60} s"
    minutes = _round(s / 60)
    if minutes < 24 * 60:
        return f"{sign}{minutes // 60} h {minutes % 60} min"
    hours = _round(s / 3600)
    return f"{sign}{hours // 24} d {hours % 24} h"


def _round(x: float) -> int:
    """Half up (Python's round() rounds half to even: 2.5 s would read 2 s, 3.5 s 4 s)."""
    return int(math.floor(x + 0.5))


def when(at: datetime | None) -> str:
    """A time as every sentence states it: ``2026-12-07 10:00:30 UTC`` (``–`` for None)."""
    if at is None:
        return "–"
    at = at if at.tzinfo else at.replace(tzinfo=UTC)
    return f"{at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"


def gpus(n: int | float) -> str:
    """``1 GPU``, ``8 GPUs``, ``0.5 GPU``."""
    return f"{n:g} GPU" + ("" if n <= 1 else "s")


def _request(spec: JobSpec) -> str:
    size = f"{spec.gpu_milli / 1000:g} GPU" if spec.gpu_milli else gpus(spec.gpus)
    return size if spec.gang_size == 1 else f"{size} on each of {spec.gang_size} nodes"


def _held(gpus_held: int, milli: int | None) -> float:
    return milli / 1000 if milli is not None else gpus_held


def describe(e: Event) -> str | None:
    """The sentence for one of a job's events; None for an event that is not a job's."""
    match e:
        case JobSubmitted():
            who = e.submitter + (f" for {e.on_behalf_of}" if e.on_behalf_of else "")
            return f"submitted by {who} to queue {e.spec.queue}: {_request(e.spec)}"
        case JobAdmitted():
            return (f"admitted and queued in {e.queue} at priority {e.priority}"
                    + ("" if e.preemptible else " (never preempted)"))
        case JobRejected():
            return f"rejected ({e.reason.value}): {e.message}"
        case QuotaPendingReasonChanged():
            return f"waiting for quota because {e.message} ({e.reason.value})"
        case SchedulingPendingReasonChanged():
            eta = f"; expected to be placed by {when(e.eta)}" if e.eta else ""
            return f"waiting for nodes because {e.message} ({e.reason.value}){eta}"
        case QuotaReserved():
            borrowed = _held(e.borrowed, e.borrowed_milli)
            return (f"quota reserved: {gpus(_held(e.gpus, e.gpu_milli))} of {e.flavor} in queue {e.queue}"
                    + (f", {gpus(borrowed)} of it borrowed from the cohort" if borrowed else ""))
        case QuotaReleased():
            return f"quota released: attempt {ended(e.reason)}"
        case JobScheduled():
            return f"placed on {', '.join(p.node for p in e.placement)} ({e.flavor})"
        case JobStarted():
            return f"started on {', '.join(e.nodes)}"
        case JobReady():
            return "ready to serve"
        case JobCheckpointed():
            return f"checkpointed at {when(e.checkpointed_at)}" + (f", step {e.step}" if e.step is not None else "")
        case PreemptionRequested() | ReclaimRequested():
            return _notice(e)
        case JobPreempted():
            if e.preempted_by == OTHER_TEAMS_JOB:
                return f"preempted: its GPUs or quota went to {OTHER_TEAMS_JOB}; it is requeued"
            by = f" for job {e.preempted_by}" if e.preempted_by else ""
            return f"preempted{by}" + (f": {e.reason}" if e.reason else "") + "; it is requeued"
        case JobRetryScheduled():
            after = {"JobFailed": f" (attempt {e.failed_attempt} failed)",
                     "JobPreempted": f" (attempt {e.failed_attempt} was preempted)"}.get(e.after or "", "")
            return f"retry scheduled: attempt {e.next_attempt} waits for quota, not before {when(e.not_before)}{after}"
        case JobSucceeded():
            return f"succeeded after {duration(e.occurred_at - e.started_at)}"
        case JobFailed():
            code = "" if e.exit_code is None else f", exit code {e.exit_code}"
            ran = f" after {duration(e.occurred_at - e.started_at)}" if e.started_at else " before it started"
            return (f"failed{ran} ({e.reason.value}{code})" + (f": {e.message}" if e.message else "")
                    + ("; it may be retried" if e.retryable else ""))
        case JobCancelRequested():
            who = e.requested_by + (f" for {e.on_behalf_of}" if e.on_behalf_of else "")
            return f"cancel requested by {who}" + (f": {e.reason}" if e.reason else "")
        case JobCancelled():
            return "cancelled" + (f": {e.reason}" if e.reason else "")
    return None


def notice_deadline(e: PreemptionRequested | ReclaimRequested) -> datetime:
    """When a preempted attempt is stopped: the notice's time plus its grace period."""
    return e.occurred_at + timedelta(seconds=e.grace_seconds)


def _notice(e: PreemptionRequested | ReclaimRequested) -> str:
    hidden = e.for_job == OTHER_TEAMS_JOB
    if isinstance(e, PreemptionRequested):
        why = (f"for {HIGHER_PRIORITY_ELSEWHERE}" if hidden
               else f"for higher-priority job {e.for_job}") + ", which needs its GPUs"
    elif e.kind == "reclaim":
        why = (f"because the {e.flavor} quota its queue borrowed is reclaimed for "
               + (OTHER_TEAMS_JOB if hidden else f"job {e.for_job} of queue {e.for_queue}"))
    else:
        why = (f"because {OTHER_TEAMS_JOB if hidden else 'job ' + e.for_job}, of higher priority in its queue, "
               f"needs the {e.flavor} quota it holds")
    return (f"preemption notice: it is stopped {why}; checkpoint before {when(notice_deadline(e))} "
            f"({e.grace_seconds:g} s); it is requeued after" + (f". {e.message}" if e.message else ""))
