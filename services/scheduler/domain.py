"""Scheduler's pure core: which nodes and GPUs an attempt that holds quota runs on, which
lower-priority attempts make room for it, and why the others wait.

The cycle (``decide``), over the state folded from the log, in numbered phases:

1. heads (``_groups_to_decide``): attempts holding quota and not yet placed, in the quota
   service's order (priority, then reservation time, then job id), only in the groups (one per
   reserved flavor, one for CPU-only work) where something changed since the last cycle: new
   heads, capacity that grew (a release, a node added, updated or uncordoned: the flavor's
   *generation*), or a wake-up time that passed;
2. snapshot (``_snapshot``): a copy-on-write view of the inventory with the decisions still on
   their way to the log charged; each placement of the cycle is charged there too, so later
   heads see it. The inventory folded from the log changes only when the log returns the
   decisions, so a refused decision needs no undoing;
3. fit (``_fit``): each head that did not already fail at the current generation is placed by the
   policy (:mod:`services.scheduler.placement`); a request shape that failed once fails for the
   rest of the cycle without another search;
4. preempt (``_preempt``): a head that still does not fit, and outranks running attempts, gets
   room by PreemptionRequested of victims chosen by the shared policy
   (:mod:`runtime.victims`; bounded, see :class:`PreemptionLimits`);
5. explain (``_explain``): every head still waiting gets a structured reason with the numbers and
   an ETA (SchedulingPendingReasonChanged), throttled by :mod:`runtime.waits`.

Clusters (a platform of several, one executor each): a gang is placed, and makes room by
preemption, inside one cluster; independent attempts go to any. A cluster whose executor's
heartbeat (ClusterReported) stops for ``cluster_lost_after_s`` is declared lost (ClusterLost,
before the cycle): its nodes leave the inventory, and the executors end the attempts on them.

Each phase returns plain values (placements, victims, explanations); the events come out in head
order. A cycle therefore costs in proportion to the heads whose situation changed, not to all of
them. GPU device indices are assigned lowest first; no GPU is given to two attempts beyond its
capacity (whole GPUs to one, sharable GPUs up to 1000 thousandths in all).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sortedcontainers import SortedList

from runtime.policy import PolicyBook
from runtime.victims import SubmittedJob, VictimPolicy
from runtime.waits import throttle, told_recently
from schemas import (
    ClusterLost,
    ClusterReported,
    Event,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointed,
    JobFailed,
    JobPreempted,
    JobRejected,
    JobScheduled,
    JobSpec,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeAssignment,
    NodeLost,
    NodeRegistered,
    NodeUpdated,
    PreemptionRequested,
    QuotaReleased,
    QuotaReserved,
    ReclaimRequested,
    SchedulingPendingReasonChanged,
    SchedulingWaitReason,
    new_event,
)
from schemas.envelope import derive_event_id
from schemas.priority import DEFAULT_PRIORITY_CLASSES, PolicyConfigured, PriorityClass
from services.scheduler.fragmentation import FlavorFragmentation, measure
from services.scheduler.inventory import MILLI, Inventory, Node, whole_free_of
from services.scheduler.placement import (
    Policy,
    Request,
    Workload,
    best_node,
    choose_gpus,
    place_gang,
    shape_fits,
    static_ok,
)

PRODUCER = "scheduler"
CPU_GROUP = "*"  # heads of CPU-only work (gpus == 0): any node


@dataclass(frozen=True)
class PreemptionLimits:
    """Global limits on preemption; per-class limits live in the priority classes."""

    enabled: bool = True
    max_per_window: int = 20  # PreemptionRequested in any rolling window ...
    window_seconds: float = 300.0  # ... of this length
    max_heads_per_cycle: int = 8  # heads that may look for victims in one cycle


@dataclass
class SchedJob(SubmittedJob):
    spec: JobSpec
    submitted: JobSubmitted
    request: Request
    priority: int = 0
    preemptible: bool = True
    reservation: QuotaReserved | None = None
    placement: JobScheduled | None = None
    cancel_requested: bool = False
    started_at: datetime | None = None  # of the placed attempt
    checkpoint_at: datetime | None = None  # latest checkpoint of the placed attempt
    stop_requested: bool = False  # a preemption or reclaim of the placed attempt was requested
    preemptions: int = 0  # PreemptionRequested against this job, all attempts
    failures: int = 0  # attempts that failed (JobFailed of the placed attempt), as quota counts them
    waiting: SchedulingPendingReasonChanged | None = None  # last reason given for this attempt
    reasons_attempt: int = 0  # the attempt reasons_given counts for
    reasons_given: int = 0  # reason events of that attempt in the log (the next one's id key)
    tried_generation: int = -1  # the group's generation when it last failed to fit
    victims: set[tuple[str, int]] = field(default_factory=set)  # (job, attempt) being stopped for this head
    lost_nodes: set[str] = field(default_factory=set)  # placement nodes lost (NodeLost, ClusterLost) meanwhile

    # The rest of what the victim policy (runtime.victims.Attempt) reads.
    @property
    def stopping(self) -> bool:
        return self.stop_requested or self.cancel_requested

    @property
    def held_gpus(self) -> float:
        share = (self.spec.gpu_milli or MILLI) / MILLI
        return self.spec.gpus * share * self.spec.gang_size

    @property
    def held_since(self) -> datetime:
        return self.reservation.occurred_at  # type: ignore[union-attr]


@dataclass
class SchedulerState:
    inventory: Inventory = field(default_factory=Inventory)
    jobs: dict[str, SchedJob] = field(default_factory=dict)
    heads: dict[str, None] = field(default_factory=dict)  # reserved, not yet placed
    # group -> request shape -> head keys in head order
    groups: dict[str, dict[tuple, SortedList]] = field(default_factory=dict)
    running: dict[str | None, set[str]] = field(default_factory=dict)  # flavor -> placed job ids
    ends: dict[str | None, SortedList] = field(default_factory=dict)  # flavor -> (declared end, job id)
    sizes: dict[str | None, dict[int, int]] = field(default_factory=dict)  # flavor -> size class -> attempts
    # flavor -> (size class, CPU millicores, GPU models) -> attempts: fgd-spread/-balance's workload
    requests: dict[str | None, dict[tuple[int, int, frozenset[str]], int]] = field(default_factory=dict)
    preemption_times: list[datetime] = field(default_factory=list)  # of the latest PreemptionRequested
    policy: PolicyBook = field(default_factory=PolicyBook)
    clusters: dict[str, "ClusterHealth"] = field(default_factory=dict)  # by name, from their executors' reports

    @property
    def nodes(self) -> dict[str, Node]:
        return self.inventory.nodes


@dataclass
class ClusterHealth:
    """One cluster as its executor's heartbeats tell it."""

    last_report: datetime
    lost: ClusterLost | None = None  # declared lost, and not reported since


