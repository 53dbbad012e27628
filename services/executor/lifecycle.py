"""The executor's core: one lifecycle for every backend (sim, local, kubernetes), and the port
(:class:`Backend`) those backends implement.

The core (:class:`BackendCore`) knows two things and does no I/O:

* what the log says: which attempt of which job is live, which must stop (cancel, reclaim,
  preemption, with their checkpoint windows), which outcomes are already recorded;
* what the backend last reported: one :class:`Observation` per attempt (pending, running,
  succeeded, failed, gone), the node inventory and closed telemetry windows, folded in from a
  :class:`SyncResult` by :meth:`BackendCore.apply`.

From those it derives

* the events that follow (:meth:`BackendCore.decide`): JobStarted once the whole gang runs,
  JobReady once a service's replica passes its readiness check and its delay, JobSucceeded,
  JobFailed with the classified reason and whether the job's retry policy retries
  it, JobPreempted / JobCancelled once the stopped attempt is gone, NodeRegistered / NodeUpdated /
  NodeLost, JobFailed(node-lost) for attempts on a lost node, and NodeTelemetryReported for each
  closed telemetry window, until it is in the log;
* the backend actions (:meth:`BackendCore.plan`, or :meth:`BackendCore.changes` for what changed
  since the last call): which workloads must exist (created under a deterministic name, so a
  restarted executor adopts what it finds instead of creating it twice), which must be stopped
  and with what grace period, and which the backend holds that the log does not want (orphans).

One reconcile pass (:func:`reconcile`) hands a plan to a backend through the port (inventory,
create, stop, observe) and returns what it saw. Backends with I/O (local, kubernetes) are
reconciled in a worker thread every few seconds (:mod:`services.executor.service`); the sim backend
is pure and is reconciled in-line on every decision (:mod:`services.executor.sim`).

Decisions are incremental: only jobs that an event or an observation touched are looked at
again, so a decision cycle costs what changed, not the size of the log.

Many clusters: with ``cluster`` set, the core is one cluster's executor (one per Kubernetes
cluster, each with its own durable and lease). It names its nodes ``<node>.<cluster>`` in the
log (a node's own name may be the same in two clusters) and tags them with the cluster; it plans,
observes and decides only the attempts placed on its cluster's nodes, and reports a heartbeat
(ClusterReported) every ``heartbeat_s`` while its backend answers. When the scheduler declares a
cluster lost (ClusterLost), every executor decides the end of the attempts that were running
there (JobFailed ``node-lost``, or JobPreempted / JobCancelled when one was asked for) with the
same event ids, so the log keeps one of each.

Event ids are derived from (job, attempt) only, and timestamps from what the backend reported
(e.g. a Pod's start and finish times), so an executor that restarts and observes the same world
derives the same events with the same ids, and JetStream drops the repeats.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol

from schemas import (
    ClusterLost,
    ClusterReported,
    Event,
    FailureReason,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobFailed,
    JobPreempted,
    JobReady,
    JobScheduled,
    JobSpec,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeLost,
    NodeRegistered,
    NodeTelemetryReported,
    NodeUpdated,
    PreemptionRequested,
    ReclaimRequested,
    new_event,
)
from schemas.job import NodeAssignment
from schemas.node import GpuTelemetry, NodeInfo
from schemas.service import ServiceDeleted, ServiceDeployed, ServiceUpdated, readiness_delay

log = logging.getLogger(__name__)

PRODUCER = "executor"
NAME_MAX = 63  # a Job's name ends up in a label value on its Pods
MAX_PENDING_REPORTS = 1000  # telemetry not yet in the log (NATS away); the oldest are dropped beyond
NODE_GONE = "the node is gone from the cluster"


class Phase(StrEnum):
    PENDING = "pending"  # created, not (all) running yet
    RUNNING = "running"  # every gang member runs
    SUCCEEDED = "succeeded"  # every gang member exited 0
    FAILED = "failed"  # a member failed (the observation says why)
    GONE = "gone"  # the backend holds nothing for the attempt any more


# How far along an attempt is: an observation never moves it back (a stale watch event), and the
# first terminal one is final (what a backend reports after the end does not change the outcome).
_RANK = {Phase.PENDING: 0, Phase.RUNNING: 1, Phase.SUCCEEDED: 2, Phase.FAILED: 2, Phase.GONE: 3}
_TERMINAL = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.GONE})


@dataclass(frozen=True)
class Observation:
    """What the backend reports about one attempt, all gang members together."""

    job_id: str
    attempt: int
    phase: Phase
    at: datetime  # when it happened, as the backend says (start or finish time), else when seen
    started_at: datetime | None = None
    reason: FailureReason | None = None  # for FAILED
    exit_code: int | None = None
    message: str = ""
    ready_at: datetime | None = None  # RUNNING: since when it passes its readiness check (None: not ready)
    # SUCCEEDED or FAILED by the workload's own doing, not by a stop: the sim knows this of an attempt
    # whose planned end came before its stop deadline. A real backend cannot tell an exit after
    # SIGTERM from one caused by it, so its ends after a stop are the stop's (JobPreempted).
    on_its_own: bool = False


def workload_name(job_id: str, attempt: int, member: int | None = None) -> str:
    """Deterministic backend name of an attempt (and gang member): the same decision always
    names the same object, so creating it again finds it instead of running it twice."""
    suffix = f"-a{attempt}" + (f"-m{member}" if member is not None else "")
    base = job_id
    if len(base) + len(suffix) > NAME_MAX:
        digest = hashlib.sha256(job_id.encode()).hexdigest()[:8]
        base = f"{job_id[: NAME_MAX - len(suffix) - 9].rstrip('-')}-{digest}"
    return re.sub(r"[^a-z0-9-]", "-", f"{base}{suffix}")


def flavor_of(product: str | None) -> str | None:
    """The flavor a GPU product makes, the same for every backend (a GFD product label, an NVML
    device name): NVIDIA-A100-SXM4-80GB -> a100-sxm4-80gb."""
    if not product:
        return None
    name = re.sub(r"[^a-z0-9]+", "-", product.lower().removeprefix("nvidia-").removeprefix("nvidia")).strip("-")
    return name[:63].rstrip("-") or None



@dataclass(frozen=True)
class TelemetryReport:
    """A telemetry window the backend closed: the payload of one NodeTelemetryReported."""

    node: str
    window_start: datetime
    window_end: datetime
    gpu_count: int
    gpus: tuple[GpuTelemetry, ...]
    source: str = "nvml"  # NodeTelemetryReported.source: "simulated" for the sim backend's modelled figures


@dataclass(frozen=True)
class Workload:
    """One attempt as the backend must run it."""

    job_id: str
    attempt: int
    spec: JobSpec
    flavor: str
    placement: tuple[NodeAssignment, ...]
    priority: int | None = None
    resume: bool = False  # an earlier attempt ran: the job should resume from its checkpoint
    started_at: datetime | None = None  # when the log says this attempt started; None: not yet

    @property
    def name(self) -> str:
        return workload_name(self.job_id, self.attempt)


@dataclass(frozen=True)
class Stop:
    """An attempt to stop: SIGTERM, then ``grace_seconds`` to checkpoint, then kill."""

    workload: Workload
    grace_seconds: float
    why: str  # "cancel", "preempt", "node-lost", "failed"


@dataclass(frozen=True)
class Plan:
    run: tuple[Workload, ...]  # must exist (create if missing, adopt if present)
    stop: tuple[Stop, ...]  # must be stopped gracefully
    keep: frozenset[tuple[str, int]]  # (job, attempt) the log still cares about
    # Complete: ``keep`` names every attempt the log holds live, so anything else the backend
    # holds is an orphan. A partial plan (:meth:`BackendCore.changes`) judges no orphans.
    complete: bool = True
    # (team, name) of every inference service the log deleted (and did not deploy again): a
    # backend that made something for it (the kubernetes backend's v1 Service) removes it.
    # Complete plans only.
    deleted_services: frozenset[tuple[str, str]] = frozenset()

    @property
    def workloads(self) -> tuple[Workload, ...]:
        """Every attempt the plan names: those to run, then those to stop."""
        return self.run + tuple(s.workload for s in self.stop)


@dataclass
class SyncResult:
    """What one reconcile pass saw; the core folds it in with :meth:`BackendCore.apply`."""

    observations: list[Observation] = field(default_factory=list)
    inventory: list[NodeInfo] | None = None  # None: the backend has not listed its nodes yet
    telemetry: list[TelemetryReport] = field(default_factory=list)
    created: int = 0
    deleted: int = 0
    # The backend answered in this pass (the cluster heartbeat counts these). The inventory of a
    # pass that found it unreachable is a stale cache: not folded in (no node lost or registered).
    reachable: bool = True


class Backend(Protocol):
    """The port every backend implements (sim, local, kubernetes). A reconcile pass calls
    inventory, create, stop and observe in that order, with the core's plan and the time of the
    pass; the backend acts and looks, and decides nothing."""

    def start(self) -> None:
        """Begin watching (threads, caches); called once before the first pass."""

    def close(self) -> None:
        """Stop watching. What runs keeps running: a restarted executor adopts it."""

    def reachable(self) -> bool:
        """Whether the backend's API answers now (the kubernetes backend: its watches are
        connected). Only passes that find it reachable count for the cluster's heartbeat."""

    def inventory(self) -> list[NodeInfo] | None:
        """The nodes as the backend sees them; None until it has listed them once (a pass then
        does nothing). While nothing changed it may return the same list object, which the core
        then does not compare again."""

    def create(self, plan: Plan, now: datetime) -> int:
        """Make every workload of ``plan.run`` exist under its deterministic name: create what is
        missing, adopt what exists, never create one twice. Returns how many were created."""

    def stop(self, plan: Plan, now: datetime) -> int:
        """Stop every attempt of ``plan.stop`` with its grace period (SIGTERM, ``grace_seconds``
        to checkpoint, then kill); for a complete plan, also stop what the backend holds that
        ``plan.keep`` does not name (orphans). Returns how many stop requests were made."""

    def observe(self, plan: Plan, now: datetime) -> tuple[list[Observation], list[TelemetryReport]]:
        """What became of the plan's attempts, one Observation each (a backend that tracks its
        own changes may report only what changed since its last call), and the telemetry windows
        closed since the last call."""


