"""A job's state: the one vocabulary every door speaks (the read model's ``jobs.state`` column,
the API's ``state`` filter, the SDK's waits, the console) and the one map from the job's events
to it.

::

    submitted ─► rejected
        │
        ▼
     queued ◄──────────────────────────────┐ JobRetryScheduled after JobPreempted:
        │  QuotaReserved                   │ queued again, attempt + 1
        ▼                                  │
     reserved ─► scheduled ─► running ─► preempting ─► preempted
        │            │           │
        │            │           ├─► succeeded
        │            │           └─► failed ─► retrying (JobRetryScheduled after JobFailed:
        │            │                            attempt + 1, waits for quota again)
        └────────────┴───────────┴─► cancelling ─► cancelled

``preempted`` is the state between an attempt's preemption and quota's decision about the next
one; once requeued the job is ``queued`` again (with its new attempt number), so ``state=queued``
finds every job that waits for quota for a fresh attempt. Imports nothing of the project but
the contract's own names."""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """Ordered as a job goes through them (the order of the diagram, top to bottom)."""

    SUBMITTED = "submitted"      # recorded by admission, not decided yet
    REJECTED = "rejected"        # refused by admission (final)
    QUEUED = "queued"            # admitted (or requeued after a preemption): waits for quota
    RETRYING = "retrying"        # failed, a retry is scheduled: waits for quota for the next attempt
    RESERVED = "reserved"        # holds quota, waits for a placement
    SCHEDULED = "scheduled"      # placed on nodes, not started yet
    RUNNING = "running"
    PREEMPTING = "preempting"    # reclaim or preemption asked; the grace period runs
    PREEMPTED = "preempted"      # stopped by preemption; quota decides about the next attempt
    CANCELLING = "cancelling"    # cancel asked, not done yet
    SUCCEEDED = "succeeded"      # final
    FAILED = "failed"            # final unless a retry follows (JobRetryScheduled)
    CANCELLED = "cancelled"      # final


FINAL_STATES: tuple[JobState, ...] = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.REJECTED)
"""States a job leaves only by a retry (``failed``) or never."""

WAITING_FOR_QUOTA: tuple[JobState, ...] = (JobState.QUEUED, JobState.RETRYING, JobState.PREEMPTED)
"""Admitted and holding no quota for its current attempt: counted in its queue's line."""

WAITING_FOR_NODES: tuple[JobState, ...] = (JobState.RESERVED,)
"""Holds quota, not placed on nodes yet."""

PLACED_STATES: tuple[JobState, ...] = (JobState.SCHEDULED, JobState.RUNNING, JobState.PREEMPTING,
                                       JobState.CANCELLING)
"""An attempt in these states holds GPUs on its nodes (cancelling: until the executor says it ended)."""

EVENT_STATES: dict[str, JobState] = {
    "JobSubmitted": JobState.SUBMITTED,
    "JobRejected": JobState.REJECTED,
    "JobAdmitted": JobState.QUEUED,
    "QuotaReserved": JobState.RESERVED,
    "ReclaimRequested": JobState.PREEMPTING,
    "PreemptionRequested": JobState.PREEMPTING,
    "JobScheduled": JobState.SCHEDULED,
    "JobStarted": JobState.RUNNING,
    "JobSucceeded": JobState.SUCCEEDED,
    "JobFailed": JobState.FAILED,
    "JobPreempted": JobState.PREEMPTED,
    "JobCancelRequested": JobState.CANCELLING,
    "JobCancelled": JobState.CANCELLED,
}
"""The state each job event leads to; JobRetryScheduled is :func:`retry_state`'s; every other
event of a job leaves its state as it was."""


def retry_state(after: str) -> JobState:
    """The state a JobRetryScheduled leads to: ``queued`` after a preemption (a requeue),
    ``retrying`` after a failure."""
    return JobState.QUEUED if after == "JobPreempted" else JobState.RETRYING


def state_after(event_type: str, retry_after: str | None = None) -> JobState | None:
    """The state a job event of this type leads to (``retry_after``: a JobRetryScheduled's
    ``after``); None for an event that does not change the job's state."""
    if event_type == "JobRetryScheduled":
        return retry_state(retry_after or "")
    return EVENT_STATES.get(event_type)
