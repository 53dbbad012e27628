"""Node inventory and GPU telemetry events (``gpusched.node.<name>.*``), written by the executor.

Inventory: NodeRegistered once, NodeUpdated when the description changes, NodeLost when the node
leaves the backend's inventory. Telemetry: NodeTelemetryReported, one per node and window, from
backends that can measure their GPUs (the local backend through NVML, ``source`` ``nvml``) and from
the sim backend, which models it (``source`` ``simulated``); the kubernetes backend reports none
(NVIDIA's DCGM exporter measures GPUs there).
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .envelope import DNS_SUBDOMAIN_PATTERN, NAME_PATTERN, Contract, Event, Timestamp

MAX_TELEMETRY_WINDOW_S = 86_400
"""Longest window one NodeTelemetryReported may cover."""

TelemetrySource = Literal["nvml", "simulated"]
"""Where a NodeTelemetryReported's figures come from: measured through NVML, or modelled by the sim
backend (docs/executor.md, "Simulated telemetry")."""


class NodeInfo(Contract):
    """What the scheduler needs to know about a node."""

    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN)
    gpu_flavor: str | None = Field(default=None, pattern=NAME_PATTERN, description="None: a CPU-only node")
    gpu_product: str | None = Field(default=None, max_length=128, description="e.g. NVIDIA-A100-SXM4-80GB")
    gpu_count: int = Field(default=0, ge=0, le=64)
    gpu_memory_mib: int | None = Field(default=None, ge=1)
    cpu_millis: int = Field(default=0, ge=0)
    memory_mib: int = Field(default=0, ge=0)
    features: tuple[str, ...] = Field(default=(), description="e.g. 'rdma', 'zone=eu-1'")
    labels: dict[str, str] = Field(default_factory=dict, description="Topology and locality labels")
    taints: tuple[str, ...] = Field(default=(), description="key=value:Effect")
    unschedulable: bool = Field(default=False, description="Cordoned")
    # Topology, smallest domain first: a gang prefers the smallest domain that holds all of it
    # (one node, then one NVLink domain, then one rack, then one network block).
    nvlink_domain: str | None = Field(default=None, max_length=253, description="NVLink / NVSwitch domain id")
    rack: str | None = Field(default=None, max_length=253, description="Rack id")
    block: str | None = Field(default=None, max_length=253, description="Network block (spine / pod) id")
    gpu_sharable: bool = Field(
        default=False, description="GPUs may be shared by fractional requests (JobSpec.gpu_milli)"
    )
    cluster: str | None = Field(
        default=None, pattern=NAME_PATTERN,
        description="The Kubernetes cluster (executor) the node belongs to; None: the one cluster of a single-cluster "
        "platform. A gang never spans clusters. The node's name then ends in '.<cluster>'")


class NodeRegistered(Event):
    aggregate: ClassVar[str] = "node"
    type: Literal["NodeRegistered"] = "NodeRegistered"
    node: NodeInfo


class NodeUpdated(Event):
    aggregate: ClassVar[str] = "node"
    type: Literal["NodeUpdated"] = "NodeUpdated"
    node: NodeInfo


class NodeLost(Event):
    aggregate: ClassVar[str] = "node"
    type: Literal["NodeLost"] = "NodeLost"
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN)
    reason: str = Field(default="", max_length=1024)


MAX_CLUSTER_NODES = 20_000
"""Most nodes one ClusterLost names (Kubernetes supports 5,000 nodes per cluster)."""

READER_LIKE = re.compile(r"(^|-)r[0-9]+$")
"""Cluster names that could be taken for a reader's consumer name (``<credential>-r<slot>``,
runtime.eventlog.reader_names): with ``r0`` or ``east-r1`` as a cluster, the credential
``executor`` or ``executor-east`` could touch that cluster's durable. Refused."""


def valid_cluster(name: str) -> bool:
    """A cluster name: a DNS label, not of the form ``r<digits>`` nor ending in ``-r<digits>``."""
    return re.fullmatch(NAME_PATTERN, name) is not None and READER_LIKE.search(name) is None


def _cluster_is_the_aggregate(event):
    """A cluster event's ``cluster`` is its aggregate id."""
    if event.cluster != event.aggregate_id:
        raise ValueError(f"cluster {event.cluster!r} differs from aggregate_id {event.aggregate_id!r}; they must be equal")
    return event


class ClusterReported(Event):
    """The executor of one cluster reached its cluster's API in the last interval: a heartbeat,
    one per ``interval_seconds`` while it can. A cluster whose reports stop for longer than the
    scheduler's ``GPUSCHED_CLUSTER_LOST_AFTER_S`` is declared lost (ClusterLost)."""

    aggregate: ClassVar[str] = "cluster"
    type: Literal["ClusterReported"] = "ClusterReported"
    cluster: str = Field(pattern=NAME_PATTERN, description="The cluster's name; also the aggregate id")
    nodes: int = Field(ge=0, description="Nodes the executor sees in the cluster")
    interval_seconds: float = Field(gt=0, le=3600, description="Seconds until the next report is due")

    _named = model_validator(mode="after")(_cluster_is_the_aggregate)


