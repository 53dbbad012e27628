"""Replay: rebuild the read models from the log into a shadow schema, compare shadow and live
(row counts and checksums per table), and swap them. The same converter and sink as the live
service, so a replay can only differ from live if the code (or the price book) changed: which
is what a replay is for.

A shadow is a Postgres schema (default ``shadow``) in the read-model database with the same
migrations; it has its own ``projection_position``.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import asyncpg
from nats.aio.client import Client as NatsClient
from pydantic import ValidationError

from runtime import eventlog
from schemas.registry import SUBJECT_PREFIX, parse_event
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


async def defer_indexes(dsn: str, schema: str) -> list[str]:
    """Bulk-load practice for a fresh shadow: drop its secondary indexes (not primary keys or
    unique ones: the sink's conflict checks and joins use those) and remember their definitions
    in the shadow, so that :func:`build_indexes` builds each once, sorted, instead of the
    load inserting into it row by row. Returns the indexes deferred."""
    conn = await connect(dsn, schema)
    try:
        async with conn.transaction():
            rows = await conn.fetch(
                "SELECT c.relname, pg_get_indexdef(i.indexrelid) AS ddl FROM pg_index i "
                "JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = $1 AND NOT i.indisprimary AND NOT i.indisunique ORDER BY c.relname", schema)
            await conn.execute("CREATE TABLE IF NOT EXISTS deferred_indexes (name text PRIMARY KEY, ddl text NOT NULL)")
            for table in TABLES:  # nothing to vacuum in a table being loaded; build_indexes analyzes it
                await conn.execute(f"ALTER TABLE {q(schema)}.{table} SET (autovacuum_enabled = off)")
            for r in rows:
                await conn.execute("INSERT INTO deferred_indexes VALUES ($1, $2) ON CONFLICT DO NOTHING", r["relname"],
                                   r["ddl"])
                await conn.execute(f"DROP INDEX {q(schema)}.{q(r['relname'])}")
            # applied_events' key: random (a digest), one entry per event, used by no conflict
            # check or join, only by lookups of ids the writer's filter cannot rule out.
            key = await conn.fetchrow(
                "SELECT conname, pg_get_constraintdef(oid) AS ddl FROM pg_constraint "
                "WHERE conrelid = $1::regclass AND contype = 'p'", f"{q(schema)}.applied_events")
            await conn.execute("INSERT INTO deferred_indexes VALUES ($1, $2)", key["conname"],
                               f"ALTER TABLE {q(schema)}.applied_events ADD CONSTRAINT {q(key['conname'])} {key['ddl']}")
            await conn.execute(f"ALTER TABLE {q(schema)}.applied_events DROP CONSTRAINT {q(key['conname'])}")
    finally:
        await conn.close()
    return [r["relname"] for r in rows] + [key["conname"]]


INDEX_BUILDERS = 2
"""Sessions that build a shadow's deferred indexes and analyze its tables at once: each build
and each ANALYZE keeps one core busy, and a rebuild's last seconds are spent there."""


async def build_indexes(dsn: str, schema: str, *, sessions: int = INDEX_BUILDERS) -> list[str]:
    """Build the indexes :func:`defer_indexes` dropped (none if there are none), then analyze
    the tables, on ``sessions`` connections at once; a shadow is swapped in only with all its
    indexes. Each index is built in a transaction that also strikes it off ``deferred_indexes``,
    so a build that fails part way resumes with what is left; the last one drops the list and
    turns autovacuum back on."""
    conn = await connect(dsn, schema)
    try:
        if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{q(schema)}.deferred_indexes"):
            return []
        rows = await conn.fetch("SELECT name, ddl FROM deferred_indexes ORDER BY name")
        # applied_events' key (one entry per event) is the longest build: it goes first.
        rows = sorted(rows, key=lambda r: not r["ddl"].startswith("ALTER TABLE"))
        # One iterator for all sessions: each statement is taken by one. The ANALYZEs (statistics
        # for the load) come after the builds: one waits for a build on its table anyway.
        work = iter([(r["name"], r["ddl"]) for r in rows] + [(None, f"ANALYZE {q(schema)}.{t}") for t in TABLES])

        async def builder() -> None:
            session = await connect(dsn, schema)
            try:
                await session.execute("SET maintenance_work_mem = '256MB'")
                for name, sql in work:
                    async with session.transaction():
                        await session.execute(sql)
                        if name is not None:
                            await session.execute("DELETE FROM deferred_indexes WHERE name = $1", name)
            finally:
                await session.close()

        builders = [asyncio.create_task(builder()) for _ in range(max(1, sessions))]
        try:
            await asyncio.gather(*builders)
        except BaseException:  # a failed build stops the others; the list keeps what is left
            for task in builders:
                task.cancel()
            await asyncio.gather(*builders, return_exceptions=True)
            raise
        async with conn.transaction():
            await conn.execute("DROP TABLE deferred_indexes")
            for table in TABLES:
                await conn.execute(f"ALTER TABLE {q(schema)}.{table} RESET (autovacuum_enabled)")
    finally:
        await conn.close()
    return [r["name"] for r in rows]


async def rebuild(js, dsn: str, schema: str, *, from_seq: int | None = None, from_time: datetime | None = None,
                  to_seq: int | None = None, batch: int = 20_000,
                  on_batch: Callable[[Progress], None] | None = None) -> Progress:
    """A fresh shadow from the log: reset, load it with its secondary indexes deferred by
    writer processes that each read their own ranges of the log, then build the indexes. A
    window (``from_seq``/``from_time``) starts the shadow just before it."""
    await reset(dsn, schema)
    await defer_indexes(dsn, schema)
    conn = await connect(dsn, schema)
    try:
        if from_seq:
            await conn.execute("INSERT INTO projection_position (projection, last_sequence) VALUES ($1, $2)",
                               sink.PROJECTION, from_seq - 1)
        progress = await replay(js, conn, from_seq=from_seq, from_time=from_time, to_seq=to_seq, batch=batch,
                                writer_process=(dsn, schema), on_batch=on_batch)
    finally:
        await conn.close()
    await build_indexes(dsn, schema)
    return progress


@dataclass
class Progress:
    applied: int = 0
    last_sequence: int = 0
    apply_s: float = 0.0  # time spent writing batches (writer processes: parsing and writing)
    wait_s: float = 0.0  # time the reader waited for the writer (writer processes: for the turn)
    read_s: float = 0.0  # writer processes: time spent waiting for a range's read (the rest overlaps)
    writer_cpu_s: float = 0.0  # CPU time of the writer processes (reading, parsing, converting, encoding)


def convert_raw(seq: int, data: bytes) -> tuple[int, str | None, list[projection.Op]]:
    """One message's entry for the sink: (sequence, event id, operations)."""
    try:
        event = parse_event(data)
        return seq, event.event_id, projection.convert(event, seq)
    except (ValueError, ValidationError, LookupError):
        return seq, None, []  # poison: the live service dead-lettered it; a replay skips it the same way


Raw = list[tuple[int, bytes]]
"""A batch as read from the log: (stream sequence, payload)."""


class InlineWriter:
    """Parses and writes batches in this process, one batch written while the next is read."""

    def __init__(self, conn: asyncpg.Connection, progress: Progress):
        self.conn, self.progress = conn, progress
        self._pending: asyncio.Task | None = None

    async def _write(self, raw: Raw) -> None:
        entries = [convert_raw(seq, data) for seq, data in raw]
        t = time.perf_counter()
        await sink.apply_batch(self.conn, entries)
        self.progress.apply_s += time.perf_counter() - t

    async def submit(self, raw: Raw) -> None:
        await self.drain()
        self._pending = asyncio.create_task(self._write(raw))

    async def drain(self) -> None:
        if self._pending is not None:
            t = time.perf_counter()
            pending, self._pending = self._pending, None
            await pending
            self.progress.wait_s += time.perf_counter() - t

    async def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()


class BatchCollector:
    """The garbage collector during a replay: not automatic, but after each batch. A batch
    allocates some hundred thousand objects (messages, events, rows) that live until it is
    written and form no cycles; automatic collections would scan them again and again while
    they are alive (and the whole heap at each full one), about 2 µs an event of the reader's
    time. After a batch they are freed already, so a collection there scans only what
    survived. Every ``full_every`` batches a full one, for any cycles that reach the oldest
    generation. Restores the collector as it was on exit."""

    def __init__(self, full_every: int = 50):
        self.full_every, self._batches = full_every, 0
        self._enabled = self._froze = False

    def __enter__(self) -> BatchCollector:
        self._enabled = gc.isenabled()
        gc.disable()
        self._froze = gc.get_freeze_count() == 0  # else someone froze the heap already: leave it so
        gc.freeze()  # what the process holds now (modules, the client): not rescanned meanwhile
        return self

    def after_batch(self) -> None:
        self._batches += 1
        gc.collect(2 if self._batches % self.full_every == 0 else 1)

    def __exit__(self, *exc) -> None:
        if self._froze:
            gc.unfreeze()
        gc.collect()
        if self._enabled:
            gc.enable()


# -- writer processes: each reads, parses and writes its own ranges of the log ---------------
#
# A rebuild cuts the log [start, end] into ranges of ``batch`` stream sequences and deals them
# round-robin to WRITERS processes, each with its own NATS and Postgres connection: range k goes
# to writer k % WRITERS. A writer reads its range straight from JetStream (an ephemeral pull
# consumer without acks, started at the range's first sequence), parses, converts and plans it,
# then waits for the turn: a token the writer of the previous range sends after its transaction
# committed. Meanwhile, and while it writes, it reads its next range. So ranges commit in log
# order, one at a time, while the next ones are being read and parsed; no message passes through
# a second process, and the server tracks no acks. The token also says whether a range failed
# (then every later one is refused: the position must never move past events that were not
# written) and carries the event ids of the ranges since this writer's last one, for its Bloom
# filter of applied ids. The parent only starts the writers and collects their results in range
# order.

WRITERS = 2
PULL_CHUNK = 5000
"""Messages per pull request: bounds what the server buffers for a writer (a few MiB), far
below its slow-consumer limit; one round trip per chunk is a fraction of a percent of its time."""


@dataclass(frozen=True)
class NatsOptions:
    """How a writer process connects: the parent's server and credentials. A ``tls://`` URL
    carries over (nats-py then uses the system's trust store); an SSL context the caller built
    does not cross a process boundary."""

    servers: tuple[str, ...]
    user: str | None = None
    password: str | None = None
    token: str | None = None

    @classmethod
    def of(cls, js) -> NatsOptions:
        nc = js._nc  # nats-py keeps the client's options on it; the context has no public accessor
        if nc.options.get("tls") is not None:
            raise ReplayError("a rebuild's writer processes cannot reuse the caller's TLS context; connect with "
                              "a tls:// URL (the system's trust store) or replay without writer_process")
        url = nc.connected_url
        if url is None:
            raise ReplayError("NATS is not connected")
        return cls(servers=(url.geturl(),), user=nc.options.get("user"), password=nc.options.get("password"),
                   token=nc.options.get("token"))

    async def connect(self):
        auth = {k: v for k, v in (("user", self.user), ("password", self.password), ("token", self.token)) if v}
        nc = RangeClient() if RangeClient.RAW_DELIVERY else NatsClient()
        await nc.connect(list(self.servers), name="gpusched-replay-writer", allow_reconnect=False, connect_timeout=5,
                         **auth)
        return nc


class RangeClient(NatsClient):
    """nats-py's client with a shortcut for the writers' range reads. nats-py hands each message
    from its protocol parser to ``_process_msg``, which parses its headers, builds a Msg and
    queues it for the subscription's task, which then awaits its callback: about a quarter of a
    writer's CPU in a profile, for reads that keep only a message's sequence and payload. The
    deliveries (messages with a reply subject) to a subscription registered with
    :meth:`deliver_raw` go as ``(reply, payload)`` straight from the parser to its handler
    instead; its status messages (no reply subject) still reach the subscription's callback.

    Both hooks are nats-py's own, private ones (as of nats-py 2.16): ``_process_msg(sid, subject,
    reply, data, headers)``, its entry point from the parser, and a subscription's ``_id`` (its
    sid). Should the signature change, RAW_DELIVERY is False: the writers connect with the plain
    client and :func:`read_range` takes the ordinary path."""

    RAW_DELIVERY = list(inspect.signature(NatsClient._process_msg).parameters) == [
        "self", "sid", "subject", "reply", "data", "headers"]

    def __init__(self) -> None:
        super().__init__()
        self._raw: dict[int, Callable[[bytes, bytes], None]] = {}

    def deliver_raw(self, sub, handler: Callable[[bytes, bytes], None] | None) -> None:
        """Hand ``sub``'s deliveries to ``handler(reply, payload)`` (None: no longer)."""
        if handler is None:
            self._raw.pop(sub._id, None)
        else:
            self._raw[sub._id] = handler

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        handler = self._raw.get(sid)
        if handler is None or not reply:
            return await super()._process_msg(sid, subject, reply, data, headers)
        handler(reply, data)


def ranges(start: int, end: int, batch: int) -> list[tuple[int, int]]:
    """[start, end] as consecutive ranges of ``batch`` sequences (the last one shorter)."""
    return [(lo, min(lo + batch - 1, end)) for lo in range(start, end + 1, batch)]


async def read_range(js, lo: int, hi: int, *, chunk: int = PULL_CHUNK) -> Raw:
    """The log's (stream sequence, payload) pairs with lo <= sequence <= hi, in order, through
    an ephemeral pull consumer that starts at ``lo`` and needs no acks. Requests ask for what is
    available (``no_wait``): a sequence deleted from the stream is simply not there, and a
    request that finds nothing more ends the range. Through a :class:`RangeClient` (the
    writers'), the deliveries skip nats-py's per-message handling."""
    import json

    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = js._nc
    # No filter: the stream holds the events only, and a consumer filtered on them cost the
    # server 63–73 ms of CPU to create on 1,000,000 messages here (1 ms unfiltered), each range.
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                            opt_start_seq=lo, inactive_threshold=30.0, mem_storage=True)
    consumer = (await js.add_consumer(eventlog.EVENTS_STREAM, config=config)).name
    out: Raw = []
    state = {"got": 0, "want": 0, "status": None, "top": lo - 1}
    answered = asyncio.Event()

    def take(seq: int, data: bytes) -> None:
        state["top"] = seq
        if seq <= hi:
            out.append((seq, data))
        state["got"] += 1
        if state["got"] >= state["want"] or seq >= hi:
            answered.set()

    async def cb(msg) -> None:
        if msg.reply:  # a delivery (when the client does not hand them to take_raw)
            take(stream_sequence(msg), msg.data)
        else:  # a status: 404 (nothing more now) or 408 (expired) end a request
            state["status"] = (msg.headers or {}).get("Status", "?"), (msg.headers or {}).get("Description", "")
            answered.set()

    def take_raw(reply: bytes, data: bytes) -> None:
        try:
            seq = reply_sequence(reply)
        except ValueError:  # raised by the loop below: nothing may raise into nats-py's parser
            state["status"] = "unreadable", f"reply subject {bytes(reply[:200])!r} is not a JetStream delivery's"
            answered.set()
            return
        take(seq, data)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=cb, pending_msgs_limit=-1, pending_bytes_limit=-1)
    raw = isinstance(nc, RangeClient)
    if raw:
        nc.deliver_raw(sub, take_raw)
    subject = f"$JS.API.CONSUMER.MSG.NEXT.{eventlog.EVENTS_STREAM}.{consumer}"
    try:
        while state["top"] < hi:
            state.update(got=0, want=min(chunk, hi - state["top"]), status=None)
            answered.clear()
            await nc.publish(subject, json.dumps({"batch": state["want"], "no_wait": True}).encode(), reply=inbox)
            try:
                await asyncio.wait_for(answered.wait(), timeout=30.0)
            except asyncio.TimeoutError:
                raise ReplayError(f"no answer from JetStream reading sequences {state['top'] + 1}..{hi}") from None
            if state["status"] is not None:
                code, description = state["status"]
                if code in ("404", "408"):
                    break  # nothing left in the range (its last sequences were deleted)
                raise ReplayError(f"JetStream refused the read of {state['top'] + 1}..{hi}: {code} {description}")
    finally:
        if raw:
            nc.deliver_raw(sub, None)
        await sub.unsubscribe()
        try:
            await js.delete_consumer(eventlog.EVENTS_STREAM, consumer)
        except Exception:  # ephemeral: the server reaps it after inactive_threshold anyway
            pass
    return out


