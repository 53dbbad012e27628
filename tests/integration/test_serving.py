"""Inference services end to end against a real nats-server: admission, quota, scheduler, the
sim executor and the serving controller as services. A team deploys and scales a service from
its own credential; an urgent scale-up of an SLA service preempts the team's low-priority
training jobs, which requeue; losing a node re-places its SLA replica first; deleting the service
retires every replica."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from datetime import UTC, datetime

import pytest

from conftest import connect_as, eventually, running, service_settings
from runtime import eventlog
from runtime.clock import ScaledClock
from runtime.loop import DecisionService
from schemas import DEFAULT_PRIORITY_CLASSES, QueueConfigured, new_event, parse_event
from schemas.node import NodeInfo
from schemas.queue import FlavorQuota, PreemptionPolicy
from services.admission.__main__ import AdmissionService
from services.admission.domain import AdmissionCore
from services.executor.sim import SimExecutorCore
from services.quota.domain import QuotaCore
from services.scheduler.domain import SchedulerCore
from services.serving.domain import ServingCore

NOW = datetime(2026, 1, 1, tzinfo=UTC)
CLOCK = ScaledClock(time_scale=100.0)  # readiness after 5 s is 50 ms
NODES = [NodeInfo(name=f"n{i}", gpu_flavor="a100", gpu_count=4, gpu_memory_mib=40960) for i in range(2)]


def service_doc(desired: int, *, image: str = "srv:1", lo: int = 1, hi: int = 8) -> dict:
    return {"spec": {"name": "chat", "team": "team-a", "queue": "research",
                     "replicas": {"min": lo, "max": hi, "desired": desired},
                     "replica": {"kind": "inference", "queue": "research", "team": "team-a", "image": image,
                                 "gpus": 1, "priority_class": "inference-sla"},
                     "readiness": {"delay_seconds": 5}}}


def training(job_id: str) -> dict:
    return {"job_id": job_id, "spec": {"kind": "training", "queue": "research", "team": "team-a", "image": "t",
                                       "gpus": 1, "priority_class": "batch-low", "expected_runtime_seconds": 1e6}}


async def events(js, subject: str) -> list:
    return [parse_event(m.data) async for m in eventlog.read(js, subjects=[subject])]


async def ready_replicas(js) -> set[str]:
    """Replicas whose latest attempt was told ready and not lost or retired since."""
    state: dict[str, str] = {}
    for e in await events(js, "gpusched.service.chat.>"):
        if e.type in ("ReplicaReady", "ReplicaLost", "ReplicaRetired"):
            state[e.job_id] = e.type
    return {j for j, t in state.items() if t == "ReplicaReady"}


@pytest.fixture
async def platform(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(new_event(QueueConfigured, aggregate_id="research", producer="config", occurred_at=NOW, key="1",
                               name="research", allowed_teams=("team-a",),
                               quotas=(FlavorQuota(flavor="a100", nominal=8),),
                               preemption=PreemptionPolicy(within_queue="lower-priority")))
    executor = SimExecutorCore(list(NODES))
    cores = {"quota": QuotaCore(), "scheduler": SchedulerCore(), "executor": executor, "serving": ServingCore()}
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(AdmissionService(
            "admission", AdmissionCore(DEFAULT_PRIORITY_CLASSES), service_settings(nats_server, "admission"), CLOCK)))
        for name, core in cores.items():
            await stack.enter_async_context(running(DecisionService(name, core, service_settings(nats_server, name),
                                                                    CLOCK)))
        tenant = await connect_as(nats_server, "team-a")
        stack.push_async_callback(tenant.close)
        yield admin_js, tenant.jetstream(), executor


async def publish(js, verb: str, body: dict) -> int:
    return (await js.publish(f"gpusched.intake.team-a.{verb}", json.dumps(body).encode())).seq


async def test_deploy_scale_urgent_scale_up_node_loss_and_delete(platform):
    admin, tenant, executor = platform
    await publish(tenant, "deploy", service_doc(2))
    await eventually(lambda: _count(ready_replicas(admin), 2), timeout_s=20)

    # the rest of the cluster fills with the team's low-priority training
    for i in range(6):
        await publish(tenant, "submit", training(f"train-{i}"))
    await eventually(lambda: _started(admin, 6), timeout_s=20)

    # urgent scale-up: no free GPU, no free quota; lower classes are preempted, and requeue
    await publish(tenant, "scale", {"service": "chat", "replicas": 4})
    await eventually(lambda: _count(ready_replicas(admin), 4), timeout_s=30)
    preempted = {e.aggregate_id for e in await events(admin, "gpusched.job.*.preempted")}
    assert len(preempted) == 2 and all(j.startswith("train-") for j in preempted)
    requeued = {e.aggregate_id for e in await events(admin, "gpusched.job.*.retry_scheduled")
                if e.after == "JobPreempted"}
    assert requeued == preempted
    scaled = [e for e in await events(admin, "gpusched.service.chat.scaled")]
    assert [(e.replicas, e.requested) for e in scaled] == [(4, 4)]

    # a node is lost: its replicas are re-placed before the training that waits
    placed = {}
    for e in await events(admin, "gpusched.service.chat.replica_scheduled"):
        placed[e.job_id] = e.nodes[0]
    lost_node = "n0" if list(placed.values()).count("n0") else "n1"
    on_lost = {j for j, n in placed.items() if n == lost_node}
    executor.backend.nodes = [n for n in NODES if n.name != lost_node]
    await eventually(lambda: _replaced_on(admin, on_lost, lost_node), timeout_s=30)
    await eventually(lambda: _count(ready_replicas(admin), 4), timeout_s=30)
    assert len(await _running_training(admin)) == 0  # 4 GPUs left, all for the SLA replicas

    # deleted: every replica retired, its job cancelled
    await publish(tenant, "delete", {"service": "chat"})
    await eventually(lambda: _count(ready_replicas(admin), 0, exact=True), timeout_s=20)
    cancelled = {e.aggregate_id for e in await events(admin, "gpusched.job.*.cancelled")}
    assert {j for j in placed if j in cancelled} == set(placed)


async def test_a_deploy_of_a_queue_the_team_may_not_use_is_dead_lettered_with_the_field(platform):
    admin, tenant, _ = platform
    doc = service_doc(1)
    doc["spec"]["replica"]["priority_class"] = "gold"
    seq = await publish(tenant, "deploy", doc)

    async def refusal():
        async for m in eventlog.read(admin, stream=eventlog.DLQ_STREAM, subjects=["gpusched.deadletter.admission.intake"]):
            if (m.headers or {}).get("Gpusched-Original-Sequence") == str(seq):
                return m.headers["Gpusched-Reason"]
        return None
    reason = await eventually(refusal)
    assert reason.startswith("DeployService: its replicas would not be admitted: spec.replica.priority_class")
    assert await events(admin, "gpusched.service.chat.>") == []


async def _count(found, n: int, exact: bool = False) -> bool:
    got = len(await found)
    return got == n if exact else got >= n


async def _started(js, n: int) -> bool:
    return len({e.aggregate_id for e in await events(js, "gpusched.job.*.started")
                if e.aggregate_id.startswith("train-")}) >= n


async def _running_training(js) -> set[str]:
    state: dict[str, str] = {}
    for e in await events(js, "gpusched.job.*.>"):
        if e.aggregate_id.startswith("train-") and e.type in ("JobStarted", "JobPreempted", "JobFailed"):
            state[e.aggregate_id] = e.type
    return {j for j, t in state.items() if t == "JobStarted"}


async def _replaced_on(js, replicas: set[str], lost_node: str) -> bool:
    """Each replica that ran on the lost node is lost there and placed again elsewhere."""
    lost = {e.job_id for e in await events(js, "gpusched.service.chat.replica_lost")}
    again = {e.job_id for e in await events(js, "gpusched.service.chat.replica_scheduled")
             if e.attempt > 1 and e.nodes[0] != lost_node}
    return replicas <= lost and replicas <= again


async def test_load_reports_from_the_ingress_scale_the_service(platform):
    admin, tenant, _ = platform
    doc = service_doc(1)
    doc["spec"]["autoscaling"] = {"metric": "requests_per_replica", "target": 10, "scale_down_stabilization_seconds": 60}
    await publish(tenant, "deploy", doc)
    await eventually(lambda: _count(ready_replicas(admin), 1), timeout_s=20)
    await publish(tenant, "load", {"service": "chat", "requests_per_second": 45})
    await eventually(lambda: _count(ready_replicas(admin), 5, exact=True), timeout_s=20)
    await publish(tenant, "load", {"service": "chat", "requests_per_second": 12})  # 2 replicas, after 60 s (0.6 s)
    await eventually(lambda: _count(ready_replicas(admin), 2, exact=True), timeout_s=20)
    scaled = [(e.by, e.replicas) for e in await events(admin, "gpusched.service.chat.scaled")]
    assert scaled == [("autoscaler", 5), ("autoscaler", 2)]
