"""Chargeback statements the platform issued (the accounting service on a real nats-server and
Postgres, months closed on the log's clock) re-verified outside gpusched, in three languages, by
the verifiers of docs/accounting.md (examples/verify: Python rfc8785, JavaScript npm
`canonicalize`, Go github.com/gowebpki/jcs, built by `make verifiers`): each reads the issued
event as the log holds it and re-derives its checksum; a changed amount is a mismatch in every
one. A month closed with an attempt's end still to come: the late end is an adjustment line of
the next month's statement (a credit), which verifies by replay and in every language, and is
exported as the one CSV."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from conftest import eventually, service_settings
from runtime import eventlog
from services.accounting import __main__ as accounting
from gpusched.cli import accounting as accounting_cli
from schemas import NodeRegistered, new_event
from schemas.node import NodeInfo
from tests.integration.test_accounting_ledger import (  # noqa: F401  (cli_env: a fixture)
    NOV, _caught_up, _Quiet, cli_env, december_event, job, scenario,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "verify"
DOC = (ROOT / "docs" / "accounting.md").read_text()


@pytest.fixture(scope="module")
def verifiers() -> dict[str, list[str]]:
    """What scripts/verifiers.sh built (`make verifiers`), with the Python one beside them."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "verifiers.sh")], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    built = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert {"go", "js"} <= set(built), f"go and node are on this machine, yet not built: {done.stdout}{done.stderr}"
    return {"python": [sys.executable, str(EXAMPLES / "python" / "verify.py")], "js": ["node", built["js"]],
            "go": [built["go"]]}


def verify(argv: list[str], statement: bytes) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, input=statement.decode(), capture_output=True, text=True, timeout=60)


def test_the_docs_show_the_verifiers_that_are_tested():
    for path in ("python/verify.py", "js/verify.mjs", "go/main.go"):
        assert (EXAMPLES / path).read_text().strip() in DOC, f"docs/accounting.md does not show examples/verify/{path}"


async def test_an_issued_statement_verifies_in_python_javascript_and_go(nats_server, admin_js, pg_dsn, cli_env,
                                                                       verifiers):
    log = eventlog.EventLog(admin_js)
    for e in scenario():
        await log.append(e)
    await log.append(december_event())  # the log passes November's end: its statement is issued
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(service_settings(nats_server, "accounting", pg_dsn=pg_dsn), stop))
    try:
        async def issued() -> list[bytes]:
            return [m.data async for m in eventlog.read(admin_js, subjects=["gpusched.statement.>"])]

        (raw,) = await eventually(issued)
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    statement = json.loads(raw)
    assert statement["checksum_alg"] == "jcs-sha256" and statement["total_cost"] == "12.22"
    tampered = json.dumps({**statement, "total_cost": "12.23"}).encode()
    for language, argv in verifiers.items():
        ok = verify(argv, raw)
        assert ok.returncode == 0 and ok.stdout.strip() == f"verified {statement['checksum']}", (language, ok)
        bad = verify(argv, tampered)
        assert bad.returncode == 1 and bad.stdout.startswith("MISMATCH"), (language, bad)


async def test_a_month_closed_with_an_end_logged_late_bills_it_in_the_next(nats_server, admin_js, pg_dsn, cli_env,
                                                                          verifiers):
    nov30 = (datetime(2026, 11, 30, tzinfo=UTC) - NOV).total_seconds()
    late = job("late", "team-a", gpus=1, start=nov30 + 10 * 3600, end=nov30 + 12 * 3600)  # ran until Nov 30 12:00
    log = eventlog.EventLog(admin_js)
    for e in scenario() + late[:-1]:  # two teams in November; "late" still running as far as the log knows
        await log.append(e)
    await log.append(december_event())  # the log's clock passes November's end: November closes
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(service_settings(nats_server, "accounting", pg_dsn=pg_dsn), stop))

    async def issued() -> list[bytes]:
        return [m.data async for m in eventlog.read(admin_js, subjects=["gpusched.statement.>"])]

    async def count(n: int):
        got = await issued()
        return got if len(got) >= n and await _caught_up(admin_js, pg_dsn) else None

    try:
        await eventually(lambda: count(1))
        await log.append(late[-1])  # its end, logged in December
        await log.append(new_event(NodeRegistered, aggregate_id="n10", producer="executor",
                                   occurred_at=datetime(2027, 1, 1, 2, tzinfo=UTC), key="1",
                                   node=NodeInfo(name="n10", gpu_flavor="a100", gpu_count=8)))  # December closes
        november, december = await eventually(lambda: count(2))
        await asyncio.sleep(0.3)
        assert len(await issued()) == 2  # November is never revised
        verified = await accounting_cli._verify(json.loads(december)["aggregate_id"], _Quiet())
        assert verified["verified"]  # re-derived by replaying the log up to its last sequence
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    nov, dec = json.loads(november), json.loads(december)
    assert {line["key"]: line["gpu_hours"] for line in nov["lines"]} == {"team-a": "19.111111", "team-b": "1.000000"}
    # December: no usage; q's idle quota (4 GPUs x 744 h, showback) and November's adjustment: 12 GPU-hours
    # that were not used after all (a credit of 24.00), idle guaranteed quota instead
    assert nov["adjustments"] == [] and dec["lines"] == [{
        "key": "team-a", "gpu_hours": "-12.000000", "guaranteed_gpu_hours": "-12.000000",
        "borrowed_gpu_hours": "0.000000", "lost_gpu_hours": "0.000000", "idle_gpu_hours": "2988.000000",
        "usage_cost": "-24.00", "idle_cost": "5976.00", "total_cost": "-24.00"}]
    assert [(a["adjusts_period"], a["team"], a["gpu_hours"], a["idle_gpu_hours"], a["amount"])
            for a in dec["adjustments"]] == [("2026-11", "team-a", "-12.000000", "12.000000", "-24.00")]
    assert dec["total_cost"] == "-24.00"
    for language, argv in verifiers.items():
        for raw in (november, december):
            ok = verify(argv, raw)
            assert ok.returncode == 0 and ok.stdout.strip() == f"verified {json.loads(raw)['checksum']}", (language, ok)

    # the export: both issued statements in one CSV, the adjustment a row of December's
    env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_PG_DSN": pg_dsn,
           "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    done = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "chargeback", "--issued", "--format", "csv"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert [(r["period"], r["team"], r["amount"], r["adjusts_period"], r["provisional"]) for r in rows] == [
        ("2026-11", "team-a", "38.22", "", "false"), ("2026-11", "team-b", "2.00", "", "false"),
        ("2026-12", "team-a", "0.00", "", "false"),  # December's idle quota (showback)
        ("2026-12", "team-a", "-24.00", "2026-11", "false")]
    assert {r["checksum"] for r in rows if r["period"] == "2026-12"} == {dec["checksum"]}
