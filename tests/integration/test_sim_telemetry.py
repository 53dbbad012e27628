"""The sim executor's simulated telemetry end to end, on a real nats-server and Postgres: the sim
executor process (`python -m services.executor`, as `make run` starts it, on a platform clock 60
times the wall's) publishes NodeTelemetryReported marked ``simulated`` for its nodes; the
accounting process projects them into gpu_telemetry (``source``) and serves them on /metrics as
``gpusched_*_utilization_simulated_ratio``, never as measured (docs/executor.md, "Simulated
telemetry")."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from conftest import eventually
from gpusched.dev import stack as devstack
from runtime import eventlog
from schemas import JobScheduled, JobSpec, JobSubmitted, NodeTelemetryReported, new_event
from schemas.job import NodeAssignment
from services.executor.sim import ANN_UTILIZATION, TELEMETRY_SAMPLES
from tests.integration.test_accounting_ledger import promtool_check
from tests.integration.test_telemetry import accounting_metrics, events, series

REPO = Path(__file__).resolve().parents[2]
CLUSTER = """groups:
  - {prefix: a100, count: 1, gpu_flavor: a100-40gb, gpu_count: 2, gpu_memory_mib: 40960}
  - {prefix: cpu, count: 1}
"""


CLOCK = {"GPUSCHED_TIME_SCALE": "60", "GPUSCHED_TICK_S": "0.05"}  # and one GPUSCHED_CLOCK_EPOCH for both


def start(service: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"services.{service}"], cwd=REPO, env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def clock() -> dict[str, str]:
    return {**CLOCK, "GPUSCHED_CLOCK_EPOCH": repr(time.time())}


@pytest.fixture
def sim_executor(nats_server, tmp_path, clock):
    spec = tmp_path / "cluster.yaml"
    spec.write_text(CLUSTER)
    proc = start("executor", {**nats_server.env("executor"), **clock, "GPUSCHED_EXECUTOR_BACKEND": "sim",
                              "GPUSCHED_SIM_CLUSTER": str(spec), "GPUSCHED_TELEMETRY_INTERVAL_S": "60"})
    yield proc
    proc.terminate()
    proc.wait(10)


async def test_the_sim_executor_reports_simulated_utilization_to_the_metrics(nats_server, admin_js, pg_dsn, clock,
                                                                            sim_executor):
    log = eventlog.EventLog(admin_js)
    now = datetime.now(UTC)
    spec = JobSpec(kind="training", queue="q", team="team-a", image="-", gpus=1, expected_runtime_seconds=86_400,
                   annotations={ANN_UTILIZATION: "0.7"})
    seq = await log.append(new_event(JobSubmitted, aggregate_id="train-1", producer="admission", occurred_at=now,
                                     key="1", spec=spec, submitter="u", intake_sequence=1), expected_last_seq=0)
    await log.append(new_event(JobScheduled, aggregate_id="train-1", producer="scheduler", occurred_at=now, key="1",
                               attempt=1, flavor="a100-40gb",
                               placement=(NodeAssignment(node="a100-0", gpus=1, gpu_indices=(1,)),)),
                     expected_last_seq=seq)

    async def whole_windows():
        """Reports of windows the job held GPU 1 through (60 platform s: a wall second each)."""
        reports = [e for e in await events(admin_js, "gpusched.node.>") if isinstance(e, NodeTelemetryReported)]
        held = [r for r in reports if r.gpus[1].allocated_samples == TELEMETRY_SAMPLES]
        return (reports, held) if len(held) >= 2 else None

    reports, held = await eventually(whole_windows, timeout_s=30)
    assert {r.node for r in reports} == {"a100-0"}  # the CPU-only node reports nothing
    assert all(r.source == "simulated" and r.producer == "executor" for r in reports)
    assert all((r.window_end - r.window_start).total_seconds() == 60 for r in reports)
    assert all(r.window_start.timestamp() % 60 == 0 for r in reports)  # on the platform clock's minutes
    assert [(r.gpus[0].utilization, r.gpus[1].utilization, r.gpus[1].allocated_utilization) for r in held[:2]] == \
        [(0.0, 0.7, 0.7)] * 2

    async with accounting_metrics(nats_server, admin_js, pg_dsn, clock) as body:  # the executor's clock
        conn = await asyncpg.connect(pg_dsn)
        try:
            rows = await conn.fetch("SELECT DISTINCT source FROM gpu_telemetry")
            busy = await conn.fetchval("SELECT count(*) FROM gpu_telemetry WHERE gpu = 1 AND utilization = 0.7 "
                                       "AND source = 'simulated'")
        finally:
            await conn.close()
    assert [r["source"] for r in rows] == ["simulated"] and busy >= 2
    simulated = series(body, "gpusched_gpu_utilization_simulated_ratio")
    assert list(simulated) == ['gpusched_gpu_utilization_simulated_ratio{flavor="a100-40gb"}']
    assert 0 < simulated['gpusched_gpu_utilization_simulated_ratio{flavor="a100-40gb"}'] <= 0.35  # one of two GPUs
    assert set(series(body, "gpusched_node_gpu_utilization_simulated_ratio")) == {
        'gpusched_node_gpu_utilization_simulated_ratio{flavor="a100-40gb",node="a100-0"}'}
    for measured in ("gpusched_gpu_utilization_measured_ratio", "gpusched_node_gpu_utilization_measured_ratio",
                     "gpusched_gpu_allocated_idle_ratio"):
        assert series(body, measured) == {}, f"{measured}: simulated telemetry counted as measured"
    assert series(body, "gpusched_team_gpu_allocated") == {
        'gpusched_team_gpu_allocated{flavor="a100-40gb",team="team-a"}': 1.0}
    promtool_check(body)


async def test_measured_and_simulated_windows_stay_apart(pg_dsn):
    """NVML and simulated windows of the same flavor, projected by the real converter and sink:
    the measured and allocated-idle metrics read the NVML rows only, the simulated gauges the
    simulated rows only; gpu_telemetry.source says which is which."""
    from datetime import timedelta

    from services.accounting import metrics, projection, replay, sink
    from tests.unit.builders import gpu, node, telemetry

    now = datetime(2026, 11, 2, 12, tzinfo=UTC)
    start = now - timedelta(seconds=600)
    measured = telemetry("real-0", [gpu(0, 0.9)], start=start, seconds=300, gpu_count=1)
    simulated = telemetry("sim-0", [gpu(0, 0.3, allocated_utilization=0.01)], start=start, seconds=300, gpu_count=1)
    simulated = simulated.model_copy(update={"source": "simulated"})
    events = [node("real-0", "a100", 1), node("sim-0", "a100", 1), measured, simulated]
    entries = [(i + 1, e.event_id, projection.convert(e, i + 1)) for i, e in enumerate(events)]
    await replay.reset(pg_dsn, "telemetry")
    conn = await replay.connect(pg_dsn, "telemetry")
    try:
        await sink.apply_batch(conn, entries)
        rows = [tuple(r) for r in await conn.fetch("SELECT node, source FROM gpu_telemetry ORDER BY node")]
        got = {(s.name, s.labels): s.value for s in await metrics.gather(conn, now) if "utilization" in s.name
               or "idle" in s.name or "measured" in s.name}
        text = await metrics.exposition(conn, now)
    finally:
        await conn.close()
    assert rows == [("real-0", "nvml"), ("sim-0", "simulated")]
    a100 = (("flavor", "a100"),)
    assert got == {
        ("gpusched_gpu_utilization_measured_ratio", a100): pytest.approx(0.9),
        ("gpusched_gpu_allocated_measured_seconds", a100): pytest.approx(300),
        ("gpusched_gpu_allocated_idle_seconds", a100): 0.0,  # the simulated GPU's 1 % is not idle time
        ("gpusched_gpu_allocated_idle_ratio", a100): 0.0,
        ("gpusched_node_gpu_utilization_measured_ratio", (("flavor", "a100"), ("node", "real-0"))): pytest.approx(0.9),
        ("gpusched_gpu_utilization_simulated_ratio", a100): pytest.approx(0.3),
        ("gpusched_node_gpu_utilization_simulated_ratio", (("flavor", "a100"), ("node", "sim-0"))): pytest.approx(0.3),
    }
    promtool_check(text)
