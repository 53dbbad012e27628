"""End to end: all five services as separate processes over a real nats-server and Postgres.

500 jobs from three teams flow through admission, quota, scheduler, the sim executor and
accounting; each of the five is killed with SIGKILL mid-run, in turn, and restarted. Every job
must end, none may run twice, and the usage ledger must equal what the log says ran.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from datetime import UTC, datetime
from collections import Counter, defaultdict

import asyncpg
import pytest

from conftest import connect_as, eventually
from gpusched.gateway import commands
from gpusched.dev import stack as devstack
from runtime import eventlog
from schemas import JobSpec, SubmitJob, parse_event
from schemas.queue import FlavorQuota, QueueConfigured

pytestmark = pytest.mark.e2e

TEAMS = ("team-a", "team-b", "team-c")
CLUSTER = """
groups:
  - {prefix: big, count: 3, gpu_flavor: a100, gpu_count: 8, gpu_memory_mib: 40960, features: [rdma]}
  - {prefix: small, count: 4, gpu_flavor: l4, gpu_count: 4, gpu_memory_mib: 23034}
"""
TIME_SCALE = 60.0
TERMINAL = {"JobSucceeded", "JobRejected", "JobCancelled"}


@pytest.fixture
async def stack(nats_server, postgres, admin_js, pg_dsn, tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    env = devstack.service_env(nats_server.env, pg_dsn, cluster=cluster, time_scale=TIME_SCALE, epoch=time.time(),
                               extra={"GPUSCHED_TICK_S": "0.1", "GPUSCHED_OTEL_EXPORTER": "file",
                                      "GPUSCHED_TRACE_DIR": str(tmp_path / "traces")})
    log = eventlog.EventLog(admin_js)
    for i, team in enumerate(TEAMS):
        await log.append(QueueConfigured(
            event_id=f"q-{team}", aggregate_id=f"q-{team}", occurred_at=datetime.now(UTC), producer="config",
            name=f"q-{team}", allowed_teams=(team,),
            quotas=(FlavorQuota(flavor="a100", nominal=8), FlavorQuota(flavor="l4", nominal=5 + i))))
    procs = devstack.ServiceProcesses(tmp_path / "logs", env)
    procs.start_all()
    yield procs, admin_js, pg_dsn, tmp_path
    procs.stop_all()
    for name in devstack.SERVICES:
        text = (tmp_path / "logs" / f"{name}.log").read_text()
        assert "Traceback" not in text, f"{name} crashed:\n{text[-3000:]}"


def workload(n: int, seed: int = 1) -> list[SubmitJob]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        team = TEAMS[i % 3]
        flavor, gpus = rng.choice([("a100", 1), ("a100", 2), ("a100", 4), ("l4", 1), ("l4", 2)])
        annotations = {}
        if i % 20 == 7:  # flaky: the first attempt loses its node, the retry succeeds
            annotations = {"sim.gpusched.io/exit-code": "1", "sim.gpusched.io/fail-attempts": "1",
                           "sim.gpusched.io/failure-reason": "node-lost"}
        spec = JobSpec(kind="training", queue=f"q-{team}" if i % 25 != 3 else "q-missing", team=team, image="img",
                       gpus=gpus, gpu_flavors=(flavor,), expected_runtime_seconds=rng.uniform(20, 90),
                       retry={"max_attempts": 2, "backoff_seconds": 5}, annotations=annotations)
        jobs.append(SubmitJob(job_id=f"e2e-{i:04d}", on_behalf_of=f"{team}-ci", spec=spec))
    return jobs


async def log_summary(js):
    """Per job: event types in order, started attempts, and GPU-seconds computed from the events."""
    history: dict[str, list] = defaultdict(list)
    async for m in eventlog.read(js, subjects=["gpusched.job.>"]):
        e = parse_event(m.data)
        history[e.aggregate_id].append(e)
    return history


def gpu_seconds_from_events(history) -> float:
    total = 0.0
    for events in history.values():
        gpus = {e.attempt: e.gpus for e in events if e.type == "QuotaReserved"}
        for e in events:
            if e.type in ("JobSucceeded", "JobFailed", "JobPreempted", "JobCancelled") and e.started_at is not None:
                total += gpus[e.attempt] * (e.occurred_at - e.started_at).total_seconds()
    return total


async def count_subject(js, pattern: str) -> int:
    return len([m async for m in eventlog.read(js, subjects=[pattern])])


async def test_500_jobs_survive_kill_9_of_every_service(stack, nats_server):
    procs, js, dsn, _ = stack
    jobs = workload(500)
    operator = await connect_as(nats_server, "operator")
    ojs = operator.jetstream()

    async def submit_all():
        for i, job in enumerate(jobs):
            await commands.publish_command(ojs, job.spec.team, "submit", job)
            if i % 10 == 0:
                await asyncio.sleep(0.2)  # keep submissions flowing while admission is killed

    submitting = asyncio.create_task(submit_all())
    # kill -9 each service in turn while work is in flight; restart it after a pause
    for succeeded, victim in [(20, "admission"), (60, "scheduler"), (120, "quota"), (200, "accounting"),
                              (280, "executor")]:
        await eventually(lambda: _at_least(js, "gpusched.job.*.succeeded", succeeded), timeout_s=120)
        procs.kill(victim)
        await asyncio.sleep(1.0)
        procs.start(victim)
    await submitting
    await operator.close()

    async def all_ended():
        history = await log_summary(js)
        ended = [j for j in jobs if history.get(j.job_id) and history[j.job_id][-1].type in TERMINAL | {"QuotaReleased"}
                 and _finished(history[j.job_id])]
        return history if len(ended) == len(jobs) else None

    history = await eventually(all_ended, timeout_s=300, interval_s=1.0)

    # no job lost, none run twice
    outcome = Counter()
    for job in jobs:
        events = history[job.job_id]
        types = [e.type for e in events]
        starts = Counter(e.attempt for e in events if e.type == "JobStarted")
        assert all(n == 1 for n in starts.values()), f"{job.job_id} started an attempt twice: {types}"
        assert types.count("JobSucceeded") <= 1, types
        assert types.count("JobScheduled") == len(starts), types
        outcome["rejected" if "JobRejected" in types else "succeeded" if "JobSucceeded" in types else "other"] += 1
    reasons = Counter(e.reason.value for ev in history.values() for e in ev if e.type == "JobRejected")
    assert reasons == {"unknown-queue": 20}
    assert outcome == {"succeeded": 480, "rejected": 20}

    # the ledger equals what the log says ran, once the accounting has caught up with the log
    last = await eventlog.last_sequence(js)
    conn = await asyncpg.connect(dsn)
    try:
        await eventually(lambda: _position_at(conn, last), timeout_s=60)
        ledger = await conn.fetchval("SELECT sum(gpu_seconds) FROM usage_ledger")
        assert ledger == pytest.approx(gpu_seconds_from_events(history), rel=1e-9)
        rows = await conn.fetchval("SELECT count(*) FROM usage_ledger")
        assert rows == sum(1 for ev in history.values() for e in ev if e.type == "JobStarted")
        states = Counter(r["state"] for r in await conn.fetch("SELECT state FROM jobs WHERE job_id LIKE 'e2e-%'"))
        assert states == {"succeeded": 480, "rejected": 20}
    finally:
        await conn.close()

    # the CLI reads the same numbers
    env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_PG_DSN": dsn}
    cli = [sys.executable, "-m", "gpusched.cli.main"]
    usage = json.loads(subprocess.run(cli + ["usage", "-o", "json"], env=env, capture_output=True, check=True, text=True).stdout)
    assert sum(r["gpu_hours"] for r in usage) * 3600 == pytest.approx(ledger, rel=1e-6)
    events = json.loads(subprocess.run(cli + ["events", "e2e-0007", "-o", "json"], env=env, capture_output=True,
                                       check=True, text=True).stdout)
    assert [e["type"] for e in events].count("JobStarted") == 2  # the flaky job's two attempts


def _finished(events) -> bool:
    types = [e.type for e in events]
    if "JobRejected" in types:
        return True
    return "JobSucceeded" in types and types[-1] == "QuotaReleased"


async def _at_least(js, pattern, n):
    return await count_subject(js, pattern) >= n


async def _position_at(conn, seq):
    return ((await conn.fetchval("SELECT last_sequence FROM projection_position")) or 0) >= seq


async def test_cli_submit_and_read_back(stack, nats_server, tmp_path):
    _, js, dsn, _ = stack
    job = tmp_path / "job.yaml"
    job.write_text("kind: training\nqueue: q-team-a\nteam: team-a\nimage: img\ngpus: 2\ngpu_flavors: [a100]\n"
                   "expected_runtime_seconds: 30\n")
    env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_PG_DSN": dsn}
    cli = [sys.executable, "-m", "gpusched.cli.main"]
    out = json.loads(subprocess.run(cli + ["submit", "-f", str(job), "-o", "json"], env=env, capture_output=True,
                                    check=True, text=True).stdout)
    assert out["decision"] == "JobAdmitted"

    def job_row():
        r = subprocess.run(cli + ["job", out["job_id"], "-o", "json"], env=env, capture_output=True, text=True)
        return json.loads(r.stdout) if r.returncode == 0 and json.loads(r.stdout)["state"] == "succeeded" else None
    row = await eventually(job_row, timeout_s=30, interval_s=0.5)
    assert row["usage"][0]["gpu_seconds"] == pytest.approx(60.0, rel=0.01)

    # one trace follows the job from the CLI through every service a job passes (all but the
    # serving controller, which follows only its replicas), via NATS headers
    on_the_way = set(devstack.SERVICES) - {"serving"}

    def services_in_trace():
        found = set()
        for f in (tmp_path / "traces").glob("*.jsonl"):
            for line in f.read_text().splitlines():
                span = json.loads(line)
                if span["context"]["trace_id"] == "0x" + out["trace_id"]:
                    found.add(f.stem)
        return found if found >= on_the_way else None
    assert await eventually(services_in_trace, timeout_s=15, interval_s=0.5) == on_the_way

    # quota views: a job too big for its queue's nominal (and no cohort) waits, and says why
    big = tmp_path / "big.yaml"
    big.write_text("job_id: too-big\nspec:\n  kind: training\n  queue: q-team-a\n  team: team-a\n  image: img\n"
                   "  gpus: 4\n  gang_size: 3\n  gpu_flavors: [a100]\n")
    subprocess.run(cli + ["submit", "-f", str(big)], env=env, capture_output=True, check=True, text=True)

    def waiting():
        r = subprocess.run(cli + ["why", "too-big", "-o", "json"], env=env, capture_output=True, text=True)
        return json.loads(r.stdout) if r.returncode == 0 and json.loads(r.stdout)["reason"] else None
    why = await eventually(waiting, timeout_s=20, interval_s=0.5)
    assert why["reason"]["code"] == "nominal-exhausted"
    assert why["reason"]["message"] == "queue q-team-a nominal a100 8, used 0; needs 12 more; no cohort to borrow from"
    queues = json.loads(subprocess.run(cli + ["queues", "-o", "json"], env=env, capture_output=True, check=True,
                                       text=True).stdout)
    row = next(q for q in queues if q["queue"] == "q-team-a" and q["flavor"] == "a100")
    assert (row["nominal"], row["used"], row["borrowed"]) == (8, 0, 0)
    assert row["pending_jobs"] >= 1

    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: training\nqueue: q-team-a\nteam: team-a\nimage: img\ngpus: -3\n")
    r = subprocess.run(cli + ["submit", "-f", str(bad)], env=env, capture_output=True, text=True)
    assert r.returncode == 2
    assert "spec.gpus: Input should be greater than or equal to 0" in r.stderr
