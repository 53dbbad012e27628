"""The accounting process over a Postgres that is killed (-9) and restarted on the same port and
data (issue 21): it retries, reconnects and resumes from its stored position without exiting; a
SIGTERM stops it within its grace period even while it retries; `gpusched dlq` lists what it
dead-lettered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import asyncpg

from conftest import eventually
from gpusched.dev import stack as devstack
from runtime import eventlog
from services.accounting.__main__ import STOP_GRACE_S
from tests.integration.test_telemetry import REPO
from tests.unit.builders import queue, submitted


def start_accounting(nats_server, dsn: str, log_path) -> subprocess.Popen:
    env = {**os.environ, **nats_server.env("accounting"), "GPUSCHED_PG_DSN": dsn, "GPUSCHED_TICK_S": "0.05"}
    return subprocess.Popen([sys.executable, "-m", "services.accounting"], cwd=REPO, env=env,
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)


async def jobs(dsn: str) -> set[str]:
    try:
        conn = await asyncpg.connect(dsn, timeout=2)
    except (OSError, asyncpg.PostgresError):
        return set()
    try:
        return {r["job_id"] for r in await conn.fetch("SELECT job_id FROM jobs")}
    except asyncpg.UndefinedTableError:
        return set()
    finally:
        await conn.close()


def has_jobs(dsn: str, *wanted: str):
    async def check():
        return set(wanted) <= await jobs(dsn)
    return check


async def test_accounting_rides_out_a_postgres_restart_and_stops_promptly_while_retrying(
        nats_server, admin_js, tmp_path):
    pg = devstack.Postgres(tmp_path / "pg", fsync=False).start()
    log = eventlog.EventLog(admin_js)
    proc = start_accounting(nats_server, pg.dsn, tmp_path / "accounting.log")
    try:
        await log.append(queue())
        await log.append(submitted("before"))
        await eventually(has_jobs(pg.dsn, "before"), timeout_s=30)

        pg.kill()
        await log.append(submitted("during"))
        nul_seq = await log.append(submitted("nul", submitter="al\x00ice"))  # one accounting cannot store
        time.sleep(2)  # accounting retries meanwhile
        assert proc.poll() is None
        pg.start()
        # "before" too: without synchronous commit (fsync=False) the crash may have undone its
        # commit, and accounting resumes from the position Postgres kept, not the one it wrote.
        await eventually(has_jobs(pg.dsn, "before", "during"), timeout_s=30)

        pg.kill()
        await log.append(submitted("after"))
        time.sleep(1.5)
        began = time.monotonic()
        proc.terminate()
        assert proc.wait(STOP_GRACE_S + 10) == 0
        assert time.monotonic() - began < STOP_GRACE_S + 5
    finally:
        if proc.poll() is None:
            proc.kill()
        pg.stop()
    text = (tmp_path / "accounting.log").read_text()
    assert "Traceback" not in text, text[-3000:]
    assert "Postgres unavailable" in text or "postgres write failed" in text

    env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    out = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "dlq", "-o", "json"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    dead = [r for r in json.loads(out.stdout) if r["subject"] == "gpusched.deadletter.accounting"]
    assert [r["original"] for r in dead] == [f"{eventlog.EVENTS_STREAM}#{nul_seq}"] and dead[0]["reason"]
