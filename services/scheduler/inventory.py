"""The scheduler's inventory: nodes, what is free on each GPU, and indexes that make a placement
cost in proportion to the shapes of free capacity, not to the number of nodes.

A GPU's free capacity is counted in thousandths (``MILLI`` = a whole GPU). Whole-GPU requests take
GPUs that are entirely free; fractional requests (``JobSpec.gpu_milli``) share GPUs of nodes that
declare ``gpu_sharable``. A node's *shape* is the sorted tuple of its GPUs' free thousandths (plus
whether it is sharable); nodes of one flavor and one shape are interchangeable as far as GPUs go,
so the policies score shapes, and only then look for a node of the best shape that also meets the
job's other constraints (memory, features, taints, CPU and memory).

Cordoned nodes (``unschedulable``) keep their allocations but are not in the shape index, so
nothing new lands on them. Node lists inside a shape are sorted by name, so every choice is
deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sortedcontainers import SortedList

from schemas.node import NodeInfo

MILLI = 1000

TOPOLOGY_LABELS = {
    "nvlink_domain": "topology.gpusched.io/nvlink-domain",
    "rack": "topology.gpusched.io/rack",
    "block": "topology.gpusched.io/block",
}
"""Labels read when the NodeInfo field of the same level is not set (the sim cluster spec and
Kubernetes node labels use these)."""

TOPOLOGY_LEVELS = ("nvlink_domain", "rack", "block")
"""Smallest domain first, after the node itself."""

Shape = tuple[bool, tuple[int, ...]]


def topology_of(info: NodeInfo) -> tuple[str | None, str | None, str | None]:
    """The node's domain at each topology level; two clusters' domains never meet, whatever
    their labels say (rack-1 of one cluster is not rack-1 of another)."""
    domains = (getattr(info, level) or info.labels.get(TOPOLOGY_LABELS[level]) for level in TOPOLOGY_LEVELS)
    if info.cluster is None:
        return tuple(domains)  # type: ignore[return-value]
    return tuple(None if d is None else f"{info.cluster}/{d}" for d in domains)  # type: ignore[return-value]


def parse_taint(taint: str) -> tuple[str, str | None, str]:
    """'key=value:Effect' -> (key, value, effect); value and effect may be absent."""
    body, _, effect = taint.partition(":")
    key, eq, value = body.partition("=")
    return key, (value if eq else None), effect or "NoSchedule"


def tolerates(tolerations: tuple[str, ...], taint: str) -> bool:
    key, value, effect = parse_taint(taint)
    if effect == "PreferNoSchedule":
        return True
    for t in tolerations:
        t_key, t_value, t_effect = parse_taint(t)
        if t_key != key:
            continue
        if t_value is not None and t_value != value:
            continue
        if ":" in t and t_effect != effect:
            continue
        return True
    return False


@dataclass
class Node:
    info: NodeInfo
    free: list[int]  # per GPU index, thousandths free
    used_cpu: int = 0
    used_memory: int = 0
    topology: tuple[str | None, str | None, str | None] = (None, None, None)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def used_gpus(self) -> set[int]:
        """Indices of GPUs some attempt holds all or part of."""
        return {i for i, f in enumerate(self.free) if f < MILLI}

    def whole_free(self) -> int:
        return self.free.count(MILLI)

    def shape(self) -> Shape:
        return (self.info.gpu_sharable, tuple(sorted(self.free)))

    def cpu_memory_ok(self, cpu: int, memory: int) -> bool:
        info = self.info
        if info.cpu_millis and info.cpu_millis - self.used_cpu < cpu:
            return False
        if info.memory_mib and info.memory_mib - self.used_memory < memory:
            return False
        return True


def whole_free_of(shape: Shape) -> int:
    return shape[1].count(MILLI)


@dataclass
class FlavorIndex:
    """The schedulable nodes of one flavor, grouped by shape."""

    shapes: dict[Shape, SortedList] = field(default_factory=dict)
    whole_free_hist: dict[int, int] = field(default_factory=dict)  # whole free GPUs -> nodes
    capacity: int = 0  # GPUs on the schedulable nodes
    # A copy's origin: a name list it still shares with it is copied before the copy changes it.
    origin: dict[Shape, SortedList] | None = field(default=None, repr=False, compare=False)

    def copy(self) -> FlavorIndex:
        """A copy that can change without changing this index (the name lists are copied on
        first change)."""
        return FlavorIndex(dict(self.shapes), dict(self.whole_free_hist), self.capacity, self.shapes)

    def _names(self, shape: Shape) -> SortedList:
        names = self.shapes.get(shape)
        if names is None:
            names = self.shapes[shape] = SortedList()
        elif self.origin is not None and self.origin.get(shape) is names:
            names = self.shapes[shape] = names.copy()
        return names

    def add(self, node: Node) -> None:
        self._names(node.shape()).add(node.name)
        wf = node.whole_free()
        self.whole_free_hist[wf] = self.whole_free_hist.get(wf, 0) + 1
        self.capacity += node.info.gpu_count

    def remove(self, node: Node) -> None:
        shape = node.shape()
        names = self._names(shape)
        names.remove(node.name)
        if not names:
            del self.shapes[shape]
        wf = node.whole_free()
        self.whole_free_hist[wf] -= 1
        if not self.whole_free_hist[wf]:
            del self.whole_free_hist[wf]
        self.capacity -= node.info.gpu_count

    def free_gpus(self) -> int:
        return sum(k * n for k, n in self.whole_free_hist.items())

    def largest_block(self) -> int:
        return max((k for k, n in self.whole_free_hist.items() if n), default=0)

    def nodes_with_at_least(self, k: int) -> int:
        return sum(n for f, n in self.whole_free_hist.items() if f >= k)


class Inventory:
    """Nodes and their allocations. ``charge`` keeps the shape index in step;
    ``generation[flavor]`` grows whenever capacity of that flavor may have grown (a release, a
    node added, updated or uncordoned), which is what tells the cycle that a head that did not
    fit before might fit now. A cycle decides against a :meth:`snapshot`, so the inventory folded
    from the log changes only with the log."""

    def __init__(self, origin: Inventory | None = None) -> None:
        """``origin``: the inventory this one is a snapshot of (see :meth:`snapshot`)."""
        self.nodes: dict[str, Node] = origin.nodes if origin is not None else {}
        self.flavors: dict[str | None, FlavorIndex] = origin.flavors if origin is not None else {}
        self.generation: dict[str | None, int] = origin.generation if origin is not None else {}
        # A snapshot's origin (None: not a snapshot), and the nodes and flavors it has copied.
        self._origin = origin
        self._copied: tuple[set[str], set[str | None]] | None = None

    def snapshot(self) -> Inventory:
        """A copy to charge a cycle's decisions into, leaving this inventory as it is. Taking one
        costs nothing; its first change copies the node and flavor maps, and each node or flavor
        index it changes is copied the first time. Valid while this inventory does not change."""
        return Inventory(self)

    def _own(self) -> tuple[set[str], set[str | None]] | None:
        """For a snapshot: what it has copied so far, the maps copied on the first call."""
        if self._origin is not None and self._copied is None:
            self.nodes, self.flavors, self.generation = dict(self.nodes), dict(self.flavors), dict(self.generation)
            self._copied = (set(), set())
        return self._copied

    def _writable(self, node: Node) -> Node:
        """The node, copied first where a snapshot still shares it with its origin."""
        copied = self._own()
        if copied is None or node.name in copied[0]:
            return node
        copied[0].add(node.name)
        copy = self.nodes[node.name] = Node(node.info, list(node.free), node.used_cpu, node.used_memory, node.topology)
        return copy

    def _writable_index(self, flavor: str | None) -> FlavorIndex:
        copied = self._own()
        index = self.flavors.get(flavor)
        if index is None:
            index = self.flavors[flavor] = FlavorIndex()
        elif copied is not None and flavor not in copied[1]:
            index = self.flavors[flavor] = index.copy()
        if copied is not None:
            copied[1].add(flavor)
        return index

    # -- nodes -----------------------------------------------------------------------------
    def _index(self, node: Node) -> None:
        if not node.info.unschedulable:
            self._writable_index(node.info.gpu_flavor).add(node)

    def _unindex(self, node: Node) -> None:
        if not node.info.unschedulable:
            self._writable_index(node.info.gpu_flavor).remove(node)

    def _grew(self, flavor: str | None) -> None:
        self.generation[flavor] = self.generation.get(flavor, 0) + 1

    def upsert(self, info: NodeInfo) -> None:
        self._own()
        existing = self.nodes.get(info.name)
        if existing is None:
            node = Node(info, [MILLI] * info.gpu_count, topology=topology_of(info))
        else:
            self._unindex(existing)
            # Allocations on GPU indices the node no longer reports are kept off the index, so a
            # shrinking node cannot hand out a GPU twice; they drain as their attempts end.
            free = (existing.free + [MILLI] * info.gpu_count)[: info.gpu_count]
            node = Node(info, free, existing.used_cpu, existing.used_memory, topology_of(info))
        self.nodes[info.name] = node
        self._index(node)
        self._grew(info.gpu_flavor)
        if existing is not None and existing.info.gpu_flavor != info.gpu_flavor:
            self._grew(existing.info.gpu_flavor)

    def lose(self, name: str) -> None:
        self._own()
        node = self.nodes.pop(name, None)
        if node is not None:
            self._unindex(node)

    # -- allocations -----------------------------------------------------------------------
    def charge(self, name: str, indices: tuple[int, ...], milli: int | None, cpu: int, memory: int,
               sign: int) -> None:
        """Take (sign +1) or give back (-1) the given GPUs of a node."""
        node = self.nodes.get(name)
        if node is None:
            return
        node = self._writable(node)
        self._unindex(node)
        share = milli if milli is not None else MILLI
        for i in indices:
            if 0 <= i < len(node.free):
                node.free[i] = min(MILLI, max(0, node.free[i] - sign * share))
        node.used_cpu += sign * cpu
        node.used_memory += sign * memory
        self._index(node)
        if sign < 0:
            self._grew(node.info.gpu_flavor)

    def flavor(self, flavor: str | None) -> FlavorIndex:
        return self.flavors.get(flavor) or FlavorIndex()
