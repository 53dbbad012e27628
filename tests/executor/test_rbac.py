"""The teams' Jobs run in a namespace without the platform's Secrets, and neither a workload Pod
nor the executor can read a Secret anywhere: checked on a real kube-apiserver with RBAC and the
manifests of k8s/base (`make test-k8s`).

A workload Pod authenticates as its namespace's ``default`` ServiceAccount; a token of it (the
token a Pod there would get) is exactly that Pod's identity."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime

import pytest
import yaml

from schemas import JobStarted
from tests.executor.conftest import NAMESPACE, PLATFORM_NAMESPACE
from tests.executor.controlplane.cluster import REPO
from tests.executor.harness import Driver, work
from tests.unit import builders as b


@pytest.fixture(scope="module")
def workload_api(control_plane):
    from kubernetes import client

    core = client.CoreV1Api(control_plane.api_client())
    token = core.create_namespaced_service_account_token(
        "default", NAMESPACE, {"spec": {"audiences": [], "expirationSeconds": 3600}}).status.token
    return control_plane.token_client(token)


def refused(call) -> int:
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as err:
        call()
    return err.value.status


def test_a_workload_pod_reads_no_secret_and_nothing_else(workload_api):
    from kubernetes import client

    core, batch = client.CoreV1Api(workload_api), client.BatchV1Api(workload_api)
    tries = {
        "get the NATS Secret of the platform": lambda: core.read_namespaced_secret("gpusched-nats-executor",
                                                                                   PLATFORM_NAMESPACE),
        "list the platform's Secrets": lambda: core.list_namespaced_secret(PLATFORM_NAMESPACE),
        "get a Secret of its own namespace": lambda: core.read_namespaced_secret("gpusched-nats-executor", NAMESPACE),
        "list its own namespace's Secrets": lambda: core.list_namespaced_secret(NAMESPACE),
        "list Secrets cluster-wide": lambda: core.list_secret_for_all_namespaces(),
        "list the Pods next to it": lambda: core.list_namespaced_pod(NAMESPACE),
        "create a Job": lambda: batch.create_namespaced_job(NAMESPACE, {
            "metadata": {"name": "escape"}, "spec": {"template": {"spec": {
                "restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}}}}),
        "mint a token for the executor": lambda: core.create_namespaced_service_account_token(
            "gpusched-executor", PLATFORM_NAMESPACE, {"spec": {"audiences": []}}),
    }
    statuses = {what: refused(call) for what, call in tries.items()}
    assert statuses == {what: 403 for what in tries}


def test_the_executor_reads_no_secret_and_runs_jobs_only_in_the_workload_namespace(executor_api):
    from kubernetes import client

    core, batch = client.CoreV1Api(executor_api), client.BatchV1Api(executor_api)
    job = {"metadata": {"name": "rbac-probe"}, "spec": {"template": {"spec": {
        "restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}}}}
    batch.create_namespaced_job(NAMESPACE, job)
    batch.delete_namespaced_job("rbac-probe", NAMESPACE, propagation_policy="Background")
    tries = {
        "get a platform Secret": lambda: core.read_namespaced_secret("gpusched-nats-executor", PLATFORM_NAMESPACE),
        "list the platform's Secrets": lambda: core.list_namespaced_secret(PLATFORM_NAMESPACE),
        "get a Secret where the Jobs run": lambda: core.read_namespaced_secret("gpusched-nats-executor", NAMESPACE),
        "create a Job in the platform's namespace": lambda: batch.create_namespaced_job(PLATFORM_NAMESPACE, job),
        "list Pods in the platform's namespace": lambda: core.list_namespaced_pod(PLATFORM_NAMESPACE),
    }
    statuses = {what: refused(call) for what, call in tries.items()}
    assert statuses == {what: 403 for what in tries}


def test_the_workload_namespace_is_bound_to_nothing_and_mounts_no_token(control_plane):
    """As applied from k8s/base: its default ServiceAccount mounts no token, the only binding in it
    is the executor's (whose subject lives in gpusched), and no ClusterRoleBinding names it."""
    from kubernetes import client

    api = control_plane.api_client()
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    assert core.read_namespaced_service_account("default", NAMESPACE).automount_service_account_token is False
    bindings = rbac.list_namespaced_role_binding(NAMESPACE).items
    assert [(rb.metadata.name, [(s.kind, s.namespace, s.name) for s in rb.subjects]) for rb in bindings] == [
        ("gpusched-executor", [("ServiceAccount", PLATFORM_NAMESPACE, "gpusched-executor")])]
    for crb in rbac.list_cluster_role_binding().items:
        for s in crb.subjects or ():
            assert s.namespace != NAMESPACE and NAMESPACE not in s.name, crb.metadata.name


