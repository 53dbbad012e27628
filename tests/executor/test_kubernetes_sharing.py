"""GPU sharing on the real control plane of ``make test-k8s``: a Node whose GPUs NVIDIA's device
plugin time-slices (GPU feature discovery labels, the renamed ``nvidia.com/gpu.shared``
resource) registers as sharable with its physical GPUs; the scheduler core places two
fractional jobs on one of its GPUs; each Pod asks for one replica, is bound to that node by the
real kube-scheduler, runs beside the other (kwok plays the kubelet) and succeeds."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from schemas import JobScheduled, JobStarted, JobSucceeded, NodeRegistered, NodeUpdated
from services.scheduler.domain import SchedulerCore
from tests.executor.conftest import NAMESPACE
from tests.executor.harness import Driver, work
from tests.unit import builders as b

SHARED = "kwok-ts-0"


def time_sliced_node() -> dict:
    """Two NVIDIA L4s time-sliced four ways with renameByDefault, as the device plugin and GPU
    feature discovery describe them (NVIDIA/k8s-device-plugin, "Shared Access to GPUs")."""
    from tests.executor.controlplane.cluster import gpu_node

    n = gpu_node(SHARED, gpus=2, product="NVIDIA-L4", memory_mib=23034, rack="rack-2")
    n["metadata"]["labels"] |= {"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "time-slicing"}
    res = {k: v for k, v in n["status"]["allocatable"].items() if k != "nvidia.com/gpu"}
    res["nvidia.com/gpu.shared"] = "8"
    n["status"] = {"capacity": res, "allocatable": res}
    return n


@pytest.fixture
def shared_node(control_plane):
    from kubernetes import client

    from tests.executor.controlplane.cluster import ensure_nodes

    core = client.CoreV1Api(control_plane.api_client())
    try:
        core.create_node(time_sliced_node())
    except client.exceptions.ApiException as err:
        if err.status != 409:
            raise
    ensure_nodes(control_plane, (SHARED, "kwok-gpu-0", "kwok-gpu-1"))  # creates none of them again; waits for Ready
    yield core
    core.delete_node(SHARED)


@pytest.fixture
def driver(shared_node, control_plane, executor_api):
    from tests.executor.conftest import _k8s_backend

    d = Driver(_k8s_backend(control_plane, executor_api))
    # registered, and Ready as the node lifecycle controller sees it (its not-ready taint removed)
    d.until(lambda: (info := shared_info(d)) is not None and info.taints == ("nvidia.com/gpu=present:NoSchedule",))
    yield d
    d.stop()


def shared_info(d: Driver):
    """The shared node as the log last described it."""
    infos = [e.node for e in d.log if isinstance(e, NodeRegistered | NodeUpdated) and e.aggregate_id == SHARED]
    return infos[-1] if infos else None


def test_fractional_jobs_share_a_time_sliced_gpu(driver, shared_node):
    info = shared_info(driver)
    assert (info.gpu_count, info.gpu_sharable, info.gpu_flavor, info.gpu_product) == (2, True, "l4-shared", "NVIDIA-L4")

    # the scheduler core places them from the executor's own inventory events
    scheduler = SchedulerCore()
    log = b.Log()
    now = datetime.now(UTC)
    jobs = [f"half-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    arrivals = []
    for i, j in enumerate(jobs):
        spec = work(6, gpus=1, gpu_milli=500, gpu_flavors=("l4-shared",), tolerations=("nvidia.com/gpu",))
        arrivals += [b.submitted(j, spec, seq=i + 1, when=now), b.admitted(j, when=now),
                     b.reserved(j, flavor="l4-shared", gpus=1, when=now)]
    nodes = [e for e in driver.log if isinstance(e, NodeRegistered | NodeUpdated)]
    decided = b.drive(scheduler, nodes + arrivals, now, log=log)
    placed = {e.aggregate_id: e for e in decided if isinstance(e, JobScheduled)}
    assert set(placed) == set(jobs), [getattr(e, "message", e.type) for e in decided]
    assert {(a.node, a.gpu_indices, a.gpu_milli) for e in placed.values() for a in e.placement} == {(SHARED, (0,), 500)}

    driver.feed(*arrivals, *placed.values())
    driver.until(lambda: all(driver.first(j, JobStarted) for j in jobs), timeout=60)
    assert not any(driver.first(j, JobSucceeded) for j in jobs)  # both run at once, on one GPU
    for j in jobs:
        (pod,) = shared_node.list_namespaced_pod(NAMESPACE, label_selector=f"gpusched.io/job-id={j}").items
        assert pod.spec.node_name == SHARED  # the real scheduler honoured the placement
        limits = pod.spec.containers[0].resources.limits
        assert {k: v for k, v in limits.items() if k.startswith("nvidia.com/")} == {"nvidia.com/gpu.shared": "1"}
        assert pod.metadata.annotations["gpusched.io/gpu-milli"] == "500"
    driver.until(lambda: all(driver.first(j, JobSucceeded) for j in jobs), timeout=60)