@dataclass
class Cycle:
    """What one cycle decides against: the inventory snapshot (the state's, with the cycle's
    placements and those still on their way to the log charged) and what is left of the
    preemption limits."""

    inventory: Inventory
    preempt_budget: int  # PreemptionRequested still allowed in the window
    preempt_tries: int  # heads that may still look for victims
    chosen_victims: set[str] = field(default_factory=set)
    lowest_running: dict[str, int] = field(default_factory=dict)  # group -> lowest running priority


@dataclass
class Explanation:
    """Why a head waits (phase 5): the reason code, the message with the numbers, and the numbers
    for the event's fields. The heads of one request shape share one per cycle (the same request
    against the same snapshot has the same answer): the first head told gets a new event, the
    others a copy of it that names them (:func:`_told_too`)."""

    reason: SchedulingWaitReason
    message: str
    numbers: dict[str, Any] = field(default_factory=dict)
    event: SchedulingPendingReasonChanged | None = None  # the first event written with it


class _Eligible(NamedTuple):
    """The nodes of one shape that meet a request's constraints (phase 5)."""

    whole_free: int  # whole free GPUs on each of them
    fits: bool  # one member's GPUs are free on each
    names: list[str]  # in name order


def _group(job: SchedJob) -> str:
    return CPU_GROUP if job.spec.gpus == 0 else job.reservation.flavor  # type: ignore[union-attr]


def _head_key(job: SchedJob) -> tuple:
    return (-job.priority, job.reservation.occurred_at, job.job_id)  # type: ignore[union-attr]


