"""Quota's pure core.

A job holds quota for one attempt from QuotaReserved until its attempt ends; the release is its
own event (QuotaReleased), so usage is a fold over the log. This version enforces each queue's
nominal (guaranteed) quota per GPU flavor; a job that allows several flavors takes the first of
them, in its order, that has room.

Order inside a queue: priority (higher first), then the time the attempt was queued, then job
id. A strict-FIFO queue stops at a head that does not fit; otherwise smaller jobs behind it may go.

Retries are decided here too: a failed attempt whose reason is in the job's ``retry_on`` and
that has attempts left gets JobRetryScheduled and re-enters the queue after the backoff.
Preempted attempts are requeued the same way without using up an attempt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from schemas import (
    Event,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobFailed,
    JobPreempted,
    JobRetryScheduled,
    JobSpec,
    JobSubmitted,
    JobSucceeded,
    QueueConfigured,
    QueueDeleted,
    QuotaReleased,
    QuotaReserved,
    new_event,
)

PRODUCER = "quota"


@dataclass
class QuotaJob:
    spec: JobSpec
    submitted: JobSubmitted
    queue: str = ""
    priority: int = 0
    admitted: bool = False
    attempt: int = 1
    failures: int = 0  # attempts that failed (preemptions do not count)
    queued_at: datetime | None = None
    not_before: datetime | None = None
    reserved: QuotaReserved | None = None
    ended: Event | None = None  # terminal event of the current attempt, awaiting release
    finished: bool = False  # no more attempts will run
    cancel_requested: bool = False


@dataclass
class QuotaState:
    queues: dict[str, QueueConfigured] = field(default_factory=dict)
    jobs: dict[str, QuotaJob] = field(default_factory=dict)
    used: dict[tuple[str, str], int] = field(default_factory=dict)  # (queue, flavor) -> GPUs
    pending: dict[str, set[str]] = field(default_factory=dict)  # queue -> job ids waiting for quota
    to_release: dict[str, None] = field(default_factory=dict)  # jobs whose attempt ended


class QuotaCore:
    def __init__(self) -> None:
        self.state = QuotaState()
        self._dirty = True  # something changed that could let a pending job in
        self._wake_at: datetime | None = None  # earliest retry backoff that has not passed

    def _enqueue(self, job_id: str, job: QuotaJob) -> None:
        self.state.pending.setdefault(job.queue, set()).add(job_id)
        self._dirty = True

    def _dequeue(self, job_id: str, job: QuotaJob) -> bool:
        """Take the job out of its queue; True if it was waiting there."""
        pending = self.state.pending.get(job.queue)
        if pending is None or job_id not in pending:
            return False
        pending.discard(job_id)
        return True

    def evolve(self, event: Event) -> None:
        s = self.state
        if isinstance(event, QueueConfigured):
            s.queues[event.name] = event
            self._dirty = True
            return
        if isinstance(event, QueueDeleted):
            s.queues.pop(event.name, None)
            return
        if isinstance(event, JobSubmitted):
            s.jobs[event.aggregate_id] = QuotaJob(spec=event.spec, submitted=event)
            return
        job = s.jobs.get(event.aggregate_id)
        if job is None:
            return
        job_id = event.aggregate_id
        match event:
            case JobAdmitted():
                job.admitted, job.queue, job.priority = True, event.queue, event.priority
                job.queued_at = event.occurred_at
                self._enqueue(job_id, job)
            case QuotaReserved():
                job.reserved = event
                key = (event.queue, event.flavor)
                s.used[key] = s.used.get(key, 0) + event.gpus
                self._dequeue(job_id, job)
            case QuotaReleased():
                if job.reserved is not None and job.reserved.attempt == event.attempt:
                    key = (event.queue, event.flavor)
                    s.used[key] = s.used.get(key, 0) - event.gpus
                    job.reserved = None
                    self._dirty = True
                if job.finished:
                    s.to_release.pop(job_id, None)
            case JobSucceeded():
                if event.attempt == job.attempt:
                    job.ended, job.finished = event, True
                    self._attempt_ended(job_id, job)
            case JobCancelled():
                job.ended, job.finished = event, True
                if self._dequeue(job_id, job):
                    self._dirty = True  # it may have been the head blocking a strict-FIFO queue
                self._attempt_ended(job_id, job)
            case JobFailed():
                if event.attempt == job.attempt:
                    job.ended = event
                    job.failures += 1
                    retry = (
                        event.retryable
                        and event.reason in job.spec.retry.retry_on
                        and job.failures < job.spec.retry.max_attempts
                        and not job.cancel_requested
                    )
                    job.finished = not retry
                    self._attempt_ended(job_id, job)
            case JobPreempted():
                if event.attempt == job.attempt:
                    job.ended = event
                    job.finished = job.cancel_requested
                    self._attempt_ended(job_id, job)
            case JobRetryScheduled():
                job.attempt = event.next_attempt
                job.not_before = event.not_before
                job.queued_at = event.occurred_at
                job.ended = None
                s.to_release.pop(job_id, None)
                self._enqueue(job_id, job)
            case JobCancelRequested():
                job.cancel_requested = True
                if self._dequeue(job_id, job):
                    self._dirty = True  # it may have been the head blocking a strict-FIFO queue

    def decisions_refused(self) -> None:
        """Some decisions were not recorded (conflict or transient error): decide again."""
        self._dirty = True

    def _attempt_ended(self, job_id: str, job: QuotaJob) -> None:
        if job.reserved is not None or not job.finished:
            self.state.to_release[job_id] = None

    # -- decide ------------------------------------------------------------------------------
    def decide(self, now: datetime) -> list[Event]:
        """Releases for ended attempts, retries, then reservations in queue order. The dirty flag
        and wake time only skip a scan that could not decide anything new."""
        out: list[Event] = []
        for job_id in list(self.state.to_release):
            out.extend(self._release(job_id, self.state.jobs[job_id], now))
        if self._dirty or (self._wake_at is not None and self._wake_at <= now):
            self._dirty = False
            out.extend(self._reserve(now))
        return out

    def _release(self, job_id: str, job: QuotaJob, now: datetime) -> list[Event]:
        out: list[Event] = []
        ended = job.ended
        if job.reserved is not None:
            r = job.reserved
            out.append(
                new_event(
                    QuotaReleased, aggregate_id=job_id, producer=PRODUCER, occurred_at=now,
                    key=f"{r.attempt}", cause=ended, attempt=r.attempt, queue=r.queue, flavor=r.flavor,
                    gpus=r.gpus, reason=ended.type if ended is not None else "unknown",
                )
            )
        if ended is not None and not job.finished and isinstance(ended, (JobFailed, JobPreempted)):
            backoff = job.spec.retry.backoff_seconds if isinstance(ended, JobFailed) else 0.0
            out.append(
                new_event(
                    JobRetryScheduled, aggregate_id=job_id, producer=PRODUCER, occurred_at=now,
                    key=f"{job.attempt}", cause=ended, failed_attempt=job.attempt,
                    next_attempt=job.attempt + 1, not_before=now + timedelta(seconds=backoff),
                )
            )
        return out

    def _reserve(self, now: datetime) -> list[Event]:
        s = self.state
        used = dict(s.used)  # this cycle's working copy
        out: list[Event] = []
        self._wake_at = None
        for queue_name in sorted(s.pending):
            queue = s.queues.get(queue_name)
            if queue is None:
                continue
            nominal = {q.flavor: q.nominal for q in queue.quotas}
            waiting = sorted(
                (s.jobs[j] for j in s.pending[queue_name]),
                key=lambda jb: (-jb.priority, jb.queued_at, jb.submitted.aggregate_id),
            )
            for job in waiting:
                if job.not_before is not None and job.not_before > now:
                    self._wake_at = min(self._wake_at or job.not_before, job.not_before)
                    continue
                if job.reserved is not None or job.cancel_requested:
                    continue
                need = job.spec.total_gpus
                flavors = job.spec.gpu_flavors or tuple(nominal)
                chosen = next(
                    (f for f in flavors if f in nominal and used.get((queue_name, f), 0) + need <= nominal[f]),
                    None,
                )
                if chosen is None:
                    if queue.strict_fifo:
                        break
                    continue
                used[(queue_name, chosen)] = used.get((queue_name, chosen), 0) + need
                job_id = job.submitted.aggregate_id
                out.append(
                    new_event(
                        QuotaReserved, aggregate_id=job_id, producer=PRODUCER, occurred_at=now,
                        key=f"{job.attempt}", cause=job.submitted, attempt=job.attempt, queue=queue_name,
                        flavor=chosen, gpus=need, borrowed=0,
                    )
                )
        return out
