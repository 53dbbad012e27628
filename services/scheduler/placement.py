"""Placement: which nodes and GPUs one request gets, under a policy. Pure functions of the
inventory; nothing here changes it.

Policies (docs/scheduling.md):

* ``first-fit``: the first node by name that fits;
* ``best-fit``: the node left with the least free GPU capacity (ties: name);
* ``fgd``: fragmentation gradient descent (Weng et al., ATC '23): the node whose *expected
  fragmentation* grows least, where a node's fragmentation is the free GPU capacity that a task
  drawn from the workload distribution could not use there (ties: best fit, then name).
* ``fgd-spread``: FGD scored as the paper's simulator scores it, on the 0–100 integer scale of a
  Kubernetes score, ``int(100 × sigmoid(−growth in GPUs))``, so growths within a few hundredths
  of a GPU tie; ties go to a fixed pseudo-random order of the nodes (the SHA-256 of the name),
  which spreads equally good choices over the cluster instead of packing them by name or best
  fit. Measured against ``fgd`` in docs/scheduling.md ("Trace replay").
* ``fgd-balance``: ``fgd-spread`` with one more key between the score and the order: the growth
  of the node's *CPU deficit*, the CPU it would lack to serve its free GPU capacity at the
  workload's CPU per GPU (``Workload.cpu_per_milli``). Among equally fragmenting choices it takes
  the one that keeps CPU and GPU in step, so GPUs are not stranded behind used-up CPU. The
  deficit counts only on nodes of a GPU model that no class of the workload is restricted to
  (``Workload.restricted_models``): it draws CPU-light work to CPU-poor nodes, and where those
  are of a model that restricted tasks need, that work would take their GPUs (there, ties go to
  the order, as in ``fgd-spread``). A CPU-only task goes to the node with the fewest free GPU
  thousandths (then the order), as in ``best-fit``: its CPU is least needed there.

A request is one gang member's share (``gpus`` whole GPUs or one ``milli`` fraction), repeated on
``gang`` distinct nodes, all or nothing. A gang takes the smallest topology domain that holds all
of it: one NVLink domain, else one rack, else one block, else anywhere.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from schemas import JobSpec
from services.scheduler.inventory import MILLI, TOPOLOGY_LEVELS, Inventory, Node, Shape, tolerates, whole_free_of


class Policy(StrEnum):
    FIRST_FIT = "first-fit"
    BEST_FIT = "best-fit"
    FGD = "fgd"
    FGD_SPREAD = "fgd-spread"
    FGD_BALANCE = "fgd-balance"

    @property
    def fragmentation_aware(self) -> bool:
        return self in (Policy.FGD, Policy.FGD_SPREAD, Policy.FGD_BALANCE)

    @property
    def integer_scored(self) -> bool:
        """Scored on the 0-100 integer scale and ranked node by node (not shape by shape)."""
        return self in (Policy.FGD_SPREAD, Policy.FGD_BALANCE)


def parse_policy(value: str) -> Policy:
    try:
        return Policy(value)
    except ValueError:
        raise ValueError(
            f"placement policy {value!r} is not known; accepted: {', '.join(p.value for p in Policy)}"
        ) from None


@dataclass(frozen=True)
class Request:
    gpus: int  # whole GPUs per member (1 for a fractional request)
    milli: int | None  # fraction of one GPU, or None for whole GPUs
    gang: int
    min_memory: int | None
    features: frozenset[str]
    tolerations: tuple[str, ...]
    cpu: int
    memory: int
    localities: frozenset[str]
    models: frozenset[str] = frozenset()  # any one of these GPU products; empty: any

    @classmethod
    def of(cls, spec: JobSpec) -> "Request":
        return cls(
            gpus=spec.gpus, milli=spec.gpu_milli, gang=spec.gang_size, min_memory=spec.min_gpu_memory_mib,
            features=frozenset(spec.node_features), tolerations=spec.tolerations, cpu=spec.cpu_millis,
            memory=spec.memory_mib,
            localities=frozenset(d.locality_hint for d in spec.datasets if d.locality_hint),
            models=frozenset(spec.gpu_models),
        )

    @property
    def size_class(self) -> int:
        """Workload-distribution key: whole GPUs, or -milli for a fraction."""
        return -self.milli if self.milli is not None else self.gpus

    @property
    def demand_milli(self) -> int:
        return self.milli if self.milli is not None else self.gpus * MILLI

    def shape_key(self) -> tuple:
        """Requests with equal keys fit or fail together (the cycle memoizes failures by it)."""
        return (self.gpus, self.milli, self.gang, self.min_memory, self.features, self.tolerations,
                self.cpu, self.memory, self.models)


# -- constraints -------------------------------------------------------------------------------


def static_ok(node: Node, req: Request) -> bool:
    """Constraints that do not depend on what is allocated: GPU model, memory, features, taints."""
    info = node.info
    if req.models and info.gpu_product not in req.models:
        return False
    if req.min_memory is not None and (info.gpu_memory_mib or 0) < req.min_memory:
        return False
    if req.features and not req.features <= set(info.features):
        return False
    if info.taints and not all(tolerates(req.tolerations, t) for t in info.taints):
        return False
    if req.milli is not None and not info.gpu_sharable:
        return False
    return info.gpu_count >= req.gpus


def shape_fits(shape: Shape, req: Request) -> bool:
    if req.milli is not None:
        return shape[0] and any(f >= req.milli for f in shape[1])
    return whole_free_of(shape) >= req.gpus


def take(free: list[int] | tuple[int, ...], req: Request) -> tuple[tuple[int, ...], list[int]]:
    """GPU indices for one member and the free vector after: whole GPUs lowest index first; a
    fraction on the fullest GPU that still has room (packing), lowest index on ties."""
    after = list(free)
    if req.milli is None:
        idx = tuple(i for i, f in enumerate(free) if f == MILLI)[: req.gpus]
        for i in idx:
            after[i] = 0
        return idx, after
    best = min((f, i) for i, f in enumerate(free) if f >= req.milli)
    after[best[1]] -= req.milli
    return (best[1],), after


def fraction_options(free, milli: int) -> list[tuple[int, list[int]]]:
    """For a fraction: (the chosen GPU's free value, the free vector after) for each distinct free
    value that has room, fullest first."""
    out = []
    for value in sorted({f for f in free if f >= milli}):
        after = list(free)
        after[after.index(value)] -= milli
        out.append((value, after))
    return out


def choose_gpus(node: Node, req: Request, policy: Policy, dist: "Workload") -> tuple[int, ...]:
    """Device indices for one member on the chosen node: FGD puts a fraction on the GPU whose
    use grows the node's fragmentation least (ties: fullest), the others pack (``take``)."""
    if req.milli is None or not policy.fragmentation_aware:
        return take(node.free, req)[0]
    cpu = _cpu_free(node)
    after_cpu = None if cpu is None else cpu - req.cpu
    model = node.info.gpu_product
    best = min(fraction_options(node.free, req.milli),
               key=lambda o: (dist.fragmentation(o[1], after_cpu, model), o[0]))
    return (min(i for i, f in enumerate(node.free) if f == best[0]),)


def _fgd_delta(free, req: Request, dist: "Workload", cpu: int | None = None, model: str | None = None) -> float:
    after_cpu = None if cpu is None else cpu - req.cpu
    before = dist.fragmentation(free, cpu, model)
    if req.milli is not None:
        return min(dist.fragmentation(after, after_cpu, model)
                   for _, after in fraction_options(free, req.milli)) - before
    return dist.fragmentation(take(free, req)[1], after_cpu, model) - before


# -- fragmentation -----------------------------------------------------------------------------


def unusable(free: list[int] | tuple[int, ...], size_class: int) -> int:
    """Free thousandths on one node that a task of ``size_class`` could not use there."""
    total = sum(free)
    if size_class < 0:  # a fraction: GPUs with less room than it are lost to it
        need = -size_class
        return sum(f for f in free if f < need)
    whole = sum(1 for f in free if f == MILLI)
    if whole >= size_class:
        return total - whole * MILLI  # the partial GPUs only
    return total


def _class_milli(size_class: int) -> int:
    return -size_class if size_class < 0 else size_class * MILLI


def cpu_deficit_growth(gpu_before: int, gpu_after: int, cpu_before: int, cpu_after: int, per_milli: float) -> float:
    """``fgd-balance``'s second key: how much the CPU a node lacks to serve its free GPU
    thousandths at ``per_milli`` CPU each grows when free GPU and CPU go from before to after."""
    return max(0.0, per_milli * gpu_after - cpu_after) - max(0.0, per_milli * gpu_before - cpu_before)


def node_fragmentation(free: list[int] | tuple[int, ...], dist: Workload) -> float:
    """Expected unusable free capacity (thousandths) for a task drawn from ``dist``."""
    return sum(p * unusable(free, c) for c, p in dist.items())


class Workload:
    """A workload distribution (size class -> probability) and the fragmentation of free
    vectors under it, memoized by sorted vector (the order of GPUs does not matter).

    With ``cpu`` ((size class, GPU models) -> ((CPU millicores, probability), ...): the classes'
    CPU requests, and the models a class may run on, empty for any) the measure is CPU- and
    model-aware as in the paper: on a node with less free CPU than a task asks for, or of a GPU
    model it may not use, all of the node's free GPU capacity is lost to that task. Nodes of one
    GPU shape then differ, so FGD scores nodes, grouped by free CPU and model, instead of shapes."""

    def __init__(self, dist: dict[int, float],
                 cpu: dict[tuple[int, frozenset[str]], tuple[tuple[int, float], ...]] | None = None) -> None:
        self.dist = dist
        self._memo: dict[tuple[int, ...], float] = {}
        self.cpu_aware = cpu is not None
        # (size class, models, probability, CPU requests ascending, probability of a request above each)
        self._classes: list[tuple[int, frozenset[str], float, list[int], list[float]]] = []
        for (c, models), pairs in (cpu or {}).items():
            ordered = sorted(pairs)
            above, acc = [0.0] * len(ordered), 0.0
            for i in range(len(ordered) - 1, -1, -1):
                above[i] = acc
                acc += ordered[i][1]
            self._classes.append((c, models, acc, [x for x, _ in ordered], above))
        self._unusable_memo: dict[tuple[tuple[int, ...], int], int] = {}
        # CPU millicores the workload asks per thousandth of a GPU (its GPU-using classes)
        gpu = sum(p * _class_milli(c) for c, p in dist.items())
        cpu_asked = sum(p * millis for (c, _), pairs in (cpu or {}).items() if c != 0 for millis, p in pairs)
        self.cpu_per_milli: float | None = cpu_asked / gpu if cpu is not None and gpu else None
        # the GPU models some class is restricted to (any one of its models): tasks that cannot go elsewhere want them
        self.restricted_models: frozenset[str] = frozenset().union(*(models for (_, models) in (cpu or {})))

    @classmethod
    def of_requests(cls, requests: dict[tuple, float]) -> "Workload":
        """From (size class, CPU millicores) or (size class, CPU millicores, GPU models) -> probability."""
        dist: dict[int, float] = {}
        cpu: dict[tuple[int, frozenset[str]], list[tuple[int, float]]] = {}
        for key, p in requests.items():
            c, millis = key[0], key[1]
            models = frozenset(key[2]) if len(key) > 2 else frozenset()
            dist[c] = dist.get(c, 0.0) + p
            cpu.setdefault((c, models), []).append((millis, p))
        return cls(dist, {k: tuple(v) for k, v in cpu.items()})

    def fragmentation(self, free, cpu_free: int | None = None, model: str | None = None) -> float:
        key = tuple(sorted(free))
        if not self.cpu_aware or cpu_free is None:
            value = self._memo.get(key)
            if value is None:
                value = self._memo[key] = node_fragmentation(key, self.dist)
            return value
        total = sum(key)
        value = 0.0
        for c, models, p, millis, above in self._classes:
            if models and model is not None and model not in models:
                value += p * total  # the node's model is not one this class may use
                continue
            # probability mass of the class whose CPU request exceeds cpu_free
            i = bisect.bisect_right(millis, cpu_free)
            blocked = (above[i - 1] if i > 0 else p) if i < len(millis) else 0.0
            if blocked:
                value += blocked * total
            if p - blocked > 1e-12:
                k = (key, c)
                u = self._unusable_memo.get(k)
                if u is None:
                    u = self._unusable_memo[k] = unusable(key, c)
                value += (p - blocked) * u
        return value


# -- choosing nodes ----------------------------------------------------------------------------


def spread_score(growth: float) -> int:
    """``fgd-spread``'s score of a fragmentation growth (thousandths of a GPU), lower is better:
    minus the Kubernetes-scale score ``int(100 × sigmoid(−growth / 1000))``."""
    return -int(100 / (1 + math.exp(min(growth / MILLI, 700.0))))


@lru_cache(maxsize=65_536)
def spread_rank(name: str) -> str:
    """A node's place in ``fgd-spread``'s fixed pseudo-random order of the nodes."""
    return hashlib.sha256(name.encode()).hexdigest()


def _score(policy: Policy, name: str, free: tuple[int, ...], req: Request, dist: Workload,
           local: int = 0, cpu: int | None = None, model: str | None = None) -> tuple:
    """Lower is better. ``cpu``, ``model``: the node's free CPU and GPU model, for the
    integer-scored policies."""
    if policy == Policy.FIRST_FIT:
        return (-local, name)
    _, after = take(free, req)
    left = sum(after)
    if policy == Policy.BEST_FIT:
        return (-local, left, name)
    if policy.integer_scored:
        return (-local, *_integer_key(policy, name, free, after, cpu, req, dist,
                                      _fgd_delta(free, req, dist, cpu, model), model))
    return (-local, round(_fgd_delta(free, req, dist), 6), left, name)


def _integer_key(policy: Policy, name: str, free, after, cpu: int | None, req: Request, dist: Workload,
                 growth: float, model: str | None = None) -> tuple:
    """``fgd-spread`` and ``fgd-balance``: the integer score, the CPU deficit's growth (0 for
    ``fgd-spread``, where the node's CPU or the workload's is not known, and on a node of a GPU
    model that some class of the workload is restricted to), the order. ``fgd-balance`` puts a
    CPU-only task where the fewest GPU thousandths are free."""
    if policy == Policy.FGD_BALANCE and req.gpus == 0:
        return (sum(free), 0, spread_rank(name))
    if policy == Policy.FGD_BALANCE and cpu is not None and dist.cpu_per_milli is not None \
            and model not in dist.restricted_models:
        deficit = cpu_deficit_growth(sum(free), sum(after), cpu, cpu - req.cpu, dist.cpu_per_milli)
        return (spread_score(growth), round(deficit), spread_rank(name))
    return (spread_score(growth), 0, spread_rank(name))


def _locality(node: Node, req: Request) -> int:
    if not req.localities:
        return 0
    labels = node.info.labels
    values = set(labels.values()) | set(labels)
    return len(req.localities & values)


def _first_ok(inv: Inventory, names, req: Request, exclude: frozenset[str]) -> Node | None:
    for name in names:
        if name in exclude:
            continue
        node = inv.nodes[name]
        if static_ok(node, req) and node.cpu_memory_ok(req.cpu, req.memory):
            return node
    return None


def fitting_shapes(inv: Inventory, flavors: tuple[str | None, ...], req: Request):
    """(flavor, shape, node names) for each shape of the flavors whose free GPUs fit one member."""
    for flavor in flavors:
        index = inv.flavors.get(flavor)
        if index is None:
            continue
        for shape, names in index.shapes.items():
            if shape_fits(shape, req):
                yield flavor, shape, names


def _cpu_free(node: Node) -> int | None:
    return node.info.cpu_millis - node.used_cpu if node.info.cpu_millis else None


def _best_node_fgd_cpu(inv, flavors, req: Request, policy: Policy, dist: Workload, exclude) -> Node | None:
    """CPU-aware FGD: per fitting shape, nodes grouped by free CPU and GPU model score alike. For ``fgd`` the
    first node by name of each group that meets the constraints stands for it; the integer-scored
    policies rank every node (their tie-break is the node's own)."""
    best: tuple | None = None
    chosen = None
    spread = policy.integer_scored
    for _, shape, names in fitting_shapes(inv, flavors, req):
        growth: dict[tuple, float] = {}  # (free CPU, GPU model) -> the group's fragmentation growth
        _, after = take(shape[1], req)
        for name in names:
            node = inv.nodes[name]
            cpu = _cpu_free(node)
            group = (cpu, node.info.gpu_product)
            if (group in growth and not spread) or name in exclude or not static_ok(node, req) \
                    or not node.cpu_memory_ok(req.cpu, req.memory):
                continue
            if group not in growth:
                growth[group] = _fgd_delta(shape[1], req, dist, cpu, node.info.gpu_product)
            score = _integer_key(policy, name, shape[1], after, cpu, req, dist, growth[group],
                                 node.info.gpu_product) if spread else \
                (round(growth[group], 6), sum(after), name)
            if best is None or score < best:
                best, chosen = score, node
    return chosen


def best_node(inv: Inventory, flavors: tuple[str | None, ...], req: Request, policy: Policy,
              dist: Workload, exclude: frozenset[str] = frozenset()) -> Node | None:
    """The best node for one member. Shapes are scored first (nodes of one shape score alike
    but for the name), then the best-scoring shape's nodes are searched in name order for one
    that meets the other constraints; a shape whose nodes all fail falls through to the next."""
    if req.localities or (policy.integer_scored and not dist.cpu_aware):  # the tie-break is per node
        return _best_node_scan(inv, flavors, req, policy, dist, exclude)
    if policy.fragmentation_aware and dist.cpu_aware:
        return _best_node_fgd_cpu(inv, flavors, req, policy, dist, exclude)
    # Each shape is scored with its first name: within a shape only the name differs, and the
    # search below walks the names in order.
    ranked: list[tuple[tuple, str | None, Shape]] = [
        (_score(policy, names[0], shape[1], req, dist), flavor, shape)
        for flavor, shape, names in fitting_shapes(inv, flavors, req)]
    ranked.sort(key=lambda r: r[0])
    if policy == Policy.FIRST_FIT:
        # First fit is by name across shapes: take, per shape, its first node that meets the
        # constraints, and the lowest name of those.
        found = [n for _, flavor, shape in ranked
                 if (n := _first_ok(inv, inv.flavors[flavor].shapes[shape], req, exclude)) is not None]
        return min(found, key=lambda n: n.name, default=None)
    for _, flavor, shape in ranked:
        node = _first_ok(inv, inv.flavors[flavor].shapes[shape], req, exclude)
        if node is not None:
            return node
    return None


def _best_node_scan(inv, flavors, req, policy, dist, exclude) -> Node | None:
    best: tuple | None = None
    chosen = None
    for node in candidates(inv, flavors, req, exclude):
        score = _score(policy, node.name, tuple(node.free), req, dist, _locality(node, req), _cpu_free(node),
                       node.info.gpu_product)
        if best is None or score < best:
            best, chosen = score, node
    return chosen


def candidates(inv: Inventory, flavors: tuple[str | None, ...], req: Request,
               exclude: frozenset[str] = frozenset()) -> list[Node]:
    """Every schedulable node of the flavors that could host one member now."""
    out = []
    for _, _, names in fitting_shapes(inv, flavors, req):
        for name in names:
            node = inv.nodes[name]
            if name not in exclude and static_ok(node, req) and node.cpu_memory_ok(req.cpu, req.memory):
                out.append(node)
    return out


def place_gang(inv: Inventory, flavors: tuple[str | None, ...], req: Request, policy: Policy,
               dist: Workload) -> list[Node] | None:
    """``req.gang`` distinct nodes, all in the smallest topology domain that has enough (else in
    the smallest cluster that has enough), or None: the domain is chosen by its candidates alone
    (fewest, then name), and only its nodes are ranked by the policy."""
    index_total = sum(inv.flavor(f).nodes_with_at_least(req.gpus) for f in flavors) if req.milli is None else None
    if index_total is not None and index_total < req.gang:
        return None  # not enough nodes with the block free, whatever their other constraints
    nodes = candidates(inv, flavors, req)
    if len(nodes) < req.gang:
        return None

    def score(n: Node) -> tuple:
        return _score(policy, n.name, tuple(n.free), req, dist, _locality(n, req), _cpu_free(n), n.info.gpu_product)

    for level, _ in enumerate(TOPOLOGY_LEVELS):
        domains: dict[str, list[Node]] = {}
        for n in nodes:
            d = n.topology[level]
            if d is not None:
                domains.setdefault(d, []).append(n)
        fitting = [(len(members), d) for d, members in domains.items() if len(members) >= req.gang]
        if fitting:
            _, smallest = min(fitting)
            return sorted(domains[smallest], key=score)[: req.gang]
    # No topology domain holds it: any nodes, but of one cluster (a gang never spans two).
    clusters: dict[str, list[Node]] = {}
    for n in nodes:
        clusters.setdefault(n.info.cluster or "", []).append(n)
    fitting_clusters = [(len(members), c) for c, members in clusters.items() if len(members) >= req.gang]
    if not fitting_clusters:
        return None
    _, smallest = min(fitting_clusters)
    return sorted(clusters[smallest], key=score)[: req.gang]