class ClusterLost(Event):
    """The scheduler heard nothing from a cluster's executor for too long: every node it names is
    lost, as if each had a NodeLost (their attempts fail with ``node-lost`` and are retried
    elsewhere, service replicas first). A later ClusterReported brings the cluster back; its
    executor registers its nodes again."""

    aggregate: ClassVar[str] = "cluster"
    type: Literal["ClusterLost"] = "ClusterLost"
    cluster: str = Field(pattern=NAME_PATTERN, description="The cluster's name; also the aggregate id")
    last_report: Timestamp | None = Field(default=None, description="occurred_at of its last ClusterReported")
    nodes: tuple[str, ...] = Field(default=(), max_length=MAX_CLUSTER_NODES,
                                   description="The cluster's nodes the log held when it was lost")
    reason: str = Field(default="", max_length=1024)

    _named = model_validator(mode="after")(_cluster_is_the_aggregate)


class GpuTelemetry(Contract):
    """One GPU's measurements over a report's window: the mean (or peak) of the samples taken in it."""

    index: int = Field(ge=0, le=63, description="NVML device index on the node (what CUDA_VISIBLE_DEVICES names)")
    samples: int = Field(ge=1, le=1_000_000, description="Samples taken in the window; the means are over these")
    utilization: float = Field(
        ge=0, le=1, description="Mean of NVML utilization.gpu over the samples: the fraction of time one or more "
        "kernels ran (NVML's own sample period is 1/6..1 s). Not SM occupancy (DCGM's SM_ACTIVE)")
    memory_used_mib: int = Field(ge=0, description="Peak device memory in use among the samples, MiB")
    memory_total_mib: int = Field(ge=1, description="Device memory, MiB")
    power_w: float | None = Field(default=None, ge=0, le=10_000,
                                  description="Mean power draw, W; None when the device does not report it")
    allocated_samples: int = Field(
        default=0, ge=0, description="Samples taken while the log had this GPU allocated: a live attempt's "
        "placement names this node and index (scheduled, running or stopping)")
    allocated_utilization: float | None = Field(
        default=None, ge=0, le=1, description="Mean utilization over the allocated samples; None when there are none")

    @model_validator(mode="after")
    def _consistent(self) -> "GpuTelemetry":
        if self.memory_used_mib > self.memory_total_mib:
            raise ValueError(f"gpu {self.index}: memory_used_mib {self.memory_used_mib} exceeds memory_total_mib "
                             f"{self.memory_total_mib}")
        if self.allocated_samples > self.samples:
            raise ValueError(f"gpu {self.index}: allocated_samples {self.allocated_samples} exceeds samples "
                             f"{self.samples}; accepted: 0..{self.samples}")
        if (self.allocated_samples > 0) != (self.allocated_utilization is not None):
            raise ValueError(f"gpu {self.index}: allocated_utilization must be set exactly when allocated_samples > 0 "
                             f"(allocated_samples {self.allocated_samples}, allocated_utilization "
                             f"{self.allocated_utilization})")
        return self


class NodeTelemetryReported(Event):
    """GPU telemetry of one node over ``[window_start, window_end)``. Windows of one node follow
    each other without overlapping; ``occurred_at`` is ``window_end``. A GPU that could not be
    sampled in the window is left out (so ``gpus`` may list fewer than ``gpu_count``)."""

    aggregate: ClassVar[str] = "node"
    type: Literal["NodeTelemetryReported"] = "NodeTelemetryReported"
    node: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, description="The node's name; also the aggregate id")
    window_start: Timestamp = Field(description="Start of the window (inclusive), host clock, UTC")
    window_end: Timestamp = Field(description="End of the window (exclusive)")
    gpu_count: int = Field(ge=1, le=64, description="GPUs on the node when the window ended")
    # At least one entry: checked below rather than with min_length, which pydantic also reports (as
    # "at least 1 item") whenever an entry is invalid, burying the real error.
    gpus: tuple[GpuTelemetry, ...] = Field(max_length=64, json_schema_extra={"minItems": 1},
                                           description="One entry per GPU sampled (at least one)")
    source: TelemetrySource = Field(
        default="nvml", description="nvml: measured on the node (NVML); simulated: modelled by the sim backend from "
        "the attempts it runs, not measured")

    @model_validator(mode="after")
    def _consistent(self) -> "NodeTelemetryReported":
        if self.node != self.aggregate_id:
            raise ValueError(f"node {self.node!r} differs from aggregate_id {self.aggregate_id!r}; they must be equal")
        if not self.gpus:
            raise ValueError("gpus is empty; accepted: at least one GPU (a node with nothing sampled reports nothing)")
        span = (self.window_end - self.window_start).total_seconds()
        if not 0 < span <= MAX_TELEMETRY_WINDOW_S:
            raise ValueError(f"window_end - window_start is {span:g} s; accepted: more than 0, at most "
                             f"{MAX_TELEMETRY_WINDOW_S} s")
        if len(self.gpus) > self.gpu_count:
            raise ValueError(f"gpus has {len(self.gpus)} entries but the node has gpu_count {self.gpu_count}; "
                             "accepted: at most one entry per GPU")
        indices = [g.index for g in self.gpus]
        if dup := sorted({i for i in indices if indices.count(i) > 1}):
            raise ValueError(f"gpus: index {', '.join(map(str, dup))} listed more than once; each GPU appears once")
        if bad := sorted(i for i in indices if i >= self.gpu_count):
            raise ValueError(f"gpus: index {', '.join(map(str, bad))} out of range for gpu_count {self.gpu_count}; "
                             f"accepted: 0..{self.gpu_count - 1}")
        return self
