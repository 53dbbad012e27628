"""Reading a job's history from the log: its events in order, and where it stands and why it
waits (the reasons quota and the scheduler recorded).

A reason is recorded when it changes, not every cycle, so the numbers in its message are those of
the cycle that recorded it (its ``since``); ``gpusched why`` shows the queue's usage now beside
it, from the same read models as ``gpusched queues``."""

from __future__ import annotations

from typing import Any

import asyncpg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from gpusched.userinput import UserError
from runtime import eventlog
from runtime.teams import TeamIndex
from schemas import Event, JobRetryScheduled, parse_event
from schemas.registry import SUBJECT_PREFIX
from services.accounting import queries


MAX_EVENTS = 10_000
"""The most events of one job read back (a job has tens; the bound keeps a request bounded)."""


async def job_events(js: JetStreamContext, job_id: str, after: int = 0, *,
                     seen_by: str | None = None) -> list[tuple[int, Event]]:
    """The job's events after stream sequence ``after``, in order, by direct gets of the next
    message on the job's subjects: no consumer is created, so any number of readers may run.
    ``seen_by``: a team's view (a member's), where another team's job is never named
    (runtime.teams.TeamIndex.as_seen_by); None: the log as it is (operators)."""
    out: list[tuple[int, Event]] = []
    if seen_by is not None:
        teams = TeamIndex(js)
        return [(s, await teams.as_seen_by(e, seen_by)) for s, e in await job_events(js, job_id, after)]
    subject = f"{SUBJECT_PREFIX}.job.{job_id}.>"
    seq = after + 1
    while len(out) < MAX_EVENTS:
        try:
            raw = await js.get_msg(eventlog.EVENTS_STREAM, seq=seq, subject=subject, direct=True, next=True)
        except NotFoundError:
            break
        out.append((raw.seq, parse_event(raw.data)))
        seq = raw.seq + 1
    return out


async def dead_letters(js: JetStreamContext, limit: int) -> list[dict[str, Any]]:
    """The last ``limit`` dead letters, newest last, with their reasons (direct gets, no consumer)."""
    last = (await js.stream_info(eventlog.DLQ_STREAM)).state.last_seq
    rows: list[dict[str, Any]] = []
    seq = last
    while seq >= 1 and len(rows) < limit:
        try:
            raw = await js.get_msg(eventlog.DLQ_STREAM, seq=seq, direct=True)
        except NotFoundError:
            seq -= 1
            continue
        h = raw.headers or {}
        rows.append({"seq": raw.seq, "subject": raw.subject,
                     "original": f"{h.get('Gpusched-Original-Stream')}#{h.get('Gpusched-Original-Sequence')}",
                     "reason": h.get("Gpusched-Reason", ""), "bytes": len(raw.data or b"")})
        seq -= 1
    return rows[::-1]


async def why(js: JetStreamContext, job_id: str, conn: asyncpg.Connection | None = None) -> dict[str, Any]:
    """Where a job stands and why it waits: :func:`explain` of its history in the log and its
    ``position`` in its queue now, from the read models (``conn``;
    :func:`services.accounting.queries.job_position`, the one position every door shows; None
    without them or when the job does not wait for quota). Every door's "why" is this one."""
    history = await job_events(js, job_id)
    if not history:
        raise UserError(f"job {job_id!r} has no events in the log")
    position = None if conn is None else await queries.job_position(conn, job_id)
    return {**explain(job_id, history), "position": position}


def current_attempt(events: list[Event]) -> int:
    """The job's current attempt: the highest attempt its events name, a JobRetryScheduled
    naming the next one (it carries ``next_attempt``, not ``attempt``)."""
    return max((e.next_attempt if isinstance(e, JobRetryScheduled) else (getattr(e, "attempt", None) or 1)
                for e in events), default=1)


def explain(job_id: str, history: list[tuple[int, Event]]) -> dict[str, Any]:
    """:func:`why` of a job's (non-empty) history: the reasons of its current attempt
    (:func:`current_attempt`; after a retry or a requeue, the next attempt's)."""
    lifecycle = [e for _, e in history if e.type not in ("QuotaPendingReasonChanged", "SchedulingPendingReasonChanged")]
    last = lifecycle[-1] if lifecycle else history[-1][1]
    reasons = [e for _, e in history if e.type == "QuotaPendingReasonChanged"]
    attempt = current_attempt(lifecycle)
    waiting = last.type in ("JobAdmitted", "JobRetryScheduled", "QuotaReleased") and not any(
        e.type in ("JobSucceeded", "JobCancelled", "JobRejected") for e in lifecycle)
    current = next((r for r in reversed(reasons) if r.attempt == attempt), None) if waiting else None
    placing = [e for _, e in history if e.type == "SchedulingPendingReasonChanged"]
    sched = next((r for r in reversed(placing) if r.attempt == attempt), None) if last.type == "QuotaReserved" else None
    admitted = next((e for e in lifecycle if e.type == "JobAdmitted"), None)
    return {
        "job_id": job_id,
        "queue": admitted.queue if admitted is not None else None,
        "attempt": attempt,
        "last_event": last.type,
        "since": last.occurred_at,
        "waiting_for_quota": waiting,
        "reason": None if current is None else {
            "code": current.reason.value, "message": current.message, "position": current.position,
            "flavor": current.flavor, "since": current.occurred_at},
        "history": [{"time": r.occurred_at, "attempt": r.attempt, "code": r.reason.value, "position": r.position,
                     "message": r.message} for r in reasons],
        # holding quota, not placed yet: the scheduler's reason (docs/scheduling.md)
        "scheduling_reason": None if sched is None else {
            "code": sched.reason.value, "message": sched.message, "flavor": sched.flavor,
            "free_gpus": sched.free_gpus, "largest_free_block": sched.largest_free_block, "eta": sched.eta,
            "since": sched.occurred_at},
        "scheduling_history": [{"time": r.occurred_at, "attempt": r.attempt, "code": r.reason.value,
                                "message": r.message} for r in placing],
    }
