"""Many clusters in the dev stack (issue 44, item 4; docs/operations.md, "Many clusters in the dev
stack"): `gpusched dev up --clusters east,west` as `make run CLUSTERS=east,west` starts it, with its
own nats-server and Postgres, and one sim executor per cluster under its own credential.

Each cluster gets one of the spec's two 4-GPU L4 nodes. An inference service with two SLA replicas
and two low-priority batch jobs (4 GPUs and 2 GPUs) fill both clusters: the 4-GPU job takes a node
of its own, the replicas and the 2-GPU job share the other. The executor of the cluster holding the
replicas is stopped (`kill PID`: the supervisor leaves it stopped); the scheduler declares that
cluster lost, and its work runs in the other cluster, SLA replicas first: they preempt the 4-GPU
batch job there, and the 2-GPU one lost with them is placed only after them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest

from conftest import eventually
from gpusched.dev import stack as devstack
from gpusched.dev.run import example
from gpusched.gateway import commands
from runtime import eventlog
from schemas import JobSpec, SubmitJob, parse_event
from schemas.queue import FlavorQuota, QueueConfigured

pytestmark = pytest.mark.e2e

CLUSTERS = ("east", "west")
SPEC = """
groups:
  - {prefix: l4, count: 2, gpu_flavor: l4, gpu_product: NVIDIA-L4, gpu_count: 4, gpu_memory_mib: 23034}
"""
TIME_SCALE = 60.0
HEARTBEAT_WALL_S, LOST_AFTER_WALL_S = 1.0, 6.0  # on a platform clock 60 times faster


def dev_up(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """`gpusched dev up --clusters east,west`, its data, output and this user's connection file under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env.update(XDG_STATE_HOME=str(tmp_path / "state"), GPUSCHED_API_PORT=str(devstack.free_port()),
               GPUSCHED_TICK_S="0.2", GPUSCHED_LEASE_TTL_S="10",  # single-active services: a lease each
               GPUSCHED_CLUSTER_HEARTBEAT_S=f"{HEARTBEAT_WALL_S * TIME_SCALE:g}",
               GPUSCHED_CLUSTER_LOST_AFTER_S=f"{LOST_AFTER_WALL_S * TIME_SCALE:g}")
    (tmp_path / "cluster.yaml").write_text(SPEC)
    out = tmp_path / "dev-up.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpusched.cli.main", "dev", "up", "--data-dir", str(tmp_path / ".data"),
             "--no-demo", "--duration", "240", "--time-scale", f"{TIME_SCALE:g}",
             "--clusters", ",".join(CLUSTERS), "--cluster-file", str(tmp_path / "cluster.yaml")],
            cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    return proc, out


