"""The usage ledger, price book, chargeback statements, replay and metrics against a real
nats-server and Postgres: guaranteed vs borrowed, work lost since the last checkpoint, queue
wait; a statement issued when the period closes, re-derived by replay with the same checksum,
re-issued after a price correction; shadow rebuild, compare and swap; `promtool check metrics`."""

from __future__ import annotations

import asyncio
import os
import subprocess
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import asyncpg
import pytest

import pytest_asyncio

from conftest import connect_as, eventually, reset_log, service_settings
from gpusched.cli import accounting as accounting_cli
from runtime import eventlog
from schemas import (
    JobAdmitted, JobCheckpointed, JobPreempted, JobRetryScheduled, JobScheduled, JobSpec, JobStarted, JobSubmitted,
    JobSucceeded, NodeAssignment, NodeRegistered, QuotaReserved, new_event,
)
from schemas.node import NodeInfo
from services.accounting import __main__ as accounting
from services.accounting import metrics, operations, queries, replay, sink
from services.accounting.bulk import copy, indexes
from services.accounting.bulk import writers as range_writers
from tests.unit.builders import price_book, queue

NOV = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)
REPO = Path(__file__).resolve().parents[2]


def s(seconds: float) -> datetime:
    return NOV + timedelta(seconds=seconds)


def job(job_id: str, team: str, *, gpus: int, borrowed: int = 0, start: float = 60, end: float = 3660,
        preempt_at: float | None = None, checkpoint_at: float | None = None) -> list:
    spec = JobSpec(kind="training", queue="q", team=team, image="img", gpus=gpus)
    ev = [
        new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=s(0), key="1", spec=spec,
                  submitter="u", intake_sequence=1),
        new_event(JobAdmitted, aggregate_id=job_id, producer="admission", occurred_at=s(0), key="d", queue="q",
                  priority=500, preemptible=True),
    ]

    def run(attempt: int, t0: float, t1: float, borrowed_: int, ending):
        ev.extend([
            new_event(QuotaReserved, aggregate_id=job_id, producer="quota", occurred_at=s(t0 - 5), key=str(attempt),
                      attempt=attempt, queue="q", flavor="a100", gpus=gpus, borrowed=borrowed_),
            new_event(JobScheduled, aggregate_id=job_id, producer="scheduler", occurred_at=s(t0 - 1), key=str(attempt),
                      attempt=attempt, flavor="a100", placement=(NodeAssignment(node="n1", gpus=gpus),)),
            new_event(JobStarted, aggregate_id=job_id, producer="executor", occurred_at=s(t0), key=str(attempt),
                      attempt=attempt, nodes=("n1",)),
        ])
        if checkpoint_at is not None and attempt == 1:
            ev.append(new_event(JobCheckpointed, aggregate_id=job_id, producer="admission", occurred_at=s(checkpoint_at + 1),
                                key="c1", attempt=1, checkpointed_at=s(checkpoint_at), intake_sequence=2))
        ev.append(new_event(ending, aggregate_id=job_id, producer="executor", occurred_at=s(t1), key=str(attempt),
                            attempt=attempt, started_at=s(t0)))

    if preempt_at is None:
        run(1, start, end, borrowed, JobSucceeded)
    else:
        run(1, start, preempt_at, borrowed, JobPreempted)
        ev.append(new_event(JobRetryScheduled, aggregate_id=job_id, producer="quota", occurred_at=s(preempt_at + 10),
                            key="r1", failed_attempt=1, next_attempt=2, not_before=s(preempt_at + 10)))
        run(2, preempt_at + 40, end, 0, JobSucceeded)
    return ev


def december_event():
    return new_event(NodeRegistered, aggregate_id="n9", producer="executor",
                     occurred_at=datetime(2026, 12, 1, 2, tzinfo=UTC), key="1",
                     node=NodeInfo(name="n9", gpu_flavor="a100", gpu_count=8))


def scenario() -> list:
    q = queue("q", ("team-a", "team-b"), {"a100": 4})
    q = q.model_copy(update={"occurred_at": datetime(2026, 11, 1, tzinfo=UTC)})
    book = price_book({"a100": 2.0}, effective_from=datetime(2026, 10, 1, tzinfo=UTC))
    return [q, book,
            *job("j1", "team-a", gpus=4, borrowed=1, start=60, preempt_at=1060, checkpoint_at=660, end=4700),
            *job("j2", "team-b", gpus=1, start=100, end=3700)]


@pytest_asyncio.fixture
async def admin_nc(nats_server, admin_js):
    """The admin's NATS client (a rebuild's writers connect with its server and credentials),
    over the streams admin_js provisioned."""
    nc = await connect_as(nats_server, "admin")
    yield nc
    await nc.close()


