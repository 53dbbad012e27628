"""Replay: rebuild the read models from the log into a shadow schema, compare shadow and live
(row counts and checksums per table), and swap them. The same converter and sink as the live
service, so a replay can only differ from live if the code (or the price book) changed: which
is what a replay is for.

A shadow is a Postgres schema (default ``shadow``) in the read-model database with the same
migrations; it has its own ``projection_position``.
"""

from __future__ import annotations

import asyncio
from collections import deque
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import asyncpg
from nats import errors as nats_errors
from pydantic import ValidationError

from gpusched import eventlog
from schemas.registry import SUBJECT_PREFIX
from services.accounting import projection, sink

PROJECTIONS = ("read-models",)
"""The projections accounting keeps (one today: every table below shares its position)."""

TABLES = ("jobs", "usage_ledger", "reservations", "attempts", "checkpoints", "nodes", "queues", "cohorts",
          "quota_history", "price_books", "statements", "gpu_telemetry", "applied_events", "projection_position",
          "schema_migrations")
# Columns that record when a row was written, not what the log says: left out of checksums.
_VOLATILE = {"projection_position": ("updated_at",), "schema_migrations": ("applied_at",)}
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class ReplayError(ValueError):
    """A replay request that cannot be carried out; says why and what is accepted."""


def check_schema(name: str) -> str:
    if not _SCHEMA_NAME.match(name) or name in ("public", "pg_catalog", "information_schema"):
        raise ReplayError(f"--into {name!r}: a shadow is a schema name other than public "
                          "(lowercase letters, digits, _; e.g. shadow)")
    return name


def q(schema: str) -> str:
    """A schema name as a quoted identifier (names are checked: no quotes inside), so that a
    reserved word such as ``window`` works too."""
    return '"' + schema.replace('"', '""') + '"'


async def connect(dsn: str, schema: str = "public") -> asyncpg.Connection:
    """A connection whose unqualified table names resolve in ``schema``."""
    return await asyncpg.connect(dsn, server_settings={"search_path": q(schema)}, timeout=10)


async def reset(dsn: str, schema: str) -> None:
    """Drop and re-create a shadow schema with the migrations applied."""
    check_schema(schema)
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {q(schema)} CASCADE; CREATE SCHEMA {q(schema)}")
    finally:
        await conn.close()
    conn = await connect(dsn, schema)
    try:
        await sink.migrate(conn)
    finally:
        await conn.close()


@dataclass
class Progress:
    applied: int = 0
    last_sequence: int = 0
    apply_s: float = 0.0  # time spent writing batches (overlaps reading and parsing the next)
    wait_s: float = 0.0  # time the reader waited for the previous batch's write


def convert_message(msg) -> tuple[int, str | None, list[projection.Op]]:
    seq = stream_sequence(msg)
    try:
        event = eventlog.parse_message(msg)
        return seq, event.event_id, projection.convert(event, seq)
    except (ValueError, ValidationError, LookupError):
        return seq, None, []  # poison: the live service dead-lettered it; a replay skips it the same way


async def replay(js, conn: asyncpg.Connection, *, from_seq: int | None = None, from_time: datetime | None = None,
                 to_seq: int | None = None, batch: int = 5000,
                 on_batch: Callable[[Progress], None] | None = None) -> Progress:
    """Apply the log from the target's position (or ``from_seq``/``from_time``, whichever is
    later) up to ``to_seq`` (default: the log's end now) through the converter and the sink. One
    batch is written while the next is parsed."""
    start = max(await sink.position(conn) + 1, from_seq or 1)
    end = to_seq if to_seq is not None else await eventlog.last_sequence(js)
    progress = Progress(last_sequence=start - 1)
    if start > end:
        return progress
    pending: asyncio.Task | None = None
    chunk: list[sink.Entry] = []

    async def flush(items):
        t = time.perf_counter()
        await sink.apply_batch(conn, items)
        progress.apply_s += time.perf_counter() - t

    async def hand_over(items) -> None:
        nonlocal pending
        if pending is not None:
            t = time.perf_counter()
            await pending
            progress.wait_s += time.perf_counter() - t
        pending = asyncio.create_task(flush(items))
        progress.applied += len(items)
        progress.last_sequence = items[-1][0]
        if on_batch:
            on_batch(progress)

    async for msg in ordered_read(js, start=start, end=end, from_time=from_time):
        entry = convert_message(msg)
        if entry[0] < start:
            continue
        chunk.append(entry)
        if len(chunk) >= batch:
            await hand_over(chunk)
            chunk = []
    if chunk:
        await hand_over(chunk)
    if pending is not None:
        await pending
    return progress


ACK_WINDOW = 20_000  # messages in flight from the server: bounds memory however long the log is