def executor_pid(parent: int, cluster: str) -> int | None:
    """The running child of the dev stack that is ``cluster``'s executor (GPUSCHED_CLUSTER in its
    environment), which connects to NATS with the cluster's own credential."""
    for pid in devstack._children(parent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"GPUSCHED_CLUSTER={cluster}".encode() in environ and not devstack._gone(pid):
            assert f"GPUSCHED_NATS_USER=executor-{cluster}".encode() in environ
            return pid
    return None


def batch(job_id: str, gpus: int) -> SubmitJob:
    spec = JobSpec(kind="batch", queue="bulk", team="team-platform", priority_class="batch-low", image="img",
                   gpus=gpus, gpu_flavors=("l4",), expected_runtime_seconds=86_400,
                   retry={"max_attempts": 3, "backoff_seconds": 0})
    return SubmitJob(job_id=job_id, on_behalf_of="team-platform-ci", spec=spec)


async def test_dev_up_with_two_clusters_places_a_lost_clusters_work_in_the_other_sla_replicas_first(tmp_path):
    began = time.monotonic()
    proc, out = dev_up(tmp_path)
    nc = None
    try:
        connection_file = tmp_path / ".data" / "run" / "connection.json"

        async def connected():
            assert proc.poll() is None, out.read_text()
            return connection_file.exists() or None

        await eventually(connected, timeout_s=90, interval_s=0.2)
        saved = json.loads(connection_file.read_text())
        users = json.loads((tmp_path / ".data" / "nats" / "users.json").read_text())
        assert {f"executor-{c}" for c in CLUSTERS} <= set(users)  # a credential per cluster
        nc = await nats.connect(saved["nats_url"], user="admin", password=users["admin"],
                                inbox_prefix=eventlog.inbox_prefix("admin"))
        js = nc.jetstream()

        async def events(subject: str = "gpusched.>") -> list:
            return [parse_event(m.data) async for m in eventlog.read(js, subjects=[subject])]

        # the work: a queue for the batch jobs, the example inference service (2 SLA replicas), 2 batch jobs
        await eventlog.EventLog(js).append(QueueConfigured(
            event_id="q-bulk", aggregate_id="bulk", occurred_at=datetime.now(UTC), producer="config", name="bulk",
            allowed_teams=("team-platform",), quotas=(FlavorQuota(flavor="l4", nominal=8),)))
        deploy = commands.deploy_command_from_file(example("service.yaml"))
        await commands.publish_command(js, "team-product", "deploy",
                                       deploy.model_copy(update={"on_behalf_of": "team-product-bot"}))
        big, small = "bulk-big", "bulk-small"
        for job_id, gpus in ((big, 4), (small, 2)):
            await commands.publish_command(js, "team-platform", "submit", batch(job_id, gpus))

        def scheduled(history: list, job: str) -> list[tuple[int, int, set[str]]]:
            """(position in the log, attempt, clusters of its nodes) of each JobScheduled of ``job``."""
            return [(i, e.attempt, {p.node.rsplit(".", 1)[1] for p in e.placement}) for i, e in enumerate(history)
                    if e.type == "JobScheduled" and e.aggregate_id == job]

        async def all_started():
            history = await events("gpusched.>")
            replicas = sorted({e.job_id for e in history if e.type == "ReplicaRequested"})
            started = {e.aggregate_id for e in history if e.type == "JobStarted"}
            return (history, replicas) if len(replicas) == 2 and {big, small, *replicas} <= started else None

        history, replicas = await eventually(all_started, timeout_s=60, interval_s=0.5)
        where = {job: scheduled(history, job)[-1][2] for job in (big, small, *replicas)}
        assert set().union(*where.values()) == set(CLUSTERS), where  # work runs in both clusters
        (gone,) = where[replicas[0]] | where[replicas[1]]  # the replicas share a node with the small job
        (left,) = set(CLUSTERS) - {gone}
        assert where[small] == {gone} and where[big] == {left}, where

        # stop the executor of the cluster that runs the replicas, for good
        pid = executor_pid(proc.pid, gone)
        assert pid is not None and executor_pid(proc.pid, left) is not None
        os.kill(pid, signal.SIGTERM)
        stopped_at = time.monotonic()

        async def lost():
            return [e for e in await events("gpusched.cluster.>") if e.type == "ClusterLost"] or None

        (lost_event,) = await eventually(lost, timeout_s=30, interval_s=0.2)
        declared_after = time.monotonic() - stopped_at
        assert lost_event.cluster == gone and set(lost_event.nodes) == {f"l4-0.{gone}"}

        async def replaced():
            history = await events("gpusched.>")
            again = {job: [s for s in scheduled(history, job) if s[1] > 1] for job in (*replicas, small)}
            return (history, again) if all(again.values()) else None

        history, again = await eventually(replaced, timeout_s=30, interval_s=0.2)
        placed_at = {job: again[job][0][0] for job in again}
        assert all(again[job][0][2] == {left} for job in again), again  # in the other cluster
        assert placed_at[small] > max(placed_at[r] for r in replicas), placed_at  # the SLA replicas first
        victims = [e for e in history if e.type == "PreemptionRequested" and e.aggregate_id == big]
        assert victims, "the replicas made room by preempting the big batch job"
        assert not [e for e in history if e.type == "ClusterLost" and e.cluster == left]
        assert executor_pid(proc.pid, gone) is None  # the supervisor left it stopped
        took = time.monotonic() - began

        def summary_says_lost():  # the summary, printed every 5 s, shows the cluster lost
            printed = " ".join(out.read_text().split())
            return printed if f"{gone} 4 GPUs LOST (no report from its executor" in printed else None

        printed = await eventually(summary_says_lost, timeout_s=15, interval_s=0.5)
    finally:
        if nc is not None:
            await nc.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert f"{gone}: l4-0.{gone} (4 GPUs)" in printed and f"{left}: l4-0.{left} (4 GPUs)" in printed, printed[-3000:]
    assert f"executor-{gone} (stopped)" in printed and f"{left} 4 GPUs reporting (executor pid" in printed
    logs = tmp_path / ".data" / "logs"
    for name in devstack.process_names(CLUSTERS):
        assert "Traceback" not in (logs / f"{name}.log").read_text(), name
    for cluster in CLUSTERS:  # each executor its own durable and lease
        said = (logs / f"executor-{cluster}.log").read_text()
        assert f'"durable": "executor-{cluster}"' in said and '"message": "active: took the lease"' in said
    print(f"\ndev stack, two clusters: {gone} lost {declared_after:.1f} s after its executor stopped "
          f"(lost after {LOST_AFTER_WALL_S:g} s of silence); the test took {took:.0f} s to there")
