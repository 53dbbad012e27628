"""Quota's pure core.

A job holds quota for one attempt from QuotaReserved until its attempt ends; the release is its
own event (QuotaReleased), so usage is a fold over the log. A queue uses its own nominal
(guaranteed) quota first, then borrows unused quota of its cohort within its borrowing limit and
the lenders' lending limits (:mod:`services.quota.capacity`). A job that allows several flavors
takes the first of them, in its order, that fits (flavor fungibility). On top of the pools, a
queue may cap its holding in weighted units across flavors and each priority class's share of its
nominal (:func:`services.quota.capacity.check_limits`). Usage and requests are counted in
thousandths of a GPU, so a fractional job (``gpu_milli``) holds its fraction of the quota.

Order inside a queue: priority (higher first), then the time the attempt was queued, then job
id. A strict-FIFO queue stops at a head that does not fit; otherwise smaller jobs behind it may go.
Across queues, heads are taken from the queue with the lowest weighted share first (usage over
nominal, both in weighted GPU units), so competing queues borrow in fair order.

A cycle (``_cycle``) runs in numbered phases over a snapshot of usage (:class:`Snapshot`):
heads, snapshot, reserve within nominal (pass 1), borrow in fair order (pass 2), then explain
and reclaim. Each phase returns its events; the usage in the state changes only when the log
returns them.

Every attempt that stays queued gets a structured reason with the numbers
(QuotaPendingReasonChanged), throttled by :mod:`runtime.waits`. Victims of reclaim and of
preemption within a queue are chosen by the shared, checkpoint-aware policy of
:mod:`runtime.victims`.

Retries are decided here too: a failed attempt whose reason is in the job's ``retry_on`` and
that has attempts left gets JobRetryScheduled and re-enters the queue after the backoff.
Preempted attempts are requeued the same way without using up an attempt.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sortedcontainers import SortedList

from runtime.policy import PolicyBook
from runtime.victims import SubmittedJob, VictimPolicy
from runtime.waits import throttle
from schemas import (
    CohortConfigured,
    Event,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointed,
    JobFailed,
    JobPreempted,
    JobRejected,
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
from schemas.priority import DEFAULT_PRIORITY_CLASSES, PolicyConfigured, PriorityClass
from services.quota.capacity import (MILLI, Limits, Pool, check_limits, flavor_weight, gpus_text, next_period,
                                     period_start)

PRODUCER = "quota"
NEVER_REFUSED = 1 << 62  # "no request of this size was refused yet"


@dataclass
class QuotaJob(SubmittedJob):
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
    reasons_given: int = 0  # reason events of this attempt in the log (the next one's id key)
    preemptible: bool = True
    started_at: datetime | None = None  # of the current attempt
    checkpoint_at: datetime | None = None  # latest checkpoint of the current attempt
    reclaim: ReclaimRequested | None = None  # asked to give the current attempt's quota back
    order_key: tuple | None = None  # its key in the queue's pending order while it waits
    flavors: tuple[QueueConfigured, tuple[str, ...]] | None = None  # usable flavors, for that queue config

    def queue_order(self) -> tuple:
        """Order inside a queue: priority (higher first), then queued time, then job id."""
        return (-self.priority, self.queued_at, self.submitted.aggregate_id)

    # The rest of what the victim policy (runtime.victims.Attempt) reads of an attempt holding quota.
    @property
    def stopping(self) -> bool:
        return self.reclaim is not None or self.finished

    @property
    def held_gpus(self) -> float:
        return self.reserved.milli_held / MILLI  # type: ignore[union-attr]

    @property
    def held_since(self) -> datetime:
        return self.reserved.occurred_at  # type: ignore[union-attr]

    @property
    def preemptions(self) -> None:
        """Quota keeps no count: reclaiming lent quota is not limited by a class's budget."""
        return None


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
    used: dict[tuple[str, str], int] = field(default_factory=dict)  # (queue, flavor) -> thousandths of a GPU
    # (queue, priority class, flavor) -> thousandths its attempts hold: what a queue's class limits count
    class_used: dict[tuple[str, str, str], int] = field(default_factory=dict)
    # queue -> (order key, job id) of the jobs waiting for quota, kept in queue order
    pending: dict[str, SortedList] = field(default_factory=dict)
    holders: dict[str, set[str]] = field(default_factory=dict)  # queue -> job ids holding a reservation
    to_release: dict[str, None] = field(default_factory=dict)  # jobs whose attempt ended
    policy: PolicyBook = field(default_factory=PolicyBook)


@dataclass
class Snapshot:
    """What one cycle decides against: the state's usage, copied when the cycle starts and
    charged with each reservation the cycle makes (the state changes only when the log returns
    them), the pools over that usage, and what the cycle learns on the way."""

    used: dict[tuple[str, str], int]  # (queue, flavor) -> thousandths of a GPU
    pools: dict[tuple[str, str], Pool]  # (pool key, flavor) -> Pool over ``used``
    # (pool key, flavor) where nobody borrows this cycle -> why, as a reason tells it: quota is
    # being preempted there, or a queue of it waits for its own lent-out quota (pass 1 adds those).
    no_borrowing: dict[tuple[str, str], str]
    spent: dict[str, float] = field(default_factory=dict)  # budget used this period, per queue
    # (queue, priority class, flavor) -> thousandths, copied and charged like ``used``
    class_used: dict[tuple[str, str, str], int] = field(default_factory=dict)
    taken: set[str] = field(default_factory=set)  # jobs reserved in this cycle
    charged_in: set[tuple[str, str]] = field(default_factory=set)  # (pool key, flavor) this cycle reserved in


