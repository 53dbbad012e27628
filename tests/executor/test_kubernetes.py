"""The kubernetes backend against the real control plane of ``make test-k8s``: what it creates,
what it reads from Nodes, how it classifies failures, and that the executor's RBAC in k8s/base
is enough and no larger."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from schemas import FailureReason, JobFailed, JobStarted, NodeRegistered, NodeUpdated
from tests.executor.conftest import NAMESPACE
from tests.executor.harness import Driver, work
from tests.unit import builders as b


@pytest.fixture
def k8s(control_plane, executor_api):
    from tests.executor.conftest import _k8s_backend

    return _k8s_backend(control_plane, executor_api)


@pytest.fixture
def driver(k8s):
    d = Driver(k8s)
    d.until(lambda: any(isinstance(e, NodeRegistered) and e.aggregate_id == k8s.node for e in d.log))
    yield d
    d.stop()


@pytest.fixture
def admin(control_plane):
    from kubernetes import client

    api = control_plane.api_client()
    return client.CoreV1Api(api), client.BatchV1Api(api)


def test_the_job_as_created_carries_the_placement_and_the_platform_contract(driver, admin):
    core, batch = admin
    j = f"shape-{uuid.uuid4().hex[:6]}"
    spec = work(None, gpus=2, max_runtime_seconds=600, queue="research", env={"EPOCHS": "3"})
    now = datetime.now(UTC)
    driver.feed(b.submitted(j, spec, when=now), b.admitted(j, when=now),
                b.scheduled(j, {"kwok-gpu-0": (2, 3)}, when=now))  # the placement's GPUs, not the spec's
    driver.until(lambda: driver.first(j, JobStarted))
    job = batch.read_namespaced_job(f"{j}-a1-m0", NAMESPACE)
    labels = job.metadata.labels
    assert labels["gpusched.io/job-id"] == j and labels["gpusched.io/attempt"] == "1"
    assert labels["gpusched.io/queue"] == "research" and labels["gpusched.io/team"] == "team-a"
    assert labels["gpusched.io/priority-class"] == "training"
    assert job.spec.backoff_limit == 0 and job.spec.active_deadline_seconds == 600
    pod = job.spec.template.spec
    c = pod.containers[0]
    assert c.resources.limits["nvidia.com/gpu"] == "2"
    assert job.metadata.annotations["gpusched.io/gpu-indices"] == "2,3"
    env = {e.name: e.value for e in c.env}
    assert env["GPUSCHED_JOB_ID"] == j and env["GPUSCHED_ATTEMPT"] == "1" and env["GPUSCHED_RESUME"] == "0"
    assert env["GPUSCHED_CHECKPOINT_DIR"] == f"/checkpoints/team-a/{j}" and env["EPOCHS"] == "3"
    term = pod.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[0]
    assert term.match_expressions[0].values == ["kwok-gpu-0"]
    assert any(t.key == "nvidia.com/gpu" for t in pod.tolerations)
    pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"gpusched.io/job-id={j}").items
    assert [p.spec.node_name for p in pods] == ["kwok-gpu-0"]  # the real scheduler honoured the placement
    driver.feed(b.cancel_requested(j, when=datetime.now(UTC)))


def test_inventory_comes_from_the_node_objects(driver, admin):
    core, _ = admin
    reg = [e for e in driver.log if isinstance(e, NodeRegistered) and e.aggregate_id == "kwok-gpu-0"][0].node
    assert (reg.gpu_count, reg.gpu_product, reg.gpu_memory_mib) == (8, "NVIDIA-A100-SXM4-80GB", 81920)
    assert reg.gpu_flavor == "a100-sxm4-80gb" and "rdma" in reg.features
    assert reg.labels["topology.gpusched.io/rack"] == "rack-1"
    assert "nvidia.com/gpu=present:NoSchedule" in reg.taints and not reg.unschedulable
    core.patch_node("kwok-gpu-0", {"spec": {"unschedulable": True}})
    try:
        upd = driver.until(lambda: [e for e in driver.log if isinstance(e, NodeUpdated)
                                    and e.aggregate_id == "kwok-gpu-0" and e.node.unschedulable])
        assert upd
    finally:
        core.patch_node("kwok-gpu-0", {"spec": {"unschedulable": False}})


def test_max_runtime_is_a_deadline_failure(driver):
    j = f"deadline-{uuid.uuid4().hex[:6]}"
    driver.submit_and_schedule(j, work(None, gpus=1, max_runtime_seconds=2))
    failed = driver.until(lambda: driver.first(j, JobFailed), timeout=60)
    assert failed.reason == FailureReason.DEADLINE_EXCEEDED


def test_oom_killed_is_classified(driver):
    j = f"oom-{uuid.uuid4().hex[:6]}"
    spec = work(1, exit_code=137, gpus=1)
    spec = spec.model_copy(update={"annotations": {**spec.annotations, "kwok.gpusched.io/reason": "OOMKilled"}})
    driver.submit_and_schedule(j, spec)
    failed = driver.until(lambda: driver.first(j, JobFailed), timeout=60)
    assert (failed.reason, failed.exit_code) == (FailureReason.OOM_KILLED, 137)


def test_an_orphan_job_is_deleted(driver, admin, k8s):
    _, batch = admin
    from services.executor.k8s_model import JobOptions, job_manifests
    from services.executor.lifecycle import Workload
    from schemas.job import NodeAssignment

    w = Workload(job_id="orphan-x", attempt=1, spec=work(None, gpus=1), flavor="a100",
                 placement=(NodeAssignment(node="kwok-gpu-0", gpus=1, gpu_indices=(0,)),))
    batch.create_namespaced_job(NAMESPACE, job_manifests(w, JobOptions(namespace=NAMESPACE))[0])

    def gone():
        from kubernetes.client.exceptions import ApiException

        try:
            j = batch.read_namespaced_job("orphan-x-a1-m0", NAMESPACE)
            return j.metadata.deletion_timestamp is not None
        except ApiException as err:
            return err.status == 404

    driver.until(gone, timeout=30)


def test_the_executor_role_is_enough_and_no_larger(executor_api):
    """What the executor does (create/watch/delete Jobs, delete Pods, read Nodes) passes the
    contract tests with this ServiceAccount's token; everything else is refused."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core, batch = client.CoreV1Api(executor_api), client.BatchV1Api(executor_api)
    batch.list_namespaced_job(NAMESPACE)
    core.list_namespaced_pod(NAMESPACE)
    core.list_node()
    forbidden = [
        ("read Secrets", lambda: core.list_namespaced_secret(NAMESPACE)),
        ("create Pods directly", lambda: core.create_namespaced_pod(NAMESPACE, {
            "metadata": {"name": "direct"}, "spec": {"containers": [{"name": "c", "image": "x"}]}})),
        ("create Jobs in another namespace", lambda: batch.create_namespaced_job("default", {
            "metadata": {"name": "elsewhere"}, "spec": {"template": {"spec": {
                "restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}}}})),
        ("delete Nodes", lambda: core.delete_node("kwok-gpu-0")),
        ("patch Nodes", lambda: core.patch_node("kwok-gpu-0", {"spec": {"unschedulable": True}})),
        ("update Jobs", lambda: batch.patch_namespaced_job("nothing", NAMESPACE, {"metadata": {"labels": {"a": "b"}}})),
        ("list ServiceAccounts", lambda: core.list_namespaced_service_account(NAMESPACE)),
    ]
    for what, call in forbidden:
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 403, what
