"""Issue 44's CLI promises against a real nats-server and Postgres: every read command says
"not ready yet" (one line, exit status 2) before accounting has created the read models, and
`cancel` finds the job's team from its id."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import eventlog
from tests.integration.test_cli_why import admitted

REPO = Path(__file__).resolve().parents[2]


def gpusched(nats_server, pg_dsn: str, *args: str, user: str = "operator") -> subprocess.CompletedProcess:
    env = {**os.environ, **nats_server.env(user), "GPUSCHED_PG_DSN": pg_dsn,
           "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=60, cwd=REPO)


READS = [("jobs",), ("job", "j1"), ("queues",), ("why", "j1"), ("services",), ("services", "svc"), ("usage",),
         ("chargeback", "--period", "2026-01"), ("chargeback", "--issued"), ("metrics",), ("token", "list")]


async def test_every_read_says_not_ready_before_accounting_created_the_read_models(nats_server, admin_js, pg_dsn):
    # pg_dsn: a database with no tables, as right after `make run` starts, before accounting migrates.
    await eventlog.EventLog(admin_js).append(admitted("j1", 2)[0])  # so that `why j1` gets as far as Postgres

    async def one(args):
        return args, await asyncio.to_thread(gpusched, nats_server, pg_dsn, *args)
    for args, proc in await asyncio.gather(*(one(a) for a in READS)):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(lines) == 1 and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert "the read models are not ready yet" in lines[0] and "try again" in lines[0], (args, lines[0])


async def test_cancel_finds_the_jobs_team_from_its_id(nats_server, admin_js, pg_dsn):
    # The read models not ready (pg_dsn is empty): the team comes from the job's JobSubmitted in the log.
    log = eventlog.EventLog(admin_js)
    for event in admitted("j-cancel", 2):
        await log.append(event)
    # No --team, no wait (no admission runs here): the request goes to the job's team's intake subject.
    proc = await asyncio.to_thread(gpusched, nats_server, pg_dsn, "cancel", "j-cancel", "--no-wait", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["job_id"] == "j-cancel"
    raw = await admin_js.get_msg(eventlog.INTAKE_STREAM, seq=answer["intake_sequence"])
    assert raw.subject.endswith(".intake.team-a.operator.cancel"), raw.subject

    unknown = await asyncio.to_thread(gpusched, nats_server, pg_dsn, "cancel", "nope", "--no-wait")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
    assert "'nope' is unknown" in unknown.stderr and "--team" in unknown.stderr
