"""Node inventory events (``gpusched.node.<name>.*``), written by the executor."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from schemas.envelope import DNS_SUBDOMAIN_PATTERN, NAME_PATTERN, Contract, Event


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
