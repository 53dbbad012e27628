"""The fragmentation index per GPU flavor (definitions in docs/scheduling.md).

* ``free(n)``: whole free GPUs of schedulable node ``n`` (GPUs no attempt holds any part of);
* ``typical(f)``: the GPU-weighted median of the per-node whole-GPU request of the attempts the
  scheduler was asked to place on flavor ``f`` (a fractional request counts as 1), 1 if none;
* ``fragmentation_ratio(f) = Σ free(n) over nodes with 0 < free(n) < typical(f) / Σ free(n)``,
  0 when nothing is free: the share of free GPUs that cannot host the typical request;
* ``largest_placeable_gang(f) = max over s of s × |{n : free(n) ≥ s}|``: the most GPUs one
  all-or-nothing job with equal per-node shares could get now (one node: its largest block).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.inventory import FlavorIndex


@dataclass(frozen=True)
class FlavorFragmentation:
    flavor: str | None
    capacity: int
    free: int
    typical: int
    ratio: float
    largest_placeable_gang: int
    largest_block: int


def typical_request(sizes: dict[int, int]) -> int:
    """GPU-weighted median of whole-GPU request sizes (``sizes``: size class -> attempts; a
    negative class is a fraction of one GPU and counts as size 1)."""
    weights: dict[int, int] = {}
    for size, count in sizes.items():
        gpus = 1 if size < 0 else size
        if gpus > 0:
            weights[gpus] = weights.get(gpus, 0) + gpus * count
    total = sum(weights.values())
    if not total:
        return 1
    acc = 0
    for gpus in sorted(weights):
        acc += weights[gpus]
        if 2 * acc >= total:
            return gpus
    return max(weights)


def measure(flavor: str | None, index: FlavorIndex, sizes: dict[int, int]) -> FlavorFragmentation:
    hist = index.whole_free_hist
    free = sum(k * n for k, n in hist.items())
    typical = typical_request(sizes)
    stranded = sum(k * n for k, n in hist.items() if 0 < k < typical)
    largest = 0
    for s in sorted(k for k in hist if k > 0):
        largest = max(largest, s * sum(n for k, n in hist.items() if k >= s))
    return FlavorFragmentation(
        flavor=flavor, capacity=index.capacity, free=free, typical=typical,
        ratio=(stranded / free) if free else 0.0, largest_placeable_gang=largest,
        largest_block=max((k for k in hist if k > 0), default=0),
    )
