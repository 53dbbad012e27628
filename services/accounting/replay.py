"""Replay: apply the log to a target through the ingest pipeline (the same converter and sink as
the live service, so a replay can only differ from live if the code or the price book changed:
which is what a replay is for).

* :func:`replay`: catch a target up from its position (or a window's start) to an end, in this
  process or, with ``writer_process``, by the bulk wing's writer processes;
* :func:`rebuild`: a fresh shadow loaded by the bulk wing (writer processes, indexes deferred),
  up to the live position or, ``as_of``, up to a past point recorded in the shadow (:func:`point`);
* :func:`swap`: the shadow, caught up to the live position while live writers wait, becomes live.

A time (``from_time``, ``to_time``) is event time, found in the log by
:mod:`services.accounting.eventtime`.

Compare a shadow with live with :func:`services.accounting.compare.compare`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import asyncpg
from nats.aio.client import Client as NatsClient

from runtime import eventlog
from runtime import eventtime
from services.accounting import pipeline, sink
from services.accounting.bulk import indexes, writers
from services.accounting.bulk.collector import BatchCollector
from services.accounting.compare import compare, table_checksums
from services.accounting.target import PROJECTIONS, TABLES, ReplayError, check_schema, connect, q, reset

# The operator's entry points in one place (the CLI's `replay`, `chargeback --verify`).
__all__ = ["PROJECTIONS", "Point", "Progress", "ReplayError", "check_schema", "compare", "connect", "point", "q",
           "rebuild", "replay", "reset", "resolve_end", "swap", "table_checksums"]


@dataclass
class Progress:
    applied: int = 0
    last_sequence: int = 0
    apply_s: float = 0.0  # time spent writing batches (writer processes: converting and writing)
    wait_s: float = 0.0  # time the reader waited for the writer (writer processes: for the turn)
    read_s: float = 0.0  # writer processes: time spent waiting for a range's read (the rest overlaps)
    writer_cpu_s: float = 0.0  # CPU time of the writer processes (reading, converting, writing)


@dataclass(frozen=True)
class Point:
    """The past point a shadow was built as of: every event up to stream sequence ``sequence``
    (``to_time``: the event time asked for, when it was asked by time; ``newest_event_time``:
    the event time of the newest event applied)."""
    sequence: int
    to_time: datetime | None
    newest_event_time: datetime | None

    def describe(self) -> str:
        when = self.to_time or self.newest_event_time
        return f"as of seq {self.sequence}" + (f" / time {when.isoformat()}" if when is not None else "")


def _streams(log) -> tuple:
    """(JetStream context, the client) of a NATS client; (the context, None) of a context."""
    return (log.jetstream(), log) if isinstance(log, NatsClient) else (log, None)


async def replay(log, conn: asyncpg.Connection, *, from_seq: int | None = None, from_time: datetime | None = None,
                 to_seq: int | None = None, to_time: datetime | None = None, batch: int = 5000,
                 writer_process: tuple[str, str] | None = None,
                 on_batch: Callable[[Progress], None] | None = None) -> Progress:
    """Apply the log from the target's position (or ``from_seq``/``from_time``, whichever is
    later) up to ``to_seq``/``to_time`` (whichever is earlier; default: the log's end now)
    through the pipeline. Times are event time (:mod:`services.accounting.eventtime`): from the
    first event that happened at or after ``from_time``, up to the last that happened at or
    before ``to_time``. ``log``: the NATS client (or a JetStream context, for a replay in this
    process). ``writer_process=(dsn, schema)``: read, convert and write in writer processes (the
    same target as ``conn``, which then only reads the position), else in this one."""
    js, client = _streams(log)
    start = max(await sink.position(conn) + 1, from_seq or 1)
    end = await resolve_end(js, to_seq, to_time)
    progress = Progress(last_sequence=start - 1)
    if from_time is not None and start <= end:
        at = await eventtime.first_at(js, from_time, hi=end)
        start = max(start, at if at is not None else end + 1)
    if start > end:
        return progress
    if writer_process is not None:
        if client is None:
            raise ReplayError("writer processes connect to NATS themselves: pass the NATS client, not a "
                              "JetStream context")
        await _write_ranges(writers.NatsOptions.of(client), *writer_process, start, end, batch, progress, on_batch)
        return progress
    await _replay_inline(js, client, conn, start, end, batch, progress, on_batch)
    return progress


async def resolve_end(js, to_seq: int | None = None, to_time: datetime | None = None) -> int:
    """The last stream sequence of a replay: ``to_seq``, the last that happened by ``to_time``
    (event time), whichever is earlier; without either, the log's last."""
    end = to_seq if to_seq is not None else await eventlog.last_sequence(js)
    if to_time is not None:
        end = min(end, await eventtime.last_at(js, to_time, hi=end))
    return end


async def _replay_inline(js, client: NatsClient | None, conn: asyncpg.Connection, start: int, end: int, batch: int,
                         progress: Progress, on_batch: Callable[[Progress], None] | None) -> None:
    """Batches of exactly ``batch`` events (the last one less), each written while the next is
    read and converted."""
    with BatchCollector() as collector:
        async def store(converted: pipeline.Converted) -> None:
            t = time.perf_counter()
            await sink.apply_batch(conn, converted.entries)
            progress.apply_s += time.perf_counter() - t

        def stored(converted: pipeline.Converted) -> None:
            progress.applied += len(converted.entries)
            progress.last_sequence = converted.last_sequence
            collector.after_batch()
            if on_batch:
                on_batch(progress)

        batches = eventlog.read_batches(js, from_seq=start, to_seq=end, batch=batch, client=client)
        await pipeline.run(batches, store, after=stored)


async def rebuild(log, dsn: str, schema: str, *, from_seq: int | None = None, from_time: datetime | None = None,
                  to_seq: int | None = None, to_time: datetime | None = None, as_of: bool = False,
                  batch: int = 20_000, on_batch: Callable[[Progress], None] | None = None) -> Progress:
    """A fresh shadow from the log: reset, load it with its secondary indexes deferred by
    writer processes that each read their own ranges of the log, then build the indexes. A
    window (``from_seq``/``from_time``) starts the shadow just before it; it ends at
    ``to_seq``/``to_time`` (:func:`replay`). ``as_of``: the shadow is the read models as of that
    past point: the point is recorded in it (:func:`point`), and :func:`swap` refuses it.
    ``log``: the NATS client (the writers connect with its server and credentials)."""
    js, _ = _streams(log)
    await reset(dsn, schema)
    await indexes.defer_indexes(dsn, schema)
    conn = await connect(dsn, schema)
    try:
        if from_seq:
            await conn.execute("INSERT INTO projection_position (projection, last_sequence) VALUES ($1, $2)",
                               sink.PROJECTION, from_seq - 1)
        end = await resolve_end(js, to_seq, to_time)
        progress = await replay(log, conn, from_seq=from_seq, from_time=from_time, to_seq=end, batch=batch,
                                writer_process=(dsn, schema), on_batch=on_batch)
        if as_of:
            newest = await eventtime.event_time(js, await sink.position(conn))
            await _record_point(conn, schema, Point(end, to_time, newest))
    finally:
        await conn.close()
    await indexes.build_indexes(dsn, schema)
    return progress


async def _record_point(conn: asyncpg.Connection, schema: str, at: Point) -> None:
    """The point in the shadow itself, table ``as_of`` (not one of the read models' tables:
    compare and swap leave it out) and the schema's comment."""
    await conn.execute("CREATE TABLE as_of (sequence bigint NOT NULL, to_time timestamptz, "
                       "newest_event_time timestamptz)")
    await conn.execute("INSERT INTO as_of VALUES ($1, $2, $3)", at.sequence, at.to_time, at.newest_event_time)
    comment = f"gpusched read models {at.describe()}".replace("'", "''")
    await conn.execute(f"COMMENT ON SCHEMA {q(schema)} IS '{comment}'")


async def point(conn: asyncpg.Connection, schema: str) -> Point | None:
    """The past point a shadow was built as of; None for one that follows the log (or live)."""
    if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{q(schema)}.as_of"):
        return None
    row = await conn.fetchrow(f"SELECT sequence, to_time, newest_event_time FROM {q(schema)}.as_of")
    return Point(row["sequence"], row["to_time"], row["newest_event_time"]) if row is not None else None


async def _write_ranges(options: writers.NatsOptions, dsn: str, schema: str, start: int, end: int, batch: int,
                        progress: Progress, on_batch: Callable[[Progress], None] | None) -> None:
    ranges = writers.RangeWriters(options, dsn, schema, start, end, batch)
    try:
        async for (_, hi), (failed, n, read_s, waited, wall, cpu) in ranges.results():
            progress.read_s += read_s
            progress.wait_s += waited
            progress.apply_s += wall - read_s - waited
            progress.writer_cpu_s += cpu
            if failed is not None:
                raise ReplayError(failed)
            progress.applied += n
            progress.last_sequence = hi
            if on_batch:
                on_batch(progress)
    except BaseException:
        ranges.kill()
        raise
    finally:
        await ranges.close()


async def swap(dsn: str, log, shadow: str, on_batch=None) -> str:
    """Make the shadow the live read models. Live writers are held off by a lock on the live
    position while the shadow catches up to exactly the live position; the live tables move to a
    ``retired_<time>`` schema (drop it when satisfied). Returns that schema's name."""
    check_schema(shadow)
    admin = await asyncpg.connect(dsn, timeout=10)
    try:
        past = await point(admin, shadow)
    finally:
        await admin.close()
    if past is not None:
        raise ReplayError(f"shadow {shadow!r} holds the read models {past.describe()}, a past point: it cannot "
                          "become live (live would move back in time); rebuild it without --to to swap it in")
    await indexes.build_indexes(dsn, shadow)  # a shadow left half-built (interrupted rebuild) gets its indexes
    retired = f"retired_{int(time.time())}"
    admin = await asyncpg.connect(dsn, timeout=10)
    shadow_conn = await connect(dsn, shadow)
    try:
        async with admin.transaction():
            await admin.execute("LOCK TABLE public.projection_position IN ACCESS EXCLUSIVE MODE")
            # Partitioned, each partition's row (services/accounting/partition.py): the shadow
            # catches up to the furthest and takes every row over, so that each partition goes on
            # from where it is (what it reads again, the shadow has: passed over by event id).
            live_rows = await sink.partition_rows(admin)
            live_pos = max((seq for seq, _ in live_rows.values()), default=0)
            await replay(log, shadow_conn, to_seq=live_pos, on_batch=on_batch)
            shadow_pos = await sink.position(shadow_conn)
            if shadow_pos != live_pos:
                raise ReplayError(f"shadow is at {shadow_pos}, live at {live_pos}: cannot swap (the log's tail "
                                  "is not readable?)")
            if set(live_rows) != {sink.PROJECTION}:
                await shadow_conn.execute("DELETE FROM projection_position WHERE projection = $1", sink.PROJECTION)
                await shadow_conn.executemany(
                    "INSERT INTO projection_position (projection, last_sequence, partitions) VALUES ($1, $2, $3)",
                    [(name, seq, n) for name, (seq, n) in live_rows.items()])
            await admin.execute(f"CREATE SCHEMA {retired}")
            for table in TABLES:
                await admin.execute(f"ALTER TABLE public.{table} SET SCHEMA {retired}")
                await admin.execute(f"ALTER TABLE {q(shadow)}.{table} SET SCHEMA public")
            await admin.execute(f"DROP SCHEMA {q(shadow)}")
    finally:
        await shadow_conn.close()
        await admin.close()
    return retired