def _writer_main(dsn: str, schema: str, nats_options: NatsOptions, mine: list[tuple[int, int]], capacity: int,
                 writers: int, turn_in, turn_out, results) -> None:
    collector = BatchCollector()
    collector.__enter__()  # for the life of the process
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(connect(dsn, schema))
    # Ranges commit one at a time, each after the previous one's commit: a commit that waited
    # for its WAL flush (16 ms each here) would hold up every writer. So they do not wait,
    # except this writer's last range: its flush makes every range before it durable too. A
    # Postgres crash before then loses the last commits together with the position that covers
    # them (a commit is still all or nothing), and a rerun applies those ranges again.
    loop.run_until_complete(conn.execute("SET synchronous_commit = off"))
    nc = loop.run_until_complete(nats_options.connect())
    js = nc.jetstream()
    applied = None
    if capacity and not loop.run_until_complete(conn.fetchval("SELECT EXISTS (SELECT FROM applied_events)")):
        # A fresh target: every id applied goes into a Bloom filter, so that only the ids in it
        # are looked up: about 3.6 bytes an event at one false positive in a million, so that a
        # lookup (a scan while the key is deferred) is rare.
        from rbloom import Bloom

        applied = Bloom(max(capacity, 1000), 1e-6)
    # The turn is read eagerly by a thread, so that the previous writer never waits for this one
    # to want it (a token can be larger than a pipe's buffer).
    turn_in = _eager(turn_in)

    async def read(lo: int, hi: int) -> tuple[Raw, str | None]:
        try:
            return await read_range(js, lo, hi), None
        except Exception as err:  # said in turn, below: no later range may be written
            return [], f"reading the range {lo}..{hi} failed: {err!r}"

    # The next range is read while this one waits for the turn and is written: the read runs
    # whenever this writer would otherwise wait (for the turn, for Postgres). So a writer holds
    # at most two ranges.
    pending = loop.create_task(read(*mine[0])) if mine else None
    try:
        for k, (lo, hi) in enumerate(mine):
            t, cpu = time.perf_counter(), time.process_time()
            raw, unread = loop.run_until_complete(pending)
            pending = loop.create_task(read(*mine[k + 1])) if k + 1 < len(mine) else None
            read_s = time.perf_counter() - t  # what the read left to wait for
            prepared = sink.prepare([convert_raw(seq, data) for seq, data in raw])
            ids = list(prepared.first)
            # The filter holds the ids of every range this writer has heard of so far: what it
            # flags is found before the turn (which holds up every writer); in the turn, only
            # the ids of the ranges committed since (the token's) are checked, exactly.
            flagged = own = None
            if applied is not None:
                own = set(ids)
                flagged = {event_id for event_id in ids if event_id in applied}
            turn_asked = time.perf_counter()
            if (token := loop.run_until_complete(loop.run_in_executor(None, turn_in.get))) is None:
                raise ReplayError("the writer of the previous range exited without handing on the turn")
            failed, recent = token  # the previous range has committed (or failed)
            failed = failed or unread
            waited = time.perf_counter() - turn_asked
            if failed is None:
                maybe = None if own is None else flagged.union(*(own.intersection(batch) for batch in recent))
                try:
                    if k == len(mine) - 1:
                        loop.run_until_complete(conn.execute("SET synchronous_commit = on"))
                    loop.run_until_complete(sink.apply_batch(conn, prepared, maybe_applied=maybe))
                except Exception as err:
                    failed = f"the range {lo}..{hi} failed: {err!r}"
            try:  # the next writer needs the ids of the writers - 1 ranges since its own last one
                turn_out.send((failed, (recent + [ids])[-(writers - 1):] if writers > 1 else []))
            except OSError:  # it has no range left and has exited: nobody needs the turn
                pass
            if applied is not None and failed is None:  # after the turn is handed on
                for batch in recent:
                    applied.update(batch)
                applied.update(ids)
            n = len(raw)
            del prepared, ids, raw
            collector.after_batch()
            results.send((failed, n, read_s, waited, time.perf_counter() - t, time.process_time() - cpu))
            if failed is not None:
                return
    finally:
        if pending is not None:
            pending.cancel()
            loop.run_until_complete(asyncio.gather(pending, return_exceptions=True))
        loop.run_until_complete(nc.close())
        loop.run_until_complete(conn.close())