class SchedulerCore:
    def __init__(self, policy: Policy | str = Policy.BEST_FIT,
                 priority_classes: dict[str, PriorityClass] = DEFAULT_PRIORITY_CLASSES,
                 preemption: PreemptionLimits = PreemptionLimits(), *,
                 workload: dict[int, float] | Workload | None = None, explain: bool = True,
                 flavor_policies: dict[str, Policy] | None = None, cluster_lost_after_s: float = 90.0) -> None:
        """``workload``: a fixed workload distribution for FGD (size class -> probability; a
        negative class is a fraction in thousandths); None: learnt from the reservations.
        ``explain``: emit pending reasons (trace replay turns them off). ``flavor_policies``:
        a flavor's own placement policy, where it is not ``policy``. ``cluster_lost_after_s``:
        silence of a cluster's executor after which the cluster is lost."""
        self.state = SchedulerState()
        self.cluster_lost_after = timedelta(seconds=cluster_lost_after_s)
        self._first_cycle: datetime | None = None  # this process's first decide (a restart waits a full period)
        self._losing: set[str] = set()  # ClusterLost decided, not yet back from the log
        self._fixed_workload = (workload if isinstance(workload, Workload) or workload is None
                                else Workload(workload))
        self._workloads: dict[tuple[str | None, bool], tuple[int, Workload]] = {}
        self.explain = explain
        self.policy = Policy(policy)
        self.flavor_policies = {f: Policy(p) for f, p in (flavor_policies or {}).items()}
        self.state.policy = PolicyBook.starting_with(dict(priority_classes))
        self._default_limits = preemption  # in force until a policy sets the rate limit
        self._follow_policy()
        self._dirty: set[str] = set()  # groups to look at in the next cycle
        self._awaiting: dict[str, JobScheduled] = {}  # decided, not yet back from the log
        self._fresh: dict[str, dict[tuple, list[str]]] = {}  # heads added since the last cycle
        self._wake_at: datetime | None = None

    # -- evolve ------------------------------------------------------------------------------
    def _generation(self, group: str) -> int:
        gens = self.state.inventory.generation
        if group == CPU_GROUP:
            return sum(gens.values())
        return gens.get(group, 0)

    def _follow_policy(self) -> None:
        """The victim policy and preemption limits of the policy in the state."""
        policy = self.state.policy
        self.victim_policy = VictimPolicy(policy.known)
        rate = policy.preemption
        self.limits = self._default_limits if rate is None else replace(
            self._default_limits, enabled=rate.enabled, max_per_window=rate.max_per_window,
            window_seconds=rate.window_seconds)

    def _mark_all_dirty(self) -> None:
        self._dirty.update(self.state.groups)

    def decisions_refused(self) -> None:
        """Some decisions were not recorded: derive them again, looking at every group. The
        inventory never held them (cycles decide against a snapshot): nothing to undo."""
        self._awaiting.clear()
        self._losing.clear()
        for job in self.state.jobs.values():
            job.tried_generation = -1
        self._mark_all_dirty()

    def _lose(self, names: set[str]) -> None:
        """Nodes gone from the inventory. The attempts placed on them keep nothing there: should a
        node of that name register again before their end is in the log, ending them must not
        give back GPUs on it that new attempts hold."""
        s = self.state
        for name in names:
            s.inventory.lose(name)
        for job_ids in s.running.values():
            for job_id in job_ids:
                job = s.jobs[job_id]
                if job.placement is not None:
                    job.lost_nodes |= {a.node for a in job.placement.placement if a.node in names}

    def _charge(self, inventory: Inventory, job: SchedJob, placement: JobScheduled, sign: int) -> None:
        for a in placement.placement:
            if sign < 0 and a.node in job.lost_nodes:
                continue  # charged to a node since lost (and maybe registered again, fresh)
            inventory.charge(a.node, a.gpu_indices, a.gpu_milli, job.spec.cpu_millis, job.spec.memory_mib, sign)

    def _add_head(self, job: SchedJob) -> None:
        s = self.state
        s.heads[job.job_id] = None
        group = _group(job)
        shape = job.request.shape_key()
        s.groups.setdefault(group, {}).setdefault(shape, SortedList()).add(_head_key(job))
        self._fresh.setdefault(group, {}).setdefault(shape, []).append(job.job_id)
        job.tried_generation = -1
        self._dirty.add(group)

    def _drop_head(self, job: SchedJob) -> None:
        s = self.state
        s.heads.pop(job.job_id, None)
        if job.reservation is not None:
            shapes = s.groups.get(_group(job))
            if shapes is not None:
                shape = job.request.shape_key()
                keys = shapes.get(shape)
                if keys is not None:
                    keys.discard(_head_key(job))
                    if not keys:
                        del shapes[shape]

    def evolve(self, event: Event) -> None:
        s = self.state
        match event:
            case NodeRegistered() | NodeUpdated():
                old = s.inventory.nodes.get(event.node.name)
                s.inventory.upsert(event.node)
                self._dirty.update({CPU_GROUP, event.node.gpu_flavor or CPU_GROUP})
                if old is not None and old.info.gpu_flavor:
                    self._dirty.add(old.info.gpu_flavor)
                return
            case NodeLost():
                self._lose({event.name})
                return
            case ClusterReported():
                health = s.clusters.get(event.cluster)
                if health is None:
                    s.clusters[event.cluster] = ClusterHealth(event.occurred_at)
                elif event.occurred_at > health.last_report:
                    health.last_report = event.occurred_at
                    health.lost = None  # it reports again: its executor registers its nodes again
                return
            case ClusterLost():
                self._losing.discard(event.cluster)
                health = s.clusters.setdefault(event.cluster, ClusterHealth(event.last_report or event.occurred_at))
                if event.last_report is None or health.last_report <= event.last_report:
                    health.lost = event
                self._lose(set(event.nodes))
                return
            case JobSubmitted():
                s.jobs[event.aggregate_id] = SchedJob(spec=event.spec, submitted=event, request=Request.of(event.spec))
                return
            case PolicyConfigured():
                s.policy.apply(event)
                self._follow_policy()
                self._mark_all_dirty()
                return
        job = s.jobs.get(event.aggregate_id)
        if job is not None:
            self._evolve_job(job, event)
            if self._last_event(job, event):
                del s.jobs[event.aggregate_id]

    @staticmethod
    def _last_event(job: SchedJob, event: Event) -> bool:
        """Whether no attempt of the job follows this event (the rule quota applies to retries),
        so the scheduler forgets it: its state holds live work only, and a snapshot's size does
        not grow with history. Later events for it change nothing (job ids are never reused)."""
        match event:
            case JobSucceeded() | JobCancelled() | JobRejected():
                return True
            case JobFailed():
                return job.cancel_requested or not job.spec.retry.retries(event.reason, event.retryable, job.failures)
            case JobPreempted():
                return job.cancel_requested
        return False

    def _evolve_job(self, job: SchedJob, event: Event) -> None:
        s = self.state
        match event:
            case JobAdmitted():
                job.priority, job.preemptible = event.priority, event.preemptible
            case QuotaReserved():
                self._reserved(job, event)
            case JobScheduled():
                self._placed(job, event)
            case JobStarted():
                if job.placement is not None and job.placement.attempt == event.attempt:
                    job.started_at = event.occurred_at
                    if job.spec.expected_runtime_seconds is not None:
                        end = event.occurred_at + timedelta(seconds=job.spec.expected_runtime_seconds)
                        s.ends.setdefault(job.placement.flavor, SortedList()).add((end, job.job_id))
            case JobCheckpointed():
                if job.placement is not None and job.placement.attempt == event.attempt:
                    if job.checkpoint_at is None or event.checkpointed_at > job.checkpoint_at:
                        job.checkpoint_at = event.checkpointed_at
            case PreemptionRequested():
                job.preemptions += 1
                s.preemption_times.append(event.occurred_at)
                del s.preemption_times[:-self.limits.max_per_window or None]  # the window reads no more
                if job.placement is not None and job.placement.attempt == event.attempt:
                    job.stop_requested = True
                    if (head := s.jobs.get(event.for_job)) is not None:
                        head.victims.add((job.job_id, event.attempt))
            case ReclaimRequested():
                if job.placement is not None and job.placement.attempt == event.attempt:
                    job.stop_requested = True
            case SchedulingPendingReasonChanged():
                # Counted from the log per attempt, so the next reason gets a new id after a
                # restart or a second reservation of the same attempt alike.
                if event.attempt != job.reasons_attempt:
                    job.reasons_attempt, job.reasons_given = event.attempt, 0
                job.reasons_given += 1
                if job.reservation is not None and job.reservation.attempt == event.attempt:
                    job.waiting = event
            case JobSucceeded() | JobFailed() | JobPreempted() | JobCancelled():
                if isinstance(event, JobFailed) and job.placement is not None and job.placement.attempt == event.attempt:
                    job.failures += 1
                self._end_attempt(job)
            case QuotaReleased():
                # Quota was given back without the attempt running (e.g. cancelled while queued).
                if job.reservation is not None and job.reservation.attempt == event.attempt:
                    self._end_attempt(job)
            case JobCancelRequested():
                job.cancel_requested = True
                if job.placement is None:
                    self._drop_head(job)

    def _reserved(self, job: SchedJob, event: QuotaReserved) -> None:
        if job.cancel_requested:
            return
        if job.reservation is not None:
            self._drop_head(job)
        job.reservation = event
        job.waiting = None
        job.victims = set()
        if job.spec.gpus > 0:
            sizes = self.state.sizes.setdefault(event.flavor, {})
            sizes[job.request.size_class] = sizes.get(job.request.size_class, 0) + 1
            requests = self.state.requests.setdefault(event.flavor, {})
            key = (job.request.size_class, job.request.cpu, job.request.models)
            requests[key] = requests.get(key, 0) + 1
        self._add_head(job)

    def _placed(self, job: SchedJob, event: JobScheduled) -> None:
        s = self.state
        self._awaiting.pop(job.job_id, None)
        if job.placement is None or job.placement.event_id != event.event_id:
            self._drop_head(job)
            self._charge(s.inventory, job, event, +1)
        job.placement = event
        job.started_at = job.checkpoint_at = None
        job.stop_requested = False
        s.heads.pop(job.job_id, None)
        s.running.setdefault(event.flavor, set()).add(job.job_id)

    def _end_attempt(self, job: SchedJob) -> None:
        s = self.state
        self._awaiting.pop(job.job_id, None)
        if job.placement is not None:
            self._charge(s.inventory, job, job.placement, -1)
            s.running.get(job.placement.flavor, set()).discard(job.job_id)
            if job.started_at is not None and job.spec.expected_runtime_seconds is not None:
                end = job.started_at + timedelta(seconds=job.spec.expected_runtime_seconds)
                ends = s.ends.get(job.placement.flavor)
                if ends is not None:
                    ends.discard((end, job.job_id))
            self._dirty.update({CPU_GROUP, job.placement.flavor})
        self._drop_head(job)
        job.placement = None
        job.reservation = None
        job.started_at = job.checkpoint_at = None
        job.stop_requested = False
        job.victims = set()
        job.lost_nodes = set()

    # -- decide ------------------------------------------------------------------------------
    def decide(self, now: datetime) -> list[Event]:
        """One cycle: 1. heads, 2. snapshot, then per group 3. fit, 4. preempt, 5. explain. Any
        cluster lost comes first."""
        out: list[Event] = self._lost_clusters(now) if self.state.clusters else []
        if out:
            return out  # nothing placed on a cluster being lost: the next cycle decides without it
        groups = self._groups_to_decide(now)
        if not groups:
            return out
        cycle = self._snapshot(now)
        for group in groups:
            out.extend(self._decide_group(cycle, group, now))
        return out

    def _lost_clusters(self, now: datetime) -> list[Event]:
        """ClusterLost for each cluster silent for ``cluster_lost_after`` (counted from this
        process's first cycle at the earliest, so a platform that was down as a whole gives its
        executors a full period to report again)."""
        if self._first_cycle is None:
            self._first_cycle = now
        out: list[Event] = []
        for name, health in sorted(self.state.clusters.items()):
            if health.lost is not None or name in self._losing:
                continue
            if now - max(health.last_report, self._first_cycle) < self.cluster_lost_after:
                continue
            nodes = tuple(sorted(n for n, node in self.state.inventory.nodes.items() if node.info.cluster == name))
            silent = (now - health.last_report).total_seconds()
            self._losing.add(name)
            out.append(new_event(
                ClusterLost, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                key=f"lost-{health.last_report.isoformat()}", cluster=name, last_report=health.last_report,
                nodes=nodes, reason=f"no report from its executor for {silent:.0f} s (lost after "
                f"{self.cluster_lost_after.total_seconds():g} s)"))
        return out

    def _groups_to_decide(self, now: datetime) -> list[str]:
        """Phase 1: the groups whose heads may have a new answer (their flavor first, CPU-only
        work last). A wake-up time that passed makes every head worth another look."""
        if self._wake_at is not None and self._wake_at <= now:
            self._wake_at = None
            for job in self.state.jobs.values():
                job.tried_generation = -1
            self._mark_all_dirty()
        dirty, self._dirty = self._dirty, set()
        return sorted(g for g in dirty if g != CPU_GROUP) + ([CPU_GROUP] if CPU_GROUP in dirty else [])

    def _snapshot(self, now: datetime) -> Cycle:
        """Phase 2: the inventory as the log will hold it once the decisions on their way there
        are in, and the preemption limits left for this cycle."""
        tries = self.limits.max_heads_per_cycle if self.limits.enabled else 0
        return Cycle(self._decided_inventory(), self._preemption_budget(now), tries)

    def _decided_inventory(self) -> Inventory:
        """A snapshot of the inventory with the decisions on their way to the log charged."""
        inventory = self.state.inventory.snapshot()
        for job_id, placement in self._awaiting.items():
            self._charge(inventory, self.state.jobs[job_id], placement, +1)
        return inventory

    def _decide_group(self, cycle: Cycle, group: str, now: datetime) -> list[Event]:
        """Phases 3 to 5 for one group. Heads of one request shape fit or fail together, so the
        heads are walked as a merge of the per-shape queues in head order, and a shape leaves the
        merge at its first failure: the cycle costs placements + shapes, not pending heads."""
        shapes = self.state.groups.get(group)
        if not shapes:
            return []
        generation = self._generation(group)
        fresh = self._fresh.pop(group, {})
        out: list[Event] = []
        merge = [(keys[0], shape) for shape, keys in shapes.items() if keys]
        heapq.heapify(merge)
        while merge:
            key, shape = heapq.heappop(merge)
            job = self.state.jobs[key[2]]
            retried = job.tried_generation != generation
            events, settled = self._head(cycle, job, group, generation, now)
            out.extend(events)
            if settled:  # what it waits for is spoken for: the next head of its shape may still go
                keys = shapes[shape]
                i = keys.bisect_right(key)
                if i < len(keys):
                    heapq.heappush(merge, (keys[i], shape))
            elif self.explain:
                out.extend(self._tell_shape(cycle, job, group, shape, fresh.get(shape, ()), retried,
                                            generation, now))
        return out

    def _head(self, cycle: Cycle, job: SchedJob, group: str, generation: int,
              now: datetime) -> tuple[list[Event], bool]:
        """One head: placed, preempting or waiting for its victims (settled: the merge goes on
        with the next head of its shape), or it does not fit (its shape leaves the merge)."""
        if job.job_id in self._awaiting:  # placed by an earlier cycle, not back from the log yet
            return [], True
        retried = job.tried_generation != generation
        if retried and (placement := self._fit(cycle.inventory, job, group)) is not None:
            return [self._place(cycle, job, placement, now)], True
        job.tried_generation = generation
        if self._victims_alive(job):
            # The victims are not named: they may be other teams' jobs, and this reason is the
            # head's team's to read (their PreemptionRequested events name the head, for operators).
            explained = Explanation(SchedulingWaitReason.PREEMPTING,
                                    f"waiting for {len(job.victims)} preempted attempt(s) to stop at the end of "
                                    "their grace period")
            return (self._reason(job, group, explained, now) if self.explain else []), True
        if not (retried and self.limits.enabled and job.spec.gpus > 0
                and job.priority > self._lowest_running_priority(cycle, group)):
            return [], False
        if cycle.preempt_tries <= 0 or cycle.preempt_budget <= 0:
            job.tried_generation = -1  # look again next cycle, when there is budget
            self._dirty.add(group)
            return [], False
        cycle.preempt_tries -= 1
        victims = self._preempt(cycle, job, group, now)
        if not victims:
            return [], False
        cycle.preempt_budget -= len(victims)
        cycle.chosen_victims.update(v.aggregate_id for v in victims)
        return list(victims), True

    def _place(self, cycle: Cycle, job: SchedJob, placement: tuple[NodeAssignment, ...],
               now: datetime) -> JobScheduled:
        r = job.reservation
        assert r is not None  # a head holds quota
        event = new_event(
            JobScheduled, aggregate_id=job.job_id, producer=PRODUCER, occurred_at=now, key=str(r.attempt),
            cause=r, attempt=r.attempt, flavor=r.flavor, placement=placement,
        )
        self._awaiting[job.job_id] = event
        self._charge(cycle.inventory, job, event, +1)
        return event

    def _tell_shape(self, cycle: Cycle, job: SchedJob, group: str, shape: tuple, fresh: tuple | list,
                    retried: bool, generation: int, now: datetime) -> list[Event]:
        """Phase 5 for a shape that left the merge: its failing head (if it was tried now) and
        the heads of its shape that arrived since the last cycle are told why, each at most every
        REASON_INTERVAL_S; older heads keep the reason they were given until their shape is
        looked at again."""
        jobs = self.state.jobs
        waiting = [job] if retried else []
        for j in fresh:
            other = jobs.get(j)  # None: finished and forgotten since it arrived
            if other is not None and other is not job and other.placement is None \
                    and other.reservation is not None and j not in self._awaiting:
                waiting.append(other)
        out: list[Event] = []
        explained = None
        for other in waiting:
            other.tried_generation = generation
            if told_recently(other.waiting, now):
                continue
            if explained is None:
                explained = self._explain(cycle.inventory, other, group, now)
            out.extend(self._reason(other, group, explained, now))
        return out

    def _lowest_running_priority(self, cycle: Cycle, group: str) -> int:
        memo = cycle.lowest_running
        if group not in memo:
            s = self.state
            memo[group] = min((s.jobs[j].priority for j in s.running.get(group, ())), default=1 << 30)
        return memo[group]

    def _victims_alive(self, job: SchedJob) -> bool:
        jobs = self.state.jobs
        return any((p := jobs[v].placement) is not None and p.attempt == n for v, n in job.victims if v in jobs)

    def _fit(self, inv: Inventory, job: SchedJob, group: str) -> tuple[NodeAssignment, ...] | None:
        """Phase 3: the head's placement on the snapshot under the policy, or None."""
        req = job.request
        flavors = tuple(inv.flavors) if group == CPU_GROUP else (group,)
        policy = self.policy_for(group)
        dist = self.workload_distribution(None if group == CPU_GROUP else group, cpu=policy.integer_scored)
        if req.gang == 1:
            node = best_node(inv, flavors, req, policy, dist)
            nodes = [node] if node is not None else None
        else:
            nodes = place_gang(inv, flavors, req, policy, dist)
        if nodes is None:
            return None
        return tuple(NodeAssignment(node=n.name, gpus=req.gpus, gpu_indices=choose_gpus(n, req, policy, dist),
                                    gpu_milli=req.milli) for n in nodes)

    def policy_for(self, group: str) -> Policy:
        """The placement policy of a flavor (CPU-only work: the default)."""
        return self.flavor_policies.get(group, self.policy)

    def workload_distribution(self, flavor: str | None, cpu: bool = False) -> Workload:
        """The workload distribution FGD scores against: request size classes of the attempts
        reserved on this flavor, as probabilities (one GPU when there are none yet); with
        ``cpu``, (size class, CPU request, GPU models) keys, the CPU- and model-aware measure
        (fgd-spread, fgd-balance: they rank every node anyway, where fgd scores shapes). Rebuilt
        only when a reservation changed the counts."""
        if self._fixed_workload is not None:
            return self._fixed_workload
        total = sum(self.state.sizes.get(flavor, {}).values())
        cached = self._workloads.get((flavor, cpu))
        if cached is None or cached[0] != total:
            if cpu and total:
                requests = self.state.requests[flavor]
                dist = Workload.of_requests({k: n / total for k, n in requests.items()})
            else:
                sizes = self.state.sizes.get(flavor) or {1: 1}
                dist = Workload({c: n / sum(sizes.values()) for c, n in sizes.items()})
            cached = self._workloads[(flavor, cpu)] = (total, dist)
        return cached[1]

    # -- preemption --------------------------------------------------------------------------
    def _preemption_budget(self, now: datetime) -> int:
        if not self.limits.enabled:
            return 0
        since = now - timedelta(seconds=self.limits.window_seconds)
        times = self.state.preemption_times
        recent = [t for t in times[-self.limits.max_per_window:] if t > since]
        if len(recent) >= self.limits.max_per_window:
            self._wake(recent[0] + timedelta(seconds=self.limits.window_seconds))
        return self.limits.max_per_window - len(recent)

    def _wake(self, at: datetime) -> None:
        self._wake_at = at if self._wake_at is None else min(self._wake_at, at)

    def _preempt(self, cycle: Cycle, head: SchedJob, flavor: str, now: datetime) -> list[PreemptionRequested] | None:
        """Phase 4: victims that make the head fit and lose the least work, or None when no set
        of eligible victims (within the budget left) would.

        Per node: its eligible victims in the victim policy's order until the member fits; a gang
        takes the ``gang`` nodes that are cheapest that way (lost work, then victims, then name)."""
        ranking = self.victim_policy.rank(
            (self.state.jobs[v] for v in self.state.running.get(flavor, ()) if v not in cycle.chosen_victims),
            now, below=head.priority, started_only=True)
        if ranking.wake_at is not None:
            self._wake(ranking.wake_at)
        on_node: dict[str, list[SchedJob]] = {}
        for victim in ranking.victims:
            for a in victim.placement.placement:  # type: ignore[union-attr]
                on_node.setdefault(a.node, []).append(victim)
        if not on_node:
            return None
        req = head.request
        options = [option for node in candidates_or_all(cycle.inventory, flavor, req)
                   if not node.info.unschedulable and static_ok(node, req)
                   and (option := _make_room(node, on_node.get(node.name, []), ranking.lost, req)) is not None]
        if len(options) < req.gang:
            return None
        # A gang stays in one cluster: the cheapest ``gang`` nodes of each, then the cheapest cluster.
        by_cluster: dict[str | None, list] = {}
        for option in options:
            by_cluster.setdefault(cycle.inventory.nodes[option[2]].info.cluster, []).append(option)
        sets = [sorted(group)[: req.gang] for group in by_cluster.values() if len(group) >= req.gang]
        if not sets:
            return None
        picked = min(sets, key=lambda chosen: (sum(o[0] for o in chosen), sum(o[1] for o in chosen), chosen))
        victims = sorted({v for *_, chosen in picked for v in chosen})
        if not victims or len(victims) > cycle.preempt_budget:
            return None if victims else []
        nodes = ", ".join(name for _, _, name, _ in picked)
        return [self._preemption(self.state.jobs[vid], head, flavor, nodes, ranking.lost[vid], now) for vid in victims]

    def _preemption(self, victim: SchedJob, head: SchedJob, flavor: str, nodes: str, lost: float,
                    now: datetime) -> PreemptionRequested:
        req = head.request
        attempt = victim.placement.attempt  # type: ignore[union-attr]
        return new_event(
            PreemptionRequested, aggregate_id=victim.job_id, producer=PRODUCER, occurred_at=now,
            key=f"{attempt}/{head.job_id}", cause=head.reservation, attempt=attempt, for_job=head.job_id,
            grace_seconds=self.victim_policy.grace_seconds(victim), work_lost_gpu_seconds=round(lost, 3),
            message=(f"preempted so that {head.job_id} (priority {head.priority}, {req.gpus}×{flavor}"
                     f"{f' × {req.gang} nodes' if req.gang > 1 else ''}) fits on {nodes}; loses "
                     f"{lost:.0f} GPU-seconds since its last {'checkpoint' if victim.checkpoint_at else 'start'}"),
        )

    # -- reasons -----------------------------------------------------------------------------
    def _explain(self, inv: Inventory, job: SchedJob, group: str, now: datetime) -> Explanation:
        """Phase 5: why a head that does not fit the snapshot waits. The nodes of one shape have
        the same free GPUs, so only the request's other constraints are checked node by node."""
        req = job.request
        flavors = tuple(inv.flavors) if group == CPU_GROUP else (group,)
        flavor = None if group == CPU_GROUP else group
        label = flavor or "any"
        eligible = [_Eligible(whole_free_of(shape), shape_fits(shape, req), names)
                    for f in flavors for shape, all_names in inv.flavor(f).shapes.items()
                    if (names := [name for name in all_names if static_ok(inv.nodes[name], req)])]
        per = f"{req.gpus}×{label}" if req.milli is None else f"{req.milli / MILLI:.3g} of a sharable {label} GPU"
        need = f"needs {per}" + (f" on each of {req.gang} nodes" if req.gang > 1 else " on one node")
        n_eligible = sum(len(e.names) for e in eligible)
        free = sum(e.whole_free * len(e.names) for e in eligible)
        free_nodes = sum(len(e.names) for e in eligible if e.whole_free > 0)
        most, largest = min(((-e.whole_free, e.names[0]) for e in eligible), default=(0, None))
        block = -most
        numbers = dict(free_gpus=free, free_nodes=free_nodes, largest_free_block=block,
                       largest_free_node=largest if block else None)
        all_nodes = sum(len(names) for f in flavors for names in inv.flavor(f).shapes.values())
        if n_eligible < req.gang:
            cordoned = sum(1 for n in inv.nodes.values() if n.info.unschedulable and n.info.gpu_flavor in flavors)
            return Explanation(
                SchedulingWaitReason.NO_NODE_OF_SHAPE,
                f"{need}; only {n_eligible} of {all_nodes} schedulable {label} node(s) meet its constraints "
                f"(GPUs ≥ {req.gpus}, GPU memory ≥ {req.min_memory or 0} MiB, features "
                f"{sorted(req.features)}, GPU model {'any' if not req.models else ' or '.join(sorted(req.models))}, "
                f"taints tolerated); {cordoned} cordoned", numbers)
        with_block = sum(len(e.names) for e in eligible if e.fits)
        numbers["eta"] = self._eta(job, flavor, eligible, now)
        if req.gang > 1 and with_block >= req.gang:
            per_cluster: dict[str | None, int] = {}
            for e in eligible:
                if e.fits:
                    for name in e.names:
                        c = inv.nodes[name].info.cluster
                        per_cluster[c] = per_cluster.get(c, 0) + 1
            most_in_one = max(per_cluster.values())
            if most_in_one < req.gang:
                return Explanation(
                    SchedulingWaitReason.GANG_INCOMPLETE,
                    f"{need}; {with_block} nodes have {req.gpus} free, but in {len(per_cluster)} clusters and a gang "
                    f"stays in one: at most {most_in_one} in one cluster", numbers)
        if with_block >= req.gang:
            return Explanation(SchedulingWaitReason.CPU_MEMORY,
                               f"{need}; {with_block} node(s) have the GPUs free but not CPU {req.cpu}m / "
                               f"memory {req.memory} MiB beside them", numbers)
        where = f"largest free block is {block} on {largest}" if block else "no GPU is free"
        summary = f"{free} {label} free across {free_nodes} node(s)"
        if n_eligible < all_nodes:
            # Counted on the nodes it may use; the cluster's own count (/v1/gpus) is over them all:
            # both are told, so the message never reads as "none free" beside free GPUs it may not use.
            everywhere = sum(whole_free_of(shape) * len(names) for f in flavors
                             for shape, names in inv.flavor(f).shapes.items())
            summary = (f"{free} {label} free across {free_nodes} of the {n_eligible} node(s) that meet its "
                       f"constraints ({everywhere} free on all {all_nodes} schedulable {label} nodes)")
        if free < req.gpus * req.gang and req.milli is None:
            return Explanation(SchedulingWaitReason.INSUFFICIENT_GPUS, f"{need}; {where}; {summary}: not enough",
                               numbers)
        if req.gang == 1:
            return Explanation(SchedulingWaitReason.FRAGMENTATION, f"{need}; {where}; {summary}: fragmentation",
                               numbers)
        return Explanation(
            SchedulingWaitReason.GANG_INCOMPLETE,
            f"{need}; {with_block} of the {req.gang} nodes have {req.gpus} free; {where}; {summary}", numbers)

    def _eta(self, job: SchedJob, flavor: str | None, eligible: list[_Eligible], now: datetime) -> datetime | None:
        """When the head would fit if running attempts end as declared (and nothing else
        arrives): walk the declared ends in order, giving their GPUs back, until it fits."""
        s = self.state
        req = job.request
        if flavor is None or req.milli is not None:
            return None
        free = {name: e.whole_free for e in eligible for name in e.names}
        fitting = sum(1 for f in free.values() if f >= req.gpus)  # nodes with one member's GPUs free
        for end, vid in s.ends.get(flavor, ()):
            victim = s.jobs.get(vid)
            if victim is None or victim.placement is None:
                continue
            for a in victim.placement.placement:
                if a.node in free and a.gpu_milli is None:
                    before = free[a.node]
                    free[a.node] += a.gpus
                    if before < req.gpus <= free[a.node]:
                        fitting += 1
            if fitting >= req.gang:
                return max(end, now)
        return None

    def _reason(self, job: SchedJob, group: str, explained: Explanation, now: datetime) -> list[Event]:
        """The head's SchedulingPendingReasonChanged, unless the throttle holds it back. Called
        with one ``explained`` only for heads of one group, shape and cycle (what the event says
        besides the head's ids comes from the first head's event)."""
        if not throttle(job.waiting, explained.reason, explained.message, now).write:
            return []
        attempt = job.reservation.attempt  # type: ignore[union-attr]
        given = job.reasons_given if job.reasons_attempt == attempt else 0
        key = f"{attempt}/{given + 1}"
        if explained.event is not None:
            event = _told_too(explained.event, job, key)
        else:
            numbers = explained.numbers
            event = explained.event = new_event(
                SchedulingPendingReasonChanged, aggregate_id=job.job_id, producer=PRODUCER, occurred_at=now,
                key=key, cause=job.reservation,
                attempt=attempt, reason=explained.reason, message=explained.message[:4096],
                flavor=None if group == CPU_GROUP else group, requested_gpus=job.spec.gpus,
                gang_size=job.spec.gang_size, free_gpus=numbers.get("free_gpus", 0),
                free_nodes=numbers.get("free_nodes", 0), largest_free_block=numbers.get("largest_free_block", 0),
                largest_free_node=numbers.get("largest_free_node"), eta=numbers.get("eta"),
            )
        job.waiting = event
        return [event]

    def next_wake(self) -> datetime | None:
        """The earliest time a decision may change with no new event (a protection window or a
        backoff ending, a cluster's silence reaching the limit): a driver on a virtual clock
        (``gpusched whatif``) steps to it."""
        times = [h.last_report + self.cluster_lost_after for h in self.state.clusters.values() if h.lost is None]
        if self._wake_at is not None:
            times.append(self._wake_at)
        return min(times, default=None)

    # -- snapshots (runtime/snapshot.py) -----------------------------------------------------
    def snapshot_state(self) -> SchedulerState:
        return self.state

    def restore_state(self, state: SchedulerState) -> None:
        """Take a saved state as a fold of the same events would leave this core: every waiting
        head new to its shape (told why it waits when its shape fails), every group to look at,
        nothing decided on its way to the log."""
        self.state = state
        self._follow_policy()
        self._workloads.clear()
        self._awaiting.clear()
        self._losing.clear()
        self._wake_at = None
        self._fresh = {}
        for job_id in state.heads:
            job = state.jobs[job_id]
            if job.reservation is not None:
                self._fresh.setdefault(_group(job), {}).setdefault(job.request.shape_key(), []).append(job_id)
        for job in state.jobs.values():
            job.tried_generation = -1
        self._mark_all_dirty()

    # -- metrics -----------------------------------------------------------------------------
    def fragmentation(self) -> list[FlavorFragmentation]:
        """The fragmentation index of every GPU flavor (docs/scheduling.md), counting the
        placements decided and not yet back from the log."""
        inventory = self._decided_inventory()
        return [measure(f, index, self.state.sizes.get(f, {}))
                for f, index in sorted(inventory.flavors.items(), key=lambda kv: kv[0] or "")
                if f is not None]


