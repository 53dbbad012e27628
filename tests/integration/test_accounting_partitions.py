"""Accounting partitioned by team (services/accounting/partition.py) against a real nats-server
and a real Postgres: N processes together give exactly the read models one process gives (a
rebuild of the same log), each applies only its share, and a change of N loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

import asyncpg
import pytest

from conftest import eventually, service_settings
from runtime import eventlog
from runtime.teams import TeamIndex, partition_of
from schemas import JobAdmitted, new_event
from services.accounting import __main__ as accounting
from services.accounting import chargeback, pipeline, queries, replay, sink
from services.accounting.partition import Partitioning, Share, projection_name
from tests.integration.test_accounting_ledger import _statements, admin_nc, cli_env, december_event, job, s, scenario  # noqa: F401
from tests.unit.builders import price_book, queue

TEAMS = [f"team-{c}" for c in "abcdefgh"]


def workload(prefix: str) -> list:
    """Jobs of every team (one preempted and run again, with a checkpoint), a queue, a price
    book, a node, and an event of a job never submitted (partition 0's)."""
    events = []
    for i, team in enumerate(TEAMS):
        events += job(f"{prefix}-{i}", team, gpus=1 + i % 4, start=60 + i, end=3600 + 7 * i,
                      preempt_at=900 if i % 3 == 0 else None, checkpoint_at=600 if i % 3 == 0 else None)
    events.append(new_event(JobAdmitted, aggregate_id=f"{prefix}-ghost", producer="admission", occurred_at=s(5),
                            key="d", queue="q", priority=500, preemptible=True))
    return events


async def run_partitions(nats_server, pg_dsn, n: int, only: list[int] | None = None,
                         stop: asyncio.Event | None = None):
    """Accounting partitions of ``n`` (or ``only`` those) as tasks of this process, until
    ``stop``; returns (stop, tasks)."""
    settings = service_settings(nats_server, "accounting", pg_dsn=pg_dsn)
    stop = stop or asyncio.Event()
    tasks = [asyncio.create_task(accounting.run(settings, stop, Partitioning(n, k)))
             for k in (only if only is not None else range(n))]
    return stop, tasks


async def stopped(stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 20)


@contextlib.asynccontextmanager
async def connected(dsn: str):
    conn = await asyncpg.connect(dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def project(nats_server, pg_dsn: str, js, n: int) -> dict[str, tuple[int, int]]:
    """``n`` partitions run until the read models are complete to the log's end; their rows."""
    stop, tasks = await run_partitions(nats_server, pg_dsn, n)
    try:
        await eventually(lambda: at_end(js, pg_dsn), timeout_s=30)
    finally:
        await stopped(stop, tasks)
    async with connected(pg_dsn) as conn:
        return await sink.partition_rows(conn)


async def at(dsn: str, projection: str | None, seq: int) -> bool:
    """Whether one partition (``projection``) or all (None) are at ``seq``."""
    conn = await asyncpg.connect(dsn)
    try:
        if await conn.fetchval("SELECT to_regclass('projection_position') IS NULL"):
            return False
        pos = await (sink.complete_position(conn) if projection is None else sink.position(conn, projection))
        return pos >= seq
    finally:
        await conn.close()


async def at_end(js, dsn: str) -> bool:
    """Whether every partition is at the log's end (which moves when statements are issued)."""
    return await at(dsn, None, await eventlog.last_sequence(js))


async def equals_a_rebuild(admin_nc, dsn: str, schema: str) -> None:  # noqa: F811
    """Every read model equals a rebuild of the log by one process (the positions: the range of
    sequences the read models hold)."""
    await replay.rebuild(admin_nc, dsn, schema)
    assert [row for row in await replay.compare(dsn, schema) if not row["equal"]] == []


async def claimed(dsn: str, n: int) -> None:
    """The position rows of ``n`` partitions, as partition 0 makes them when it starts (another
    partition waits for them)."""
    async with connected(dsn) as conn:
        await sink.migrate(conn)
        assert await sink.claim(conn, "read-models", [projection_name(k) for k in range(n)], may_change=True) == 0


async def test_two_partitions_give_what_one_gives_each_applying_its_own_teams(nats_server, admin_js, admin_nc,  # noqa: F811
                                                                              pg_dsn):
    assert {partition_of(t, 2) for t in TEAMS} == {0, 1}
    log = eventlog.EventLog(admin_js)
    for e in scenario() + [december_event()] + workload("first"):
        await log.append(e)
    await admin_js.publish("gpusched.job.zz.submitted", b"garbage")  # poison: partition 0 dead-letters it
    last = await eventlog.last_sequence(admin_js)

    # partition 1 alone (partition 0 made the rows): its teams' jobs, nothing that is not a
    # job's, its position at the end
    await claimed(pg_dsn, 2)
    stop, tasks = await run_partitions(nats_server, pg_dsn, 2, only=[1])
    try:
        await eventually(lambda: at(pg_dsn, projection_name(1), last))
        conn = await asyncpg.connect(pg_dsn)
        try:
            teams = {r[0] for r in await conn.fetch("SELECT DISTINCT team FROM jobs")}
            assert teams == {t for t in TEAMS if partition_of(t, 2) == 1}
            assert await conn.fetchval("SELECT count(*) FROM queues") == 0
            assert await conn.fetchval("SELECT count(*) FROM nodes") == 0
            assert await sink.complete_position(conn) == 0  # partition 0 has applied nothing
        finally:
            await conn.close()
        # partition 0 joins while more jobs arrive, and jobs submitted before go on
        tasks += (await run_partitions(nats_server, pg_dsn, 2, only=[0], stop=stop))[1]
        for e in workload("second") + job("first-1", "team-b", gpus=2, start=9000, end=9500)[2:]:
            await log.append(e)
        await eventually(lambda: at_end(admin_js, pg_dsn), timeout_s=30)
        await asyncio.sleep(1)  # partition 0 issues statements after a batch: they come in and are applied
        await eventually(lambda: at_end(admin_js, pg_dsn), timeout_s=30)
    finally:
        await stopped(stop, tasks)
    last = await eventlog.last_sequence(admin_js)
    assert await _statements(admin_js)  # partition 0 issued the closed periods' statements
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await sink.partition_rows(conn) == {"read-models": (last, 2), "read-models/p1": (last, 2)}
    finally:
        await conn.close()
    dead = [m async for m in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM)]
    assert len(dead) == 1  # the poison once, not once per partition
    await equals_a_rebuild(admin_nc, pg_dsn, "one")


async def test_a_change_of_partitions_starts_each_from_the_lowest_and_loses_nothing(nats_server, admin_js,
                                                                                    admin_nc, pg_dsn,  # noqa: F811
                                                                                    monkeypatch):
    monkeypatch.setenv("GPUSCHED_STATEMENT_BY", "")  # no statements: the log is only what the test appends
    log = eventlog.EventLog(admin_js)
    for e in scenario() + workload("a"):
        await log.append(e)
    last = await eventlog.last_sequence(admin_js)
    assert await project(nats_server, pg_dsn, admin_js, 2) == {"read-models": (last, 2), "read-models/p1": (last, 2)}
    async with connected(pg_dsn) as conn:  # as if partition 1 had stopped halfway
        await conn.execute("UPDATE projection_position SET last_sequence = $1 WHERE projection = 'read-models/p1'",
                           last // 2)

    for e in workload("b"):
        await log.append(e)
    last = await eventlog.last_sequence(admin_js)
    rows = await project(nats_server, pg_dsn, admin_js, 3)
    assert rows == {projection_name(k): (last, 3) for k in range(3)}
    await equals_a_rebuild(admin_nc, pg_dsn, "again")
    async with connected(pg_dsn) as conn:  # a process still running with the old number applies nothing
        entry = (last + 1, "some-event", [])
        with pytest.raises(sink.PartitioningChanged, match="say 3 partition"):
            await sink.apply_batch(conn, [entry], projection_name(1), partitions=2)
        with pytest.raises(sink.PartitioningChanged):
            await sink.apply_batch(conn, [entry], "read-models/p5", partitions=6)
        assert await sink.partition_rows(conn) == rows

    for e in workload("c"):  # back to one: it reads again from the lowest row and holds the only row
        await log.append(e)
    last = await eventlog.last_sequence(admin_js)
    assert await project(nats_server, pg_dsn, admin_js, 1) == {"read-models": (last, 1)}
    await equals_a_rebuild(admin_nc, pg_dsn, "single")


async def test_a_swap_keeps_each_partitions_position(nats_server, admin_js, admin_nc, pg_dsn,  # noqa: F811
                                                     monkeypatch):
    """A shadow swapped in under running partitions: it is caught up to the furthest partition
    and takes every partition's row, so each goes on where it was, and nothing is lost."""
    monkeypatch.setenv("GPUSCHED_STATEMENT_BY", "")
    log = eventlog.EventLog(admin_js)
    for e in scenario() + workload("a"):
        await log.append(e)
    last = await eventlog.last_sequence(admin_js)
    stop, tasks = await run_partitions(nats_server, pg_dsn, 2)
    try:
        await eventually(lambda: at(pg_dsn, None, last))
        await replay.rebuild(admin_nc, pg_dsn, "shadow", to_seq=last // 2)
        await replay.swap(pg_dsn, admin_js, "shadow")
        conn = await asyncpg.connect(pg_dsn)
        try:
            assert await sink.partition_rows(conn) == {"read-models": (last, 2), "read-models/p1": (last, 2)}
        finally:
            await conn.close()
        for e in workload("b"):
            await log.append(e)
        last = await eventlog.last_sequence(admin_js)
        await eventually(lambda: at(pg_dsn, None, last), timeout_s=30)
    finally:
        await stopped(stop, tasks)
    await equals_a_rebuild(admin_nc, pg_dsn, "after_swap")


async def test_a_partition_other_than_0_waits_for_partition_0_to_set_the_number(nats_server, admin_js, pg_dsn,
                                                                                monkeypatch):
    """Only partition 0 changes the rows: in a rolling change, a pod on the other number waits
    (and one restarting on the old number cannot turn the change back)."""
    monkeypatch.setenv("GPUSCHED_STATEMENT_BY", "")
    log = eventlog.EventLog(admin_js)
    for e in scenario() + workload("a"):
        await log.append(e)
    last = await eventlog.last_sequence(admin_js)
    assert await project(nats_server, pg_dsn, admin_js, 2) == {"read-models": (last, 2), "read-models/p1": (last, 2)}
    for e in workload("b"):
        await log.append(e)
    stop, tasks = await run_partitions(nats_server, pg_dsn, 3, only=[1, 2])  # the new number's pods, not yet 0
    try:
        await asyncio.sleep(1)
        async with connected(pg_dsn) as conn:
            assert await sink.partition_rows(conn) == {"read-models": (last, 2), "read-models/p1": (last, 2)}
        tasks += (await run_partitions(nats_server, pg_dsn, 3, only=[0], stop=stop))[1]
        await eventually(lambda: at_end(admin_js, pg_dsn), timeout_s=30)
    finally:
        await stopped(stop, tasks)
    async with connected(pg_dsn) as conn:
        last = await eventlog.last_sequence(admin_js)
        assert await sink.partition_rows(conn) == {projection_name(k): (last, 3) for k in range(3)}
        assert await sink.claim(conn, "read-models/p1", ["read-models", "read-models/p1"], may_change=False) is None


async def test_every_partition_gives_an_event_the_owner_the_log_names_before_it(nats_server, admin_js):
    """A job's team is the one named before the event, whoever asks and whenever: an event
    logged before its job's submission is partition 0's for a partition that asked before the
    submission came, one that asks after it, and one that remembers it; a submission subject whose
    first message is poison names the team of the first valid one after it."""
    log = eventlog.EventLog(admin_js)
    early = new_event(JobAdmitted, aggregate_id="late", producer="admission", occurred_at=s(5), key="early",
                      queue="q", priority=500, preemptible=True)
    await log.append(early)
    await admin_js.publish("gpusched.job.late2.submitted", b"garbage")
    shares = lambda: [Share(Partitioning(2, k), TeamIndex(admin_js)) for k in (0, 1)]  # noqa: E731

    async def owners(share_pair, event, seq):
        return [(await share.owned(pipeline.Converted(entries=[(seq, event.event_id, [])], events=[event])))[0]
                for share in share_pair]

    before = shares()
    assert await owners(before, early, 1) == [True, False]  # asked before the submission: partition 0's
    late = [e for e in job("late", "team-c", gpus=1) if e.type != "JobAdmitted"]  # team-c: partition 1's
    late2 = job("late2", "team-c", gpus=1)
    for e in late + late2:
        await log.append(e)
    after, remembering = shares(), shares()
    for share in remembering:
        share.seen(late[0], 3)  # the submission, at sequence 3
    for pair in (before, after, remembering):
        assert await owners(pair, early, 1) == [True, False]  # still partition 0's
        assert await owners(pair, late[1], 4) == [False, True]  # after the submission: team-c's
        assert await owners(pair, late2[1], 9) == [False, True]  # past the poison: the valid submission's team


async def test_a_statement_is_issued_at_one_position_of_every_partition(nats_server, admin_js, admin_nc,  # noqa: F811
                                                                        pg_dsn, monkeypatch):
    """Partition 1 ahead of partition 0 at the month's close: the statement waits until both are
    at one position, so it says what the log says up to its last sequence (what `gpusched
    chargeback --verify` recomputes), and is not revised."""
    monkeypatch.setenv("GPUSCHED_STATEMENT_GRACE_S", "0")
    monkeypatch.setenv("GPUSCHED_STATEMENT_BY", "team")
    assert (partition_of("team-a", 2), partition_of("team-c", 2)) == (0, 1)
    book = price_book({"a100": 2.0}, effective_from=datetime(2026, 10, 1, tzinfo=UTC))
    q = queue("q", ("team-a", "team-c"), {"a100": 8}).model_copy(update={"occurred_at": datetime(2026, 11, 1,
                                                                                                  tzinfo=UTC)})
    running = job("A", "team-c", gpus=2, start=100, end=2_484_000)  # runs past the month, ends Dec 1 03:00
    log = eventlog.EventLog(admin_js)
    for e in [q, book, *job("B", "team-a", gpus=1, start=60, end=3660), *running[:-1], december_event(), running[-1]]:
        await log.append(e)
    last = await eventlog.last_sequence(admin_js)
    await claimed(pg_dsn, 2)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(accounting.run(service_settings(nats_server, "accounting", pg_dsn=pg_dsn), stop,
                                                Partitioning(2, 1)))]
    try:
        await eventually(lambda: at(pg_dsn, projection_name(1), last))
        slow = service_settings(nats_server, "accounting", pg_dsn=pg_dsn, batch_size=1)  # a statement check per event
        tasks.append(asyncio.create_task(accounting.run(slow, stop, Partitioning(2, 0))))
        await eventually(lambda: at_end(admin_js, pg_dsn))
        await asyncio.sleep(1)
        await eventually(lambda: at_end(admin_js, pg_dsn))
    finally:
        await stopped(stop, tasks)
    (issued,) = [x for x in await _statements(admin_js) if x.period == "2026-11"]
    await replay.rebuild(admin_nc, pg_dsn, "verify", to_seq=issued.last_sequence)
    async with connected(pg_dsn) as conn:
        await conn.execute('SET search_path TO "verify"')
        body = await queries.statement(conn, issued.period, issued.group_by, log=admin_js,
                                       as_of=chargeback.parse_period(issued.period)[1],
                                       last_sequence=issued.last_sequence)
    assert body["checksum"] == issued.checksum
    assert {line["key"] for line in body["lines"]} == {"team-a", "team-c"}


async def test_replay_into_a_shadow_compares_equal_with_partitioned_live(nats_server, admin_js, pg_dsn, cli_env,
                                                                         monkeypatch):  # noqa: F811
    """`gpusched replay --into shadow` (the CLI's path) under two partitions: equal, positions
    included; `gpusched replay` into live is refused."""
    from rich.console import Console

    from gpusched.cli.accounting import _replay
    from gpusched.userinput import UserError

    monkeypatch.setenv("GPUSCHED_STATEMENT_BY", "")
    log = eventlog.EventLog(admin_js)
    for e in scenario() + workload("a"):
        await log.append(e)
    await project(nats_server, pg_dsn, admin_js, 2)
    result = await _replay("shadowc", None, None, True, False, 20_000, Console(stderr=True))
    assert [r for r in result["compare"] if not r["equal"]] == []
    with pytest.raises(UserError, match="several accounting partitions"):
        await _replay(None, None, None, False, False, 20_000, Console(stderr=True))