def _eager(conn) -> queue.Queue:
    """A queue that a daemon thread fills with every message from ``conn``; None once it closes."""
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        try:
            while True:
                q.put(conn.recv())
        except (EOFError, OSError):
            q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


class RangeWriters:
    """WRITERS writer processes over the ranges of [start, end] (see above); :meth:`results`
    yields each range's outcome in log order."""

    def __init__(self, js, dsn: str, schema: str, start: int, end: int, batch: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.ranges = ranges(start, end, batch)
        writers = max(1, min(WRITERS, len(self.ranges)))
        options = NatsOptions.of(js)
        turns = [ctx.Pipe(duplex=False) for _ in range(writers)]  # turns[i]: into writer i
        self._results, self._procs = [], []
        for i in range(writers):
            results_r, results_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_writer_main, name=f"replay-writer-{i}", daemon=True,
                               args=(dsn, schema, options, self.ranges[i::writers], end - start + 1, writers,
                                     turns[i][0], turns[(i + 1) % writers][1], results_w))
            proc.start()
            results_w.close()  # the writer's end: held here too, a writer's death would go unnoticed
            self._results.append(results_r)
            self._procs.append(proc)
        turns[0][1].send((None, []))  # the first range's turn
        for turn in turns:
            for end_ in turn:
                end_.close()

    async def results(self):
        """(range, (failed, events read, read s, turn waited s, wall s, CPU s)) in log order."""
        loop = asyncio.get_running_loop()
        for k, rng in enumerate(self.ranges):
            yield rng, await loop.run_in_executor(None, self._receive, k % len(self._procs))

    def _receive(self, i: int):
        try:
            return self._results[i].recv()
        except EOFError:  # its end closed: the writer is gone
            self._procs[i].join(5)
            raise ReplayError(f"writer process {i} exited (code {self._procs[i].exitcode}) before its result") from None

    def kill(self) -> None:
        """Stop every writer now (a failed or interrupted rebuild leaves none behind)."""
        for proc in self._procs:
            proc.kill()

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for proc in self._procs:
            await loop.run_in_executor(None, proc.join, 30)
            if proc.is_alive():
                proc.kill()


