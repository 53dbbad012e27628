"""Fixtures for the executor backends: the three backends under the one contract suite, and
the real Kubernetes control plane (``make test-k8s`` sets GPUSCHED_K8S_TESTS=1; without it the
kubernetes cases are skipped, so ``make test`` needs no Go build)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from schemas import JobStarted
from schemas.node import NodeInfo
from tests.executor.harness import Backend

K8S = os.environ.get("GPUSCHED_K8S_TESTS") == "1"
from tests.executor.controlplane.cluster import EXECUTOR_SA, NAMESPACE, PLATFORM_NAMESPACE


@pytest.fixture(scope="session")
def control_plane():
    if not K8S:
        pytest.skip("the Kubernetes tests run with `make test-k8s` (GPUSCHED_K8S_TESTS=1)")
    from tests.executor.controlplane import cluster

    plane = cluster.start()
    try:
        cluster.prepare(plane)
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def executor_token(control_plane) -> str:
    from kubernetes import client

    core = client.CoreV1Api(control_plane.api_client())
    tr = core.create_namespaced_service_account_token(
        EXECUTOR_SA, PLATFORM_NAMESPACE, {"spec": {"audiences": [], "expirationSeconds": 7200}})
    return tr.status.token


@pytest.fixture(scope="session")
def executor_api(control_plane, executor_token):
    """An API client with exactly the executor ServiceAccount's rights."""
    return control_plane.token_client(executor_token)


def _sim_backend() -> Backend:
    from services.executor.sim import SimExecutorCore

    nodes = [NodeInfo(name="sim-0", gpu_flavor="a100", gpu_product="NVIDIA-A100-SXM4-80GB", gpu_count=8,
                      gpu_memory_mib=81920), NodeInfo(name="sim-1", gpu_flavor="a100", gpu_count=8)]
    cores: list = []

    def make_core():
        core = SimExecutorCore(nodes)
        cores.append(core)
        return core

    def lose(node: str) -> None:
        for c in cores:
            c.backend.nodes = [n for n in c.backend.nodes if n.name != node]

    return Backend(name="sim", make_core=make_core, make_backend=lambda: None, node="sim-0", gpus=1,
                   honours_grace=True, count_runs=lambda driver, job: len(driver.events(job, JobStarted)),
                   lose_node=lose, spare_node="sim-1")


def _local_backend(root: Path) -> Backend:
    from services.executor.lifecycle import BackendCore
    from services.executor.local import LocalBackend

    def count(driver, job: str) -> int:
        return sum(1 for d in (root / "runs").glob("*") if (d / "run.json").exists()
                   and yaml.safe_load((d / "run.json").read_text())["job_id"] == job)

    return Backend(name="local", make_core=BackendCore,
                   make_backend=lambda: LocalBackend(root, node_name="local-0", telemetry_s=1),
                   node="local-0", gpus=0, honours_grace=True, count_runs=count,
                   close=lambda backend: backend.close())


def _k8s_backend(plane, api) -> Backend:
    from kubernetes import client

    from services.executor.k8s_model import L_JOB, JobOptions
    from services.executor.kubernetes import KubernetesBackend
    from services.executor.lifecycle import BackendCore

    admin = client.CoreV1Api(plane.api_client())
    seen_pods: dict[str, set[str]] = {}

    def count(driver, job: str) -> int:
        pods = admin.list_namespaced_pod(NAMESPACE, label_selector=f"{L_JOB}={job}").items
        seen_pods.setdefault(job, set()).update(p.metadata.uid for p in pods)
        return len(seen_pods[job])

    def lose(node: str) -> None:
        admin.delete_node(node)

    opts = JobOptions(namespace=NAMESPACE, default_grace_s=30)
    return Backend(name="kubernetes", make_core=BackendCore,
                   make_backend=lambda: KubernetesBackend(opts, api_client=api, resync_s=60),
                   node="kwok-gpu-0", gpus=1, honours_grace=True, count_runs=count,
                   close=lambda backend: backend.close(), lose_node=lose, spare_node="kwok-gpu-1")


@pytest.fixture(params=["sim", "local", "kubernetes"])
def backend(request, tmp_path) -> Backend:
    if request.param == "sim":
        return _sim_backend()
    if request.param == "local":
        return _local_backend(tmp_path / "local")
    plane = request.getfixturevalue("control_plane")
    return _k8s_backend(plane, request.getfixturevalue("executor_api"))
