"""End to end: the five services as processes ride out a broker restart and a database restart
(issue 21, deliverable 4). Mid-run nats-server is killed with SIGKILL and started again on the
same port and store, then Postgres likewise on the same data; no service exits, every job ends,
and the read models catch up with the log."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime

import asyncpg
import pytest

from conftest import TEST_TEAMS, eventually
from e2e.test_e2e import CLUSTER, TIME_SCALE, _finished, _position_at, count_subject, log_summary, workload
from gpusched.gateway import commands
from gpusched.dev import stack as devstack
from runtime import eventlog
from runtime.settings import Settings
from schemas.queue import FlavorQuota, QueueConfigured

pytestmark = pytest.mark.e2e

JOBS = 150


async def connect(server: devstack.NatsServer, user: str):
    return await eventlog.connect(Settings(nats_url=server.url(), nats_user=user,
                                           nats_password=server.creds.users[user]), f"test-{user}")


@pytest.fixture
async def own_stack(tmp_path):
    """A stack with its own nats-server and Postgres, which this test may kill."""
    nats_server = devstack.NatsServer(tmp_path / "nats", teams=TEST_TEAMS).start()
    pg = devstack.Postgres(tmp_path / "pg", fsync=False).start()
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    admin = await connect(nats_server, "admin")
    js = admin.jetstream()
    await eventlog.provision(js)
    for i, team in enumerate(TEST_TEAMS):
        await eventlog.EventLog(js).append(QueueConfigured(
            event_id=f"q-{team}", aggregate_id=f"q-{team}", occurred_at=datetime.now(UTC), producer="config",
            name=f"q-{team}", allowed_teams=(team,),
            quotas=(FlavorQuota(flavor="a100", nominal=8), FlavorQuota(flavor="l4", nominal=5 + i))))
    env = devstack.service_env(nats_server.env, pg.dsn, cluster=cluster, time_scale=TIME_SCALE, epoch=time.time(),
                               extra={"GPUSCHED_TICK_S": "0.1"})
    procs = devstack.ServiceProcesses(tmp_path / "logs", env)
    procs.start_all()
    try:
        yield nats_server, pg, procs, js
    finally:
        procs.stop_all()
        await admin.close()
        pg.stop()
        nats_server.stop()
    for name in devstack.SERVICES:
        text = (tmp_path / "logs" / f"{name}.log").read_text()
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"


async def test_services_ride_out_a_nats_restart_and_a_postgres_restart(own_stack):
    nats_server, pg, procs, js = own_stack
    pids = {name: p.pid for name, p in procs.procs.items()}
    jobs = workload(JOBS)
    operator = await connect(nats_server, "operator")
    ojs = operator.jetstream()

    async def submit_all():
        for i, job in enumerate(jobs):
            while True:  # the broker may be away: publish again (the message id de-duplicates)
                try:
                    await commands.publish_command(ojs, job.spec.team, "submit", job,
                                                   headers={"Nats-Msg-Id": f"submit:{job.job_id}"})
                    break
                except eventlog.BROKER_ERRORS:
                    await asyncio.sleep(0.5)
            if i % 10 == 0:
                await asyncio.sleep(0.2)

    submitting = asyncio.create_task(submit_all())
    await eventually(lambda: _at_least(js, "gpusched.job.*.succeeded", 15), timeout_s=120)
    nats_server.kill()
    await asyncio.sleep(2.0)
    nats_server.start()  # same port, same store

    await eventually(lambda: _at_least(js, "gpusched.job.*.succeeded", 45), timeout_s=120)
    pg.kill()
    await asyncio.sleep(2.0)
    pg.start()  # same port, same data
    await submitting
    await operator.close()

    async def all_ended():
        history = await log_summary(js)
        done = [j for j in jobs if history.get(j.job_id) and _finished(history[j.job_id])]
        return history if len(done) == len(jobs) else None

    history = await eventually(all_ended, timeout_s=240, interval_s=1.0)
    for job in jobs:
        starts = Counter(e.attempt for e in history[job.job_id] if e.type == "JobStarted")
        assert all(n == 1 for n in starts.values()), f"{job.job_id} started an attempt twice"

    exited = {name: p.returncode for name, p in procs.procs.items() if p.poll() is not None or p.pid != pids[name]}
    assert exited == {}, f"services exited: {exited}"

    last = await eventlog.last_sequence(js)
    conn = await asyncpg.connect(pg.dsn)
    try:
        await eventually(lambda: _position_at(conn, last), timeout_s=60)
        states = Counter(r["state"] for r in await conn.fetch("SELECT state FROM jobs WHERE job_id LIKE 'e2e-%'"))
        rejected = sum(1 for j in jobs if j.spec.queue == "q-missing")
        assert states == {"succeeded": JOBS - rejected, "rejected": rejected}
    finally:
        await conn.close()


async def _at_least(js, pattern: str, n: int) -> bool:
    try:
        return await count_subject(js, pattern) >= n
    except eventlog.BROKER_ERRORS:
        return False
