"""Shared GPUs end to end in the executor: what a Kubernetes Node's NVIDIA device plugin and GPU
feature discovery labels make of it (time-slicing, MIG single and mixed, MPS), the Job a
fractional member gets, the sim cluster spec's ``gpu_sharable``, and fractional jobs placed,
run, preempted and run again on a shared GPU of the sim."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from schemas import JobPreempted, JobScheduled, JobStarted, JobSucceeded, PreemptionRequested
from schemas.job import NodeAssignment
from schemas.priority import DEFAULT_PRIORITY_CLASSES
from services.executor.cluster import ClusterSpecError, load_cluster
from services.executor.k8s_model import JobOptions, gpu_offer, job_manifests, node_info
from services.executor.lifecycle import Workload
from services.executor.sim import SimExecutorCore
from services.quota.domain import QuotaCore
from services.scheduler.domain import SchedulerCore
from tests.unit.builders import T0, Log, admitted, at, queue, spec, submitted

REPO = Path(__file__).resolve().parents[2]
A100 = "NVIDIA-A100-SXM4-80GB"


def gfd(product: str, **more: str) -> dict[str, str]:
    return {"nvidia.com/gpu.product": product, **more}


def node(alloc: dict[str, str], labels: dict[str, str]) -> dict:
    return {"metadata": {"name": "g1", "labels": labels},
            "status": {"allocatable": {"cpu": "32", "memory": "256Gi", **alloc}}}


TS = {"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "time-slicing", "nvidia.com/gpu.count": "2"}

# (case, allocatable, labels, (count, resource, sharable, product), flavor, note fragment or "")
OFFERS = [
    ("whole GPUs", {"nvidia.com/gpu": "8"}, gfd(A100, **{"nvidia.com/gpu.replicas": "1",
                                                         "nvidia.com/gpu.sharing-strategy": "none"}),
     (8, "nvidia.com/gpu", False, A100), "a100-sxm4-80gb", ""),
    ("GFD without sharing labels", {"nvidia.com/gpu": "8"}, gfd(A100), (8, "nvidia.com/gpu", False, A100),
     "a100-sxm4-80gb", ""),
    ("time-slicing: 2 GPUs × 4 replicas, product suffixed -SHARED", {"nvidia.com/gpu": "8"},
     gfd(f"{A100}-SHARED", **TS), (2, "nvidia.com/gpu", True, A100), "a100-sxm4-80gb-shared", ""),
    ("time-slicing, renameByDefault: nvidia.com/gpu.shared, product unsuffixed", {"nvidia.com/gpu.shared": "8"},
     gfd(A100, **TS), (2, "nvidia.com/gpu.shared", True, A100), "a100-sxm4-80gb-shared", ""),
    ("time-slicing from a GFD without the sharing-strategy label", {"nvidia.com/gpu": "8"},
     gfd(f"{A100}-SHARED", **{"nvidia.com/gpu.replicas": "4"}), (2, "nvidia.com/gpu", True, A100),
     "a100-sxm4-80gb-shared", ""),
    ("time-slicing with an unhealthy GPU: whole GPUs of the replicas left", {"nvidia.com/gpu": "6"},
     gfd(f"{A100}-SHARED", **TS), (1, "nvidia.com/gpu", True, A100), "a100-sxm4-80gb-shared", ""),
    ("time-slicing, flavor named by label", {"nvidia.com/gpu": "8"},
     gfd(f"{A100}-SHARED", **TS, **{"gpusched.io/gpu-flavor": "a100-pool"}), (2, "nvidia.com/gpu", True, A100),
     "a100-pool", ""),
    ("MPS: not shared by gpusched", {"nvidia.com/gpu": "8"},
     gfd(f"{A100}-SHARED", **{**TS, "nvidia.com/gpu.sharing-strategy": "mps"}),
     (0, "nvidia.com/gpu", False, f"{A100}-SHARED"), None, "GPUs shared by 'mps' (nvidia.com/gpu.replicas=4)"),
    ("replicas not a number", {"nvidia.com/gpu": "8"}, gfd(A100, **{"nvidia.com/gpu.replicas": "four"}),
     (0, "nvidia.com/gpu", False, A100), None, "label nvidia.com/gpu.replicas='four' is not a whole number"),
    ("renamed resource without replicas", {"nvidia.com/gpu.shared": "8"}, gfd(A100),
     (0, "nvidia.com/gpu.shared", False, A100), None, "physical GPU count is unknown"),
    ("MIG single: MIG devices as whole GPUs of a MIG flavor", {"nvidia.com/gpu": "14"},
     gfd("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", **{"nvidia.com/mig.strategy": "single", "nvidia.com/gpu.count": "14",
                                                "nvidia.com/gpu.replicas": "1", "nvidia.com/gpu.memory": "4864"}),
     (14, "nvidia.com/gpu", False, "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"), "a100-sxm4-40gb-mig-1g-5gb", ""),
    ("MIG single, time-sliced", {"nvidia.com/gpu": "28"},
     gfd("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED", **{"nvidia.com/mig.strategy": "single",
                                                       "nvidia.com/gpu.replicas": "2"}),
     (14, "nvidia.com/gpu", True, "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"), "a100-sxm4-40gb-mig-1g-5gb-shared", ""),
    ("MIG single, invalid configuration", {"nvidia.com/gpu": "1"},
     gfd("NVIDIA-A100-SXM4-40GB-MIG-INVALID", **{"nvidia.com/mig.strategy": "single", "nvidia.com/gpu.count": "0",
                                                 "nvidia.com/gpu.replicas": "0"}),
     (0, "nvidia.com/gpu", False, "NVIDIA-A100-SXM4-40GB-MIG-INVALID"), None, "invalid MIG configuration"),
    ("MIG mixed, every GPU partitioned: no GPUs", {"nvidia.com/mig-1g.10gb": "7", "nvidia.com/mig-3g.40gb": "2"},
     gfd(A100, **{"nvidia.com/mig.strategy": "mixed", "nvidia.com/mig-1g.10gb.count": "7"}),
     (0, "nvidia.com/gpu", False, A100), None,
     "MIG devices (nvidia.com/mig-1g.10gb: 7, nvidia.com/mig-3g.40gb: 2; mig.strategy mixed) are not offered"),
    ("MIG mixed beside whole GPUs: the whole GPUs only", {"nvidia.com/gpu": "4", "nvidia.com/mig-1g.10gb": "14"},
     gfd(A100, **{"nvidia.com/mig.strategy": "mixed"}), (4, "nvidia.com/gpu", False, A100), "a100-sxm4-80gb",
     "MIG devices (nvidia.com/mig-1g.10gb: 14; mig.strategy mixed) are not offered"),
    ("no GPU", {}, {}, (0, "nvidia.com/gpu", False, None), None, ""),
]


@pytest.mark.parametrize("case, alloc, labels, offer, flavor, note", OFFERS, ids=[c[0] for c in OFFERS])
def test_what_a_node_offers(case, alloc, labels, offer, flavor, note):
    n = node(alloc, labels)
    got = gpu_offer(n)
    assert (got.count, got.resource, got.sharable, got.product) == offer
    assert note in got.note and bool(got.note) == bool(note)
    info = node_info(n)
    assert (info.gpu_count, info.gpu_flavor, info.gpu_sharable) == (offer[0], flavor, offer[2] and offer[0] > 0)
    assert info.gpu_product == (offer[3] if offer[0] else None)


def test_a_mig_device_carries_its_own_memory():
    info = node_info(node({"nvidia.com/gpu": "14"}, gfd("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
                                                        **{"nvidia.com/gpu.memory": "4864"})))
    assert info.gpu_memory_mib == 4864


def test_a_long_product_keeps_its_shared_flavor_a_valid_name():
    info = node_info(node({"nvidia.com/gpu": "8"}, gfd("NVIDIA-" + "X" * 70 + "-SHARED", **TS)))
    assert info.gpu_flavor.endswith("-shared") and len(info.gpu_flavor) <= 63


def workload(placement: NodeAssignment, **fields) -> Workload:
    return Workload(job_id="f1", attempt=1, spec=spec(**{"gpus": 1, **fields}), flavor="a100-sxm4-80gb-shared",
                    placement=(placement,))


@pytest.mark.parametrize("resources, resource", [
    ({"ts-0": "nvidia.com/gpu.shared"}, "nvidia.com/gpu.shared"),
    ({"ts-0": "nvidia.com/gpu"}, "nvidia.com/gpu"),
    (None, "nvidia.com/gpu"),
])
def test_a_fractional_member_asks_for_one_replica_on_its_node(resources, resource):
    w = workload(NodeAssignment(node="ts-0", gpus=1, gpu_indices=(0,), gpu_milli=250), gpu_milli=250)
    (job,) = job_manifests(w, JobOptions(), resources)
    pod = job["spec"]["template"]["spec"]
    res = pod["containers"][0]["resources"]
    gpu_keys = {k for k in res["limits"] if k.startswith("nvidia.com/")}
    assert gpu_keys == {resource} and res["limits"][resource] == res["requests"][resource] == "1"
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0]["values"] == ["ts-0"]
    assert job["metadata"]["annotations"]["gpusched.io/gpu-milli"] == "250"


def test_whole_gpus_on_a_time_sliced_node_are_replicas_of_its_resource():
    w = workload(NodeAssignment(node="ts-0", gpus=2, gpu_indices=(0, 1)), gpus=2)
    (job,) = job_manifests(w, JobOptions(), {"ts-0": "nvidia.com/gpu.shared"})
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu.shared"] == "2"
    assert "gpusched.io/gpu-milli" not in job["metadata"]["annotations"]


# -- the sim ------------------------------------------------------------------------------------


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text(text)
    return p


def test_a_cluster_group_may_share_its_gpus(tmp_path):
    nodes = load_cluster(write(tmp_path, """
