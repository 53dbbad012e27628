"""The gateway's reads (gpusched.gateway.port) through both adapters on one running platform
(tests/api/stack.py): the operator's NATS + Postgres (gpusched.gateway.log) and a member's token
on the HTTP API (gpusched.gateway.http) give the same answers on what both give: a waiting job's
state, reason, position and attempt, its events with their stream sequences, its queue's usage,
the summary. And the CLI's reads over the API alone (no NATS, no Postgres)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from gpusched.gateway.connection import Connection
from gpusched.gateway.http import HttpGateway
from gpusched.gateway.log import LogGateway
from gpusched.userinput import UserError
from tests.api.stack import ApiStack, job_document

TEAM, QUEUE = "team-b", "q-team-b"


def operator(stack: ApiStack) -> Connection:
    env = stack.nats_server.env("operator")
    return Connection(nats_url=env["GPUSCHED_NATS_URL"], nats_user=env["GPUSCHED_NATS_USER"],
                      nats_password=env["GPUSCHED_NATS_PASSWORD"], pg_dsn=stack.dsn)


def holder(stack: ApiStack, name: str = "bob") -> Connection:
    """The API only: a token, no NATS credential, no Postgres."""
    return Connection(nats_url="nats://127.0.0.1:1", nats_user=None, nats_password=None, pg_dsn=None,
                      api_url=stack.url, api_token=stack.tokens[name])


async def ask(connection: Connection, call) -> Any:
    async with connection.gateway() as gateway:
        return await call(gateway)


def plain(value: Any) -> Any:
    """As JSON gives it (the log's adapter reads datetimes from Postgres, the API's are text)."""
    return json.loads(json.dumps(value, default=lambda v: v.isoformat() if isinstance(v, datetime) else str(v)))


async def agreeing(read, timeout_s: float = 60.0):
    """``read()`` -> (log's, API's, agree); retried until they agree (the platform moves on
    between two reads), the last pair otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        ours, theirs, agree = await read()
        if agree or time.monotonic() > deadline:
            return ours, theirs
        await asyncio.sleep(0.3)


@pytest.fixture(scope="module")
def waiting(api_stack):
    """A job of team-b that waits for quota behind one holding all of the team's queue; both
    cancelled at the end."""
    from schemas.commands import SubmitJob

    hold, wait = f"hold-{uuid.uuid4().hex[:8]}", f"wait-{uuid.uuid4().hex[:8]}"

    async def submit():
        for job_id in (hold, wait):
            command = SubmitJob.model_validate(job_document(job_id, TEAM, gpus=8, runtime_s=36_000))
            answer = await ask(holder(api_stack), lambda gw: gw.submit(command))
            assert answer.decision == "JobAdmitted", answer

        deadline = time.monotonic() + 60
        while True:  # quota recorded why it waits, and the read models have its place in line
            found = await ask(operator(api_stack), lambda gw: gw.why(wait))
            if found["reason"] is not None and found["position"] is not None:
                return
            assert time.monotonic() < deadline, found
            await asyncio.sleep(0.3)
    asyncio.run(submit())
    yield wait
    with api_stack.client("ops") as ops:
        for job_id in (wait, hold):
            ops.post(f"/v1/jobs/{job_id}/cancel", json={"reason": "test over"}, params={"wait": 0})


def test_each_connection_picks_its_adapter(api_stack):
    assert isinstance(operator(api_stack).gateway(), LogGateway)
    assert isinstance(holder(api_stack).gateway(), HttpGateway)


async def test_why_gives_one_reason_position_and_attempt(api_stack, waiting):
    async def read():
        ours = await ask(operator(api_stack), lambda gw: gw.why(waiting))
        theirs = await ask(holder(api_stack), lambda gw: gw.why(waiting))
        return ours, theirs, _why_fields(ours) == _why_fields(theirs)
    ours, theirs = await agreeing(read)

    assert _why_fields(ours) == _why_fields(theirs)
    assert ours["waiting_for_quota"] and ours["queue"] == QUEUE and ours["position"] >= 1
    assert ours["reason"]["code"] and ours["attempt"] == 1
    assert plain(ours["since"]) == plain(theirs["since"]) and plain(ours["history"]) == plain(theirs["history"])
    assert ours["queue_now"]["flavors"][0]["queue"] == QUEUE  # the log's adapter reads the read models too
    assert "queue_now" not in theirs  # the API does not give it


def _why_fields(found: dict[str, Any]) -> tuple:
    reason = found["reason"] or {}
    return (found["job_id"], found["queue"], found["attempt"], found["last_event"], found["waiting_for_quota"],
            found["position"], reason.get("code"), reason.get("message"), reason.get("position"))


async def test_events_come_in_log_order_with_their_sequences(api_stack, waiting):
    async def read():
        ours = await ask(operator(api_stack), lambda gw: gw.events(waiting))
        theirs = await ask(holder(api_stack), lambda gw: gw.events(waiting))
        return ours, theirs, len(ours) == len(theirs)
    ours, theirs = await agreeing(read)

    assert [(e["sequence"], e["type"]) for e in ours] == [(e["sequence"], e["type"]) for e in theirs]
    assert [e["type"] for e in ours][:2] == ["JobSubmitted", "JobAdmitted"]
    assert ours == theirs  # the whole events, as JSON
    assert all(isinstance(e["sequence"], int) for e in theirs)
    assert [e["sequence"] for e in ours] == sorted(e["sequence"] for e in ours)


