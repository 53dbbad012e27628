"""GPU telemetry end to end on a real nats-server and Postgres: the executor service with the
local backend publishes NodeTelemetryReported (NATS permissions of the executor user), the
accounting process projects it into gpu_telemetry and serves measured utilization and
allocated-but-idle GPU time on /metrics (checked with promtool) and through `gpusched metrics`.

This machine has no GPU. The GPU case runs the local backend over a stand-in for the NVML
reader only (``StandInNvml``, as tests/executor/test_local.py does): everything after the
sample (windows, the core, the executor's NATS user, the log, the projection, SQL, metrics, the
CLI) is the real code. The CPU-only case uses the real NVML reader, which finds no GPU here and
publishes nothing; ``test_real_nvml_reports`` and ``test_a_busy_job_on_a_real_gpu_is_measured_end_to_end``
run only where NVML finds a GPU (the second also needs PyTorch to load it): they are run on a
GPU machine by hand (docs/executor.md, "Checking on a real GPU")."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from conftest import eventually, running, service_settings
from gpusched.dev import stack as devstack
from runtime import eventlog
from schemas import JobCancelRequested, JobScheduled, JobSpec, JobSubmitted, NodeRegistered, new_event, parse_event
from schemas.job import NodeAssignment
from services.accounting import metrics, sink
from services.executor.k8s_model import flavor_of
from services.executor.lifecycle import BackendCore
from services.executor.local import GpuSample, LocalBackend, Nvml
from services.executor.service import ExecutorService
from tests.integration.test_accounting_ledger import promtool_check

REPO = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"
FLAVOR = "h100-80gb-hbm3"


class StandInNvml:
    """Two GPUs as NVML would describe them: GPU 0 busy (60 %), GPU 1 nearly idle (2 %)."""

    available = True
    why = ""

    def sample(self):
        return [GpuSample(0, H100, 81559, 30000, 0.6, 420.0), GpuSample(1, H100, 81559, 2048, 0.02, 75.0)]


def executor(nats_server, root, nvml, interval_s=1.0) -> ExecutorService:
    backend = LocalBackend(root, node_name="gpu-0", telemetry_s=0.1, telemetry_interval_s=interval_s, nvml=nvml)
    return ExecutorService("executor", BackendCore(), service_settings(nats_server, "executor"), backend=backend,
                           sync_s=0.1)


async def schedule_on_gpu(log: eventlog.EventLog, job_id: str, gpu: int, script: str, flavor: str = FLAVOR) -> None:
    now = datetime.now(UTC)
    spec = JobSpec(kind="batch", queue="q", team="team-a", image="-", gpus=1, command=("sh", "-c", script))
    seq = await log.append(new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=now,
                                     key="1", spec=spec, submitter="u", intake_sequence=1), expected_last_seq=0)
    await log.append(new_event(JobScheduled, aggregate_id=job_id, producer="scheduler", occurred_at=now, key="1",
                               attempt=1, flavor=flavor,
                               placement=(NodeAssignment(node="gpu-0", gpus=1, gpu_indices=(gpu,)),)),
                     expected_last_seq=seq)


async def events(js, subject: str) -> list:
    return [parse_event(m.data) async for m in eventlog.read(js, subjects=[subject])]


async def caught_up(js, dsn: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        if not await conn.fetchval("SELECT to_regclass('projection_position') IS NOT NULL"):
            return False
        return await sink.position(conn) >= await eventlog.last_sequence(js)
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def accounting_metrics(nats_server, admin_js, pg_dsn: str,
                             extra: dict[str, str] | None = None) -> AsyncIterator[bytes]:
    """The accounting process, run until the block ends: its /metrics once it has caught up
    with the log. ``extra``: more of its environment (another process's platform clock)."""
    port = devstack.free_port()
    env = {**os.environ, **nats_server.env("accounting"), "GPUSCHED_PG_DSN": pg_dsn,
           "GPUSCHED_METRICS_PORT": str(port), "GPUSCHED_TICK_S": "0.05", **(extra or {})}
    proc = subprocess.Popen([sys.executable, "-m", "services.accounting"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await eventually(lambda: caught_up(admin_js, pg_dsn), timeout_s=30)
        yield await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                                                     timeout=10).read())
    finally:
        proc.terminate()
        proc.wait(10)


def cli(nats_server, pg_dsn: str, *args: str) -> str:
    env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_PG_DSN": pg_dsn,
           "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    proc = subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def series(text: bytes, name: str) -> dict[str, float]:
    """name{labels} -> value of one metric in the text format."""
    out = {}
    for line in text.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


async def test_telemetry_from_the_executor_to_metrics_and_cli(nats_server, admin_js, pg_dsn, tmp_path):
    log = eventlog.EventLog(admin_js)
    async with running(executor(nats_server, tmp_path, StandInNvml())):
        await schedule_on_gpu(log, "train", 1, "sleep 60")  # holds GPU 1 of gpu-0 while it runs

        async def two_windows_while_allocated():
            reports = await events(admin_js, "gpusched.node.gpu-0.telemetry")
            held = [r for r in reports if r.gpus[1].allocated_samples > 0]
            return reports if len(held) >= 2 else None

        reports = await eventually(two_windows_while_allocated, timeout_s=30)
        await log.append(new_event(JobCancelRequested, aggregate_id="train", producer="admission",
                                   occurred_at=datetime.now(UTC), key="c", requested_by="u"))
        await eventually(lambda: events(admin_js, "gpusched.job.train.cancelled"), timeout_s=30)
    reports = await events(admin_js, "gpusched.node.gpu-0.telemetry")
    (registered,) = await events(admin_js, "gpusched.node.gpu-0.registered")
    assert isinstance(registered, NodeRegistered) and registered.node.gpu_flavor == FLAVOR
    for r in reports:  # the window of each, from the local backend's samples
        assert r.producer == "executor" and r.gpu_count == 2 and [g.index for g in r.gpus] == [0, 1]
        assert 0.9 <= (r.window_end - r.window_start).total_seconds() < 2.5
        g0, g1 = r.gpus
        assert (g0.utilization, g0.memory_used_mib, g0.power_w) == (pytest.approx(0.6), 30000, pytest.approx(420.0))
        assert g0.allocated_samples == 0  # nothing of the log holds GPU 0
        assert g1.utilization == pytest.approx(0.02) and g1.allocated_samples <= g1.samples
    starts = [r.window_start for r in reports]
    # one after the other, never overlapping (back to back unless a stalled window was dropped)
    assert starts == sorted(starts) and all(a.window_end <= b.window_start for a, b in zip(reports, reports[1:]))

    async with accounting_metrics(nats_server, admin_js, pg_dsn) as body:
        conn = await asyncpg.connect(pg_dsn)
        try:
            rows = await conn.fetch("SELECT * FROM gpu_telemetry ORDER BY window_start, gpu")
        finally:
            await conn.close()
        assert len(rows) == 2 * len(reports)
        assert {(r["node"], r["gpu"]) for r in rows} == {("gpu-0", 0), ("gpu-0", 1)}
        assert any(r["gpu"] == 1 and r["allocated_samples"] > 0 and r["allocated_utilization"] == pytest.approx(0.02)
                   for r in rows)
        promtool_check(body)
        flavor = f'{{flavor="{FLAVOR}"}}'
        # both GPUs reported over the same windows: the mean of 0.6 and 0.02
        assert series(body, "gpusched_gpu_utilization_measured_ratio") == {
            f"gpusched_gpu_utilization_measured_ratio{flavor}": pytest.approx(0.31)}
        assert series(body, "gpusched_node_gpu_utilization_measured_ratio") == {
            f'gpusched_node_gpu_utilization_measured_ratio{{flavor="{FLAVOR}",node="gpu-0"}}': pytest.approx(0.31)}
        idle = series(body, "gpusched_gpu_allocated_idle_seconds")[f"gpusched_gpu_allocated_idle_seconds{flavor}"]
        held = series(body, "gpusched_gpu_allocated_measured_seconds")[
            f"gpusched_gpu_allocated_measured_seconds{flavor}"]
        assert 1.0 < held == pytest.approx(idle)  # GPU 1 was idle (2 % < 5 %) all the time it was held
        assert series(body, "gpusched_gpu_allocated_idle_ratio") == {
            f"gpusched_gpu_allocated_idle_ratio{flavor}": pytest.approx(1.0)}

        table = cli(nats_server, pg_dsn, "metrics")
        assert "gpusched_gpu_allocated_idle_ratio" in table and f"flavor={FLAVOR}" in table
        assert "no NVML telemetry reported" not in table
        prom = cli(nats_server, pg_dsn, "metrics", "--format", "prometheus").encode()
        promtool_check(prom)
        assert series(prom, "gpusched_gpu_allocated_idle_ratio") == {
            f"gpusched_gpu_allocated_idle_ratio{flavor}": pytest.approx(1.0)}


async def test_cpu_only_publishes_no_telemetry_and_the_metrics_say_so(nats_server, admin_js, pg_dsn, tmp_path):
    nvml = Nvml()
    if nvml.available:
        pytest.skip("NVML finds a GPU here: this is the CPU-only case")
    async with running(executor(nats_server, tmp_path, nvml)):
        reg = await eventually(lambda: events(admin_js, "gpusched.node.gpu-0.registered"), timeout_s=20)
        assert reg[0].node.gpu_count == 0
        await asyncio.sleep(3)  # three telemetry intervals
    assert await events(admin_js, "gpusched.node.*.telemetry") == []

    async with accounting_metrics(nats_server, admin_js, pg_dsn) as body:
        promtool_check(body)
        for name in ("gpusched_gpu_utilization_measured_ratio", "gpusched_gpu_allocated_idle_ratio",
                     "gpusched_gpu_allocated_idle_seconds"):
            assert series(body, name) == {}, name  # absent, not 0
        table = cli(nats_server, pg_dsn, "metrics")
        assert "GPU utilization: no NVML telemetry reported in the last 3600 s" in table
        assert "gpusched_gpu_utilization_measured_ratio" not in table
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM gpu_telemetry") == 0
        assert not metrics.has_telemetry(await metrics.gather(conn, datetime.now(UTC)))
    finally:
        await conn.close()


async def test_real_nvml_reports(nats_server, admin_js, tmp_path):
    """Where NVML finds a GPU: the real reader's windows reach the log with sane values."""
    nvml = Nvml()
    if not nvml.available:
        pytest.skip(f"no GPU here ({nvml.why})")
    async with running(executor(nats_server, tmp_path, nvml)):
        reports = await eventually(lambda: events(admin_js, "gpusched.node.gpu-0.telemetry"), timeout_s=30)
    r = reports[0]
    assert r.gpu_count == len(nvml.sample()) and r.gpus
    for g in r.gpus:
        assert 0 <= g.utilization <= 1 and 0 <= g.memory_used_mib <= g.memory_total_mib and g.samples >= 1


# A CUDA load for the job below: bf16 matrix products on the one GPU CUDA_VISIBLE_DEVICES names.
MATMUL_LOAD = """
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("cuda", torch.cuda.get_device_name(0), flush=True)
end = time.time() + 120
while time.time() < end:
    a @ a
    torch.cuda.synchronize()
"""


async def test_a_busy_job_on_a_real_gpu_is_measured_end_to_end(nats_server, admin_js, pg_dsn, tmp_path):
    """Where NVML finds a GPU and PyTorch can use it: a job that keeps GPU 0 busy is measured by
    the real NVML reader while the log holds that GPU for it (allocated samples, high utilization),
    and accounting serves that as measured utilization and not as allocated-but-idle time."""
    nvml = Nvml()
    if not nvml.available:
        pytest.skip(f"no GPU here ({nvml.why})")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("no PyTorch here to load the GPU with")
    product = nvml.sample()[0].name
    flavor = flavor_of(re.sub(r"\s+", "-", product.strip()))
    log = eventlog.EventLog(admin_js)
    async with running(executor(nats_server, tmp_path, nvml)):
        await schedule_on_gpu(log, "matmul", 0, f"exec {sys.executable} -c '{MATMUL_LOAD}'", flavor=flavor)

        async def two_busy_windows_while_allocated():
            reports = await events(admin_js, "gpusched.node.gpu-0.telemetry")
            busy = [r for r in reports if r.gpus[0].allocated_samples == r.gpus[0].samples
                    and r.gpus[0].allocated_utilization > 0.5]
            return reports if len(busy) >= 2 else None

        reports = await eventually(two_busy_windows_while_allocated, timeout_s=120)
        await log.append(new_event(JobCancelRequested, aggregate_id="matmul", producer="admission",
                                   occurred_at=datetime.now(UTC), key="c", requested_by="u"))
        await eventually(lambda: events(admin_js, "gpusched.job.matmul.cancelled"), timeout_s=60)
    (registered,) = await events(admin_js, "gpusched.node.gpu-0.registered")
    assert registered.node.gpu_flavor == flavor and registered.node.gpu_count == len(nvml.sample())
    assert "cuda" in (tmp_path / "runs/matmul-a1-m0/log").read_text()
    for r in reports:
        g = r.gpus[0]
        assert 0 < g.memory_used_mib <= g.memory_total_mib and (g.power_w is None or g.power_w > 0)

    async with accounting_metrics(nats_server, admin_js, pg_dsn) as body:
        label = f'{{flavor="{flavor}"}}'
        measured = series(body, "gpusched_gpu_utilization_measured_ratio")[
            f"gpusched_gpu_utilization_measured_ratio{label}"]
        idle = series(body, "gpusched_gpu_allocated_idle_ratio")[f"gpusched_gpu_allocated_idle_ratio{label}"]
        held = series(body, "gpusched_gpu_allocated_measured_seconds")[
            f"gpusched_gpu_allocated_measured_seconds{label}"]
        print(f"{product}: measured utilization {measured:.2f}, allocated-idle {idle:.2f} of {held:.1f} s held")
        # The job's first seconds (Python and CUDA starting) hold the GPU idle, and count as
        # allocated-idle; the two busy windows waited for above do not.
        assert measured > 0.2 and 0 <= idle < 1 and held * (1 - idle) >= 1.5


async def test_measured_utilization_is_time_weighted_clipped_and_idempotent(pg_dsn):
    """The metrics' SQL on rows projected by the real converter and sink: windows weighted by
    their overlap with the last hour, the idle threshold (below 5 %, not at it), flavors from the
    nodes, and a report applied twice (a redelivery at a new sequence) counted once."""
    from datetime import timedelta

    from services.accounting import projection, replay
    from tests.unit.builders import gpu, node, telemetry

    now = datetime(2026, 11, 2, 12, tzinfo=UTC)

    def t(seconds_before: float) -> datetime:
        return now - timedelta(seconds=seconds_before)

    events = [
        node("n1", "a100", 2), node("n2", "h100", 1),
        # n1 GPU 0 busy and held, 100 of its 200 s inside the hour
        telemetry("n1", [gpu(0, 1.0)], start=t(3700), seconds=200, gpu_count=2),
        # n1 over the last 300 s: GPU 0 at 20 %, held half the samples at 4 % (idle); GPU 1 unheld, 0 %
        telemetry("n1", [gpu(0, 0.2, samples=6, allocated=3, allocated_utilization=0.04), gpu(1, 0.0, allocated=0)],
                  start=t(300), seconds=300, gpu_count=2),
        # n2 held at exactly 5 %: not idle
        telemetry("n2", [gpu(0, 0.9, allocated_utilization=0.05)], start=t(120), seconds=60, gpu_count=1),
        # two hours ago: outside the window
        telemetry("n1", [gpu(0, 0.0)], start=t(7200), seconds=200, gpu_count=2),
    ]
    entries = [(i + 1, e.event_id, projection.convert(e, i + 1)) for i, e in enumerate(events)]
    again = events[3]  # the same report appended again: a new sequence, no event id to de-duplicate by
    entries.append((len(entries) + 1, None, projection.convert(again, len(entries) + 1)))
    await replay.reset(pg_dsn, "telemetry")
    conn = await replay.connect(pg_dsn, "telemetry")
    try:
        await sink.apply_batch(conn, entries[:3])
        await sink.apply_batch(conn, entries[3:])
        assert await conn.fetchval("SELECT count(*) FROM gpu_telemetry") == 5
        got = {(s.name, s.labels): s.value for s in await metrics.gather(conn, now)
               if "measured" in s.name or "idle" in s.name}
        text = await metrics.exposition(conn, now)
    finally:
        await conn.close()
    a100, h100 = (("flavor", "a100"),), (("flavor", "h100"),)
    assert got == {
        ("gpusched_gpu_utilization_measured_ratio", a100): pytest.approx((100 * 1.0 + 300 * 0.2) / 700),
        ("gpusched_gpu_allocated_measured_seconds", a100): pytest.approx(100 + 150),
        ("gpusched_gpu_allocated_idle_seconds", a100): pytest.approx(150),
        ("gpusched_gpu_allocated_idle_ratio", a100): pytest.approx(0.6),
        ("gpusched_gpu_utilization_measured_ratio", h100): pytest.approx(0.9),
        ("gpusched_gpu_allocated_measured_seconds", h100): pytest.approx(60),
        ("gpusched_gpu_allocated_idle_seconds", h100): 0.0,
        ("gpusched_gpu_allocated_idle_ratio", h100): 0.0,
        ("gpusched_node_gpu_utilization_measured_ratio", (("flavor", "a100"), ("node", "n1"))):
            pytest.approx(160 / 700),
        ("gpusched_node_gpu_utilization_measured_ratio", (("flavor", "h100"), ("node", "n2"))): pytest.approx(0.9),
    }
    promtool_check(text)