@pytest.fixture
def cli_env(nats_server, pg_dsn, monkeypatch):
    monkeypatch.setenv("GPUSCHED_NATS_URL", nats_server.url())
    monkeypatch.setenv("GPUSCHED_NATS_USER", "operator")
    monkeypatch.setenv("GPUSCHED_NATS_PASSWORD", nats_server.creds.users["operator"])
    monkeypatch.setenv("GPUSCHED_PG_DSN", pg_dsn)
    monkeypatch.setenv("GPUSCHED_CONNECTION_FILE", "/nonexistent")
    monkeypatch.setenv("GPUSCHED_STATEMENT_GRACE_S", "0")
    monkeypatch.setenv("GPUSCHED_STATEMENT_BY", "team")


async def _position(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return await sink.position(conn) if await conn.fetchval("SELECT to_regclass('projection_position') IS NOT NULL") else 0
    finally:
        await conn.close()


async def _caught_up(js, dsn: str) -> bool:
    return await _position(dsn) >= await eventlog.last_sequence(js)


async def _statements(js) -> list:
    from schemas import parse_event
    return [parse_event(m.data) async for m in eventlog.read(js, subjects=["gpusched.statement.>"])]


async def test_ledger_statement_replay_and_metrics(nats_server, admin_js, pg_dsn, cli_env):
    log = eventlog.EventLog(admin_js)
    for e in scenario():
        await log.append(e)
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(service_settings(nats_server, "accounting", pg_dsn=pg_dsn), stop))
    conn = await asyncpg.connect(pg_dsn)
    try:
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
        rows = {(r["job_id"], r["attempt"]): dict(r) for r in await conn.fetch("SELECT * FROM usage_ledger")}
        a1, a2 = rows[("j1", 1)], rows[("j1", 2)]
        assert (a1["gpu_seconds"], a1["borrowed_gpu_seconds"], a1["lost_gpu_seconds"]) == (4000.0, 1000.0, 1600.0)
        assert a1["last_checkpoint_at"] == s(660) and a1["wait_seconds"] == 60.0 and a1["outcome"] == "JobPreempted"
        assert (a2["gpu_seconds"], a2["borrowed_gpu_seconds"], a2["lost_gpu_seconds"]) == (4 * 3600.0, 0.0, 0.0)
        assert a2["wait_seconds"] == 30.0  # retry decided at 1070, started at 1100
        assert rows[("j2", 1)]["cpu_core_seconds"] == 3600.0
        assert await _statements(admin_js) == []  # November is not over in the log yet

        # time travel: usage up to 4000 s — j1's first attempt, the first 2900 s of its second
        # (4 GPUs from 1100 s, it ended later), and j2
        early = await queries.rollup(conn, ["team"], as_of=s(4000))
        assert [(r["team"], r["gpu_hours"], r["attempts"]) for r in early] == [
            ("team-a", (4000 + 4 * 2900) / 3600, 2), ("team-b", 1.0, 1)]

        # the log passes the end of November: the statement is issued and projected
        await log.append(december_event())
        (st,) = await eventually(lambda: _statements(admin_js))
        assert st.period == "2026-11" and st.group_by == "team" and st.first_sequence == 1
        assert st.last_sequence == len(scenario()) + 1  # the read models had applied the December event
        lines = {line.key: line for line in st.lines}
        assert lines["team-a"].gpu_hours == "5.111111" and lines["team-a"].usage_cost == "10.22"  # 5.111111 h x 2.0
        assert lines["team-a"].lost_gpu_hours == "0.444444" and lines["team-a"].borrowed_gpu_hours == "0.277778"
        assert Decimal(lines["team-a"].idle_gpu_hours) > 0 and lines["team-a"].total_cost == lines["team-a"].usage_cost
        assert st.total_cost == "12.22" and st.checksum_alg == "jcs-sha256"  # team-b: 1 GPU-hour x 2.0
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
        assert [r["statement_id"] for r in await queries.issued(conn)] == [st.aggregate_id]

        # anyone can re-derive it by replay and get the same checksum
        verified = await accounting_cli._verify(st.aggregate_id, _Quiet())
        assert verified["verified"] and verified["replayed_checksum"] == st.checksum

        # a corrected price for the same effective time re-prices November: November's statement
        # stands, December (still open) carries the difference
        await log.append(price_book({"a100": 3.0}, effective_from=datetime(2026, 10, 1, tzinfo=UTC), key="fix",
                                    when=datetime(2026, 12, 1, 3, tzinfo=UTC)))
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
        await asyncio.sleep(0.3)
        assert await _statements(admin_js) == [st]
        december = await queries.statement(conn, "2026-12", "team", log=admin_js)
        assert sum(Decimal(a["amount"]) for a in december["adjustments"]) == Decimal("18.33") - Decimal("12.22")
        assert december["total_cost"] == "6.11" and december["provisional"] is True

        # replay into a shadow: identical to live, table by table; then swap it in while live runs
        result = await accounting_cli._replay("shadow", None, None, True, False, 7, _Quiet())
        assert result["position"] == await _position(pg_dsn)
        assert [r["table"] for r in result["compare"] if not r["equal"]] == []
        assert {r["table"]: r["live_rows"] for r in result["compare"]}["usage_ledger"] == 3
        # the rebuild loads with secondary indexes deferred, then builds them: the same as live's
        assert await _indexes(conn, "shadow") == await _indexes(conn, "public")
        await conn.execute("UPDATE shadow.usage_ledger SET gpu_seconds = gpu_seconds + 1 WHERE job_id = 'j2'")
        diff = await replay.compare(pg_dsn, "shadow")
        assert [r["table"] for r in diff if not r["equal"]] == ["usage_ledger"]
        swapped = await accounting_cli._replay("shadow", None, None, False, True, 1000, _Quiet())
        assert swapped["retired"].startswith("retired_")
        for e in job("j3", "team-a", gpus=2, start=10, end=20):
            await log.append(e.model_copy(update={"occurred_at": e.occurred_at + timedelta(days=30)}))
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
        assert await conn.fetchval("SELECT count(*) FROM public.usage_ledger") == 4  # live writes to the new tables

        # operations metrics: the exposition is valid for promtool
        text = await metrics.exposition(conn, datetime(2026, 12, 2, tzinfo=UTC))
        assert b'gpusched_team_gpu_seconds{flavor="a100",team="team-a"}' in text
        assert b'gpusched_gpu_capacity{flavor="a100"} 8.0' in text
        promtool_check(text)
        # the endpoint's SQL team cost follows the same pricing rule as the statements (split at price changes)
        await log.append(price_book({"a100": 5.0}, effective_from=s(2000), key="mid", when=s(2001)))
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
        sampled = {dict(x.labels)["team"]: x.value for x in await metrics.gather(conn, s(9999))
                   if x.name == "gpusched_team_cost"}
        pure = {r["team"]: r["cost"] for r in await queries.rollup(conn, ["team"])}
        assert sampled == pytest.approx(pure) and pure["team-a"] > 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await conn.close()


