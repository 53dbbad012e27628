"""Fixtures for the executor backends: the three backends under the one contract suite, and
the real Kubernetes control plane (``make test-k8s`` sets GPUSCHED_K8S_TESTS=1; without it the
kubernetes cases are skipped, so ``make test`` needs no Go build)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from schemas import JobStarted
from schemas.node import NodeInfo
from tests.executor.harness import Backend

K8S = os.environ.get("GPUSCHED_K8S_TESTS") == "1"
NAMESPACE = "gpusched"
EXECUTOR_SA = "gpusched-executor"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def control_plane():
    if not K8S:
        pytest.skip("the Kubernetes tests run with `make test-k8s` (GPUSCHED_K8S_TESTS=1)")
    from tests.executor.controlplane import cluster

    plane = cluster.start()
    try:
        setup_cluster(plane)
        yield plane
    finally:
        plane.stop()


def setup_cluster(plane) -> None:
    """The gpusched namespace, the executor's ServiceAccount and RBAC exactly as in k8s/base, two
    fake GPU nodes."""
    from kubernetes import client, utils

    from tests.executor.controlplane.cluster import gpu_node

    api = plane.api_client()
    core = client.CoreV1Api(api)
    try:
        core.create_namespace({"metadata": {"name": NAMESPACE}})
    except client.exceptions.ApiException as err:
        if err.status != 409:
            raise
    for name in ("serviceaccounts.yaml", "executor-rbac.yaml"):
        for doc in yaml.safe_load_all((REPO / "k8s/base" / name).read_text()):
            if not doc:
                continue
            if doc["kind"] == "ServiceAccount" and doc["metadata"]["name"] != EXECUTOR_SA:
                continue
            doc.setdefault("metadata", {})
            if doc["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
                doc["metadata"]["namespace"] = NAMESPACE
            try:
                utils.create_from_dict(api, doc)
            except utils.FailToCreateError as err:
                if not all(getattr(e, "status", None) == 409 for e in err.api_exceptions):
                    raise
    for n in ("kwok-gpu-0", "kwok-gpu-1"):
        try:
            core.create_node(gpu_node(n))
        except client.exceptions.ApiException as err:
            if err.status != 409:
                raise
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        nodes = core.list_node().items
        if len(nodes) >= 2 and all(any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or ())
                                   for n in nodes):
            break
        time.sleep(0.3)
    else:
        raise RuntimeError(f"kwok did not make the nodes Ready:\n{plane.logs('kwok')}")


@pytest.fixture(scope="session")
def executor_token(control_plane) -> str:
    from kubernetes import client

    core = client.CoreV1Api(control_plane.api_client())
    tr = core.create_namespaced_service_account_token(
        EXECUTOR_SA, NAMESPACE, {"spec": {"audiences": [], "expirationSeconds": 7200}})
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
            c.desired.pop(node, None)
            c.decisions_refused()

    return Backend(name="sim", make_core=make_core, make_backend=lambda: None, node="sim-0", gpus=1,
                   honours_grace=False, count_runs=lambda driver, job: len(driver.events(job, JobStarted)),
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
