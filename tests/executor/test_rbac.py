"""The teams' Jobs run in a namespace without the platform's Secrets, and neither a workload Pod
nor the executor can read a Secret anywhere: checked on a real kube-apiserver with RBAC and the
manifests of k8s/base (`make test-k8s`).

A workload Pod authenticates as its namespace's ``default`` ServiceAccount; a token of it (the
token a Pod there would get) is exactly that Pod's identity."""

from __future__ import annotations

import pytest

from tests.executor.conftest import NAMESPACE, PLATFORM_NAMESPACE


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