groups:
  - {prefix: l4, count: 1, gpu_flavor: l4, gpu_count: 1, gpu_sharable: true}
  - {prefix: a100, count: 1, gpu_flavor: a100, gpu_count: 8}
""")).nodes()
    assert [(n.name, n.gpu_sharable) for n in nodes] == [("l4-0", True), ("a100-0", False)]


@pytest.mark.parametrize("text, fragment", [
    ("groups:\n  - {prefix: c, count: 1, gpu_sharable: true}\n",
     "groups.0: Value error, gpu_sharable needs GPUs to share: a gpu_flavor and gpu_count ≥ 1 (got gpu_flavor None, "
     "gpu_count 0)"),
    ("groups:\n  - {prefix: c, count: 1, gpu_flavor: l4, gpu_count: 1, gpu_sharable: maybe}\n",
     "groups.0.gpu_sharable: Input should be a valid boolean"),
])
def test_a_sharable_group_is_checked(tmp_path, text, fragment):
    with pytest.raises(ClusterSpecError, match="cluster spec .*: ") as err:
        load_cluster(write(tmp_path, text))
    assert fragment in str(err.value)


def test_the_example_cluster_shares_its_l4s():
    nodes = load_cluster(REPO / "gpusched" / "examples" / "cluster.yaml").nodes()
    assert {n.gpu_flavor for n in nodes if n.gpu_sharable} == {"l4"}


class Platform:
    """Quota, scheduler and the sim executor on one log, on a virtual clock."""

    def __init__(self, cluster_yaml: Path) -> None:
        self.cores = (QuotaCore(), SchedulerCore(), SimExecutorCore(load_cluster(cluster_yaml).nodes()))
        self.log = Log()
        self.seq = 0
        self.feed(queue("research", ("team-a",), {"l4": 8}, when=T0), now=T0)

    def feed(self, *events, now):
        for e in events:
            if self.log.append(e):
                for core in self.cores:
                    core.evolve(e)
        for _ in range(100):
            new = [e for core in self.cores for e in core.decide(now) if self.log.append(e)]
            if not new:
                return
            for e in new:
                for core in self.cores:
                    core.evolve(e)
        raise AssertionError("still deciding")

    def submit(self, job_id: str, milli: int, pc: str, runtime: float, now):
        self.seq += 1
        s = spec(gpus=1, gpu_milli=milli, priority_class=pc, gpu_flavors=("l4",), expected_runtime_seconds=runtime)
        self.feed(submitted(job_id, s, seq=self.seq, when=now),
                  admitted(job_id, priority=DEFAULT_PRIORITY_CLASSES[pc].value,
                           preemptible=DEFAULT_PRIORITY_CLASSES[pc].preemptible, when=now), now=now)

    def of(self, job_id: str, kind: type) -> list:
        return [e for e in self.log.events if e.aggregate_id == job_id and isinstance(e, kind)]


def test_fractional_jobs_share_a_gpu_in_the_sim_and_one_is_preempted_and_runs_again(tmp_path):
    p = Platform(write(tmp_path, "groups:\n  - {prefix: l4, count: 1, gpu_flavor: l4, gpu_count: 1, "
                                 "cpu_millis: 64000, memory_mib: 262144, gpu_sharable: true}\n"))
    p.submit("half-a", 500, "batch-low", 3600, at(0))
    p.submit("half-b", 500, "batch-low", 3600, at(1))
    for j in ("half-a", "half-b"):  # both on the one GPU, at once
        (s,) = p.of(j, JobScheduled)
        assert [(a.node, a.gpu_indices, a.gpu_milli) for a in s.placement] == [("l4-0", (0,), 500)]
        assert p.of(j, JobStarted)

    p.submit("urgent", 500, "inference-sla", 60, at(100))  # the GPU is full: a half must make room
    (victim,) = [e.aggregate_id for e in p.log.events if isinstance(e, PreemptionRequested)]
    assert victim in ("half-a", "half-b") and not p.of(victim, JobPreempted)  # the notice: batch-low's 10 s grace
    p.feed(now=at(110))  # the deadline: the sim stops the victim, the urgent job takes its half
    assert [e.occurred_at for e in p.of(victim, JobPreempted)] == [at(110)]
    (s,) = p.of("urgent", JobScheduled)
    assert [(a.node, a.gpu_milli) for a in s.placement] == [("l4-0", 500)] and p.of("urgent", JobStarted)

    p.feed(now=at(170))  # urgent ends; the victim's next attempt takes its half back
    assert p.of("urgent", JobSucceeded)
    again = [e for e in p.of(victim, JobScheduled) if e.attempt == 2]
    assert again and again[0].placement[0].gpu_milli == 500 and [e.attempt for e in p.of(victim, JobStarted)] == [1, 2]
    p.feed(now=at(170) + timedelta(seconds=3600))
    assert {e.aggregate_id for e in p.log.events if isinstance(e, JobSucceeded)} == {"half-a", "half-b", "urgent"}
