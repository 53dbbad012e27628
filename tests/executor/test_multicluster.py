"""Many clusters (docs/executor.md, "Many clusters"): two real Kubernetes control planes at once,
each with the same two fake GPU node names, one executor each (its own NATS credential, durable
and lease), with quota and the scheduler on a real nats-server.

Jobs land in both clusters; the gang stays inside one. Then one control plane is stopped mid-run:
its executor's heartbeat stops, the scheduler declares the cluster lost, the other executor ends
the attempts that ran there (``node-lost``, once each), and they run again in the cluster that is
left, once its GPUs are free."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import nats
import pytest

from conftest import eventually, running
from gpusched.dev import stack as devstack
from runtime import eventlog
from runtime.loop import DecisionService
from runtime.settings import Settings
from schemas import parse_event
from services.executor.k8s_model import JobOptions
from services.executor.kubernetes import KubernetesBackend
from services.executor.lifecycle import BackendCore
from services.executor.service import ExecutorService
from services.quota.domain import QuotaCore
from services.scheduler.domain import SchedulerCore
from tests.executor.conftest import K8S
from tests.executor.controlplane.cluster import EXECUTOR_SA, NAMESPACE, PLATFORM_NAMESPACE
from tests.executor.harness import work
from tests.unit import builders as b

pytestmark = pytest.mark.skipif(not K8S, reason="the Kubernetes tests run with `make test-k8s`")

CLUSTERS = ("east", "west")
FLAVOR = "a100-sxm4-80gb"  # what the fake nodes' GPU product makes
LOST_AFTER_S = 6.0
HEARTBEAT_S = 1.0


@pytest.fixture(scope="module")
def planes():
    """Two more control planes (beside the session's), prepared like it: namespaces, the
    executor's ServiceAccount and RBAC from k8s/base, two fake GPU nodes named alike in both."""
    from tests.executor.controlplane import cluster

    started = {}
    try:
        for name in CLUSTERS:
            started[name] = cluster.start()
            cluster.prepare(started[name])
        yield started
    finally:
        for plane in started.values():
            plane.stop()


@pytest.fixture(scope="module")
def nats_two_clusters(tmp_path_factory):
    server = devstack.NatsServer(tmp_path_factory.mktemp("nats-mc"), teams=("team-a",), clusters=CLUSTERS).start()
    yield server
    server.stop()


def executor_client(plane):
    from kubernetes import client

    token = client.CoreV1Api(plane.api_client()).create_namespaced_service_account_token(
        EXECUTOR_SA, PLATFORM_NAMESPACE, {"spec": {"audiences": [], "expirationSeconds": 3600}}).status.token
    return plane.token_client(token)


def settings(server, user: str) -> Settings:
    return Settings(nats_url=server.url(), nats_user=user, nats_password=server.creds.users[user], tick_s=0.05,
                    snapshot_every=0)


async def events(js, subject: str = "gpusched.>") -> list:
    return [parse_event(m.data) async for m in eventlog.read(js, subjects=[subject])]


async def test_jobs_span_two_clusters_a_gang_stays_in_one_and_a_lost_cluster_is_run_elsewhere(
        planes, nats_two_clusters):
    server = nats_two_clusters
    nc = await nats.connect(server.url(), user="admin", password=server.creds.users["admin"])
    js = nc.jetstream()
    await eventlog.provision(js)
    log = eventlog.EventLog(js)
    await log.append(b.queue("research", ("team-a",), {FLAVOR: 32}))

    services = [
        DecisionService("quota", QuotaCore(), settings(server, "quota")),
        DecisionService("scheduler", SchedulerCore(cluster_lost_after_s=LOST_AFTER_S), settings(server, "scheduler")),
        *(ExecutorService(f"executor-{c}", BackendCore(cluster=c, heartbeat_s=HEARTBEAT_S),
                          settings(server, f"executor-{c}"), sync_s=0.2,
                          backend=KubernetesBackend(JobOptions(namespace=NAMESPACE), api_client=executor_client(p)))
          for c, p in planes.items()),
    ]
    run = uuid.uuid4().hex[:5]
    gang, big, small = f"gang-{run}", f"big-{run}", f"small-{run}"
    gpu = {"tolerations": ("nvidia.com/gpu",)}  # the fake GPU nodes' taint
    retry = {"max_attempts": 3, "backoff_seconds": 0}
    async with running(services[0]), running(services[1]), running(services[2]), running(services[3]):
        # both executors register their nodes, under their clusters' names
        async def registered():
            names = {e.aggregate_id for e in await events(js, "gpusched.node.>") if e.type == "NodeRegistered"}
            return names if len(names) == 4 else None

        assert await eventually(registered, timeout_s=60) == {
            f"kwok-gpu-{i}.{c}" for i in (0, 1) for c in CLUSTERS}

        now = datetime.now(UTC)
        for seq, (job, job_spec) in enumerate(((gang, work(20, gpus=8, gang_size=2, **gpu)),
                                               (big, work(None, gpus=8, retry=retry, **gpu)),
                                               (small, work(None, gpus=4, retry=retry, **gpu))), start=1):
            await log.append(b.submitted(job, job_spec, seq=seq, when=now))
            await log.append(b.admitted(job, when=now))

        async def placed(job: str, attempt: int = 1):
            for e in await events(js, f"gpusched.job.{job}.>"):
                if e.type == "JobScheduled" and e.attempt == attempt:
                    return [p.node for p in e.placement]
            return None

        async def all_started():
            started = [e.aggregate_id for e in await events(js, "gpusched.job.>") if e.type == "JobStarted"]
            return started if {gang, big, small} <= set(started) else None

        await eventually(all_started, timeout_s=60)
        where = {job: await placed(job) for job in (gang, big, small)}
        clusters_of = {job: {n.rsplit(".", 1)[1] for n in nodes} for job, nodes in where.items()}
        assert len(where[gang]) == 2 and len(clusters_of[gang]) == 1, where  # the gang in one cluster
        assert set().union(*clusters_of.values()) == set(CLUSTERS), where  # jobs in both
        (gone,) = clusters_of[big] | clusters_of[small]
        (left,) = set(CLUSTERS) - {gone}
        assert clusters_of[gang] == {left}

        # One control plane goes away mid-run; its executor keeps running, unable to reach it.
        stopped_at = datetime.now(UTC)
        await asyncio.to_thread(planes[gone].stop)  # the services go on meanwhile

        async def lost():
            return [e for e in await events(js, "gpusched.cluster.>") if e.type == "ClusterLost"] or None

        (lost_event,) = await eventually(lost, timeout_s=30)
        silence = (lost_event.occurred_at - stopped_at).total_seconds()
        assert lost_event.cluster == gone and set(lost_event.nodes) == {f"kwok-gpu-{i}.{gone}" for i in (0, 1)}
        assert LOST_AFTER_S - HEARTBEAT_S <= silence <= LOST_AFTER_S + 10, silence

        # its attempts end once each (node-lost, retried) and run again where the gang ran, when it ends
        again = {}
        for job in (big, small):
            again[job] = await eventually(lambda: placed(job, attempt=2), timeout_s=60)
        assert {n.rsplit(".", 1)[1] for nodes in again.values() for n in nodes} == {left}

        async def restarted():
            started = [(e.aggregate_id, e.attempt) for e in await events(js, "gpusched.job.>")
                       if e.type == "JobStarted"]
            return started if {(big, 2), (small, 2)} <= set(started) else None

        await eventually(restarted, timeout_s=60)
        quiet = (lost_event.occurred_at - lost_event.last_report).total_seconds()
        print(f"\nmany clusters: {gone} lost {silence:.1f} s after its control plane began to stop, "
              f"{quiet:.1f} s after its last heartbeat (lost after {LOST_AFTER_S:g} s of silence)")

    # nothing decided twice: one JobFailed per lost attempt, one event per id
    history = await events(js, "gpusched.job.>")
    failures = [(e.aggregate_id, e.attempt, e.reason.value) for e in history if e.type == "JobFailed"]
    assert sorted(failures) == sorted([(big, 1, "node-lost"), (small, 1, "node-lost")]), failures
    ids = [e.event_id for e in await events(js)]
    assert len(ids) == len(set(ids))
    # the Jobs of the second attempts exist in the cluster that is left
    from kubernetes import client

    names = [j.metadata.name for j in client.BatchV1Api(planes[left].api_client()).list_namespaced_job(NAMESPACE).items]
    for job in (big, small):
        assert any(n.startswith(f"{job}-a2") for n in names), (job, names)
    await nc.close()
    await asyncio.sleep(0)