def reconcile(backend: Backend, plan: Plan, now: datetime) -> SyncResult:
    """One pass: the backend acts on ``plan`` and reports what it sees."""
    inventory = backend.inventory()
    if inventory is None:
        return SyncResult()  # not listed yet: judging orphans or lost nodes would be premature
    created = backend.create(plan, now)
    deleted = backend.stop(plan, now)
    observations, telemetry = backend.observe(plan, now)
    return SyncResult(observations, inventory, telemetry, created, deleted, reachable=backend.reachable())


@dataclass
class _Attempt:
    scheduled: JobScheduled
    started: JobStarted | None = None
    ready_not_before: datetime | None = None  # a started replica: its start + the service's readiness delay
    ready: bool = False  # JobReady is in the log
    stop: ReclaimRequested | PreemptionRequested | None = None
    failed_on_node: str | None = None  # a placement node was lost
    mine: bool = True  # placed on this executor's cluster (else another executor runs it)


@dataclass
class _Job:
    spec: JobSpec
    readiness_delay: float | None = None  # a service's replica: seconds after its start before it is ready
    priority: int | None = None
    attempt: _Attempt | None = None  # live attempt, if any
    ran_before: bool = False
    finished: bool = False  # succeeded or cancelled
    cancel: JobCancelRequested | None = None
    # A stop asked for an attempt before it was placed (quota reclaims a reservation the scheduler
    # has not placed yet): that attempt, once placed, is stopped without running.
    stop_before_placed: ReclaimRequested | PreemptionRequested | None = None