async def _write_ranges(js, dsn: str, schema: str, start: int, end: int, batch: int, progress: Progress,
                        on_batch: Callable[[Progress], None] | None) -> None:
    writers = RangeWriters(js, dsn, schema, start, end, batch)
    try:
        async for (_, hi), (failed, n, read_s, waited, wall, cpu) in writers.results():
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
        writers.kill()
        raise
    finally:
        await writers.close()


async def start_sequence(js, from_time: datetime) -> int | None:
    """The first stream sequence at or after ``from_time`` (None: nothing is that recent)."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
    from nats.errors import TimeoutError as NatsTimeout

    sub = await js.pull_subscribe(f"{SUBJECT_PREFIX}.>", stream=eventlog.EVENTS_STREAM, config=ConsumerConfig(
        ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=from_time.isoformat(),
        inactive_threshold=10.0, mem_storage=True))
    try:
        msgs = await sub.fetch(1, timeout=1.0)
    except NatsTimeout:
        return None
    finally:
        await sub.unsubscribe()
    return stream_sequence(msgs[0]) if msgs else None


async def replay(js, conn: asyncpg.Connection, *, from_seq: int | None = None, from_time: datetime | None = None,
                 to_seq: int | None = None, batch: int = 5000, writer_process: tuple[str, str] | None = None,
                 on_batch: Callable[[Progress], None] | None = None) -> Progress:
    """Apply the log from the target's position (or ``from_seq``/``from_time``, whichever is
    later) up to ``to_seq`` (default: the log's end now) through the converter and the sink.
    ``writer_process=(dsn, schema)``: read, parse and write in writer processes (the same target
    as ``conn``, which then only reads the position), else in this one."""
    start = max(await sink.position(conn) + 1, from_seq or 1)
    end = to_seq if to_seq is not None else await eventlog.last_sequence(js)
    progress = Progress(last_sequence=start - 1)
    if writer_process is not None and from_time is not None and start <= end:
        at = await start_sequence(js, from_time)
        start = max(start, at if at is not None else end + 1)
    if start > end:
        return progress
    if writer_process is not None:
        await _write_ranges(js, *writer_process, start, end, batch, progress, on_batch)
        return progress
    writer = InlineWriter(conn, progress)
    chunk: Raw = []

    async def hand_over(items: Raw) -> None:
        await writer.submit(items)
        progress.applied += len(items)
        progress.last_sequence = items[-1][0]

    try:
        with BatchCollector() as collector:
            async for items in ordered_read(js, start=start, end=end, from_time=from_time):
                chunk += items
                while len(chunk) >= batch:  # batches of exactly ``batch`` events (the last one less)
                    await hand_over(chunk[:batch])
                    chunk = chunk[batch:]
                    collector.after_batch()
                    if on_batch:
                        on_batch(progress)
        if chunk:
            await hand_over(chunk)
        await writer.drain()
        if on_batch and chunk:
            on_batch(progress)
    finally:
        await writer.close()
    return progress

ACK_WINDOW = 20_000  # messages in flight from the server: bounds memory however long the log is
IDLE_CHECK_S = 2.0  # nothing arrived for this long: ask the server whether anything is left to come


async def ordered_read(js, *, start: int, end: int, from_time: datetime | None = None):
    """The log's (stream sequence, payload) pairs [start, end], in order, in lists of what has
    arrived, through an ephemeral push consumer with ack-all: the server keeps at most
    ACK_WINDOW messages in flight (acked every tenth of it), which bounds memory, and pushes
    without the per-batch round trips of a pull consumer (about 1.5x its rate here)."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    if from_time is not None:
        policy = dict(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=from_time.isoformat())
    elif start > 1:
        policy = dict(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
    else:
        policy = dict(deliver_policy=DeliverPolicy.ALL)
    config = ConsumerConfig(ack_policy=AckPolicy.ALL, max_ack_pending=ACK_WINDOW, inactive_threshold=30.0,
                            mem_storage=True, ack_wait=300.0, **policy)
    buffer: Raw = []
    last: list = [None]  # the latest message, to ack up to
    arrived = asyncio.Event()

    async def cb(msg) -> None:
        # No task or timer per message, and only its sequence and payload are kept: the message
        # object is freed at once, as it would be by a consumer that only counts.
        buffer.append((stream_sequence(msg), msg.data))
        last[0] = msg
        arrived.set()

    sub = await js.subscribe(f"{SUBJECT_PREFIX}.>", stream=eventlog.EVENTS_STREAM, config=config, manual_ack=True,
                             cb=cb, pending_msgs_limit=-1, pending_bytes_limit=-1)
    every = max(1, ACK_WINDOW // 10)
    unacked = 0
    top = start - 1  # the newest sequence seen
    try:
        while True:
            if not buffer:
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), timeout=IDLE_CHECK_S)
                except asyncio.TimeoutError:
                    if await eventlog.last_sequence(js) < end:
                        raise ReplayError(f"the log ends before sequence {end}") from None
                    info = await sub.consumer_info()
                    if info.num_pending == 0 and (info.delivered.stream_seq or 0) <= top:
                        return  # the rest up to ``end`` was deleted from the stream
                continue
            items, newest = buffer.copy(), last[0]
            buffer.clear()
            top = items[-1][0]
            if top > end or items[0][0] < start:
                items = [item for item in items if start <= item[0] <= end]
            if items:
                yield items
                unacked += len(items)
                if unacked >= every:
                    await newest.ack()  # ack-all: everything delivered up to this one
                    unacked = 0
            if top >= end:
                return
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # ephemeral: the server reaps it anyway
            pass


def reply_sequence(reply: bytes | str) -> int:
    """The stream sequence from a JetStream delivery's reply subject (as the parser hands it
    over, or as nats-py's Msg has it), without building nats-py's metadata object:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<seq>...`` (9 tokens) or, with domain and account
    hash, ``$JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<seq>...`` (12 tokens).
    ValueError for anything else."""
    tokens = reply.split(b"." if isinstance(reply, bytes) else ".")
    if len(tokens) == 9:
        return int(tokens[5])
    if len(tokens) >= 12:
        return int(tokens[7])
    raise ValueError(f"not a JetStream delivery's reply subject: {reply[:200]!r}")


def stream_sequence(msg) -> int:
    """:func:`reply_sequence` of a nats-py message (its metadata, if the subject is not one)."""
    try:
        return reply_sequence(msg.reply or "")
    except ValueError:
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
    await build_indexes(dsn, shadow)  # a shadow left half-built (interrupted rebuild) gets its indexes
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
