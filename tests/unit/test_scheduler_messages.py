"""A scheduler wait reason agrees with the cluster's own count (`/v1/gpus`): where constraints
leave some nodes of the flavor out, the message says its count is over the nodes the job may use
and gives the count over them all (docs/scheduling.md, "Pending reasons")."""

from __future__ import annotations

import pytest

from schemas import SchedulingPendingReasonChanged, SchedulingWaitReason
from services.accounting.queries import gpus_by_flavor
from services.scheduler.domain import SchedulerCore
from services.scheduler.placement import Policy
from tests.unit.builders import T0, Log, admitted, at, drive, node, reserved, scheduled, spec, submitted

BIG, SMALL = 81920, 40960  # GPU memory, MiB


def node_rows(nodes: dict[str, tuple[int, int]]) -> list[dict]:
    """What /v1/gpus reads (services.accounting.queries.nodes): name -> (GPUs, GPUs held)."""
    return [{"name": n, "gpu_flavor": "a100", "gpu_count": c, "used": u, "free": c - u, "lost": False,
             "unschedulable": False} for n, (c, u) in nodes.items()]


@pytest.mark.parametrize(
    "nodes, fill, job_gpus, min_memory, expect_reason, expect_message",
    [
        # 8 free on a 40 GB node it may not use: the reason said "2 a100 free across 1 node(s)" beside 10 free
        ({"n1": (8, SMALL), "n2": (8, BIG)}, {"n2": 6}, 4, BIG, SchedulingWaitReason.INSUFFICIENT_GPUS,
         "needs 4×a100 on one node; largest free block is 2 on n2; 2 a100 free across 1 of the 1 node(s) that meet "
         "its constraints (10 free on all 2 schedulable a100 nodes): not enough"),
        # a 4-GPU node cannot hold an 8-GPU member: its 4 free GPUs are named, not hidden
        ({"n1": (4, BIG), "n2": (8, BIG), "n3": (8, BIG)}, {"n2": 2, "n3": 3}, 8, None,
         SchedulingWaitReason.FRAGMENTATION,
         "needs 8×a100 on one node; largest free block is 6 on n2; 11 a100 free across 2 of the 2 node(s) that meet "
         "its constraints (15 free on all 3 schedulable a100 nodes): fragmentation"),
        # every node eligible: the count is the cluster's, as before
        ({"n1": (8, BIG), "n2": (8, BIG)}, {"n1": 5, "n2": 2}, 8, None, SchedulingWaitReason.FRAGMENTATION,
         "needs 8×a100 on one node; largest free block is 6 on n2; 9 a100 free across 2 node(s): fragmentation"),
    ],
    ids=["memory-constraint", "too-small-node", "all-eligible"],
)
def test_a_placement_reason_states_the_free_gpus_the_cluster_counts(nodes, fill, job_gpus, min_memory, expect_reason,
                                                                     expect_message):
    core, log = SchedulerCore(Policy.BEST_FIT), Log()
    drive(core, [node(n, gpus=c, gpu_memory_mib=m) for n, (c, m) in nodes.items()], T0, log=log)
    for seq, (n, used) in enumerate(fill.items(), start=1):
        drive(core, [submitted(f"fill-{n}", spec(gpus=used), seq=seq), admitted(f"fill-{n}"),
                     scheduled(f"fill-{n}", {n: tuple(range(used))})], T0, log=log)
    s = spec(gpus=job_gpus, min_gpu_memory_mib=min_memory)
    out = drive(core, [submitted("j", s, seq=99, when=at(1)), admitted("j", when=at(1)),
                       reserved("j", gpus=job_gpus, when=at(1))], at(1), log=log)
    (r,) = [e for e in out if isinstance(e, SchedulingPendingReasonChanged)]
    assert r.reason == expect_reason
    assert r.message == expect_message
    (cluster,) = gpus_by_flavor(node_rows({n: (c, fill.get(n, 0)) for n, (c, _) in nodes.items()}))
    assert r.free_gpus <= cluster["free"]
    if r.free_gpus < cluster["free"]:  # counted over fewer nodes: the cluster's count is told too
        assert f"({cluster['free']} free on all {cluster['nodes']} schedulable a100 nodes)" in r.message