@dataclass(frozen=True)
class Blocker:
    """The highest-priority job of a queue that was refused quota in this cycle and could fit
    once enough is freed: the queue's jobs of lower priority on its flavors wait behind it, so
    that what is freed collects for it instead of going, a GPU at a time, to smaller jobs of
    lower priority (docs/quota.md, "Priority before size")."""

    job: QuotaJob
    flavors: frozenset[str]

    def holds_back(self, job: QuotaJob, flavors: tuple[str, ...]) -> bool:
        return job.priority < self.job.priority and not self.flavors.isdisjoint(flavors)

    def reason(self, queue_name: str) -> tuple[QuotaWaitReason, str]:
        head = self.job
        return (QuotaWaitReason.BLOCKED_BY_HEAD,
                f"job {head.submitted.aggregate_id} of queue {queue_name} (priority {head.priority}, "
                f"{gpus_text(head.spec.total_milli)} GPUs) waits for quota first: jobs of lower priority on its flavors "
                "wait behind it")


@dataclass
class QueueTurn:
    """A queue's place in pass 2."""

    waiting: list[QuotaJob]
    cursor: int = 0
    ahead: int = 0  # jobs of the queue before the cursor that still wait
    failed: dict[tuple[str, ...], int] = field(default_factory=dict)  # flavors -> smallest refused request
    blocker: Blocker | None = None


@dataclass
class ReclaimRound:
    """Preemptions asked in one cycle. Each is decided against a trial pool that counts the
    preemptions under way and those asked earlier in the cycle as done (their victims gone, the
    jobs they are for holding their quota)."""

    served: set[str]  # jobs whose victims are stopping
    victims: dict[tuple[str, str], list[QuotaJob]] = field(default_factory=dict)  # per pool, best first
    trials: dict[tuple[str, str], Pool] = field(default_factory=dict)
    hopeless: dict[tuple[str, str, str, int], int] = field(default_factory=dict)  # smallest request that found too few
    asked: set[str] = field(default_factory=set)  # victims asked in this cycle


Refused = tuple[QuotaJob, str, int, tuple[str, ...]]  # (job, queue, position, flavors)
Held = tuple[QuotaWaitReason, str, str | None]  # why a job waits whatever the quota: (reason, message, flavor)