async def test_the_job_and_its_queue_read_the_same(api_stack, waiting):
    fields = ("job_id", "state", "team", "queue", "total_gpus", "attempt")

    async def jobs():
        ours = await ask(operator(api_stack), lambda gw: gw.job(waiting))
        theirs = await ask(holder(api_stack), lambda gw: gw.job(waiting))
        return ours, theirs, plain({f: ours.get(f) for f in fields}) == {f: theirs.get(f) for f in fields}
    ours, theirs = await agreeing(jobs)
    assert plain({f: ours.get(f) for f in fields}) == {f: theirs.get(f) for f in fields}
    assert theirs["state"] == "queued"

    async def queues():
        ours = [r for r in await ask(operator(api_stack), lambda gw: gw.queues()) if r["queue"] == QUEUE]
        theirs = await ask(holder(api_stack), lambda gw: gw.queues())  # a member: its team's queues
        return ours, theirs, plain(ours) == [{k: v for k, v in r.items() if k != "teams"} for r in theirs]
    ours, theirs = await agreeing(queues)
    assert plain(ours) == [{k: v for k, v in r.items() if k != "teams"} for r in theirs]
    assert ours[0]["pending_jobs"] >= 1 and [r["teams"] for r in theirs] == [[TEAM]]


async def test_the_summary_reads_the_same(api_stack, waiting):
    async def read():
        ours = await ask(operator(api_stack), lambda gw: gw.summary())
        theirs = await ask(holder(api_stack, "ops"), lambda gw: gw.summary())  # every team's, as the operator's
        return ours, theirs, plain(ours["jobs_by_state"]) == theirs["jobs_by_state"]
    ours, theirs = await agreeing(read)
    assert plain(ours["jobs_by_state"]) == theirs["jobs_by_state"] and ours["jobs_by_state"]["queued"] >= 1
    assert set(ours) == set(theirs)
    assert all(set(ours[k]) == set(theirs[k]) for k in ("wait_s", "gpu_utilization_last_hour"))
    team = await ask(holder(api_stack), lambda gw: gw.summary())  # a member: its team's jobs
    assert set(team) == set(ours) and team["jobs_by_state"].get("queued", 0) >= 1


async def test_chargeback_is_the_statement_for_a_chargeback_reader_only(api_stack):
    month = datetime.now(UTC).strftime("%Y-%m")
    ours = await ask(operator(api_stack), lambda gw: gw.chargeback(month, "team"))
    theirs = await ask(holder(api_stack, "money"), lambda gw: gw.chargeback(month, "team"))
    assert set(ours) == set(theirs) and ours["period"] == theirs["period"] == month
    with pytest.raises(UserError, match="the API refused the chargeback"):
        await ask(holder(api_stack), lambda gw: gw.chargeback(month, "team"))


def cli_over_the_api(stack: ApiStack, name: str, *args: str, output: str = "json") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}  # no NATS: only the API
    env.update(GPUSCHED_API_URL=stack.url, GPUSCHED_API_TOKEN=stack.tokens[name],
               GPUSCHED_CONNECTION_FILE="/nonexistent")
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args, "-o", output], env=env,
                          capture_output=True, text=True, timeout=60)


def cli_as_operator(stack: ApiStack, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env.update(stack.nats_server.env("operator"), GPUSCHED_PG_DSN=stack.dsn, GPUSCHED_CONNECTION_FILE="/nonexistent")
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("door", ["api", "operator"])
def test_the_tables_of_the_reads_show_either_adapters_answer(api_stack, waiting, door):
    for args, shown in ((("why", waiting), waiting), (("events", waiting), "QuotaPendingReasonChanged"),
                        (("queues",), QUEUE)):
        done = (cli_over_the_api(api_stack, "bob", *args, output="table") if door == "api"
                else cli_as_operator(api_stack, *args))
        assert done.returncode == 0, (args, done.stderr)
        assert shown in done.stdout, done.stdout
    why = (cli_over_the_api(api_stack, "bob", "why", waiting, output="table") if door == "api"
           else cli_as_operator(api_stack, "why", waiting)).stdout
    assert "waiting for quota" in why and "position" in why
    assert ("now (read models at sequence" in why) == (door == "operator")  # the usage now: the log's adapter only


async def test_the_clis_reads_work_over_the_api_alone(api_stack, waiting):
    why = cli_over_the_api(api_stack, "bob", "why", waiting)
    assert why.returncode == 0, why.stderr
    shown = json.loads(why.stdout)
    ours = await ask(operator(api_stack), lambda gw: gw.why(waiting))
    assert (shown["reason"]["code"], shown["position"], shown["attempt"], shown["queue"]) == (
        ours["reason"]["code"], ours["position"], ours["attempt"], ours["queue"])

    events = cli_over_the_api(api_stack, "bob", "events", waiting)
    assert events.returncode == 0, events.stderr
    logged = await ask(operator(api_stack), lambda gw: gw.events(waiting))
    assert [(e["sequence"], e["type"]) for e in json.loads(events.stdout)] == [
        (e["sequence"], e["type"]) for e in logged][:len(json.loads(events.stdout))]

    queues = cli_over_the_api(api_stack, "bob", "queues")
    assert queues.returncode == 0, queues.stderr
    assert [r["queue"] for r in json.loads(queues.stdout)] == [QUEUE]

    month = datetime.now(UTC).strftime("%Y-%m")
    statement = cli_over_the_api(api_stack, "money", "chargeback", "--period", month, "--by", "team")
    assert statement.returncode == 0, statement.stderr
    assert json.loads(statement.stdout)["period"] == month
    refused = cli_over_the_api(api_stack, "bob", "chargeback", "--period", month)
    assert refused.returncode == 2 and "refused the chargeback" in refused.stderr
    unknown = cli_over_the_api(api_stack, "bob", "why", "no-such-job")
    assert unknown.returncode == 2 and "no-such-job" in unknown.stderr, unknown.stderr
