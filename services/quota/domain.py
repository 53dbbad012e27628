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
                self._dequeue(job_id, job)
            case QuotaReleased():
                if job.reserved is not None and job.reserved.attempt == event.attempt:
                    key = (event.queue, event.flavor)
                    self._age_history(event.queue, event.occurred_at)
                    self._charge_budget(job.reserved, event.occurred_at)
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

    def pool_of(self, pools: dict[tuple[str, str], Pool], queue: str, flavor: str) -> Pool | None:
        root = self.root_cohort(self.state.queues[queue].cohort)
        return pools.get((root if root is not None else f"queue:{queue}", flavor))

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
        for j in self.state.jobs.values():
            r = j.reserved
            if r is not None and r.queue == queue.name:
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
        s = self.state
        used = dict(s.used)  # this cycle's working copy
        pools = self.pools(used)
        out: list[Event] = []
        self._wake_at = None
        order: dict[str, list[QuotaJob]] = {}
        for queue_name, ids in s.pending.items():
            waiting = sorted(
                (s.jobs[j] for j in ids if s.jobs[j].reserved is None and not s.jobs[j].cancel_requested),
                key=lambda jb: (-jb.priority, jb.queued_at, jb.submitted.aggregate_id),
            )
            if not waiting:
                continue
            queue = s.queues.get(queue_name)
            if queue is None:
                for position, job in enumerate(waiting, start=1):
                    out.extend(self._reason(job, QuotaWaitReason.QUEUE_MISSING,
                                            f"queue {queue_name} no longer exists", position, None, now))
                continue
            order[queue_name] = waiting
        cursor = dict.fromkeys(order, 0)

        def turn(queue_name: str) -> tuple[int, float, str]:
            """Heap key: a head that fits without borrowing goes before any that must borrow
            (guaranteed quota first, so reclaimed quota reaches its owner), then lowest share."""
            queue, waiting = s.queues[queue_name], order[queue_name]
            borrows = 0
            if cursor[queue_name] < len(waiting):
                head = waiting[cursor[queue_name]]
                nominal = {fq.flavor for fq in queue.quotas}
                for flavor in [f for f in (head.spec.gpu_flavors or [fq.flavor for fq in queue.quotas]) if f in nominal]:
                    v = self.pool_of(pools, queue_name, flavor).check(queue_name, head.spec.total_gpus)
                    if v.fits:
                        borrows = 1 if v.borrowed else 0
                        break
            return (borrows, self.share(queue, used, now), queue_name)

        heap = [turn(q) for q in order]
        heapq.heapify(heap)
        ahead = dict.fromkeys(order, 0)  # jobs of the queue, before this one, that still wait
        refused: list[tuple[QuotaJob, str, int]] = []
        spent_now: dict[str, float] = {}  # budget used this period, per queue, for this cycle
        # No new borrowing in a pool while quota is being reclaimed there: the reclaimed GPUs
        # go to their owner, not to the next borrower (no reclaim loops).
        reclaiming: dict[str, set[str | None]] = {}
        for j in s.jobs.values():
            if j.reclaim is not None and j.reserved is not None:
                reclaiming.setdefault(j.reserved.flavor, set()).add(self.root_cohort(s.queues[j.reserved.queue].cohort)
                                                                  if j.reserved.queue in s.queues else None)
        while heap:
            *_, queue_name = heapq.heappop(heap)
            queue, waiting = s.queues[queue_name], order[queue_name]
            if cursor[queue_name] >= len(waiting):
                continue
            job = waiting[cursor[queue_name]]
            cursor[queue_name] += 1
            position = ahead[queue_name] + 1
            if job.not_before is not None and job.not_before > now:
                self._wake_at = min(self._wake_at or job.not_before, job.not_before)
                ahead[queue_name] += 1
                out.extend(self._reason(job, QuotaWaitReason.RETRY_BACKOFF,
                                        f"retry of attempt {job.attempt - 1} waits until {job.not_before.isoformat()}",
                                        position, None, now))
                heapq.heappush(heap, turn(queue_name))
                continue
            need = job.spec.total_gpus
            nominal = {fq.flavor for fq in queue.quotas}
            flavors = [f for f in (job.spec.gpu_flavors or [fq.flavor for fq in queue.quotas]) if f in nominal]
            if queue.budget is not None and flavors:
                spent = spent_now.setdefault(queue_name, self.budget_spent(queue, now))
                if (over := self._over_budget(queue, job, self._weight(queue_name, flavors[0]), spent, now)):
                    ahead[queue_name] += 1
                    out.extend(self._reason(job, QuotaWaitReason.BUDGET_EXHAUSTED, over, position, None, now))
                    heapq.heappush(heap, turn(queue_name))
                    continue
            chosen, verdict = None, None
            for flavor in flavors:
                pool = self.pool_of(pools, queue_name, flavor)
                v = pool.check(queue_name, need)
                if v.fits and not (v.borrowed and pool.cohort in reclaiming.get(flavor, ())):
                    chosen, verdict = flavor, v
                    break
            if chosen is not None:
                self.pool_of(pools, queue_name, chosen).charge(queue_name, need)
                used[(queue_name, chosen)] = used.get((queue_name, chosen), 0) + need
                if queue_name in spent_now:  # the budget check of the next head counts this one's plan
                    spent_now[queue_name] += need * self._weight(queue_name, chosen) * (
                        job.spec.expected_runtime_seconds or 0) / 3600
                out.append(
                    new_event(
                        QuotaReserved, aggregate_id=job.submitted.aggregate_id, producer=PRODUCER, occurred_at=now,
                        key=f"{job.attempt}", cause=job.submitted, attempt=job.attempt, queue=queue_name,
                        flavor=chosen, gpus=need, borrowed=verdict.borrowed,
                    )
                )
                heapq.heappush(heap, turn(queue_name))
                continue
            ahead[queue_name] += 1
            refused.append((job, queue_name, position))
            if queue.strict_fifo:
                head = job.submitted.aggregate_id
                for behind, other in enumerate(waiting[cursor[queue_name]:], start=position + 1):
                    out.extend(self._reason(other, QuotaWaitReason.BLOCKED_BY_HEAD,
                                            f"queue {queue_name} is strict FIFO and its head {head} "
                                            f"({need} GPUs) does not fit", behind, None, now))
                continue
            heapq.heappush(heap, turn(queue_name))
        # Explain what still waits with the numbers as they stand after this cycle's reservations
        # (the state the log will hold), not as they stood when the job's turn came.
        # One reclaim at a time per pool: none while one is under way, at most one asked per cycle.
        reclaimed: set[tuple[str | None, str]] = set()
        victims: dict[tuple[str | None, str], list[QuotaJob]] = {}  # per pool, computed once a cycle
        for job, queue_name, position in refused:
            events, lent_flavor = self._explain(job, queue_name, position, pools, now)
            out.extend(events)
            if lent_flavor is None:
                continue
            root = self.root_cohort(s.queues[queue_name].cohort)
            if (root, lent_flavor) in reclaimed or root in reclaiming.get(lent_flavor, ()):
                continue
            pool = self.pool_of(pools, queue_name, lent_flavor)
            if (root, lent_flavor) not in victims:
                victims[(root, lent_flavor)] = self._victims(lent_flavor, pool, now)
            asked = self._reclaim(job, queue_name, lent_flavor, pool, victims[(root, lent_flavor)], now)
            if asked:
                reclaimed.add((root, lent_flavor))
                out.extend(asked)
        return out

    def _victims(self, flavor: str, pool: Pool, now: datetime) -> list[QuotaJob]:
        """Borrowing attempts of a pool that may be reclaimed, best victim first: lowest priority,
        then least work lost (GPUs × time running), then newest. Never non-preemptible attempts
        or ones inside their protection window (the core wakes when a window ends)."""
        candidates = []
        for j in self.state.jobs.values():
            r = j.reserved
            if (r is None or r.flavor != flavor or r.queue not in pool.limits or pool.borrowed(r.queue) == 0
                    or j.reclaim is not None or not j.preemptible or j.finished):
                continue
            pc = DEFAULT_PRIORITY_CLASSES.get(j.spec.priority_class)
            running_s = (now - j.started_at).total_seconds() if j.started_at is not None else 0.0
            if pc is not None and j.started_at is not None and running_s < pc.protection_seconds:
                until = j.started_at + timedelta(seconds=pc.protection_seconds)
                self._wake_at = min(self._wake_at or until, until)
                continue
            candidates.append((j.priority, r.gpus * running_s, -r.occurred_at.timestamp(), j.submitted.aggregate_id, j))
        candidates.sort(key=lambda c: c[:4])
        return [c[-1] for c in candidates]

    def _reclaim(self, waiting: QuotaJob, queue_name: str, flavor: str, pool: Pool, victims: list[QuotaJob],
                 now: datetime) -> list[Event]:
        """ReclaimRequested for the fewest of ``victims`` (other queues' borrowing attempts, best
        first) whose release gives ``waiting`` its guaranteed quota back; nothing if they cannot."""
        job_id = waiting.submitted.aggregate_id
        trial = Pool(pool.flavor, pool.cohort, dict(pool.limits), dict(pool.used))
        chosen: list[QuotaJob] = []
        for j in victims:
            if j.reserved.queue == queue_name:
                continue
            trial.charge(j.reserved.queue, -j.reserved.gpus)
            chosen.append(j)
            if trial.check(queue_name, waiting.spec.total_gpus).fits:
                break
        else:
            return []  # not enough can be reclaimed now; the job keeps waiting
        return [
            new_event(
                ReclaimRequested, aggregate_id=v.submitted.aggregate_id, producer=PRODUCER, occurred_at=now,
                key=f"{v.attempt}/{job_id}", cause=waiting.waiting or waiting.submitted, attempt=v.attempt,
                for_job=job_id, for_queue=queue_name, flavor=flavor,
                message=f"queue {queue_name} needs its guaranteed {flavor} back for job {job_id}; "
                        f"{v.reserved.queue} borrowed {pool.borrowed(v.reserved.queue)}",
            )
            for v in chosen
        ]

    def _explain(self, job: QuotaJob, queue_name: str, position: int, pools: dict[tuple[str, str], Pool],
                 now: datetime) -> tuple[list[Event], str | None]:
        """The job's reason event (if it changed), and the flavor whose guaranteed quota is lent
        out when that is why it waits (a reclaim candidate)."""
        queue = self.state.queues[queue_name]
        nominal = [fq.flavor for fq in queue.quotas]
        flavors = [f for f in (job.spec.gpu_flavors or nominal) if f in nominal]
        for flavor in flavors:
            v = self.pool_of(pools, queue_name, flavor).check(queue_name, job.spec.total_gpus)
            if not v.fits:
                lent = flavor if v.reason == QuotaWaitReason.NOMINAL_LENT else None
                return self._reason(job, v.reason, v.message, position, flavor, now), lent
            return (self._reason(job, QuotaWaitReason.COHORT_EXHAUSTED,
                                 f"queue {queue_name} {flavor}: quota is being reclaimed in its cohort; "
                                 "no new borrowing until it completes", position, flavor, now), None)
        if not flavors:
            return self._reason(job, QuotaWaitReason.NO_QUOTA_FOR_FLAVOR,
                                f"queue {queue_name} has no quota for flavors {list(job.spec.gpu_flavors)}",
                                position, None, now), None
        return [], None

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
