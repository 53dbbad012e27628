"""Scheduler's pure core: which nodes and GPUs an attempt that holds quota runs on.

The cycle, over the state folded from the log:

1. heads: attempts holding quota and not yet placed, by priority then reservation time;
2. snapshot: free GPUs, CPU and memory per node, copied for this cycle;
3. fit: for each head, the nodes of the reserved flavor that meet its GPU memory and feature
   constraints, best fit first (fewest GPUs left over); a gang needs ``gang_size`` distinct nodes,
   all or nothing;
4. decide: JobScheduled with the placement, and the snapshot is charged so later heads of the
   same cycle see it.

GPU device indices are assigned lowest first, so a node's allocation is a set of indices, and no
GPU is ever given to two attempts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from schemas import (
    Event,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobFailed,
    JobPreempted,
    JobScheduled,
    JobSpec,
    JobSubmitted,
    JobSucceeded,
    NodeAssignment,
    NodeLost,
    NodeRegistered,
    NodeUpdated,
    QuotaReleased,
    QuotaReserved,
    new_event,
)
from schemas.node import NodeInfo

PRODUCER = "scheduler"


@dataclass
class NodeState:
    info: NodeInfo
    used_gpus: set[int] = field(default_factory=set)
    used_cpu: int = 0
    used_memory: int = 0

    def free_gpus(self) -> list[int]:
        return [i for i in range(self.info.gpu_count) if i not in self.used_gpus]


@dataclass
class SchedJob:
    spec: JobSpec
    submitted: JobSubmitted
    priority: int = 0
    reservation: QuotaReserved | None = None
    placement: JobScheduled | None = None
    cancel_requested: bool = False


@dataclass
class SchedulerState:
    nodes: dict[str, NodeState] = field(default_factory=dict)
    jobs: dict[str, SchedJob] = field(default_factory=dict)
    heads: dict[str, None] = field(default_factory=dict)  # reserved, not yet placed


class SchedulerCore:
    def __init__(self) -> None:
        self.state = SchedulerState()
        self._dirty = True

    def decisions_refused(self) -> None:
        self._dirty = True

    def _charge(self, nodes: dict[str, NodeState], spec: JobSpec, placement: JobScheduled, sign: int) -> None:
        for a in placement.placement:
            node = nodes.get(a.node)
            if node is None:
                continue
            if sign > 0:
                node.used_gpus.update(a.gpu_indices)
            else:
                node.used_gpus.difference_update(a.gpu_indices)
            node.used_cpu += sign * spec.cpu_millis
            node.used_memory += sign * spec.memory_mib

    def evolve(self, event: Event) -> None:
        s = self.state
        match event:
            case NodeRegistered() | NodeUpdated():
                existing = s.nodes.get(event.node.name)
                if existing is None:
                    s.nodes[event.node.name] = NodeState(event.node)
                else:
                    existing.info = event.node
                self._dirty = True
                return
            case NodeLost():
                s.nodes.pop(event.name, None)
                return
            case JobSubmitted():
                s.jobs[event.aggregate_id] = SchedJob(spec=event.spec, submitted=event)
                return
        job = s.jobs.get(event.aggregate_id)
        if job is None:
            return
        job_id = event.aggregate_id
        match event:
            case JobAdmitted():
                job.priority = event.priority
            case QuotaReserved():
                if not job.cancel_requested:
                    job.reservation = event
                    s.heads[job_id] = None
                    self._dirty = True
            case JobScheduled():
                job.placement = event
                s.heads.pop(job_id, None)
                self._charge(s.nodes, job.spec, event, +1)
            case JobSucceeded() | JobFailed() | JobPreempted() | JobCancelled():
                self._end_attempt(job_id, job)
            case QuotaReleased():
                # Quota was given back without the attempt running (e.g. cancelled while queued).
                if job.reservation is not None and job.reservation.attempt == event.attempt:
                    self._end_attempt(job_id, job)
            case JobCancelRequested():
                job.cancel_requested = True
                s.heads.pop(job_id, None)

    def _end_attempt(self, job_id: str, job: SchedJob) -> None:
        if job.placement is not None:
            self._charge(self.state.nodes, job.spec, job.placement, -1)
            self._dirty = True
        job.placement = None
        job.reservation = None
        self.state.heads.pop(job_id, None)

    def decide(self, now: datetime) -> list[Event]:
        if not self._dirty or not self.state.heads:
            return []
        self._dirty = False
        s = self.state
        snapshot = {
            name: NodeState(n.info, set(n.used_gpus), n.used_cpu, n.used_memory) for name, n in s.nodes.items()
        }
        heads = sorted(
            (s.jobs[j] for j in s.heads),
            key=lambda jb: (-jb.priority, jb.reservation.occurred_at, jb.submitted.aggregate_id),
        )
        out: list[Event] = []
        for job in heads:
            placement = self._fit(job, snapshot)
            if placement is None:
                continue
            event = new_event(
                JobScheduled, aggregate_id=job.submitted.aggregate_id, producer=PRODUCER, occurred_at=now,
                key=str(job.reservation.attempt), cause=job.reservation, attempt=job.reservation.attempt,
                flavor=job.reservation.flavor, placement=placement,
            )
            self._charge(snapshot, job.spec, event, +1)
            out.append(event)
        return out

    @staticmethod
    def _fit(job: SchedJob, nodes: dict[str, NodeState]) -> tuple[NodeAssignment, ...] | None:
        spec, flavor = job.spec, job.reservation.flavor
        candidates: list[tuple[int, str, NodeState]] = []
        for name, node in nodes.items():
            info = node.info
            if info.unschedulable or (spec.gpus > 0 and info.gpu_flavor != flavor):
                continue
            if spec.min_gpu_memory_mib is not None and (info.gpu_memory_mib or 0) < spec.min_gpu_memory_mib:
                continue
            if not set(spec.node_features) <= set(info.features):
                continue
            free = info.gpu_count - len(node.used_gpus)
            if free < spec.gpus:
                continue
            if info.cpu_millis and info.cpu_millis - node.used_cpu < spec.cpu_millis:
                continue
            if info.memory_mib and info.memory_mib - node.used_memory < spec.memory_mib:
                continue
            candidates.append((free - spec.gpus, name, node))
        if len(candidates) < spec.gang_size:
            return None
        candidates.sort(key=lambda c: (c[0], c[1]))  # best fit: least left over, then by name
        return tuple(
            NodeAssignment(node=name, gpus=spec.gpus, gpu_indices=tuple(node.free_gpus()[: spec.gpus]))
            for _, name, node in candidates[: spec.gang_size]
        )