class QuotaCore:
    def __init__(self, priority_classes: Mapping[str, PriorityClass] = DEFAULT_PRIORITY_CLASSES) -> None:
        self.state = QuotaState(policy=PolicyBook.starting_with(dict(priority_classes)))
        self.victim_policy = VictimPolicy(self.state.policy.known)
        self._dirty = True  # something changed that could let a pending job in
        self._wake_at: datetime | None = None  # the earliest time a waiting job's answer may change

    def _wake(self, at: datetime) -> None:
        self._wake_at = at if self._wake_at is None else min(self._wake_at, at)

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
        if isinstance(event, (QueueConfigured, QueueDeleted, CohortConfigured)):
            self._configure(event)
        elif isinstance(event, PolicyConfigured):
            s.policy.apply(event)
            self.victim_policy = VictimPolicy(s.policy.known)
            self._dirty = True
        elif isinstance(event, JobSubmitted):
            s.jobs[event.aggregate_id] = QuotaJob(spec=event.spec, submitted=event)
        elif (job := s.jobs.get(event.aggregate_id)) is not None:
            if isinstance(event, (JobSucceeded, JobCancelled, JobFailed, JobPreempted)):
                self._ended(event.aggregate_id, job, event)
            else:
                self._evolve_job(event.aggregate_id, job, event)
            rejected = isinstance(event, JobRejected)  # refused after submission: never admitted
            if rejected or (job.finished and job.reserved is None and event.aggregate_id not in s.to_release):
                self._forget(event.aggregate_id, job)

    def _forget(self, job_id: str, job: QuotaJob) -> None:
        """A job quota has nothing more to decide for (finished, its quota given back) leaves the
        state, so the state holds live work only and a snapshot's size does not grow with history.
        Later events for it change nothing (job ids are never reused)."""
        self._dequeue(job_id, job)
        del self.state.jobs[job_id]

    def _configure(self, event: QueueConfigured | QueueDeleted | CohortConfigured) -> None:
        s = self.state
        if isinstance(event, QueueConfigured):
            s.queues[event.name] = event
        elif isinstance(event, QueueDeleted):
            s.queues.pop(event.name, None)
        else:
            s.cohorts[event.name] = event.parent
            s.cohort_config[event.name] = event
        self._dirty = True

    def _evolve_job(self, job_id: str, job: QuotaJob, event: Event) -> None:
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
                self.state.used[key] = self.state.used.get(key, 0) + event.milli_held
                by_class = (event.queue, job.spec.priority_class, event.flavor)
                self.state.class_used[by_class] = self.state.class_used.get(by_class, 0) + event.milli_held
                self.state.holders.setdefault(event.queue, set()).add(job_id)
                self._dequeue(job_id, job)
            case QuotaReleased():
                self._released(job_id, job, event)
            case JobRetryScheduled():
                job.attempt = event.next_attempt
                job.waiting, job.reasons_given = None, 0
                job.started_at = job.checkpoint_at = None
                job.reclaim = None
                job.not_before = event.not_before
                job.queued_at = event.occurred_at
                job.ended = None
                self.state.to_release.pop(job_id, None)
                self._enqueue(job_id, job)
            case QuotaPendingReasonChanged() if event.attempt == job.attempt:
                job.waiting = event
                job.reasons_given += 1
            case JobStarted() if event.attempt == job.attempt:
                job.started_at = event.occurred_at
            case JobCheckpointed() if event.attempt == job.attempt:
                if job.checkpoint_at is None or event.checkpointed_at > job.checkpoint_at:
                    job.checkpoint_at = event.checkpointed_at
            case ReclaimRequested() if event.attempt == job.attempt:
                job.reclaim = event
            case JobCancelRequested():
                job.cancel_requested = True
                if self._dequeue(job_id, job):
                    self._dirty = True  # it may have been the head blocking a strict-FIFO queue

    def _released(self, job_id: str, job: QuotaJob, event: QuotaReleased) -> None:
        s = self.state
        if job.reserved is not None and job.reserved.attempt == event.attempt:
            key = (event.queue, event.flavor)
            self._age_history(event.queue, event.occurred_at)
            self._charge_budget(job.reserved, event.occurred_at)
            s.used[key] = s.used.get(key, 0) - event.milli_released
            by_class = (event.queue, job.spec.priority_class, event.flavor)
            s.class_used[by_class] = s.class_used.get(by_class, 0) - event.milli_released
            s.holders.get(event.queue, set()).discard(job_id)
            job.reserved = None
            self._dirty = True
        if job.finished:
            s.to_release.pop(job_id, None)

    def _ended(self, job_id: str, job: QuotaJob, event: Event) -> None:
        """An attempt ended (or the job was cancelled): whether another attempt follows is
        decided here; the release and the retry are decided in the next cycle."""
        if isinstance(event, JobCancelled):
            job.ended, job.finished = event, True
            if self._dequeue(job_id, job):
                self._dirty = True  # it may have been the head blocking a strict-FIFO queue
            self._attempt_ended(job_id, job)
            return
        if event.attempt != job.attempt:  # type: ignore[attr-defined]
            return
        job.ended = event
        if isinstance(event, JobSucceeded):
            job.finished = True
        elif isinstance(event, JobFailed):
            job.failures += 1
            retry = job.spec.retry.retries(event.reason, event.retryable, job.failures)
            job.finished = not retry or job.cancel_requested
        else:  # preempted: requeued unless a cancel was asked
            job.finished = job.cancel_requested
        self._attempt_ended(job_id, job)

    def decisions_refused(self) -> None:
        """Some decisions were not recorded (conflict or transient error): decide again."""
        self._dirty = True

    def next_wake(self) -> datetime | None:
        """The earliest time a decision may change with no new event (a protection window or a
        backoff ending): a driver on a virtual clock (``gpusched whatif``) steps to it."""
        return self._wake_at

    def snapshot_state(self) -> QuotaState:
        return self.state

    def restore_state(self, state: QuotaState) -> None:
        self.state = state
        self.victim_policy = VictimPolicy(state.policy.known)
        self._dirty, self._wake_at = True, None
        for job in state.jobs.values():
            job.flavors = None  # a cache the cycle fills

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
            out.extend(self._cycle(now))
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
                    gpus=r.gpus, gpu_milli=r.gpu_milli, reason=ended.type if ended is not None else "unknown",
                )
            )
        if ended is not None and not job.finished and isinstance(ended, (JobFailed, JobPreempted)):
            backoff = job.spec.retry.backoff_for(job.failures) if isinstance(ended, JobFailed) else 0.0
            out.append(
                new_event(
                    JobRetryScheduled, aggregate_id=job_id, producer=PRODUCER, occurred_at=now,
                    key=f"{job.attempt}", cause=ended, failed_attempt=job.attempt,
                    next_attempt=job.attempt + 1, not_before=now + timedelta(seconds=backoff), after=ended.type,
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
                pool.limits[name] = Limits.in_milli(fq.nominal, fq.borrowing_limit, fq.lending_limit)
                pool.used[name] = used.get((name, fq.flavor), 0)
        return pools

    def pool_key(self, queue: str) -> str:
        """The root cohort of the queue, or ``queue:<name>`` for a queue outside any cohort."""
        root = self.root_cohort(self.state.queues[queue].cohort)
        return root if root is not None else f"queue:{queue}"

    def pool_of(self, pools: dict[tuple[str, str], Pool], queue: str, flavor: str) -> Pool | None:
        return pools.get((self.pool_key(queue), flavor))

    # -- GPU-hour budgets ----------------------------------------------------------------------
    def _weight(self, queue: str, flavor: str) -> float:
        return flavor_weight(self.state.queues.get(queue), flavor)

    def _charge_budget(self, r: QuotaReserved, released_at: datetime) -> None:
        """Fold a released reservation's weighted GPU-seconds, within the current period, into
        what its queue has spent."""
        queue = self.state.queues.get(r.queue)
        if queue is None or queue.budget is None:
            return
        start = period_start(queue.budget.period, released_at)
        prev_start, spent = self.state.spent.get(r.queue, (start, 0.0))
        if prev_start != start:
            spent = 0.0
        held = (released_at - max(r.occurred_at, start)).total_seconds()
        gpus = r.milli_held / MILLI
        self.state.spent[r.queue] = (start, spent + max(0.0, held) * gpus * self._weight(r.queue, r.flavor))

    def budget_spent(self, queue: QueueConfigured, now: datetime) -> float:
        """Weighted GPU-hours the queue has used or committed this period: released reservations,
        plus for each one still held the longer of its time so far and its declared runtime."""
        start = period_start(queue.budget.period, now)
        prev_start, spent = self.state.spent.get(queue.name, (start, 0.0))
        seconds = spent if prev_start == start else 0.0
        for j in (self.state.jobs[i] for i in self.state.holders.get(queue.name, ())):
            r = j.reserved
            if r is not None:
                held = max((now - max(r.occurred_at, start)).total_seconds(), j.spec.expected_runtime_seconds or 0)
                seconds += max(0.0, held) * r.milli_held / MILLI * self._weight(r.queue, r.flavor)
        return seconds / 3600

    def _over_budget(self, queue: QueueConfigured, job: QuotaJob, weight: float, spent: float,
                     now: datetime) -> str | None:
        b = queue.budget
        planned = job.spec.total_milli / MILLI * weight * (job.spec.expected_runtime_seconds or 0) / 3600
        if spent + planned <= b.gpu_hours and spent < b.gpu_hours:
            return None
        start = period_start(b.period, now)
        until = next_period(b.period, start)
        self._wake(until)
        return (f"queue {queue.name} has used or committed {spent:.1f} of its {b.gpu_hours:g} GPU-hours this {b.period} "
                f"(since {start.date().isoformat()}); this job plans {planned:.1f} more; the budget renews "
                f"{until.isoformat()}")

    def _half_life(self, queue: QueueConfigured | None) -> tuple[float | None, float]:
        root = self.root_cohort(queue.cohort) if queue is not None else None
        config = self.state.cohort_config.get(root) if root is not None else None
        return (config.usage_half_life_seconds, config.history_weight) if config is not None else (None, 0.0)

    def _weighted_usage(self, queue: QueueConfigured, used: dict[tuple[str, str], int]) -> float:
        return sum(used.get((queue.name, fq.flavor), 0) * fq.weight for fq in queue.quotas) / MILLI

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

    # -- the cycle ---------------------------------------------------------------------------
    def _cycle(self, now: datetime) -> list[Event]:
        """One quota cycle (docs/quota.md), in numbered phases:

        1. heads: each queue's waiting jobs in queue order (jobs of a deleted queue are told so);
        2. snapshot: usage copied from the state, the pools over it, the pools closed to borrowing;
        3. reserve (pass 1): every job that fits in its queue's unused nominal, queues in fair
           order, so reclaimed quota reaches its owner and a borrower never takes what a queue's
           own job could use this cycle;
        4. borrow (pass 2): the rest, borrowing allowed, one job at a time from the queue with the
           lowest weighted share;
        5. explain and reclaim: every job still waiting is told why, against the usage after this
           cycle's reservations (the state the log will hold), and reclaims are asked."""
        self._wake_at = None
        heads, out = self._heads(now)
        snap = self._snapshot()
        out.extend(self._reserve_nominal(snap, heads, now))
        borrowed, refused = self._borrow(snap, heads, now)
        out.extend(borrowed)
        out.extend(self._explain_and_reclaim(snap, refused, now))
        return out

    def _heads(self, now: datetime) -> tuple[dict[str, list[QuotaJob]], list[Event]]:
        """Phase 1: queue -> its waiting jobs in queue order; and the reasons of the jobs whose
        queue was deleted."""
        s = self.state
        heads: dict[str, list[QuotaJob]] = {}
        out: list[Event] = []
        for queue_name, entries in s.pending.items():
            waiting = [s.jobs[j] for _, j in entries if not s.jobs[j].cancel_requested]
            if not waiting:
                continue
            if queue_name not in s.queues:
                for position, job in enumerate(waiting, start=1):
                    out.extend(self._reason(job, QuotaWaitReason.QUEUE_MISSING,
                                            f"queue {queue_name} no longer exists", position, None, now))
                continue
            heads[queue_name] = waiting
        return heads, out

    def _snapshot(self) -> Snapshot:
        """Phase 2. No new borrowing in a pool while quota is being preempted there: that quota
        goes to the job it is freed for, not to the next borrower (no reclaim loops)."""
        used = dict(self.state.used)
        no_borrowing = {(self.pool_key(j.reserved.queue), j.reserved.flavor): "quota is being reclaimed there"
                        for j in self._holding() if j.reclaim is not None and j.reserved.queue in self.state.queues}
        return Snapshot(used, self.pools(used), no_borrowing, class_used=dict(self.state.class_used))

    def _reserve_nominal(self, snap: Snapshot, heads: dict[str, list[QuotaJob]], now: datetime) -> list[Event]:
        """Phase 3 (pass 1): own nominal quota only. Within a queue the smallest request that did
        not fit is remembered per flavor list: usage only grows during a pass, so a larger one
        cannot fit."""
        s = self.state
        out: list[Event] = []
        for queue_name in sorted(heads, key=lambda q: (self.share(s.queues[q], snap.used, now), q)):
            queue = s.queues[queue_name]
            failed: dict[tuple[str, ...], int] = {}
            blocker: Blocker | None = None
            for job in heads[queue_name]:
                flavors, held = self._admissible(snap, job, queue, now)
                if held is not None:
                    continue
                if blocker is not None and blocker.holds_back(job, flavors):
                    continue
                need = job.spec.total_milli
                if need < failed.get(flavors, NEVER_REFUSED):
                    if (reserved := self._try_reserve(snap, job, queue, flavors, False, now)) is not None:
                        out.append(reserved)
                        continue
                    if queue.preemption.reclaim_within_cohort != "never":
                        self._hold_lent_quota(snap, queue_name, flavors, need)
                blocker = blocker or self._blocker(snap, job, queue_name, flavors)
                failed[flavors] = min(failed.get(flavors, NEVER_REFUSED), need)
                if queue.strict_fifo:
                    break
        return out

    def _blocker(self, snap: Snapshot, job: QuotaJob, queue_name: str, flavors: tuple[str, ...]) -> Blocker | None:
        """The refused job as its queue's blocker, if some flavor could ever hold it (a job too
        large for any holds nobody back)."""
        need = job.spec.total_milli
        if job.spec.gpus == 0 or not any(self.pool_of(snap.pools, queue_name, f).ceiling(queue_name) >= need
                                         for f in flavors):
            return None
        return Blocker(job, frozenset(flavors))

    def _hold_lent_quota(self, snap: Snapshot, queue_name: str, flavors: tuple[str, ...], need: int) -> None:
        """The lent quota a job waits for is held for its owner: nobody borrows it this cycle."""
        for flavor in flavors:
            if self.pool_of(snap.pools, queue_name, flavor).check(queue_name, need).reason == QuotaWaitReason.NOMINAL_LENT:
                why = f"queue {queue_name} waits for its own {flavor} quota, lent out, and takes what is freed first"
                snap.no_borrowing.setdefault((self.pool_key(queue_name), flavor), why)

    def _borrow(self, snap: Snapshot, heads: dict[str, list[QuotaJob]],
                now: datetime) -> tuple[list[Event], list[Refused]]:
        """Phase 4 (pass 2): borrowing allowed, in fair order: the queue with the lowest share
        takes its next job. Jobs that do not get quota change nothing, so a queue keeps its turn
        until one of its jobs is reserved (then its share is recomputed) or it has none left.
        Returns the events and the jobs refused, in the order they were."""
        queues = self.state.queues
        heap = [(self.share(queues[q], snap.used, now), q) for q in heads]
        heapq.heapify(heap)
        turns = {q: QueueTurn(waiting) for q, waiting in heads.items()}
        out: list[Event] = []
        refused: list[Refused] = []
        while heap:
            _, queue_name = heapq.heappop(heap)
            events, reserved = self._borrow_turn(snap, queues[queue_name], turns[queue_name], refused, now)
            out.extend(events)
            if reserved:
                heapq.heappush(heap, (self.share(queues[queue_name], snap.used, now), queue_name))
        return out, refused

    def _borrow_turn(self, snap: Snapshot, queue: QueueConfigured, turn: QueueTurn, refused: list[Refused],
                     now: datetime) -> tuple[list[Event], bool]:
        """A queue's turn in pass 2: its waiting jobs from the cursor until one is reserved (True)
        or none is left, or a strict-FIFO head does not fit (False)."""
        out: list[Event] = []
        while turn.cursor < len(turn.waiting):
            job = turn.waiting[turn.cursor]
            turn.cursor += 1
            if job.submitted.aggregate_id in snap.taken:
                continue
            position = turn.ahead + 1
            flavors, held = self._admissible(snap, job, queue, now)
            if held is not None:
                turn.ahead += 1
                out.extend(self._reason(job, held[0], held[1], position, held[2], now))
                continue
            if turn.blocker is not None and turn.blocker.holds_back(job, flavors):
                # It keeps the reason it had (quota short, most often): heads of higher priority
                # come and go all the time, and a reason that followed them would be an event
                # per waiting job each time. A job not told anything yet is told this.
                turn.ahead += 1
                if job.waiting is None:
                    out.extend(self._reason(job, *turn.blocker.reason(queue.name), position, None, now))
                continue
            need = job.spec.total_milli
            if need < turn.failed.get(flavors, NEVER_REFUSED) and (
                    reserved := self._try_reserve(snap, job, queue, flavors, True, now)) is not None:
                out.append(reserved)
                return out, True
            turn.blocker = turn.blocker or self._blocker(snap, job, queue.name, flavors)
            turn.failed[flavors] = min(turn.failed.get(flavors, NEVER_REFUSED), need)
            turn.ahead += 1
            refused.append((job, queue.name, position, flavors))
            if queue.strict_fifo:
                out.extend(self._blocked_behind(snap, queue.name, turn, job, position, now))
                return out, False
        return out, False

    def _blocked_behind(self, snap: Snapshot, queue_name: str, turn: QueueTurn, head: QuotaJob, position: int,
                        now: datetime) -> list[Event]:
        out: list[Event] = []
        message = (f"queue {queue_name} is strict FIFO and its head {head.submitted.aggregate_id} "
                   f"({gpus_text(head.spec.total_milli)} GPUs) does not fit")
        for other in turn.waiting[turn.cursor:]:
            if other.submitted.aggregate_id in snap.taken:
                continue
            position += 1
            out.extend(self._reason(other, QuotaWaitReason.BLOCKED_BY_HEAD, message, position, None, now))
        return out

    def _flavors_of(self, job: QuotaJob, queue: QueueConfigured) -> tuple[str, ...]:
        """The job's flavors, in its order, that the queue has quota for (kept on the job until
        the queue is reconfigured)."""
        if job.flavors is None or job.flavors[0] is not queue:
            nominal = [fq.flavor for fq in queue.quotas]
            job.flavors = (queue, tuple(f for f in (job.spec.gpu_flavors or nominal) if f in nominal))
        return job.flavors[1]

    def _admissible(self, snap: Snapshot, job: QuotaJob, queue: QueueConfigured,
                    now: datetime) -> tuple[tuple[str, ...], Held | None]:
        """The job's flavors it may take now and, when it waits whatever the quota, why: a retry
        in its backoff, a queue over its budget, or each of its flavors over the queue's weighted
        limit or its class's limit (told by its first flavor). A job held back holds nobody
        back: these limits are the job's own (a smaller job, or one of another class, may fit),
        so it neither stops a strict-FIFO queue nor becomes its queue's blocker."""
        flavors = self._flavors_of(job, queue)
        if job.not_before is not None and job.not_before > now:
            self._wake(job.not_before)
            return flavors, (QuotaWaitReason.RETRY_BACKOFF,
                             f"retry of attempt {job.attempt - 1} waits until {job.not_before.isoformat()}", None)
        if queue.budget is not None and flavors:
            spent = snap.spent.setdefault(queue.name, self.budget_spent(queue, now))
            if (over := self._over_budget(queue, job, self._weight(queue.name, flavors[0]), spent, now)):
                return flavors, (QuotaWaitReason.BUDGET_EXHAUSTED, over, None)
        if not flavors or (queue.weighted_limit is None and not queue.class_limits):
            return flavors, None
        held = {fq.flavor: snap.used.get((queue.name, fq.flavor), 0) for fq in queue.quotas}
        cls = job.spec.priority_class
        verdicts = [check_limits(queue, f, job.spec.total_milli, cls, held, snap.class_used.get((queue.name, cls, f), 0))
                    for f in flavors]
        within = tuple(f for f, v in zip(flavors, verdicts) if v.fits)
        if within:
            return within, None
        return flavors, (verdicts[0].reason, verdicts[0].message, flavors[0])

    def _try_reserve(self, snap: Snapshot, job: QuotaJob, queue: QueueConfigured, flavors: tuple[str, ...],
                     borrow: bool, now: datetime) -> QuotaReserved | None:
        """The reservation of the first of the job's flavors that fits (without borrowing unless
        ``borrow``), charged to the snapshot; None if none fits."""
        need = job.spec.total_milli
        for flavor in flavors:
            pool = self.pool_of(snap.pools, queue.name, flavor)
            v = pool.check(queue.name, need)
            if not v.fits or (v.borrowed and (not borrow or (self.pool_key(queue.name), flavor) in snap.no_borrowing)):
                continue
            pool.charge(queue.name, need)
            snap.used[(queue.name, flavor)] = snap.used.get((queue.name, flavor), 0) + need
            by_class = (queue.name, job.spec.priority_class, flavor)
            snap.class_used[by_class] = snap.class_used.get(by_class, 0) + need
            snap.charged_in.add((self.pool_key(queue.name), flavor))
            if queue.name in snap.spent:  # the budget check of the next head counts this one's plan
                snap.spent[queue.name] += need / MILLI * self._weight(queue.name, flavor) * (
                    job.spec.expected_runtime_seconds or 0) / 3600
            snap.taken.add(job.submitted.aggregate_id)
            return new_event(
                QuotaReserved, aggregate_id=job.submitted.aggregate_id, producer=PRODUCER, occurred_at=now,
                key=f"{job.attempt}", cause=job.submitted, attempt=job.attempt, queue=queue.name,
                flavor=flavor, **_amounts(need, v.borrowed, fractional=job.spec.gpu_milli is not None),
            )
        return None

    def _explain_and_reclaim(self, snap: Snapshot, refused: list[Refused], now: datetime) -> list[Event]:
        """Phase 5: each refused job's reason, then the preemptions that would let it in (none
        for a job whose victims are already stopping)."""
        served = {j.reclaim.for_job for j in self._holding() if j.reclaim is not None}
        rr = ReclaimRound(served)
        verdicts: dict = {}
        out: list[Event] = []
        for job, queue_name, position, flavors in refused:
            events, lent_flavor = self._explain(job, queue_name, flavors, position, snap, now, verdicts)
            out.extend(events)
            if job.submitted.aggregate_id not in rr.served:
                out.extend(self._reclaim(snap, rr, job, queue_name, flavors, lent_flavor, now))
        return out

    def _reclaim(self, snap: Snapshot, rr: ReclaimRound, job: QuotaJob, queue_name: str, flavors: tuple[str, ...],
                 lent_flavor: str | None, now: datetime) -> list[Event]:
        """ReclaimRequested for the victims that let ``job`` in: its lent-out quota back
        (``reclaim``), else room among its own queue's lower priorities (``priority``)."""
        policy = self.state.queues[queue_name].preemption
        if lent_flavor is not None and policy.reclaim_within_cohort != "never":
            flavors = (lent_flavor,)
        elif policy.within_queue != "lower-priority":
            return []
        root, need = self.pool_key(queue_name), job.spec.total_milli
        for flavor in flavors:
            kind = "reclaim" if flavor == lent_flavor else "priority"
            # One that found too few victims: a request as large, of no higher priority, would too.
            hopeless_key = (queue_name, flavor, kind, job.priority)
            if need >= rr.hopeless.get(hopeless_key, NEVER_REFUSED):
                continue
            pool = self.pool_of(snap.pools, queue_name, flavor)
            if (root, flavor) not in rr.victims:
                rr.victims[(root, flavor)] = self._victims(flavor, pool, now)
                rr.trials[(root, flavor)] = self._after_preemptions(pool, flavor)
            candidates = _candidates(rr.victims[(root, flavor)], job, queue_name, kind,
                                     policy.reclaim_within_cohort == "any", rr.asked)
            found = self._preempt_for(job, queue_name, flavor, pool, rr.trials[(root, flavor)], candidates, kind, now)
            if found is not None:
                asked, rr.trials[(root, flavor)] = found
                rr.asked.update(e.aggregate_id for e in asked)
                return asked
            rr.hopeless[hopeless_key] = min(rr.hopeless.get(hopeless_key, NEVER_REFUSED), need)
            if (root, flavor) in snap.charged_in:
                # Victims are attempts the log holds; this cycle's reservations are not among
                # them yet. Look again once they are.
                self._dirty = True
        return []

    def _holding(self):
        return (self.state.jobs[i] for ids in self.state.holders.values() for i in ids)

    def _victims(self, flavor: str, pool: Pool, now: datetime) -> list[QuotaJob]:
        """Attempts holding quota of ``flavor`` in a pool that may be preempted now, best victim
        first, by the shared policy (:mod:`runtime.victims`; the core wakes when a protection
        window that kept one out ends)."""
        holders = (self.state.jobs[i] for q in pool.limits for i in self.state.holders.get(q, ()))
        ranking = self.victim_policy.rank(
            (j for j in holders if j.reserved is not None and j.reserved.flavor == flavor), now)
        if ranking.wake_at is not None:
            self._wake(ranking.wake_at)
        return ranking.victims

    def _after_preemptions(self, pool: Pool, flavor: str) -> Pool:
        """A copy of ``pool`` as it will be once the preemptions under way in it are done: the
        victims' quota released and each job they are for holding its request."""
        trial = pool.copy()
        served: set[str] = set()
        for q in pool.limits:
            for j in (self.state.jobs[i] for i in self.state.holders.get(q, ())):
                if j.reclaim is None or j.reserved.flavor != flavor:
                    continue
                trial.charge(q, -j.reserved.milli_held)
                for_job = self.state.jobs.get(j.reclaim.for_job)
                if (for_job is not None and j.reclaim.for_job not in served and for_job.reserved is None
                        and not for_job.finished and for_job.queue in pool.limits):
                    served.add(j.reclaim.for_job)
                    trial.charge(for_job.queue, for_job.spec.total_milli)
        return trial

    def _preempt_for(self, waiting: QuotaJob, queue_name: str, flavor: str, pool: Pool, trial: Pool,
                     candidates: list[QuotaJob], kind: str, now: datetime) -> tuple[list[Event], Pool] | None:
        """ReclaimRequested for the fewest of ``candidates`` (best victim first) whose release
        lets ``waiting`` fit in ``trial``, and ``trial`` as it will be then (victims gone,
        ``waiting`` holding its request); no events if it fits there already; None if all of
        them together would not be enough."""
        need = waiting.spec.total_milli
        after = trial.copy()
        chosen: list[QuotaJob] = []
        if not after.check(queue_name, need).fits:
            for j in candidates:
                if kind == "reclaim" and after.borrowed(j.reserved.queue) == 0:
                    continue  # its queue no longer borrows: what it holds now is its own guaranteed quota
                after.charge(j.reserved.queue, -j.reserved.milli_held)
                chosen.append(j)
                if after.check(queue_name, need).fits:
                    break
            else:
                return None  # not enough can be preempted now; the job keeps waiting
        after.charge(queue_name, need)
        return [self._reclaim_event(v, waiting, queue_name, flavor, pool, kind, now) for v in chosen], after

    def _reclaim_event(self, victim: QuotaJob, waiting: QuotaJob, queue_name: str, flavor: str, pool: Pool,
                       kind: str, now: datetime) -> ReclaimRequested:
        job_id, holder = waiting.submitted.aggregate_id, victim.reserved.queue  # type: ignore[union-attr]
        if kind == "reclaim":
            why = (f"queue {queue_name} needs its guaranteed {flavor} back for job {job_id}; {holder} borrowed "
                   f"{gpus_text(pool.borrowed(holder))}")
        else:
            why = (f"job {job_id} (priority {waiting.priority}) of queue {queue_name} needs {flavor} quota "
                   f"held by lower-priority work of the same queue; {holder} holds {gpus_text(pool.used.get(holder, 0))} "
                   f"(priority {victim.priority} here)")
        return new_event(
            ReclaimRequested, aggregate_id=victim.submitted.aggregate_id, producer=PRODUCER, occurred_at=now,
            key=f"{victim.attempt}/{job_id}", cause=waiting.waiting or waiting.submitted, attempt=victim.attempt,
            kind=kind, for_job=job_id, for_queue=queue_name, flavor=flavor, message=why,
            grace_seconds=self.victim_policy.grace_seconds(victim),  # its class's checkpoint window
        )

    def _explain(self, job: QuotaJob, queue_name: str, flavors: tuple[str, ...], position: int,
                 snap: Snapshot, now: datetime, cache: dict) -> tuple[list[Event], str | None]:
        """The job's reason event (if it changed), and the flavor whose guaranteed quota is lent
        out when that is why it waits (a reclaim candidate). ``cache`` holds the verdicts of this
        cycle's pools by (queue, flavors, request): jobs of the same shape share one."""
        shape = (queue_name, flavors, job.spec.total_milli)
        found = cache.get(shape)
        if found is None:
            found = cache[shape] = self._verdict(queue_name, flavors, job.spec, snap)
        reason, message, flavor, lent = found
        return self._reason(job, reason, message, position, flavor, now), lent

    def _verdict(self, queue_name: str, flavors: tuple[str, ...], spec: JobSpec,
                 snap: Snapshot) -> tuple[QuotaWaitReason, str, str | None, str | None]:
        """(reason, message, flavor, lent flavor) for a request that did not get quota, told by
        its first flavor, from the verdict of the cycle's snapshot after its reservations (the
        usage the log holds once they are in; usage only grows within a cycle, so a request
        refused earlier in the cycle is refused there too, and the message's numbers are the
        ones that verdict compared)."""
        if not flavors:
            return (QuotaWaitReason.NO_QUOTA_FOR_FLAVOR,
                    f"queue {queue_name} has no quota for flavors {list(spec.gpu_flavors)}", None, None)
        flavor = flavors[0]
        v = self.pool_of(snap.pools, queue_name, flavor).check(queue_name, spec.total_milli)
        if not v.fits:
            return v.reason, v.message, flavor, (flavor if v.reason == QuotaWaitReason.NOMINAL_LENT else None)
        # It fits the usage but was refused: borrowing is closed in its pool this cycle, for the
        # cause the snapshot recorded.
        why = snap.no_borrowing.get((self.pool_key(queue_name), flavor), "quota is being reclaimed there")
        return (QuotaWaitReason.COHORT_EXHAUSTED,
                f"queue {queue_name} {flavor}: would borrow {gpus_text(v.borrowed)}, but borrowing is closed in "
                f"its cohort this cycle: {why}", flavor, None)

    def _reason(self, job: QuotaJob, reason: QuotaWaitReason, message: str, position: int,
                flavor: str | None, now: datetime) -> list[Event]:
        """A QuotaPendingReasonChanged when the throttle (runtime.waits) lets it out; when it
        holds a changed message back, the core looks again once it may go."""
        verdict = throttle(job.waiting, reason, message, now)
        if not verdict.write:
            if verdict.recheck_at is not None:
                self._wake(verdict.recheck_at)
            return []
        return [
            new_event(
                QuotaPendingReasonChanged, aggregate_id=job.submitted.aggregate_id, producer=PRODUCER,
                # One id per reason given: a message that comes back to an earlier text is a new event.
                occurred_at=now, key=f"{job.attempt}/{job.reasons_given + 1}", cause=job.submitted,
                attempt=job.attempt, reason=reason, message=message, position=position, flavor=flavor,
            )
        ]


def _amounts(held: int, borrowed: int, fractional: bool) -> dict:
    """QuotaReserved's amounts from thousandths: whole GPUs, rounded up (what readers of gpus and
    borrowed have always summed), and the thousandths themselves for a fractional job, or where
    the borrowed part is not whole (a whole-GPU job can borrow what fractional ones left)."""
    return {"gpus": -(-held // MILLI), "borrowed": -(-borrowed // MILLI),
            "gpu_milli": held if fractional else None,
            "borrowed_milli": borrowed if fractional or borrowed % MILLI else None}


def _candidates(victims: list[QuotaJob], job: QuotaJob, queue_name: str, kind: str, any_priority: bool,
                asked: set[str]) -> list[QuotaJob]:
    """The victims ``job`` may take, in victim order: for ``reclaim`` other queues' attempts (of
    lower priority unless ``any_priority``), for ``priority`` its own queue's lower priorities;
    none asked already in this cycle."""
    if kind == "reclaim":
        return [v for v in victims if v.reserved.queue != queue_name and v.submitted.aggregate_id not in asked
                and (any_priority or v.priority < job.priority)]
    return [v for v in victims if v.reserved.queue == queue_name and v.priority < job.priority
            and v.submitted.aggregate_id not in asked]