async def _ready(coro, n):
    items = await coro
    return items if len(items) >= n else None


def _Quiet():  # noqa: N802
    """The CLI's stderr console, silenced under pytest."""
    from rich.console import Console
    return Console(file=open(os.devnull, "w"))


def promtool() -> str:
    if os.environ.get("PROMTOOL"):
        return os.environ["PROMTOOL"]
    proc = subprocess.run(["sh", str(REPO / "scripts" / "promtool.sh")], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"promtool not installable here: {proc.stderr.strip()}")
    return proc.stdout.strip()


def promtool_check(text: bytes) -> None:
    proc = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()
    assert proc.stdout + proc.stderr == b"", (proc.stdout + proc.stderr).decode()  # no lint warnings either


async def test_service_metrics_endpoint_passes_promtool(nats_server, admin_js, pg_dsn):
    """The accounting process's own /metrics (process, service and read-model metrics)."""
    import urllib.request

    from gpusched.dev import stack as devstack
    port = devstack.free_port()
    log = eventlog.EventLog(admin_js)
    for e in scenario():
        await log.append(e)
    env = {**os.environ, **nats_server.env("accounting"), "GPUSCHED_PG_DSN": pg_dsn,
           "GPUSCHED_METRICS_PORT": str(port), "GPUSCHED_TICK_S": "0.05"}
    proc = subprocess.Popen([str(Path(os.sys.executable)), "-m", "services.accounting"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await eventually(lambda: _caught_up(admin_js, pg_dsn), timeout_s=30)
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read())
        assert b"gpusched_queue_wait_seconds{quantile=\"0.5\",queue=\"q\"}" in body
        assert b"gpusched_team_cost{currency=\"USD\",team=\"team-b\"} 2.0" in body
        promtool_check(body)
    finally:
        proc.terminate()
        proc.wait(10)


async def _indexes(conn, schema: str) -> list[tuple[str, str]]:
    return [(r["indexname"], r["indexdef"].replace(f"{schema}.", "")) for r in await conn.fetch(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1 ORDER BY indexname", schema)]


async def test_a_rebuild_skips_an_event_appended_twice_and_equals_the_inline_replay(nats_server, admin_js, admin_nc, pg_dsn,
                                                                                     monkeypatch):
    """The rebuild (writer processes, Bloom filter of applied ids, deferred indexes) and the
    inline replay give the same tables, and both skip the second copy of an event appended
    again after JetStream's duplicate window, whichever batch and writer each copy falls in."""
    from schemas.registry import dumps, event_subject

    log = eventlog.EventLog(admin_js)
    events = scenario() + job("dup", "team-b", gpus=2, start=10, end=110)
    for e in events:
        await log.append(e)
    started = next(e for e in events if e.aggregate_id == "dup" and e.type == "JobStarted")
    for e in (started, events[-1]):
        await admin_js.publish(event_subject(e), dumps(e), headers={"Nats-Msg-Id": "late-" + e.event_id})
    sums = {}
    for schema, batch, writers in (("inline_one", 1, None), ("rebuilt_3", 3, 2), ("rebuilt_3_by_1", 3, 1),
                                   ("rebuilt_3_by_3", 3, 3), ("rebuilt_all", 10_000, 2)):
        if writers is None:  # the inline replay: no writer processes
            await replay.reset(pg_dsn, schema)
            conn = await replay.connect(pg_dsn, schema)
            try:
                await replay.replay(admin_js, conn, batch=batch)
            finally:
                await conn.close()
        else:
            monkeypatch.setattr(range_writers, "WRITERS", writers)
            progress = await replay.rebuild(admin_nc, pg_dsn, schema, batch=batch)
            assert progress.applied == len(events) + 2 and progress.writer_cpu_s > 0
        conn = await replay.connect(pg_dsn, schema)
        try:
            sums[schema] = await replay.table_checksums(conn, schema)
            assert await conn.fetchval("SELECT state FROM jobs WHERE job_id = 'dup'") == "succeeded"
            assert await conn.fetchval("SELECT count(*) FROM applied_events") == len(events)
            assert await conn.fetchval("SELECT to_regclass('deferred_indexes')") is None
        finally:
            await conn.close()
    assert all(s == sums["inline_one"] for s in sums.values()), sums.keys()


async def test_an_event_appended_twice_changes_nothing(nats_server, admin_js, pg_dsn):
    """A producer that re-decides after JetStream's duplicate window appends the same event (same
    id) at a new sequence: the second copy must not move the job back or count again."""
    from schemas.registry import dumps, event_subject

    log = eventlog.EventLog(admin_js)
    events = job("d1", "team-a", gpus=2, start=10, end=110)
    for e in events:
        await log.append(e)
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(service_settings(nats_server, "accounting", pg_dsn=pg_dsn), stop))
    conn = await asyncpg.connect(pg_dsn)
    try:
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
        before = [dict(r) for r in await conn.fetch("SELECT * FROM usage_ledger")]
        started = next(e for e in events if e.type == "JobStarted")
        succeeded = next(e for e in events if e.type == "JobSucceeded")
        for e in (started, succeeded):  # outside the duplicate window: a new Nats-Msg-Id
            await admin_js.publish(event_subject(e), dumps(e), headers={"Nats-Msg-Id": "late-" + e.event_id})
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
        assert await conn.fetchval("SELECT state FROM jobs WHERE job_id = 'd1'") == "succeeded"
        assert [dict(r) for r in await conn.fetch("SELECT * FROM usage_ledger")] == before
        assert await conn.fetchval("SELECT count(*) FROM applied_events") == len(events)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await conn.close()


async def test_batched_ops_give_the_same_tables_as_one_event_at_a_time(pg_dsn, monkeypatch):
    """The sink groups a batch's ops by statement (phase order); the result must not depend on
    where batch boundaries fall. Interleaved lifecycles with preemptions, retries and checkpoints."""
    import random

    from services.accounting import projection

    rng = random.Random(7)
    lifecycles = [job(f"b{i}", rng.choice(["team-a", "team-b"]), gpus=rng.choice([1, 2, 4]), borrowed=rng.choice([0, 1]),
                      start=rng.uniform(10, 50), end=rng.uniform(3000, 6000),
                      preempt_at=rng.choice([None, rng.uniform(500, 2000)]), checkpoint_at=rng.uniform(100, 400))
                  for i in range(40)]
    events = scenario()[:2]
    while any(lifecycles):  # interleave: each step takes the next event of a random job
        pick = rng.choice([lc for lc in lifecycles if lc])
        events.append(pick.pop(0))
    # Re-decided copies under new ids (not de-duplicated by id): a second submission with another
    # team and a second reservation of attempt 1 with other GPUs, a few events to a few hundred
    # after the first (the same batch or a later one). The first row of a key stands.
    for k in range(8):
        first = next(i for i, e in enumerate(events) if e.aggregate_id == f"b{k}" and e.type == "QuotaReserved")
        sub, res = next(e for e in events if e.aggregate_id == f"b{k}" and e.type == "JobSubmitted"), events[first]
        events.insert(first + rng.randint(1, 200), res.model_copy(update={"event_id": f"again-r{k}", "gpus": 8}))
        events.insert(first + rng.randint(1, 200), sub.model_copy(update={
            "event_id": f"again-s{k}", "spec": sub.spec.model_copy(update={"team": "team-z"})}))
    entries = [(i + 1, e.event_id, projection.convert(e, i + 1)) for i, e in enumerate(events)]
    sums = {}
    for schema, size, stage_min in (("one_by_one", 1, 10**9), ("batched", 10_000, 10**9), ("odd", 13, 10**9),
                                    ("staged", 10_000, 1), ("staged_odd", 29, 1)):
        monkeypatch.setattr(copy, "STAGE_MIN", stage_min)  # COPY + set-based statements, or executemany
        await replay.reset(pg_dsn, schema)
        conn = await replay.connect(pg_dsn, schema)
        try:
            for k in range(0, len(entries), size):
                await sink.apply_batch(conn, entries[k:k + size])
            sums[schema] = await replay.table_checksums(conn, schema)
        finally:
            await conn.close()
    # Batches prepared ahead (as a replay's writer does), overlapping as redeliveries do, and then
    # the first hundred events again under their own ids at new sequences: what is applied
    # already is planned out again at apply time, so the tables are the same.
    again = [(len(entries) + 1 + i, event_id, ops) for i, (_, event_id, ops) in enumerate(entries[:100])]
    prepared = [sink.prepare(entries[k:k + 70]) for k in range(0, len(entries), 50)] + [sink.prepare(again)]
    await replay.reset(pg_dsn, "prepared")
    conn = await replay.connect(pg_dsn, "prepared")
    try:
        assert sum([await sink.apply_batch(conn, batch) for batch in prepared]) == len(entries)
        ahead = await replay.table_checksums(conn, "prepared")
        assert await sink.position(conn) == again[-1][0]
    finally:
        await conn.close()
    assert {t: v for t, v in ahead.items() if t != "projection_position"} == {
        t: v for t, v in sums["one_by_one"].items() if t != "projection_position"}
    # Without event ids only the position tells what is applied already: the first half, prepared
    # before the whole log was applied, changes nothing after it.
    anonymous = [(seq, ops) for seq, _, ops in entries]
    stale = sink.prepare(anonymous[:len(anonymous) // 2])
    await replay.reset(pg_dsn, "prepared_anonymous")
    conn = await replay.connect(pg_dsn, "prepared_anonymous")
    try:
        assert await sink.apply_batch(conn, sink.prepare(anonymous)) == len(anonymous)
        assert await sink.apply_batch(conn, stale) == 0
        anonymous_sums = await replay.table_checksums(conn, "prepared_anonymous")
    finally:
        await conn.close()
    assert {t: v for t, v in anonymous_sums.items() if t != "applied_events"} == {
        t: v for t, v in sums["one_by_one"].items() if t != "applied_events"}
    assert sums["one_by_one"]["usage_ledger"][0] == 40 + sum(1 for e in events if e.type == "JobPreempted")
    assert sums["one_by_one"] == sums["batched"] == sums["odd"] == sums["staged"] == sums["staged_odd"]
    conn = await replay.connect(pg_dsn, "staged_odd")
    try:
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE team = 'team-z'") == 0
        assert await conn.fetchval("SELECT count(*) FROM reservations WHERE gpus = 8") == 0
    finally:
        await conn.close()


async def test_cli_prices_usage_and_chargeback(nats_server, admin_js, pg_dsn, tmp_path):
    """As the operator: publish a price book (NATS permissions allow pricebook.*.*), then read
    usage and a statement in every format, and see bad arguments refused with the field."""
    import csv
    import io
    import json
    import sys

    log = eventlog.EventLog(admin_js)
    for e in scenario()[:1] + scenario()[2:]:  # everything but the price book: the CLI publishes it
        await log.append(e)
    book = tmp_path / "pricebook.yaml"
    book.write_text("price_books:\n  - effective_from: 2026-10-01T00:00:00Z\n    gpu_prices: {a100: 2.0}\n")
    env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_PG_DSN": pg_dsn,
           "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    cli = [sys.executable, "-m", "gpusched.cli.main"]

    def gs(*args, check=True):
        proc = subprocess.run(cli + list(args), env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
        if check:
            assert proc.returncode == 0, proc.stderr
        return proc

    assert "new version from 2026-10-01" in gs("prices", "-f", str(book), "--dry-run").stdout
    published = json.loads(gs("prices", "-f", str(book), "-o", "json").stdout)
    assert [c["event"] for c in published] == ["PriceBookUpdated"]
    assert json.loads(gs("apply", "-f", str(book), "-o", "json").stdout) == []  # unchanged: nothing published
    assert json.loads(gs("prices", "-o", "json").stdout)[0]["gpu_prices"] == {"a100": 2.0}
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(service_settings(nats_server, "accounting", pg_dsn=pg_dsn), stop))
    try:
        # The price book's time (now) closes November: accounting issues its statement, an event
        # it then applies too. Quiet once both are done.
        async def quiet() -> bool:
            return bool(await _statements(admin_js)) and await _caught_up(admin_js, pg_dsn)

        await eventually(quiet)
        usage = json.loads(gs("usage", "--by", "team,day", "-o", "json").stdout)
        assert [(r["team"], r["day"]) for r in usage] == [("team-a", "2026-11-02"), ("team-b", "2026-11-02")]
        assert usage[1]["cost"] == pytest.approx(2.0)
        body = json.loads(gs("chargeback", "--period", "2026-11", "--by", "team", "--format", "json").stdout)
        assert body["checksum"].startswith("sha256:") and body["last_sequence"] == await _position(pg_dsn)
        rows = list(csv.reader(io.StringIO(gs("chargeback", "--period", "2026-11", "--format", "csv").stdout)))
        assert rows[0][:5] == ["statement_id", "period", "log_first_sequence", "log_last_sequence", "team"]
        assert [r[4] for r in rows[1:]] == ["team-a", "team-b"] and rows[2][rows[0].index("checksum")] == body["checksum"]
        both = gs("chargeback", "--period", "2026-11", "--format", "csv", "-o", "json", check=False)
        assert both.returncode == 2 and not both.stdout and "--format csv and --output json" in both.stderr
        assert "total" in gs("chargeback", "--period", "2026-11").stdout
        bad = gs("chargeback", "--period", "2026-13", check=False)
        assert bad.returncode == 2 and "accepted: YYYY-MM" in bad.stderr
        bad = gs("usage", "--by", "colour", check=False)
        assert bad.returncode == 2 and "accepted dimensions: team, project, queue, flavor, day" in bad.stderr
        prom = gs("metrics", "--format", "prometheus").stdout.encode()
        promtool_check(prom)
        table = gs("replay", "--into", "shadow")
        assert "replayed" in table.stdout and "usage_ledger" in table.stdout
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_failed_staged_batch_is_retried_on_the_same_connection(pg_dsn, monkeypatch):
    """The first staged batch of a session fails after creating its temporary tables: they go
    with the rollback, and the retry on the same connection must create them again."""
    from services.accounting import projection

    monkeypatch.setattr(copy, "STAGE_MIN", 1)
    events = [e for i in range(5) for e in job(f"f{i}", "team-a", gpus=1)]
    entries = [(i + 1, e.event_id, projection.convert(e, i + 1)) for i, e in enumerate(events)]
    conn = await asyncpg.connect(pg_dsn)
    try:
        await sink.migrate(conn)
        broken = entries + [(len(entries) + 1, "x", [operations.RejectJob("f0", None, None, None, None)])]
        with pytest.raises(asyncpg.PostgresError):
            await sink.apply_batch(conn, broken)
        assert await sink.apply_batch(conn, entries) == len(entries)
        assert await conn.fetchval("SELECT count(*) FROM usage_ledger") == 5
    finally:
        await conn.close()


async def test_replay_window_and_live_catch_up(nats_server, admin_js, pg_dsn, cli_env):
    """--from replays only from a sequence (the window's shadow lacks what came before);
    without --into, replay catches the live models up to the log's end (and is idempotent)."""
    log = eventlog.EventLog(admin_js)
    for e in scenario():
        await log.append(e)
    live = await accounting_cli._replay(None, None, None, False, False, 4, _Quiet())
    assert live["target"] == "public" and live["position"] == len(scenario()) == live["applied"]
    again = await accounting_cli._replay(None, None, None, False, False, 4, _Quiet())
    assert again["applied"] == 0
    first_job2 = next(i for i, e in enumerate(scenario(), start=1) if e.aggregate_id == "j2")
    window = await accounting_cli._replay("window", first_job2, None, True, False, 100, _Quiet())
    assert window["applied"] == len(scenario()) - first_job2 + 1
    differs = {r["table"]: (r["live_rows"], r["shadow_rows"]) for r in window["compare"] if not r["equal"]}
    assert differs["jobs"] == (2, 1) and differs["usage_ledger"] == (3, 1)  # only j2 is inside the window


async def test_the_writers_refuse_every_batch_after_a_failed_one(admin_js, admin_nc, pg_dsn):
    """A batch is never applied after one that failed, whichever writer process holds it: the
    position would move past the failed batch's events and they would be lost. The second of
    three one-job batches fails in Postgres (a trigger refuses its job)."""
    log = eventlog.EventLog(admin_js)
    start = await eventlog.last_sequence(admin_js) + 1
    batches = [job(name, "team-a", gpus=1) for name in ("w1", "boom", "w2")]
    for e in sum(batches, []):
        await log.append(e)
    await replay.reset(pg_dsn, "writers")
    conn = await replay.connect(pg_dsn, "writers")
    try:
        await conn.execute("""
            CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
                $$ BEGIN RAISE EXCEPTION 'refused %', NEW.job_id; END $$;
            CREATE TRIGGER refuse BEFORE INSERT ON jobs FOR EACH ROW WHEN (NEW.job_id = 'boom') EXECUTE FUNCTION refuse();
        """)
        with pytest.raises(replay.ReplayError, match=r"failed: .*refused boom"):
            await replay.replay(admin_nc, conn, from_seq=start, batch=len(batches[0]),
                                writer_process=(pg_dsn, "writers"))
        assert await sink.position(conn) == start + len(batches[0]) - 1
        assert [r[0] for r in await conn.fetch("SELECT job_id FROM jobs")] == ["w1"]
    finally:
        await conn.close()


async def test_a_rebuild_of_batches_larger_than_a_pipe_buffer_finishes(admin_js, admin_nc, pg_dsn):
    """The turn carries a batch's event ids (here about 95 KB; a pipe holds 64 KB): the
    writer of the last batch must be able to hand it on to a writer that has no batch left."""
    log = eventlog.EventLog(admin_js)
    start = await eventlog.last_sequence(admin_js) + 1
    events = [e for i in range(800) for e in job(f"big{i}", "team-a", gpus=1)]
    for e in events:
        await log.append(e)
    progress = await asyncio.wait_for(
        replay.rebuild(admin_nc, pg_dsn, "big", from_seq=start, batch=len(events) // 2), 60)
    assert progress.applied == len(events)
    conn = await replay.connect(pg_dsn, "big")
    try:
        assert await conn.fetchval("SELECT count(*) FROM applied_events") == len(events)
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE state = 'succeeded'") == 800
    finally:
        await conn.close()


async def test_writers_read_around_deleted_sequences_and_from_a_time(admin_js, admin_nc, pg_dsn):
    """Writer processes read their ranges straight from JetStream: a sequence deleted from the
    stream (in the middle of a range, and the log's last one) is skipped as the inline replay
    skips it, and --from TIME starts at the first event that happened at or after that time (event time)."""
    await reset_log(admin_js, immutable=False)  # the platform's streams refuse message deletes
    log = eventlog.EventLog(admin_js)
    start = await eventlog.last_sequence(admin_js) + 1
    early = [e for i in range(3) for e in job(f"t{i}", "team-a", gpus=1, checkpoint_at=600)]
    for e in early:
        await log.append(e)
    between = s(12 * 3600)
    late = [e.model_copy(update={"occurred_at": e.occurred_at + timedelta(days=1)})
            for e in job("t3", "team-a", gpus=2)]
    for e in late:
        await log.append(e)
    end = await eventlog.last_sequence(admin_js)
    checkpointed = start + next(i for i, e in enumerate(early) if e.type == "JobCheckpointed")
    for seq in (checkpointed, end):  # t0's checkpoint, and t3's last event (its success)
        await admin_js.delete_msg(eventlog.EVENTS_STREAM, seq)

    async def tables(schema: str) -> dict:
        conn = await replay.connect(pg_dsn, schema)
        try:
            return await replay.table_checksums(conn, schema)
        finally:
            await conn.close()

    await replay.reset(pg_dsn, "inline_gaps")
    conn = await replay.connect(pg_dsn, "inline_gaps")
    try:
        await replay.replay(admin_js, conn, from_seq=start, batch=4)
    finally:
        await conn.close()
    progress = await asyncio.wait_for(replay.rebuild(admin_nc, pg_dsn, "gaps", from_seq=start, batch=4), 60)
    assert progress.applied == len(early) + len(late) - 2
    sums = await tables("gaps")
    assert sums == await tables("inline_gaps")
    assert sums["checkpoints"][0] == 2 and sums["applied_events"][0] == len(early) + len(late) - 2

    progress = await asyncio.wait_for(replay.rebuild(admin_nc, pg_dsn, "late", from_time=between, batch=3), 60)
    assert progress.applied == len(late) - 1
    conn = await replay.connect(pg_dsn, "late")
    try:
        assert [r[0] for r in await conn.fetch("SELECT job_id FROM jobs")] == ["t3"]
        assert await sink.position(conn) == end - 1
    finally:
        await conn.close()
    future = await replay.rebuild(admin_nc, pg_dsn, "none", from_time=between + timedelta(days=30))
    assert future.applied == 0


async def test_a_rebuild_whose_writer_is_killed_fails_and_keeps_a_consistent_position(admin_js, admin_nc, pg_dsn):
    """A writer process killed (SIGKILL) while a rebuild runs: the rebuild stops with an error
    naming the writer instead of waiting for it, the other writer stops too, and the shadow's
    position covers exactly the jobs it holds (a resumed replay would continue from there)."""
    import multiprocessing
    import signal

    log = eventlog.EventLog(admin_js)
    start = await eventlog.last_sequence(admin_js) + 1
    per_job = len(job("k0", "team-a", gpus=1))
    for i in range(400):
        for e in job(f"k{i}", "team-a", gpus=1):
            await log.append(e)
    rebuild = asyncio.create_task(replay.rebuild(admin_nc, pg_dsn, "killed", from_seq=start, batch=per_job * 5))
    victim = None
    while victim is None and not rebuild.done():
        victim = next((p for p in multiprocessing.active_children() if p.name == "replay-writer-0"), None)
        await asyncio.sleep(0.01)
    assert victim is not None, "the rebuild finished before a writer could be killed"
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(replay.ReplayError, match="writer process 0 exited"):
        await asyncio.wait_for(rebuild, 60)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("replay-writer")]
    conn = await replay.connect(pg_dsn, "killed")
    try:
        written = await sink.position(conn)
        done = written - start + 1 if written else 0  # events applied, whole batches of whole jobs
        assert done % per_job == 0
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE state = 'succeeded'") == done // per_job
    finally:
        await conn.close()


async def test_a_failed_index_build_resumes_with_what_is_left(pg_dsn):
    """The deferred indexes are built on two sessions, each in its own transaction that strikes
    it off the list: a build that fails leaves the list with the failed one (and any not reached),
    none built twice, and the next build finishes the rest, then drops the list."""
    await replay.reset(pg_dsn, "resume")
    deferred = await indexes.defer_indexes(pg_dsn, "resume")
    conn = await replay.connect(pg_dsn, "resume")
    try:
        # the last of the list (built in name order, after applied_events' key)
        await conn.execute("INSERT INTO deferred_indexes VALUES ('zz_broken', 'CREATE INDEX zz ON no_such_table (x)')")
        with pytest.raises(asyncpg.UndefinedTableError):
            await indexes.build_indexes(pg_dsn, "resume")
        left = {r[0] for r in await conn.fetch("SELECT name FROM deferred_indexes")}
        assert "zz_broken" in left
        built = {r[0] for r in await conn.fetch("SELECT indexname FROM pg_indexes WHERE schemaname = 'resume'")}
        assert built & set(deferred) and not built & left  # what was built is off the list
        await conn.execute("DELETE FROM deferred_indexes WHERE name = 'zz_broken'")
        assert sorted(await indexes.build_indexes(pg_dsn, "resume")) == sorted(left - {"zz_broken"})
        assert await conn.fetchval("SELECT to_regclass('deferred_indexes')") is None
        names = {r[0] for r in await conn.fetch("SELECT indexname FROM pg_indexes WHERE schemaname = 'resume'")}
        assert set(deferred) <= names
        assert await conn.fetchval(
            "SELECT reloptions FROM pg_class WHERE oid = 'resume.jobs'::regclass") is None  # autovacuum back on
    finally:
        await conn.close()


async def test_a_statement_counts_running_attempts_and_a_late_end_is_an_adjustment_in_the_next_period(
        nats_server, admin_js, pg_dsn, cli_env):
    """November's statement counts the November part of an attempt still running, and of one
    whose end has not been logged yet; when that end arrives (it happened in November), November's
    statement stays as issued and December's carries an adjustment line for it (a credit), issued
    when December closes and re-derived by replay. The running one ending in December changes
    nothing in November."""
    nov30 = (datetime(2026, 11, 30, tzinfo=UTC) - NOV).total_seconds()
    long = job("long", "team-b", gpus=2, start=nov30 + 20 * 3600, end=nov30 + 34 * 3600)  # until Dec 1 10:00
    late = job("late", "team-a", gpus=1, start=nov30 + 10 * 3600, end=nov30 + 12 * 3600)
    log = eventlog.EventLog(admin_js)
    for e in scenario()[:2] + long[:-1] + late[:-1]:
        await log.append(e)
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(service_settings(nats_server, "accounting", pg_dsn=pg_dsn), stop))
    conn = await asyncpg.connect(pg_dsn)
    try:
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
        await log.append(december_event())
        (first,) = await eventually(lambda: _statements(admin_js))
        gpu_h = {line.key: line.gpu_hours for line in first.lines}
        assert gpu_h == {"team-a": "14.000000", "team-b": "8.000000"} and first.adjustments == ()

        await log.append(late[-1])  # JobSucceeded at 12:00 on November 30, logged in December
        await log.append(long[-1])  # ends on December 1 at 10:00: November's part is what was counted
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
        await asyncio.sleep(0.5)
        assert await _statements(admin_js) == [first]  # November's statement is what it was
        december = await queries.statement(conn, "2026-12", "team", log=admin_js)
        assert december["provisional"] is True
        assert [(a["adjusts_period"], a["team"], a["gpu_hours"], a["amount"]) for a in december["adjustments"]] == [
            ("2026-11", "team-a", "-12.000000", "-24.00")]  # ran 2 h, not the 14 h counted: 12 GPU-hours at 2.0

        # the log passes December's end: December is issued with the adjustment, and verifies
        await log.append(new_event(NodeRegistered, aggregate_id="n10", producer="executor",
                                   occurred_at=datetime(2027, 1, 1, 2, tzinfo=UTC), key="1",
                                   node=NodeInfo(name="n10", gpu_flavor="a100", gpu_count=8)))
        _, dec = await eventually(lambda: _ready(_statements(admin_js), 2))
        assert dec.period == "2026-12" and [a.model_dump() for a in dec.adjustments] == december["adjustments"]
        assert {line.key: line.total_cost for line in dec.lines} == {"team-a": "-24.00", "team-b": "40.00"}
        assert dec.total_cost == "16.00"  # team-b: 2 GPUs x 10 h of December at 2.0
        assert (await accounting_cli._verify(dec.aggregate_id, _Quiet()))["verified"]
        await eventually(lambda: _caught_up(admin_js, pg_dsn))
        january = await queries.statement(conn, "2027-01", "team", log=admin_js)
        assert january["adjustments"] == []  # carried into December's already
        by_day = await queries.rollup(conn, ["team", "day"])
        assert [(r["team"], r["day"], r["gpu_hours"], r["attempts"]) for r in by_day] == [
            ("team-a", "2026-11-30", 2.0, 1), ("team-b", "2026-11-30", 8.0, 1), ("team-b", "2026-12-01", 20.0, 0)]
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await conn.close()