def _told_too(event: SchedulingPendingReasonChanged, job: SchedJob, key: str) -> SchedulingPendingReasonChanged:
    """``event``, told to another head of the same group and request shape in this cycle, for
    ``job``: what ``new_event`` builds for it (its id from ``key``, its attempt, its causal links),
    without validating the shared explanation once per head."""
    cause = job.reservation
    assert cause is not None  # a head holds quota
    return event.model_copy(update={
        "event_id": derive_event_id(event.type, job.job_id, key), "aggregate_id": job.job_id,
        "attempt": cause.attempt, "causation_id": cause.event_id,
        "correlation_id": cause.correlation_id or cause.event_id,
    })


def candidates_or_all(inv: Inventory, flavor: str, req: Request) -> list[Node]:
    """Nodes of the flavor, in name order, whatever is free on them (preemption frees GPUs)."""
    index = inv.flavors.get(flavor)
    if index is None:
        return []
    return sorted((inv.nodes[name] for names in index.shapes.values() for name in names), key=lambda n: n.name)


def _make_room(node: Node, victims: list[SchedJob], lost: dict[str, float],
               req: Request) -> tuple[float, int, str, list[str]] | None:
    """(lost work, victims, node, their ids) when stopping the first of ``victims`` (in the
    victim policy's order) until one member fits makes room on ``node``; None when all of them
    would not."""
    free = list(node.free)
    cpu, mem = node.used_cpu, node.used_memory
    chosen: list[str] = []
    cost = 0.0
    for victim in victims:
        if fits_now(node, free, cpu, mem, req):
            break
        for a in victim.placement.placement:  # type: ignore[union-attr]
            if a.node == node.name:
                share = a.gpu_milli or MILLI
                for i in a.gpu_indices:
                    free[i] = min(MILLI, free[i] + share)
        cpu -= victim.spec.cpu_millis
        mem -= victim.spec.memory_mib
        chosen.append(victim.job_id)
        cost += lost[victim.job_id]
    return (cost, len(chosen), node.name, chosen) if fits_now(node, free, cpu, mem, req) else None


def fits_now(node: Node, free: list[int], cpu: int, mem: int, req: Request) -> bool:
    if not shape_fits((node.info.gpu_sharable, tuple(sorted(free))), req):
        return False
    info = node.info
    if info.cpu_millis and info.cpu_millis - cpu < req.cpu:
        return False
    if info.memory_mib and info.memory_mib - mem < req.memory:
        return False
    return True
