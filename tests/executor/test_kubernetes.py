"""The kubernetes backend against the real control plane of ``make test-k8s``: what it creates,
what it reads from Nodes, how it classifies failures, and that the executor's RBAC in k8s/base
is enough and no larger."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from schemas import (
    FailureReason, JobFailed, JobReady, JobStarted, JobSucceeded, NodeRegistered, NodeUpdated, ServiceDeleted, new_event,
)
from tests.executor.conftest import NAMESPACE
from tests.executor.harness import Driver, work
from tests.unit import builders as b


@pytest.fixture
def k8s(control_plane, executor_api):
    from tests.executor.conftest import _k8s_backend

    return _k8s_backend(control_plane, executor_api)


@pytest.fixture
def driver(k8s, control_plane):
    from tests.executor.controlplane.cluster import ensure_nodes

    ensure_nodes(control_plane)  # the contract's node-lost case deletes one
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
        ("update Services", lambda: core.patch_namespaced_service("nothing", NAMESPACE, {"spec": {"ports": []}})),
        ("delete Services in another namespace", lambda: core.delete_namespaced_service("kubernetes", "default")),
        ("create Services in another namespace", lambda: core.create_namespaced_service("default", {
            "metadata": {"name": "elsewhere"}, "spec": {"ports": [{"port": 80}]}})),
    ]
    for what, call in forbidden:
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 403, what


def gang(driver, j: str, spec) -> None:
    now = datetime.now(UTC)
    driver.feed(b.submitted(j, spec.model_copy(update={"gang_size": 2}), when=now), b.admitted(j, when=now),
                b.scheduled(j, {"kwok-gpu-0": (0,), "kwok-gpu-1": (0,)}, when=now))


def test_a_gang_is_one_job_per_node_slice_and_starts_when_all_run(driver, admin):
    _, batch = admin
    j = f"gang-{uuid.uuid4().hex[:6]}"
    gang(driver, j, work(2, gpus=1))
    started = driver.until(lambda: driver.first(j, JobStarted))
    assert started.nodes == ("kwok-gpu-0", "kwok-gpu-1")
    jobs = batch.list_namespaced_job(NAMESPACE, label_selector=f"gpusched.io/job-id={j}").items
    assert sorted(x.metadata.name for x in jobs) == [f"{j}-a1-m0", f"{j}-a1-m1"]
    assert {x.metadata.labels["gpusched.io/gang-size"] for x in jobs} == {"2"}
    done = driver.until(lambda: driver.first(j, JobSucceeded), timeout=60)
    assert done.started_at == started.occurred_at


def test_one_failed_member_fails_the_gang_and_stops_the_rest(driver, admin):
    core, _ = admin
    j = f"gangf-{uuid.uuid4().hex[:6]}"
    gang(driver, j, work(None, gpus=1))
    driver.until(lambda: driver.first(j, JobStarted))
    # member 1 crashes with exit code 5 (kwok ends it when it carries these annotations)
    [p1] = core.list_namespaced_pod(NAMESPACE, label_selector=f"gpusched.io/job-id={j},gpusched.io/member=1").items
    core.patch_namespaced_pod(p1.metadata.name, NAMESPACE, {"metadata": {"annotations": {
        "kwok.gpusched.io/exit-code": "5", "kwok.gpusched.io/run-for": "0s"}}})
    failed = driver.until(lambda: driver.first(j, JobFailed), timeout=60)
    assert (failed.reason, failed.exit_code) == (FailureReason.EXIT_CODE, 5)

    def member0_stopped():
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"gpusched.io/job-id={j},gpusched.io/member=0")
        return all(p.status.phase in ("Succeeded", "Failed") or p.metadata.deletion_timestamp for p in pods.items)

    driver.until(member0_stopped, timeout=30)


async def test_the_executor_service_against_nats_and_the_cluster(nats_server, admin_js, control_plane, executor_api):
    """The real service loop: the log in NATS, the reconcile side loop, the cluster."""
    from conftest import eventually, running, service_settings
    from runtime import eventlog
    from schemas import parse_event
    from services.executor.k8s_model import JobOptions
    from services.executor.kubernetes import KubernetesBackend
    from services.executor.lifecycle import BackendCore
    from services.executor.service import ExecutorService
    from tests.executor.controlplane.cluster import ensure_nodes

    ensure_nodes(control_plane)
    log = eventlog.EventLog(admin_js)
    j = f"svc-{uuid.uuid4().hex[:6]}"
    service = ExecutorService("executor", BackendCore(), service_settings(nats_server, "executor"),
                              backend=KubernetesBackend(JobOptions(namespace=NAMESPACE), api_client=executor_api),
                              sync_s=0.2)
    async with running(service):
        now = datetime.now(UTC)
        seq = await log.append(b.submitted(j, work(1, gpus=1), when=now), expected_last_seq=0)
        await log.append(b.scheduled(j, {"kwok-gpu-0": (0,)}, when=now), expected_last_seq=seq)

        async def types():
            return [parse_event(m.data).type async for m in eventlog.read(admin_js, subjects=[f"gpusched.job.{j}.>"])]

        async def done():
            t = await types()
            return t if t[-1:] == ["JobSucceeded"] else None

        assert await eventually(done, timeout_s=60) == ["JobSubmitted", "JobScheduled", "JobStarted", "JobSucceeded"]
    nodes = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=["gpusched.node.>"])]
    assert {"kwok-gpu-0", "kwok-gpu-1"} <= {n.aggregate_id for n in nodes}


def test_a_services_replicas_carry_its_label_and_probe_and_one_service_routes_to_them(driver, admin):
    """Two replicas of an inference service (docs/serving.md): each its own Job pinned to its node,
    labelled with the service, with the readiness probe from its spec, and ready (JobReady) when
    the Pod's Ready condition says its probe passed; one v1 Service selects them, and goes with
    the service."""
    from kubernetes.client.exceptions import ApiException

    core, batch = admin
    name = f"svc-{uuid.uuid4().hex[:6]}"
    ann = {"gpusched.io/service": name, "gpusched.io/readiness-path": "/healthz", "gpusched.io/readiness-port": "8000",
           "gpusched.io/readiness-delay": "1",
           "kwok.gpusched.io/ready-after": "4s"}  # kwok's stand-in for a probe that passes 4 s after the start
    spec = work(None, kind="inference", priority_class="inference-sla")
    spec = spec.model_copy(update={"annotations": {**spec.annotations, **ann}})
    replicas = [f"replica-{name}-1-{i}" for i in range(2)]
    now = datetime.now(UTC)
    driver.feed(b.service_deployed(b.service_spec(name=name, team=spec.team, queue_=spec.queue), when=now))
    for i, j in enumerate(replicas):
        driver.feed(b.submitted(j, spec, when=now), b.admitted(j, priority=1000, preemptible=False, when=now),
                    b.scheduled(j, {f"kwok-gpu-{i}": (0,)}, when=now))
    driver.until(lambda: all(driver.first(j, JobStarted) for j in replicas), timeout=60)
    assert not any(driver.first(j, JobReady) for j in replicas)  # running, the probe not passing yet
    driver.until(lambda: all(driver.first(j, JobReady) for j in replicas), timeout=30)
    for j in replicas:
        took = (driver.first(j, JobReady).occurred_at - driver.first(j, JobStarted).occurred_at).total_seconds()
        assert took >= 3, took  # when the probe passed (4 s, to the second), not the 1 s delay
    for i, j in enumerate(replicas):
        job = batch.read_namespaced_job(f"{j}-a1-m0", NAMESPACE)
        assert job.spec.template.metadata.labels["gpusched.io/service"] == name
        c = job.spec.template.spec.containers[0]
        probe = c.readiness_probe
        assert (probe.http_get.path, probe.http_get.port, probe.initial_delay_seconds) == ("/healthz", 8000, 1)
        assert [p.container_port for p in c.ports] == [8000]
    svc = core.read_namespaced_service(name, NAMESPACE)
    assert svc.spec.selector == {"app.kubernetes.io/managed-by": "gpusched-executor", "gpusched.io/service": name}
    assert [(p.port, p.target_port) for p in svc.spec.ports] == [(8000, 8000)]
    pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"gpusched.io/service={name}").items
    assert sorted(p.spec.node_name for p in pods) == ["kwok-gpu-0", "kwok-gpu-1"]
    for j in replicas:
        driver.feed(b.cancel_requested(j, when=datetime.now(UTC)))
    driver.feed(new_event(ServiceDeleted, aggregate_id=name, producer="admission", occurred_at=datetime.now(UTC),
                          key="deleted", deleted_by="alice", intake_sequence=2))

    def service_gone() -> bool:
        try:
            core.read_namespaced_service(name, NAMESPACE)
            return False
        except ApiException as err:
            return err.status == 404
    driver.until(service_gone, timeout=30)
