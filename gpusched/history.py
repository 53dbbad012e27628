"""Reading a job's history from the log: its events in order, and where it stands and why it
waits (the reasons quota and the scheduler recorded).

A reason is recorded when it changes, not every cycle, so the numbers in its message are those of
the cycle that recorded it (its ``since``); ``gpusched why`` shows the queue's usage now beside
it, from the same read models as ``gpusched queues``."""

from __future__ import annotations

from typing import Any

from nats.js import JetStreamContext

from gpusched.userinput import UserError
from runtime import eventlog
from schemas import Event, parse_event
from schemas.registry import SUBJECT_PREFIX


async def job_events(js: JetStreamContext, job_id: str) -> list[tuple[int, Event]]:
    out = []
    async for msg in eventlog.read(js, subjects=[f"{SUBJECT_PREFIX}.job.{job_id}.>"]):
        out.append((msg.metadata.sequence.stream, parse_event(msg.data)))
    return out


async def why(js: JetStreamContext, job_id: str) -> dict[str, Any]:
    """Where a job stands and why it waits, from its history in the log."""
    history = await job_events(js, job_id)
    if not history:
        raise UserError(f"job {job_id!r} has no events in the log")
    lifecycle = [e for _, e in history if e.type not in ("QuotaPendingReasonChanged", "SchedulingPendingReasonChanged")]
    last = lifecycle[-1] if lifecycle else history[-1][1]
    reasons = [e for _, e in history if e.type == "QuotaPendingReasonChanged"]
    attempt = max((getattr(e, "attempt", 1) or 1 for e in lifecycle), default=1)
    waiting = last.type in ("JobAdmitted", "JobRetryScheduled", "QuotaReleased") and not any(
        e.type in ("JobSucceeded", "JobCancelled", "JobRejected") for e in lifecycle)
    current = next((r for r in reversed(reasons) if r.attempt == attempt), None) if waiting else None
    placing = [e for _, e in history if e.type == "SchedulingPendingReasonChanged"]
    sched = next((r for r in reversed(placing) if r.attempt == attempt), None) if last.type == "QuotaReserved" else None
    admitted = next((e for e in lifecycle if e.type == "JobAdmitted"), None)
    return {
        "job_id": job_id,
        "queue": admitted.queue if admitted is not None else None,
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