async def ordered_read(js, *, start: int, end: int, from_time: datetime | None = None):
    """Messages [start, end] of the events stream, in order, through an ephemeral push consumer
    with ack-all: the server keeps at most ACK_WINDOW messages in flight (acked every tenth of
    it), which bounds memory, and pushes without the per-batch round trips of a pull consumer
    (about 1.5x its rate here)."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    if from_time is not None:
        policy = dict(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=from_time.isoformat())
    elif start > 1:
        policy = dict(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
    else:
        policy = dict(deliver_policy=DeliverPolicy.ALL)
    config = ConsumerConfig(ack_policy=AckPolicy.ALL, max_ack_pending=ACK_WINDOW, inactive_threshold=30.0,
                            mem_storage=True, ack_wait=300.0, **policy)
    buffer: deque = deque()
    arrived = asyncio.Event()

    async def cb(msg) -> None:  # no task or timer per message: the subscription appends, we drain
        buffer.append(msg)
        arrived.set()

    sub = await js.subscribe(f"{SUBJECT_PREFIX}.>", stream=eventlog.EVENTS_STREAM, config=config, manual_ack=True,
                             cb=cb, pending_msgs_limit=-1, pending_bytes_limit=-1)
    every = max(1, ACK_WINDOW // 10)
    count = 0
    try:
        while True:
            if not buffer:
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), timeout=10.0)
                except asyncio.TimeoutError:
                    if await eventlog.last_sequence(js) < end:
                        raise ReplayError(f"the log ends before sequence {end}") from None
                continue
            msg = buffer.popleft()
            seq = stream_sequence(msg)
            if seq > end:
                return
            yield msg
            count += 1
            if count % every == 0:
                await msg.ack()  # ack-all: everything delivered up to this one
            if seq >= end:
                return
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # ephemeral: the server reaps it anyway
            pass


def stream_sequence(msg) -> int:
    """The stream sequence from a JetStream reply subject without building the metadata object:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<seq>...`` (9 tokens) or, with domain and account
    hash, ``$JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<seq>...`` (12 tokens)."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9:
        return int(tokens[5])
    if len(tokens) >= 12:
        return int(tokens[7])
    return msg.metadata.sequence.stream


async def table_checksums(conn: asyncpg.Connection, schema: str) -> dict[str, tuple[int, str]]:
    """table -> (rows, md5 over the sorted md5 of each row's text)."""
    out = {}
    for table in TABLES:
        exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{q(schema)}.{table}")
        if not exists:
            out[table] = (0, "missing")
            continue
        cols = [r["attname"] for r in await conn.fetch(
            "SELECT attname FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped "
            "ORDER BY attname", f"{q(schema)}.{table}")]
        cols = [c for c in cols if c not in _VOLATILE.get(table, ())]
        row = ", ".join(f't."{c}"' for c in cols)
        n, digest = await conn.fetchrow(
            f"SELECT count(*), coalesce(md5(string_agg(h, '' ORDER BY h)), '') FROM "
            f"(SELECT md5(ROW({row})::text) AS h FROM {q(schema)}.{table} t) s")
        out[table] = (n, digest)
    return out


async def compare(dsn: str, shadow: str, live: str = "public") -> list[dict]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            a = await table_checksums(conn, live)
            b = await table_checksums(conn, shadow)
    finally:
        await conn.close()
    return [{"table": t, "live_rows": a[t][0], "shadow_rows": b[t][0], "live_checksum": a[t][1][:12],
             "shadow_checksum": b[t][1][:12], "equal": a[t] == b[t]} for t in TABLES]


async def swap(dsn: str, js, shadow: str, on_batch=None) -> str:
    """Make the shadow the live read models. Live writers are held off by a lock on the live
    position while the shadow catches up to exactly the live position; the live tables move to a
    ``retired_<time>`` schema (drop it when satisfied). Returns that schema's name."""
    check_schema(shadow)
    retired = f"retired_{int(time.time())}"
    admin = await asyncpg.connect(dsn, timeout=10)
    shadow_conn = await connect(dsn, shadow)
    try:
        async with admin.transaction():
            await admin.execute("LOCK TABLE public.projection_position IN ACCESS EXCLUSIVE MODE")
            live_pos = await admin.fetchval(
                "SELECT last_sequence FROM public.projection_position WHERE projection = $1", sink.PROJECTION) or 0
            await replay(js, shadow_conn, to_seq=live_pos, on_batch=on_batch)
            shadow_pos = await sink.position(shadow_conn)
            if shadow_pos != live_pos:
                raise ReplayError(f"shadow is at {shadow_pos}, live at {live_pos}: cannot swap (the log's tail "
                                  "is not readable?)")
            await admin.execute(f"CREATE SCHEMA {retired}")
            for table in TABLES:
                await admin.execute(f"ALTER TABLE public.{table} SET SCHEMA {retired}")
                await admin.execute(f"ALTER TABLE {q(shadow)}.{table} SET SCHEMA public")
            await admin.execute(f"DROP SCHEMA {q(shadow)}")
    finally:
        await shadow_conn.close()
        await admin.close()
    return retired
