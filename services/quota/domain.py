"""Quota's pure core.

A job holds quota for one attempt from QuotaReserved until its attempt ends; the release is its
own event (QuotaReleased), so usage is a fold over the log. A queue uses its own nominal
(guaranteed) quota first, then borrows unused quota of its cohort within its borrowing limit and
the lenders' lending limits (:mod:`services.quota.capacity`). A job that allows several flavors
takes the first of them, in its order, that fits (flavor fungibility).

Order inside a queue: priority (higher first), then the time the attempt was queued, then job
id. A strict-FIFO queue stops at a head that does not fit; otherwise smaller jobs behind it may go.
Across queues, heads are taken from the queue with the lowest weighted share first (usage over
nominal, both in weighted GPU units), so competing queues borrow in fair order.

Every attempt that stays queued gets a structured reason with the numbers
(QuotaPendingReasonChanged), emitted when the reason changes and at most every
``REASON_INTERVAL_S`` for a changed message with the same code.

Retries are decided here too: a failed attempt whose reason is in the job's ``retry_on`` and
that has attempts left gets JobRetryScheduled and re-enters the queue after the backoff.
Preempted attempts are requeued the same way without using up an attempt.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sortedcontainers import SortedList

from schemas import (
    CohortConfigured,
    Event,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobFailed,
    JobPreempted,
    JobRetryScheduled,
    JobSpec,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    QueueConfigured,
    QueueDeleted,
    QuotaPendingReasonChanged,
    QuotaReleased,
    QuotaReserved,
    QuotaWaitReason,
    ReclaimRequested,
    new_event,
)
from schemas.priority import DEFAULT_PRIORITY_CLASSES
from services.quota.capacity import Limits, Pool

PRODUCER = "quota"
REASON_INTERVAL_S = 30.0


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
    waiting: QuotaPendingReasonChanged | None = None  # the last reason given for this attempt
    preemptible: bool = True
    started_at: datetime | None = None  # of the current attempt
    reclaim: ReclaimRequested | None = None  # asked to give the current attempt's quota back
    order_key: tuple | None = None  # its key in the queue's pending order while it waits
    flavors: tuple[QueueConfigured, tuple[str, ...]] | None = None  # usable flavors, for that queue config

    def queue_order(self) -> tuple:
        """Order inside a queue: priority (higher first), then queued time, then job id."""
        return (-self.priority, self.queued_at, self.submitted.aggregate_id)


@dataclass
class QuotaState:
    queues: dict[str, QueueConfigured] = field(default_factory=dict)
    cohorts: dict[str, str | None] = field(default_factory=dict)  # cohort -> parent
    cohort_config: dict[str, CohortConfigured] = field(default_factory=dict)
    # queue -> (decayed average of weighted GPUs in use, the time it was last brought up to date)
    history: dict[str, tuple[float, datetime]] = field(default_factory=dict)
    # queue -> (period start, weighted GPU-seconds of reservations released within the period)
    spent: dict[str, tuple[datetime, float]] = field(default_factory=dict)
    jobs: dict[str, QuotaJob] = field(default_factory=dict)
    used: dict[tuple[str, str], int] = field(default_factory=dict)  # (queue, flavor) -> GPUs
    # queue -> (order key, job id) of the jobs waiting for quota, kept in queue order
    pending: dict[str, SortedList] = field(default_factory=dict)
    holders: dict[str, set[str]] = field(default_factory=dict)  # queue -> job ids holding a reservation
    to_release: dict[str, None] = field(default_factory=dict)  # jobs whose attempt ended


class QuotaCore:
    def __init__(self) -> None:
        self.state = QuotaState()
        self._dirty = True  # something changed that could let a pending job in
        self._wake_at: datetime | None = None  # earliest retry backoff that has not passed

    def _enqueue(self, job_id: str, job: QuotaJob) -> None:
        if job.order_key is not None:
            self._dequeue(job_id, job)
        job.order_key = job.queue_order()
        self.state.pending.setdefault(job.queue, SortedList()).add((job.order_key, job_id))
        self._dirty = True

    def _dequeue(self, job_id: str, job: QuotaJob) -> bool:
        """Take the job out of its queue; True if it was waiting there."""
        if job.order_key is None:
            return False
        self.state.pending[job.queue].discard((job.order_key, job_id))
        job.order_key = None
        return True

    def evolve(self, event: Event) -> None:
        s = self.state
        if isinstance(event, QueueConfigured):
            s.queues[event.name] = event
            self._dirty = True
            return
        if isinstance(event, QueueDeleted):
            s.queues.pop(event.name, None)
            self._dirty = True
            return
        if isinstance(event, CohortConfigured):
            s.cohorts[event.name] = event.parent
            s.cohort_config[event.name] = event
            self._dirty = True
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
                job.preemptible = event.preemptible
                job.queued_at = event.occurred_at
                self._enqueue(job_id, job)
            case QuotaReserved():
                job.reserved = event
                key = (event.queue, event.flavor)
                self._age_history(event.queue, event.occurred_at)
                s.used[key] = s.used.get(key, 0) + event.gpus
                s.holders.setdefault(event.queue, set()).add(job_id)
                self._dequeue(job_id, job)
            case QuotaReleased():
                if job.reserved is not None and job.reserved.attempt == event.attempt:
                    key = (event.queue, event.flavor)
                    self._age_history(event.queue, event.occurred_at)
                    self._charge_budget(job.reserved, event.occurred_at)
                    s.used[key] = s.used.get(key, 0) - event.gpus
                    s.holders.get(event.queue, set()).discard(job_id)
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
                job.waiting = None
                job.started_at = None
                job.reclaim = None
                job.not_before = event.not_before
                job.queued_at = event.occurred_at
                job.ended = None
                s.to_release.pop(job_id, None)
                self._enqueue(job_id, job)
            case QuotaPendingReasonChanged():
                if event.attempt == job.attempt:
                    job.waiting = event
            case JobStarted():
                if event.attempt == job.attempt:
                    job.started_at = event.occurred_at
            case ReclaimRequested():
                if event.attempt == job.attempt:
                    job.reclaim = event
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
            backoff = job.spec.retry.backoff_for(job.failures) if isinstance(ended, JobFailed) else 0.0
            out.append(
                new_event(
                    JobRetryScheduled, aggregate_id=job_id, producer=PRODUCER, occurred_at=now,
                    key=f"{job.attempt}", cause=ended, failed_attempt=job.attempt,
                    next_attempt=job.attempt + 1, not_before=now + timedelta(seconds=backoff),
                )
            )
        return out

    def root_cohort(self, cohort: str | None) -> str | None:
        """Top of the cohort tree (cycles in the configuration stop at the first repeat)."""
        seen: set[str] = set()
        while cohort is not None and cohort not in seen:
            seen.add(cohort)
            parent = self.state.cohorts.get(cohort)
            if parent is None:
                return cohort
            cohort = parent
        return cohort

    def pools(self, used: dict[tuple[str, str], int] | None = None) -> dict[tuple[str, str], Pool]:
        """(pool key, flavor) -> Pool, where the key is the root cohort or ``queue:<name>``."""
        used = self.state.used if used is None else used
        pools: dict[tuple[str, str], Pool] = {}
        for name, queue in self.state.queues.items():
            root = self.root_cohort(queue.cohort)
            key = root if root is not None else f"queue:{name}"
            for fq in queue.quotas:
                pool = pools.setdefault((key, fq.flavor), Pool(fq.flavor, root))
                pool.limits[name] = Limits(fq.nominal, fq.borrowing_limit, fq.lending_limit)
                pool.used[name] = used.get((name, fq.flavor), 0)
        return pools

    def pool_key(self, queue: str) -> str:
        """The root cohort of the queue, or ``queue:<name>`` for a queue outside any cohort."""
        root = self.root_cohort(self.state.queues[queue].cohort)
        return root if root is not None else f"queue:{queue}"

    def pool_of(self, pools: dict[tuple[str, str], Pool], queue: str, flavor: str) -> Pool | None:
        return pools.get((self.pool_key(queue), flavor))

    # -- GPU-hour budgets ----------------------------------------------------------------------
    @staticmethod
    def period_start(period: str, at: datetime) -> datetime:
        day = at.replace(hour=0, minute=0, second=0, microsecond=0)
        if period == "day":
            return day
        if period == "week":
            return day - timedelta(days=day.weekday())
        return day.replace(day=1)

    @staticmethod
    def next_period(period: str, start: datetime) -> datetime:
        if period == "day":
            return start + timedelta(days=1)
        if period == "week":
            return start + timedelta(days=7)
        return (start.replace(day=28) + timedelta(days=4)).replace(day=1)

    def _weight(self, queue: str, flavor: str) -> float:
        q = self.state.queues.get(queue)
        return next((fq.weight for fq in q.quotas if fq.flavor == flavor), 1.0) if q is not None else 1.0

    def _charge_budget(self, r: QuotaReserved, released_at: datetime) -> None:
        """Fold a released reservation's weighted GPU-seconds, within the current period, into
        what its queue has spent."""
        queue = self.state.queues.get(r.queue)
        if queue is None or queue.budget is None:
            return
        start = self.period_start(queue.budget.period, released_at)
        prev_start, spent = self.state.spent.get(r.queue, (start, 0.0))
        if prev_start != start:
            spent = 0.0
        held = (released_at - max(r.occurred_at, start)).total_seconds()
        self.state.spent[r.queue] = (start, spent + max(0.0, held) * r.gpus * self._weight(r.queue, r.flavor))

    def budget_spent(self, queue: QueueConfigured, now: datetime) -> float:
        """Weighted GPU-hours the queue has used or committed this period: released reservations,
        plus for each one still held the longer of its time so far and its declared runtime."""
        start = self.period_start(queue.budget.period, now)
        prev_start, spent = self.state.spent.get(queue.name, (start, 0.0))
        seconds = spent if prev_start == start else 0.0
        for j in (self.state.jobs[i] for i in self.state.holders.get(queue.name, ())):
            r = j.reserved
            if r is not None:
                held = max((now - max(r.occurred_at, start)).total_seconds(), j.spec.expected_runtime_seconds or 0)
                seconds += max(0.0, held) * r.gpus * self._weight(r.queue, r.flavor)
        return seconds / 3600

    def _over_budget(self, queue: QueueConfigured, job: QuotaJob, flavor_weight: float, spent: float,
                     now: datetime) -> str | None:
        b = queue.budget
        planned = job.spec.total_gpus * flavor_weight * (job.spec.expected_runtime_seconds or 0) / 3600
        if spent + planned <= b.gpu_hours and spent < b.gpu_hours:
            return None
        start = self.period_start(b.period, now)
        until = self.next_period(b.period, start)
        self._wake_at = min(self._wake_at or until, until)
        return (f"queue {queue.name} has used or committed {spent:.1f} of its {b.gpu_hours:g} GPU-hours this {b.period} "
                f"(since {start.date().isoformat()}); this job plans {planned:.1f} more; the budget renews "
                f"{until.isoformat()}")

    def _half_life(self, queue: QueueConfigured | None) -> tuple[float | None, float]:
        root = self.root_cohort(queue.cohort) if queue is not None else None
        config = self.state.cohort_config.get(root) if root is not None else None
        return (config.usage_half_life_seconds, config.history_weight) if config is not None else (None, 0.0)

    def _weighted_usage(self, queue: QueueConfigured, used: dict[tuple[str, str], int]) -> float:
        return sum(used.get((queue.name, fq.flavor), 0) * fq.weight for fq in queue.quotas)

    def _decayed(self, queue: QueueConfigured, at: datetime) -> float:
        """The decayed average of the queue's weighted usage, brought forward to ``at`` with the
        usage it has now (constant since the last change)."""
        half_life, _ = self._half_life(queue)
        average, since = self.state.history.get(queue.name, (0.0, at))
        if half_life is None or at <= since:
            return average
        keep = 0.5 ** ((at - since).total_seconds() / half_life)
        return average * keep + self._weighted_usage(queue, self.state.used) * (1 - keep)

    def _age_history(self, queue_name: str, at: datetime) -> None:
        """Before the queue's usage changes at ``at``: fold the usage so far into its average."""
        queue = self.state.queues.get(queue_name)
        if queue is not None and self._half_life(queue)[0] is not None:
            self.state.history[queue_name] = (self._decayed(queue, at), at)

    def share(self, queue: QueueConfigured, used: dict[tuple[str, str], int], now: datetime | None = None) -> float:
        """Weighted share: usage over nominal, both in weighted GPU units. In a cohort with a
        usage half-life, blended with the decayed average usage: fairness over time, not only now."""
        nominal = sum(fq.nominal * fq.weight for fq in queue.quotas)
        usage = self._weighted_usage(queue, used)
        half_life, weight = self._half_life(queue)
        if half_life is not None and now is not None:
            usage = (1 - weight) * usage + weight * self._decayed(queue, now)
        if nominal == 0:
            return 0.0 if usage == 0 else float("inf")
        return usage / nominal

    def _reserve(self, now: datetime) -> list[Event]:
        """One quota cycle in two passes. Pass 1: every waiting job that fits in its queue's
        unused nominal quota, queues in fair order (guaranteed quota first, so reclaimed quota
        reaches its owner and a borrower never takes what a queue's own job could use this
        cycle). Pass 2: the rest, borrowing allowed, one job at a time from the queue with the
        lowest weighted share. Then every job still waiting is explained, and preemptions asked."""
        s = self.state
        used = dict(s.used)  # this cycle's working copy
        pools = self.pools(used)
        out: list[Event] = []
        self._wake_at = None
        order: dict[str, list[QuotaJob]] = {}
        for queue_name, entries in s.pending.items():
            waiting = [s.jobs[j] for _, j in entries if not s.jobs[j].cancel_requested]
            if not waiting:
                continue
            queue = s.queues.get(queue_name)
            if queue is None:
                for position, job in enumerate(waiting, start=1):
                    out.extend(self._reason(job, QuotaWaitReason.QUEUE_MISSING,
                                            f"queue {queue_name} no longer exists", position, None, now))
                continue
            order[queue_name] = waiting
        # No new borrowing in a pool (pool key, flavor) while quota is being preempted there, or
        # while a queue of it waits for its own lent-out quota (pass 1 adds those): that quota
        # goes to the job it is freed for, not to the next borrower (no reclaim loops).
        no_borrowing: set[tuple[str, str]] = {
            (self.pool_key(j.reserved.queue), j.reserved.flavor)
            for j in self._holding() if j.reclaim is not None and j.reserved.queue in s.queues
        }
        spent_now: dict[str, float] = {}  # budget used this period, per queue, for this cycle
        taken: set[str] = set()  # reserved in this cycle
        charged_in: set[tuple[str, str]] = set()  # (pool key, flavor) where this cycle reserved

        def flavors_of(job: QuotaJob, queue: QueueConfigured) -> tuple[str, ...]:
            """The job's flavors, in its order, that the queue has quota for (kept on the job
            until the queue is reconfigured)."""
            if job.flavors is None or job.flavors[0] is not queue:
                nominal = [fq.flavor for fq in queue.quotas]
                job.flavors = (queue, tuple(f for f in (job.spec.gpu_flavors or nominal) if f in nominal))
            return job.flavors[1]

        def held_back(job: QuotaJob, queue: QueueConfigured, flavors: list[str]) -> tuple[QuotaWaitReason, str] | None:
            """A retry in its backoff or a queue over its budget: the job waits whatever the quota."""
            if job.not_before is not None and job.not_before > now:
                self._wake_at = min(self._wake_at or job.not_before, job.not_before)
                return (QuotaWaitReason.RETRY_BACKOFF,
                        f"retry of attempt {job.attempt - 1} waits until {job.not_before.isoformat()}")
            if queue.budget is not None and flavors:
                spent = spent_now.setdefault(queue.name, self.budget_spent(queue, now))
                if (over := self._over_budget(queue, job, self._weight(queue.name, flavors[0]), spent, now)):
                    return QuotaWaitReason.BUDGET_EXHAUSTED, over
            return None

        def try_reserve(job: QuotaJob, queue: QueueConfigured, flavors: list[str], borrow: bool) -> bool:
            """Reserve the first of the job's flavors that fits (without borrowing unless ``borrow``)."""
            need = job.spec.total_gpus
            for flavor in flavors:
                pool = self.pool_of(pools, queue.name, flavor)
                v = pool.check(queue.name, need)
                if not v.fits or (v.borrowed and (not borrow or (self.pool_key(queue.name), flavor) in no_borrowing)):
                    continue
                pool.charge(queue.name, need)
                used[(queue.name, flavor)] = used.get((queue.name, flavor), 0) + need
                charged_in.add((self.pool_key(queue.name), flavor))
                if queue.name in spent_now:  # the budget check of the next head counts this one's plan
                    spent_now[queue.name] += need * self._weight(queue.name, flavor) * (
                        job.spec.expected_runtime_seconds or 0) / 3600
                taken.add(job.submitted.aggregate_id)
                out.append(
                    new_event(
                        QuotaReserved, aggregate_id=job.submitted.aggregate_id, producer=PRODUCER, occurred_at=now,
                        key=f"{job.attempt}", cause=job.submitted, attempt=job.attempt, queue=queue.name,
                        flavor=flavor, gpus=need, borrowed=v.borrowed,
                    )
                )
                return True
            return False

        failed_at: dict[str, dict[tuple[str, ...], int]] = {}  # pass 2: queue -> flavors -> smallest refused
        # Pass 1: own nominal quota. Within a queue the smallest request that did not fit is
        # remembered per flavor list: usage only grows during a pass, so a larger one cannot fit.
        for queue_name in sorted(order, key=lambda q: (self.share(s.queues[q], used, now), q)):
            queue = s.queues[queue_name]
            failed: dict[tuple[str, ...], int] = {}
            for job in order[queue_name]:
                flavors = flavors_of(job, queue)
                if held_back(job, queue, flavors) is not None:
                    continue
                key = flavors
                if job.spec.total_gpus < failed.get(key, 1 << 62):
                    if try_reserve(job, queue, flavors, borrow=False):
                        continue
                    if queue.preemption.reclaim_within_cohort != "never":
                        for flavor in flavors:
                            v = self.pool_of(pools, queue_name, flavor).check(queue_name, job.spec.total_gpus)
                            if v.reason == QuotaWaitReason.NOMINAL_LENT:
                                # The lent quota is held for its owner: nobody borrows it this cycle.
                                no_borrowing.add((self.pool_key(queue_name), flavor))
                failed[key] = min(failed.get(key, 1 << 62), job.spec.total_gpus)
                if queue.strict_fifo:
                    break
        # Pass 2: borrowing allowed, in fair order: the queue with the lowest share takes its next
        # job. Jobs that do not get quota change nothing, so a queue keeps its turn until one
        # of its jobs is reserved (then its share is recomputed) or it has none left.
        heap = [(self.share(s.queues[q], used, now), q) for q in order]
        heapq.heapify(heap)
        cursor = dict.fromkeys(order, 0)
        ahead = dict.fromkeys(order, 0)  # jobs of the queue, before this one, that still wait
        refused: list[tuple[QuotaJob, str, int, tuple[str, ...]]] = []
        while heap:
            _, queue_name = heapq.heappop(heap)
            queue, waiting = s.queues[queue_name], order[queue_name]
            failed: dict[tuple[str, ...], int] = failed_at.setdefault(queue_name, {})
            while cursor[queue_name] < len(waiting):
                job = waiting[cursor[queue_name]]
                cursor[queue_name] += 1
                if job.submitted.aggregate_id in taken:
                    continue
                position = ahead[queue_name] + 1
                flavors = flavors_of(job, queue)
                if (held := held_back(job, queue, flavors)) is not None:
                    ahead[queue_name] += 1
                    out.extend(self._reason(job, *held, position, None, now))
                    continue
                need, key = job.spec.total_gpus, flavors
                if need < failed.get(key, 1 << 62) and try_reserve(job, queue, flavors, borrow=True):
                    heapq.heappush(heap, (self.share(queue, used, now), queue_name))
                    break
                failed[key] = min(failed.get(key, 1 << 62), need)
                ahead[queue_name] += 1
                refused.append((job, queue_name, position, flavors))
                if queue.strict_fifo:
                    head, behind = job.submitted.aggregate_id, position
                    for other in waiting[cursor[queue_name]:]:
                        if other.submitted.aggregate_id in taken:
                            continue
                        behind += 1
                        out.extend(self._reason(other, QuotaWaitReason.BLOCKED_BY_HEAD,
                                                f"queue {queue_name} is strict FIFO and its head {head} "
                                                f"({need} GPUs) does not fit", behind, None, now))
                    break
        # Explain what still waits with the numbers as they stand after this cycle's reservations
        # (the state the log will hold), not as they stood when the job's turn came. Then ask
        # preemptions, each against a trial pool that already counts the preemptions under
        # way and those asked earlier in this cycle as done (their victims gone, the jobs they
        # are for holding their quota): several jobs may be served in one cycle, no victim is
        # asked twice, and a job that will fit once its victims stop asks nothing more.
        victims: dict[tuple[str, str], list[QuotaJob]] = {}  # per pool, computed once a cycle
        verdicts: dict = {}
        hopeless: dict[tuple[str, str, str, int], int] = {}
        trials: dict[tuple[str, str], Pool] = {}
        served = {j.reclaim.for_job for j in self._holding() if j.reclaim is not None}
        asked_victims: set[str] = set()
        for job, queue_name, position, flavors in refused:
            events, lent_flavor = self._explain(job, queue_name, flavors, position, pools, now, verdicts)
            out.extend(events)
            queue = s.queues[queue_name]
            root = self.pool_key(queue_name)
            policy = queue.preemption
            if job.submitted.aggregate_id in served:
                continue  # its victims are stopping
            if lent_flavor is not None and policy.reclaim_within_cohort != "never":
                flavors = (lent_flavor,)
            elif policy.within_queue != "lower-priority":
                continue
            for flavor in flavors:
                kind = "reclaim" if flavor == lent_flavor else "priority"
                # One that found too few victims: a request as large, of no higher priority, would too.
                hopeless_key = (queue_name, flavor, kind, job.priority)
                if job.spec.total_gpus >= hopeless.get(hopeless_key, 1 << 62):
                    continue
                pool = self.pool_of(pools, queue_name, flavor)
                if (root, flavor) not in victims:
                    victims[(root, flavor)] = self._victims(flavor, pool, now)
                    trials[(root, flavor)] = self._after_preemptions(pool, flavor)
                trial = trials[(root, flavor)]
                if kind == "reclaim":  # other queues' borrowing attempts
                    candidates = [v for v in victims[(root, flavor)] if v.reserved.queue != queue_name
                                  and (policy.reclaim_within_cohort == "any" or v.priority < job.priority)]
                else:  # the queue's own lower-priority attempts
                    candidates = [v for v in victims[(root, flavor)]
                                  if v.reserved.queue == queue_name and v.priority < job.priority]
                candidates = [v for v in candidates if v.submitted.aggregate_id not in asked_victims]
                asked = self._preempt_for(job, queue_name, flavor, pool, trial, candidates, kind, now)
                if asked is not None:
                    asked_victims.update(e.aggregate_id for e in asked)
                    out.extend(asked)
                    break
                hopeless[hopeless_key] = min(hopeless.get(hopeless_key, 1 << 62), job.spec.total_gpus)
                if (root, flavor) in charged_in:
                    # Victims are attempts the log holds; this cycle's reservations are not among
                    # them yet. Look again once they are.
                    self._dirty = True
        return out

    def _holding(self):
        return (self.state.jobs[i] for ids in self.state.holders.values() for i in ids)

    def _victims(self, flavor: str, pool: Pool, now: datetime) -> list[QuotaJob]:
        """Attempts holding quota in a pool that may be preempted now, best victim first: lowest
        priority, then least work lost (GPUs × time running), then newest. Never non-preemptible
        attempts, ones already asked to stop, or ones inside their protection window (the core
        wakes when a window ends)."""
        candidates = []
        for q in pool.limits:
            for j in (self.state.jobs[i] for i in self.state.holders.get(q, ())):
                r = j.reserved
                if r is None or r.flavor != flavor or j.reclaim is not None or not j.preemptible or j.finished:
                    continue
                pc = DEFAULT_PRIORITY_CLASSES.get(j.spec.priority_class)
                running_s = (now - j.started_at).total_seconds() if j.started_at is not None else 0.0
                if pc is not None and j.started_at is not None and running_s < pc.protection_seconds:
                    until = j.started_at + timedelta(seconds=pc.protection_seconds)
                    self._wake_at = min(self._wake_at or until, until)
                    continue
                candidates.append((j.priority, r.gpus * running_s, -r.occurred_at.timestamp(),
                                   j.submitted.aggregate_id, j))
        candidates.sort(key=lambda c: c[:4])
        return [c[-1] for c in candidates]

    def _after_preemptions(self, pool: Pool, flavor: str) -> Pool:
        """A copy of ``pool`` as it will be once the preemptions under way in it are done: the
        victims' quota released and each job they are for holding its request."""
        trial = Pool(pool.flavor, pool.cohort, dict(pool.limits), dict(pool.used))
        served: set[str] = set()
        for q in pool.limits:
            for j in (self.state.jobs[i] for i in self.state.holders.get(q, ())):
                if j.reclaim is None or j.reserved.flavor != flavor:
                    continue
                trial.charge(q, -j.reserved.gpus)
                for_job = self.state.jobs.get(j.reclaim.for_job)
                if (for_job is not None and j.reclaim.for_job not in served and for_job.reserved is None
                        and not for_job.finished and for_job.queue in pool.limits):
                    served.add(j.reclaim.for_job)
                    trial.charge(for_job.queue, for_job.spec.total_gpus)
        return trial

    def _preempt_for(self, waiting: QuotaJob, queue_name: str, flavor: str, pool: Pool, trial: Pool,
                     candidates: list[QuotaJob], kind: str, now: datetime) -> list[Event] | None:
        """ReclaimRequested for the fewest of ``candidates`` (best victim first) whose release
        lets ``waiting`` fit in ``trial``, which is then charged with the outcome (victims gone,
        ``waiting`` holding its request); [] if it fits there already; None if all of them
        together would not be enough (nothing changes)."""
        job_id, need = waiting.submitted.aggregate_id, waiting.spec.total_gpus
        attempt = Pool(trial.flavor, trial.cohort, trial.limits, dict(trial.used))
        chosen: list[QuotaJob] = []
        if not attempt.check(queue_name, need).fits:
            for j in candidates:
                if kind == "reclaim" and attempt.borrowed(j.reserved.queue) == 0:
                    continue  # its queue no longer borrows: what it holds now is its own guaranteed quota
                attempt.charge(j.reserved.queue, -j.reserved.gpus)
                chosen.append(j)
                if attempt.check(queue_name, need).fits:
                    break
            else:
                return None  # not enough can be preempted now; the job keeps waiting
        attempt.charge(queue_name, need)
        trial.used, trial._totals, trial._borrowers = attempt.used, None, None
        if kind == "reclaim":
            why = f"queue {queue_name} needs its guaranteed {flavor} back for job {job_id}"
        else:
            why = (f"job {job_id} (priority {waiting.priority}) of queue {queue_name} needs {flavor} quota "
                   "held by lower-priority work of the same queue")
        return [
            new_event(
                ReclaimRequested, aggregate_id=v.submitted.aggregate_id, producer=PRODUCER, occurred_at=now,
                key=f"{v.attempt}/{job_id}", cause=waiting.waiting or waiting.submitted, attempt=v.attempt,
                kind=kind, for_job=job_id, for_queue=queue_name, flavor=flavor,
                message=f"{why}; {v.reserved.queue} "
                        + (f"borrowed {pool.borrowed(v.reserved.queue)}" if kind == "reclaim"
                           else f"holds {pool.used.get(v.reserved.queue, 0)} (priority {v.priority} here)"),
            )
            for v in chosen
        ]

    def _explain(self, job: QuotaJob, queue_name: str, flavors: tuple[str, ...], position: int,
                 pools: dict[tuple[str, str], Pool], now: datetime, cache: dict | None = None
                 ) -> tuple[list[Event], str | None]:
        """The job's reason event (if it changed), and the flavor whose guaranteed quota is lent
        out when that is why it waits (a reclaim candidate). ``cache`` holds the verdicts of this
        cycle's pools by (queue, flavors, request): jobs of the same shape share one."""
        shape = (queue_name, flavors, job.spec.total_gpus)
        found = cache.get(shape) if cache is not None else None
        if found is None:
            found = self._verdict(queue_name, flavors, job.spec, pools)
            if cache is not None:
                cache[shape] = found
        if found[0] is None:
            return [], None
        reason, message, flavor, lent = found
        return self._reason(job, reason, message, position, flavor, now), lent

    def _verdict(self, queue_name: str, flavors: tuple[str, ...], spec: JobSpec,
                 pools: dict[tuple[str, str], Pool]) -> tuple[QuotaWaitReason | None, str, str | None, str | None]:
        """(reason, message, flavor, lent flavor) for a request that did not get quota."""
        for flavor in flavors:
            v = self.pool_of(pools, queue_name, flavor).check(queue_name, spec.total_gpus)
            if not v.fits:
                return v.reason, v.message, flavor, (flavor if v.reason == QuotaWaitReason.NOMINAL_LENT else None)
            return (QuotaWaitReason.COHORT_EXHAUSTED,
                    f"queue {queue_name} {flavor}: quota is being reclaimed in its cohort; "
                    "no new borrowing until it completes", flavor, None)
        if not flavors:
            return (QuotaWaitReason.NO_QUOTA_FOR_FLAVOR,
                    f"queue {queue_name} has no quota for flavors {list(spec.gpu_flavors)}", None, None)
        return None, "", None, None

    def _reason(self, job: QuotaJob, reason: QuotaWaitReason, message: str, position: int,
                flavor: str | None, now: datetime) -> list[Event]:
        """A QuotaPendingReasonChanged if the reason changed, or its message did and the last
        one is older than REASON_INTERVAL_S."""
        last = job.waiting
        if last is not None and last.reason == reason:
            if last.message == message:
                return []
            due = last.occurred_at + timedelta(seconds=REASON_INTERVAL_S)
            if now < due:  # look again when the interval has passed
                self._wake_at = min(self._wake_at or due, due)
                return []
        return [
            new_event(
                QuotaPendingReasonChanged, aggregate_id=job.submitted.aggregate_id, producer=PRODUCER,
                occurred_at=now, key=f"{job.attempt}/{reason.value}/{message}", cause=job.submitted,
                attempt=job.attempt, reason=reason, message=message, position=position, flavor=flavor,
            )
        ]