def _deployment_env() -> dict[str, str]:
    """The plain-valued variables the executor's Deployment in k8s/base sets."""
    for doc in yaml.safe_load_all((REPO / "k8s/base/deployment-executor.yaml").read_text()):
        if doc and doc["kind"] == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            return {e["name"]: e["value"] for e in container["env"] if "value" in e}
    raise AssertionError("no Deployment in k8s/base/deployment-executor.yaml")


def test_the_executor_as_deployed_starts_a_job_in_the_workload_namespace(control_plane, executor_api, monkeypatch):
    """The executor, configured by its Deployment's variables and authenticated as its
    ServiceAccount, creates the job's Job in gpusched-workloads (none in gpusched), and the Pod
    there gets no API token."""
    from kubernetes import client

    from services.executor.config import ExecutorConfig
    from services.executor.kubernetes import KubernetesBackend
    from tests.executor.conftest import _k8s_backend
    from tests.executor.controlplane.cluster import ensure_nodes

    for name in ("GPUSCHED_K8S_NAMESPACE", "GPUSCHED_K8S_SERVICE_ACCOUNT", "GPUSCHED_K8S_CHECKPOINT_ROOT",
                 "GPUSCHED_K8S_TTL_AFTER_FINISHED_S", "GPUSCHED_K8S_DEFAULT_GRACE_S", "GPUSCHED_K8S_RESYNC_S"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _deployment_env().items():
        if name.startswith("GPUSCHED_K8S_"):
            monkeypatch.setenv(name, value)
    options = ExecutorConfig.from_env().k8s
    assert options.namespace == NAMESPACE

    ensure_nodes(control_plane)
    spec = dataclasses.replace(_k8s_backend(control_plane, executor_api),
                               make_backend=lambda: KubernetesBackend(options, api_client=executor_api, resync_s=60))
    driver = Driver(spec)
    api = control_plane.api_client()
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    j = f"rbac-{uuid.uuid4().hex[:6]}"
    selector = f"gpusched.io/job-id={j}"
    try:
        driver.submit_and_schedule(j, work(None, gpus=1))
        driver.until(lambda: driver.first(j, JobStarted))
        jobs = batch.list_job_for_all_namespaces(label_selector=selector).items
        assert [(job.metadata.namespace, job.metadata.name) for job in jobs] == [(NAMESPACE, f"{j}-a1-m0")]
        pods = core.list_pod_for_all_namespaces(label_selector=selector).items
        assert pods and {p.metadata.namespace for p in pods} == {NAMESPACE}
        for pod in pods:
            assert pod.spec.service_account_name == "default"
            mounted = [v.name for v in pod.spec.volumes or () if v.projected and any(
                src.service_account_token for src in v.projected.sources or ())]
            assert mounted == [], pod.metadata.name
        driver.feed(b.cancel_requested(j, when=datetime.now(UTC)))
        driver.until(lambda: all(p.status.phase in ("Succeeded", "Failed") or p.metadata.deletion_timestamp
                                 for p in core.list_namespaced_pod(NAMESPACE, label_selector=selector).items))
    finally:
        driver.stop()