@dataclass
class _State:
    jobs: dict[str, _Job] = field(default_factory=dict)
    nodes: dict[str, NodeInfo] = field(default_factory=dict)  # as the log has them
    node_cluster: dict[str, str | None] = field(default_factory=dict)  # every node the log named, lost or not
    last_report: datetime | None = None  # this executor's cluster's latest ClusterReported in the log
    registrations: dict[str, int] = field(default_factory=dict)
    observed: dict[tuple[str, int], Observation] = field(default_factory=dict)  # live attempts only
    inventory: dict[str, NodeInfo] | None = None  # as the backend reports them; None: not listed yet
    telemetry: dict[str, NodeTelemetryReported] = field(default_factory=dict)  # by event id, not yet in the log
    live: dict[str, None] = field(default_factory=dict)  # jobs with a live attempt
    readiness: dict[str, datetime] = field(default_factory=dict)  # replicas whose readiness delay runs: until when
    services: dict[str, tuple[str, bool]] = field(default_factory=dict)  # inference service -> (team, deleted)
    due: dict[str, None] = field(default_factory=dict)  # jobs whose next event may have changed, in that order
    changed: dict[str, None] = field(default_factory=dict)  # jobs whose plan entry may have changed


class BackendCore:
    """A :class:`runtime.loop.Core` deciding what happened from the log and a backend's
    observations. ``node_lost_reason`` is what NodeLost says when a node leaves the inventory.

    ``cluster``: the cluster this executor runs (None: the only one, node names as the backend
    gives them, no heartbeat). ``heartbeat_s``: the interval of its ClusterReported.
    ``cluster_flavors``: quota per cluster: each GPU flavor is suffixed with the cluster
    (``a100-80gb-east``), so queues give quota per cluster; without it a flavor is global."""

    def __init__(self, *, node_lost_reason: str = NODE_GONE, cluster: str | None = None, heartbeat_s: float = 15.0,
                 cluster_flavors: bool = False) -> None:
        self.state = _State()
        self.node_lost_reason = node_lost_reason
        self.cluster = cluster
        self.heartbeat_s = heartbeat_s
        self.cluster_flavors = cluster_flavors
        self._inventory_dirty = False  # the inventory decisions must be compared again
        self._inventory_list: list[NodeInfo] | None = None  # the list last observed, as given
        self._contacts = 0  # reconcile passes that found the backend reachable
        self._reachable = True  # ... and whether the last pass did: no inventory decisions while not
        self._reported_contacts = 0  # ... when the last heartbeat was decided
        self._reporting = False  # a heartbeat decided and not yet in the log

    # -- clusters ----------------------------------------------------------------------------
    def qualify(self, info: NodeInfo) -> NodeInfo | None:
        """A node as the backend names it -> as the log names it (None: its name cannot carry the
        cluster's suffix within 253 characters)."""
        if self.cluster is None:
            return info
        name = f"{info.name}.{self.cluster}"
        if len(name) > 253:
            log.warning("node name too long to carry its cluster; left out", extra={"node": info.name})
            return None
        update: dict = {"name": name, "cluster": self.cluster}
        if self.cluster_flavors and info.gpu_flavor:
            update["gpu_flavor"] = f"{info.gpu_flavor[:62 - len(self.cluster)].rstrip('-')}-{self.cluster}"
        return info.model_copy(update=update)

    def unqualify(self, node: str) -> str:
        """A node as the log names it -> as the backend does."""
        return node.removesuffix(f".{self.cluster}") if self.cluster is not None else node

    def cluster_of(self, node: str) -> str | None:
        """The cluster of a node the log named (a node it never named: this executor's when it
        carries the suffix, else the unnamed cluster's)."""
        s = self.state
        if node in s.node_cluster:
            return s.node_cluster[node]
        return self.cluster if self.cluster is not None and node.endswith(f".{self.cluster}") else None

    def contact(self) -> None:
        """The backend answered (a reconcile pass found it reachable; the sim always is)."""
        self._contacts += 1

    # -- inputs ------------------------------------------------------------------------------
    def evolve(self, event: Event) -> None:
        if not self._evolve_inventory(event):
            self._evolve_job(event)

    def _evolve_inventory(self, event: Event) -> bool:
        """Node events, a new job and the inference services; False for anything else."""
        s = self.state
        match event:
            case NodeRegistered() | NodeUpdated():
                s.nodes[event.node.name] = event.node
                s.node_cluster[event.node.name] = event.node.cluster
                if isinstance(event, NodeRegistered):
                    s.registrations[event.node.name] = s.registrations.get(event.node.name, 0) + 1
                self._inventory_dirty = True
            case NodeTelemetryReported():
                s.telemetry.pop(event.event_id, None)
            case NodeLost():
                self._lose({event.name})
            case ClusterLost():
                self._lose(set(event.nodes))
            case ClusterReported():
                if event.cluster == self.cluster:
                    if s.last_report is None or event.occurred_at > s.last_report:
                        s.last_report = event.occurred_at
                    self._reporting = False
            case ServiceDeployed() | ServiceUpdated():
                s.services[event.aggregate_id] = (event.spec.team, False)
            case ServiceDeleted():
                if (known := s.services.get(event.aggregate_id)) is not None:
                    s.services[event.aggregate_id] = (known[0], True)
            case JobSubmitted():
                s.jobs.setdefault(event.aggregate_id, _Job(
                    spec=event.spec, readiness_delay=readiness_delay(event.aggregate_id, event.spec)))
            case _:
                return False
        return True

    def _evolve_job(self, event: Event) -> None:
        s = self.state
        job_id = event.aggregate_id
        job = s.jobs.get(job_id)
        if job is None:
            return
        a = job.attempt
        match event:
            case JobAdmitted():
                job.priority = event.priority
                return
            case JobScheduled():
                if a is not None:
                    self._end_attempt(job_id, job)
                early = job.stop_before_placed
                job.attempt = _Attempt(event, failed_on_node=self._lost_node(event.placement),
                                       mine=self._mine(event.placement),
                                       stop=early if early is not None and early.attempt == event.attempt else None)
                job.stop_before_placed = None
                s.live[job_id] = None
                self._touch(job_id)
            case JobStarted():
                if a is not None and a.scheduled.attempt == event.attempt:
                    a.started = event
                    job.ran_before = True
                    if job.readiness_delay is not None:
                        a.ready_not_before = event.occurred_at + timedelta(seconds=job.readiness_delay)
                        s.readiness[job_id] = a.ready_not_before
                    obs = s.observed.get((job_id, event.attempt))
                    if obs is not None and obs.phase in _TERMINAL:
                        s.due[job_id] = None  # it ended before its start was in the log: the end follows
            case JobReady():
                if a is not None and a.scheduled.attempt == event.attempt:
                    a.ready = True
                    s.readiness.pop(job_id, None)
            case JobSucceeded() | JobFailed() | JobPreempted():
                if a is not None and a.scheduled.attempt == event.attempt:
                    self._end_attempt(job_id, job)
                if isinstance(event, JobSucceeded):
                    job.finished = True
                elif job.cancel is not None:
                    s.due[job_id] = None  # the cancel is answered now that nothing runs
            case JobCancelled():
                if a is not None:
                    self._end_attempt(job_id, job)
                job.finished = True
            case ReclaimRequested() | PreemptionRequested():
                if a is not None and a.scheduled.attempt == event.attempt and a.stop is None:
                    a.stop = event
                    self._touch(job_id)
                elif a is None or a.scheduled.attempt < event.attempt:
                    job.stop_before_placed = event
            case JobCancelRequested():
                if job.cancel is None:
                    job.cancel = event
                    self._touch(job_id)

    def _lose(self, names: set[str]) -> None:
        """Nodes the log lost: the attempts placed on them cannot run."""
        s = self.state
        for name in names:
            s.nodes.pop(name, None)
        self._inventory_dirty = True
        for job_id in s.live:
            a = s.jobs[job_id].attempt
            if a.failed_on_node is None:
                lost = next((p.node for p in a.scheduled.placement if p.node in names), None)
                if lost is not None:
                    a.failed_on_node = lost
                    self._touch(job_id)

    def _touch(self, job_id: str) -> None:
        """The job's next event and its plan entry may have changed. (An attempt's start or end
        changes no entry a backend must act on: it saw that itself.)"""
        self.state.due[job_id] = None
        self.state.changed[job_id] = None

    def _end_attempt(self, job_id: str, job: _Job) -> None:
        self.state.observed.pop((job_id, job.attempt.scheduled.attempt), None)
        self.state.live.pop(job_id, None)
        self.state.readiness.pop(job_id, None)
        job.attempt = None

    def _mine(self, placement: tuple[NodeAssignment, ...]) -> bool:
        """Placed on this executor's cluster (a gang never spans two)."""
        return not placement or self.cluster_of(placement[0].node) == self.cluster

    def _lost_node(self, placement: tuple[NodeAssignment, ...]) -> str | None:
        """A placement node the log registered and then lost (the scheduler decided before it
        saw the NodeLost): the attempt cannot run there."""
        s = self.state
        return next((p.node for p in placement if p.node not in s.nodes and p.node in s.registrations), None)

    def observe(self, obs: Observation) -> None:
        """The backend's latest word on one attempt."""
        s = self.state
        job = s.jobs.get(obs.job_id)
        if job is None or job.attempt is None or job.attempt.scheduled.attempt != obs.attempt:
            return  # not live in the log: the plan treats it as an orphan
        key = (obs.job_id, obs.attempt)
        prev = s.observed.get(key)
        if prev is not None and (prev == obs or prev.phase in _TERMINAL or _RANK[obs.phase] < _RANK[prev.phase]):
            return
        s.observed[key] = obs
        s.due[obs.job_id] = None
        if obs.phase == Phase.FAILED:
            s.changed[obs.job_id] = None  # the plan stops what is left of it (the rest of a gang)

    def observe_inventory(self, nodes: list[NodeInfo]) -> None:
        """The backend's full node list."""
        if nodes is self._inventory_list:
            return
        self._inventory_list = nodes
        qualified = (self.qualify(n) for n in nodes) if self.cluster is not None else nodes
        inventory = {n.name: n for n in qualified if n is not None}
        if inventory != self.state.inventory:
            self.state.inventory = inventory
            self._inventory_dirty = True

    def observe_telemetry(self, report: TelemetryReport) -> None:
        """A closed telemetry window; decided as NodeTelemetryReported (id from node and window
        start) until the log has it. Raises ValueError (pydantic's) for an invalid report."""
        node = f"{report.node}.{self.cluster}" if self.cluster is not None else report.node
        event = new_event(NodeTelemetryReported, aggregate_id=node, producer=PRODUCER,
                          occurred_at=report.window_end, key=report.window_start.isoformat(), node=node,
                          window_start=report.window_start, window_end=report.window_end,
                          gpu_count=report.gpu_count, gpus=report.gpus, source=report.source)
        pending = self.state.telemetry
        pending[event.event_id] = event
        while len(pending) > MAX_PENDING_REPORTS:
            del pending[next(iter(pending))]

    def apply(self, result: SyncResult) -> None:
        """Fold in what a reconcile pass saw."""
        self._reachable = result.reachable
        if result.reachable:
            self.contact()
            if result.inventory is not None:
                self.observe_inventory(result.inventory)
        for obs in result.observations:
            self.observe(obs)
        for report in result.telemetry:
            try:
                self.observe_telemetry(report)
            except ValueError as err:  # a report the contract refuses: drop it, keep running
                log.warning("telemetry report dropped", extra={"node": report.node, "error": str(err)})

    def decisions_refused(self) -> None:
        """Whatever was decided and not recorded is derived again on the next cycle."""
        s = self.state
        self._inventory_dirty = True
        self._reporting = False
        for job_id, job in s.jobs.items():
            if job.attempt is not None or (job.cancel is not None and not job.finished):
                s.due[job_id] = None

    # -- outputs -----------------------------------------------------------------------------
    def decide(self, now: datetime) -> list[Event]:
        s = self.state
        out: list[Event] = []
        if self._inventory_dirty and self._reachable:
            # (the inventory of a backend that does not answer is a stale cache: nothing is
            # registered again or reported lost from it)
            out = self._inventory(now)
            self._inventory_dirty = bool(out)  # compared again until the log agrees
        if s.telemetry:
            out.extend(s.telemetry.values())  # after the node's own inventory events
        if self.cluster is not None and (heartbeat := self._heartbeat(now)) is not None:
            out.append(heartbeat)
        if s.readiness:
            for job_id in [j for j, until in s.readiness.items() if until <= now]:
                del s.readiness[job_id]
                s.due[job_id] = None  # its delay has passed: ready when the backend says so (an observation)
        if s.due:
            # A job is looked at again when an event or an observation touches it, which is also
            # when its decision is in the log; a decision the log refused: decisions_refused.
            due, s.due = s.due, {}
            for job_id in due:
                if (event := self._next(job_id, s.jobs[job_id], now)) is not None:
                    out.append(event)
        return out

    def _heartbeat(self, now: datetime) -> ClusterReported | None:
        """ClusterReported once per ``heartbeat_s``, while reconcile passes find the backend
        reachable (at least one since the last report): an executor whose cluster's API is away,
        or whose passes hang, stops reporting, and the scheduler declares the cluster lost."""
        s = self.state
        if self._reporting or self._contacts == self._reported_contacts or s.inventory is None:
            return None  # (one on its way to the log, or no pass reached the backend since the last)
        if s.last_report is not None and (now - s.last_report).total_seconds() < self.heartbeat_s:
            return None
        self._reporting, self._reported_contacts = True, self._contacts
        return new_event(ClusterReported, aggregate_id=self.cluster, producer=PRODUCER, occurred_at=now,
                         key=now.isoformat(),
                         cluster=self.cluster, nodes=len(self.state.inventory), interval_seconds=self.heartbeat_s)

    def next_wake(self) -> datetime | None:
        """When the next started replica's readiness delay ends, or the cluster's next heartbeat
        is due (None: neither)."""
        times = list(self.state.readiness.values())
        if self.cluster is not None and self.state.last_report is not None:
            times.append(self.state.last_report + timedelta(seconds=self.heartbeat_s))
        return min(times, default=None)

    def plan(self) -> Plan:
        """Every live attempt's entry, and the services deleted: a complete plan."""
        plan = self._plan(self.state.live, complete=True)
        deleted = frozenset((team, name) for name, (team, gone) in self.state.services.items() if gone)
        return replace(plan, deleted_services=deleted) if deleted else plan

    def changes(self) -> Plan:
        """The entries that changed since the last call (a new attempt to run, a stop): a partial
        plan, for a backend that remembers what it was told and reports its own changes (the
        sim)."""
        s = self.state
        if not s.changed:
            return _NO_CHANGES
        changed, s.changed = s.changed, {}
        return self._plan([j for j in changed if j in s.live], complete=False)

    def _plan(self, job_ids, complete: bool) -> Plan:
        run: list[Workload] = []
        stop: list[Stop] = []
        keep: set[tuple[str, int]] = set()
        for job_id in job_ids:
            job = self.state.jobs[job_id]
            a = job.attempt
            if not a.mine:
                continue  # another cluster's executor runs it
            n = a.scheduled.attempt
            keep.add((job_id, n))
            obs = self.state.observed.get((job_id, n))
            if job.cancel is not None:
                why, grace = "cancel", _grace(job.spec)
            elif a.stop is not None:
                why, grace = "preempt", float(a.stop.grace_seconds)
            elif a.failed_on_node is not None:
                why, grace = "node-lost", 0.0
            elif obs is not None and obs.phase == Phase.FAILED:
                why, grace = "failed", 0.0  # e.g. the rest of a gang, or an image that never pulls
            elif obs is None or obs.phase in (Phase.PENDING, Phase.RUNNING):
                why = None
            else:
                continue  # it ended; the backend saw that
            placement = a.scheduled.placement
            if self.cluster is not None:
                placement = tuple(p.model_copy(update={"node": self.unqualify(p.node)}) for p in placement)
            w = Workload(job_id=job_id, attempt=n, spec=job.spec, flavor=a.scheduled.flavor,
                         placement=placement, priority=job.priority, resume=n > 1 and job.ran_before,
                         started_at=a.started.occurred_at if a.started is not None else None)
            if why is None:
                run.append(w)
            else:
                stop.append(Stop(w, grace, why))
        return Plan(tuple(run), tuple(stop), frozenset(keep), complete)

    def _inventory(self, now: datetime) -> list[Event]:
        inv = self.state.inventory
        if inv is None:
            return []  # never report nodes lost before the backend was listed once
        out: list[Event] = []
        for name, info in inv.items():
            seen = self.state.nodes.get(name)
            if seen == info:
                continue
            cls = NodeRegistered if seen is None else NodeUpdated
            # A node registered again after a loss gets a new id: JetStream would drop the first
            # registration's id again within its duplicate window.
            again = self.state.registrations.get(name, 0)
            key = info.model_dump_json() if cls is NodeUpdated or not again else f"{again}/{info.model_dump_json()}"
            out.append(new_event(cls, aggregate_id=name, producer=PRODUCER, occurred_at=now, key=key, node=info))
        for name in self.state.nodes.keys() - inv.keys():
            if self.cluster_of(name) != self.cluster:
                continue  # another cluster's
            out.append(new_event(NodeLost, aggregate_id=name, producer=PRODUCER, occurred_at=now,
                                 key=f"removed-{self.state.registrations.get(name, 0)}", name=name,
                                 reason=self.node_lost_reason))
        return out

    def _next(self, job_id: str, job: _Job, now: datetime) -> Event | None:
        a = job.attempt
        if a is not None and (not a.mine or (a.failed_on_node is not None and not self._reachable)):
            # another cluster's attempt; or ours, on a node lost while our backend does not
            # answer (its stop would never be observed): ended where it ran, now
            return self._ended_elsewhere(job_id, job, a, now)
        if job.cancel is not None:
            if job.finished:
                return None  # cancelled or succeeded already: a late attempt is only stopped
            if a is None:
                return new_event(JobCancelled, aggregate_id=job_id, producer=PRODUCER, occurred_at=now,
                                 key="cancelled", cause=job.cancel, attempt=None, reason=job.cancel.reason)
            obs = self.state.observed.get((job_id, a.scheduled.attempt))
            if obs is None or obs.phase not in _TERMINAL:
                return None  # still stopping; the backend stops it with the grace period
            return new_event(JobCancelled, aggregate_id=job_id, producer=PRODUCER, occurred_at=obs.at,
                             key="cancelled", cause=job.cancel, attempt=a.scheduled.attempt,
                             started_at=_started_at(a, obs), reason=job.cancel.reason)
        if a is None:
            return None
        n = a.scheduled.attempt
        obs = self.state.observed.get((job_id, n))
        if a.failed_on_node is not None and a.stop is None:
            return new_event(JobFailed, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key=str(n),
                             cause=a.started or a.scheduled, attempt=n, started_at=_started_at(a, obs),
                             reason=FailureReason.NODE_LOST, message=f"node {a.failed_on_node} lost",
                             retryable=FailureReason.NODE_LOST in job.spec.retry.retry_on)
        if obs is None:
            return None
        if a.stop is not None and not obs.on_its_own:
            if obs.phase in _TERMINAL:
                return new_event(JobPreempted, aggregate_id=job_id, producer=PRODUCER, occurred_at=obs.at,
                                 key=str(n), cause=a.stop, attempt=n, started_at=_started_at(a, obs),
                                 preempted_by=a.stop.for_job, reason=a.stop.message)
            return None
        if obs.phase == Phase.RUNNING or (obs.phase == Phase.SUCCEEDED and a.started is None):
            if a.started is None:
                return new_event(JobStarted, aggregate_id=job_id, producer=PRODUCER,
                                 occurred_at=obs.started_at or obs.at, key=str(n), cause=a.scheduled, attempt=n,
                                 nodes=tuple(p.node for p in a.scheduled.placement))
            earliest = a.ready_not_before
            if (obs.phase == Phase.RUNNING and obs.ready_at is not None and not a.ready and earliest is not None
                    and earliest <= now):
                return new_event(JobReady, aggregate_id=job_id, producer=PRODUCER,
                                 occurred_at=max(obs.ready_at, earliest), key=f"{n}/ready", cause=a.started, attempt=n)
            return None
        if obs.phase == Phase.SUCCEEDED:
            return new_event(JobSucceeded, aggregate_id=job_id, producer=PRODUCER, occurred_at=obs.at, key=str(n),
                             cause=a.started, attempt=n, started_at=_started_at(a, obs))
        if obs.phase == Phase.FAILED:
            reason = obs.reason or FailureReason.BACKEND_ERROR
            return new_event(JobFailed, aggregate_id=job_id, producer=PRODUCER, occurred_at=obs.at, key=str(n),
                             cause=a.started or a.scheduled, attempt=n, started_at=_started_at(a, obs),
                             reason=reason, exit_code=obs.exit_code, message=obs.message[:4096] or reason.value,
                             retryable=reason in job.spec.retry.retry_on)
        if obs.phase == Phase.GONE:
            # Nobody here asked for it to stop: someone else deleted it.
            return new_event(JobFailed, aggregate_id=job_id, producer=PRODUCER, occurred_at=obs.at, key=str(n),
                             cause=a.started or a.scheduled, attempt=n, started_at=_started_at(a, obs),
                             reason=FailureReason.BACKEND_ERROR, message=obs.message or "the workload disappeared",
                             retryable=FailureReason.BACKEND_ERROR in job.spec.retry.retry_on)
        return None


    def _ended_elsewhere(self, job_id: str, job: _Job, a: _Attempt, now: datetime) -> Event | None:
        """An attempt on another cluster: its executor decides what became of it, unless its node
        was lost (NodeLost, or ClusterLost: its executor may be gone too). Then it ended there, and
        every executor says so with the same event id (the log keeps the first): cancelled or
        preempted when that was asked for, else failed with ``node-lost``. (Also our own attempt
        on a lost node while our backend does not answer.)"""
        if a.failed_on_node is None or job.finished:
            return None
        n = a.scheduled.attempt
        started_at = _started_at(a, None)
        lost = f"node {a.failed_on_node} lost"
        if job.cancel is not None:
            return new_event(JobCancelled, aggregate_id=job_id, producer=PRODUCER, occurred_at=now,
                             key="cancelled", cause=job.cancel, attempt=n, started_at=started_at,
                             reason=job.cancel.reason)
        if a.stop is not None:
            return new_event(JobPreempted, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key=str(n),
                             cause=a.stop, attempt=n, started_at=started_at, preempted_by=a.stop.for_job,
                             reason=f"{a.stop.message} ({lost})"[:1024])
        return new_event(JobFailed, aggregate_id=job_id, producer=PRODUCER, occurred_at=now, key=str(n),
                         cause=a.started or a.scheduled, attempt=n, started_at=started_at,
                         reason=FailureReason.NODE_LOST, message=lost,
                         retryable=FailureReason.NODE_LOST in job.spec.retry.retry_on)


_NO_CHANGES = Plan((), (), frozenset(), complete=False)


def _started_at(a: _Attempt, obs: Observation | None) -> datetime | None:
    if a.started is not None:
        return a.started.occurred_at
    return obs.started_at if obs is not None else None


def _grace(spec: JobSpec) -> float:
    """Checkpoint window of a cancel: the job may ask for one by annotation (default 30 s)."""
    raw = spec.annotations.get("gpusched.io/cancel-grace-seconds")
    try:
        return max(0.0, float(raw)) if raw else 30.0
    except ValueError:
        return 30.0
