"""Accounting adapter: the log from the stored position, through the ingest pipeline
(converter -> batch -> Postgres sink, position in the same transaction). One process per
partition (:mod:`services.accounting.partition`; one partition unless
``GPUSCHED_ACCOUNTING_PARTITIONS`` says more): a second process of the same partition would wait
on the position row's lock and pass over what the first applied, doing the work twice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import asyncpg
from runtime import eventlog, health, observability
from runtime.clock import ScaledClock
from runtime.settings import Settings
from runtime.teams import TeamIndex
from services.accounting import metrics, partition, pipeline, sink, statements

log = logging.getLogger("accounting")
NAME = "accounting"

UNSTORABLE = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError)
"""Postgres refusing what a batch holds: the same batch will be refused again, unlike a lost
connection or a server restart, which :func:`run` rides out by reconnecting."""
PG_UNAVAILABLE = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)
"""A lost connection, a server restarting or not up yet (any other Postgres error than
:data:`UNSTORABLE`): reconnect and go on from the stored position."""
STOP_GRACE_S = 5.0
"""On SIGTERM a batch being written may commit for this long; then the service stops wherever it
is (a retry, a reconnect): an uncommitted batch commits nothing, and the next start resumes from
the stored position."""


async def connect_pg(dsn: str) -> asyncpg.Connection:
    failures = 0
    while True:
        try:
            return await asyncpg.connect(dsn, timeout=10)
        except PG_UNAVAILABLE as err:
            failures += 1
            log.warning("postgres unavailable, retrying", extra={"error": repr(err)})
            await asyncio.sleep(eventlog.retry_delay(failures))


async def reconnect_pg(conn: asyncpg.Connection, dsn: str) -> asyncpg.Connection:
    """A new connection in place of one that failed (closed without waiting for the server)."""
    conn.terminate()
    return await connect_pg(dsn)


async def run(settings: Settings, stop: asyncio.Event, partitioning: partition.Partitioning | None = None) -> None:
    """Project the log into Postgres, strictly in stream order, from the stored position.

    The position lives in Postgres, written in the transaction that writes the rows, so the
    consumer need not remember anything: an ephemeral in-order reader starts at position + 1, and
    after any failure (NATS or Postgres) the loop starts again from the stored position, after a
    growing pause, reconnecting to Postgres when that was what failed: no later event is applied
    before a batch that failed to commit."""
    if not settings.pg_dsn:
        raise SystemExit("GPUSCHED_PG_DSN is required by the accounting service")
    partitioning = partitioning or partition.Partitioning.from_env()
    issuer = statements.Issuer(statements.IssuerConfig.from_env())
    # /readyz: ready once Postgres answers and the projection has caught up with the log (_project)
    health.HEALTH.waiting_for("postgres")
    health.HEALTH.waiting_for("catch-up")
    conn = await connect_pg(settings.pg_dsn)
    health.HEALTH.done("postgres")
    await sink.migrate(conn)
    clock = ScaledClock(settings.time_scale, settings.clock_epoch, settings.clock_start)
    collector = (metrics.register(settings.pg_dsn, now=clock.now)
                 if settings.metrics_port and partitioning.first else None)
    nc = await eventlog.connect(settings, "gpusched-accounting")
    js = nc.jetstream()
    store = _Store(js, conn, settings, issuer, partitioning)
    try:
        await eventlog.wait_for_streams(js)
        failures = 0
        while not stop.is_set():
            try:
                await _project(js, store, settings, stop)
            except eventlog.BROKER_ERRORS as err:
                failures += 1
                health.HEALTH.jetstream = False
                log.warning("NATS unavailable; resuming from the stored position", extra={"error": repr(err)})
                await asyncio.sleep(eventlog.retry_delay(failures))
            except sink.PartitioningChanged as err:
                log.warning("the partitions' positions changed under this process; claiming its partition again",
                            extra={"error": str(err)})
                await asyncio.sleep(settings.tick_s)
            except PG_UNAVAILABLE as err:
                failures += 1
                log.warning("Postgres unavailable; reconnecting, then resuming from the stored position",
                            extra={"error": repr(err)})
                health.HEALTH.waiting_for("postgres")
                await asyncio.sleep(eventlog.retry_delay(failures))
                store.conn = await reconnect_pg(store.conn, settings.pg_dsn)
                health.HEALTH.done("postgres")
            else:
                failures = 0
    finally:
        if collector is not None:
            metrics.unregister(collector)
        await eventlog.close(nc)
        try:
            await store.conn.close(timeout=2)
        except Exception:  # Postgres is away: nothing to say goodbye to
            store.conn.terminate()


async def _project(js, store: "_Store", settings: Settings, stop: asyncio.Event) -> None:
    """From the stored position on, until ``stop`` or a failure."""
    store.failure = None
    health.HEALTH.waiting_for("catch-up")  # /readyz: until the projection reaches the log's end as it is now
    p = store.partitioning
    names = [partition.projection_name(k) for k in range(p.partitions)]
    waiting = False
    # Only partition 0 changes the number of partitions (sink.claim): another partition whose
    # number the rows do not say waits for partition 0 to start with it (a rolling change).
    while (position := await sink.claim(store.conn, p.projection, names, may_change=p.first)) is None:
        if not waiting:
            log.warning("waiting for partition 0 to start with this number of partitions",
                        extra={"partitions": p.partitions, "partition": p.partition})
            waiting = True
        if stop.is_set():
            return
        await asyncio.sleep(settings.tick_s)
    store.catch_up_to = (await js.stream_info(eventlog.EVENTS_STREAM)).state.last_seq
    if position >= store.catch_up_to:
        health.HEALTH.done("catch-up")
    batches = eventlog.read_batches(js, from_seq=position + 1, follow=True, batch=settings.batch_size,
                                    idle_s=settings.tick_s)
    await pipeline.run(_until(stop, batches, store), store, trace="accounting", observe=store.observe,
                       skip=store.share.skip if p.partitions > 1 else None)


async def _until(stop: asyncio.Event, batches, store: "_Store"):
    """The reader's batches until ``stop`` is set or the store failed (both checked at least
    every idle tick: the pipeline stores a batch while it reads the next, so a failed store
    would otherwise surface only once another event arrived)."""
    async with contextlib.aclosing(batches):
        async for msgs in batches:
            if store.failure is not None:
                raise store.failure
            if stop.is_set():
                return
            health.HEALTH.jetstream = True  # the reader answered
            if not msgs and store.partitioning.first and store.partitioning.partitions > 1:
                await store.idle()  # the other partitions may have caught up: a statement may be due
            yield msgs


class _Store:
    """The live end of the pipeline: the batch narrowed to this partition's events, its poison
    dead-lettered, the batch applied, then the statements that fell due (partition 0)."""

    def __init__(self, js, conn: asyncpg.Connection, settings: Settings, issuer: statements.Issuer,
                 partitioning: partition.Partitioning) -> None:
        self.js, self.conn, self.settings, self.issuer = js, conn, settings, issuer
        self.partitioning, self.share = partitioning, partition.Share(partitioning, TeamIndex(js))
        self.failure: Exception | None = None  # the last batch's, until the run starts again
        self.catch_up_to = 0  # the log's last sequence when the projection started (readiness)
        self.lock = asyncio.Lock()  # one user of the connection at a time: a batch stored, or statements issued

    def observe(self, event, sequence: int) -> None:
        observability.EVENTS_CONSUMED.labels(service=NAME, type=event.type).inc()
        self.issuer.observe(event.occurred_at)
        self.share.seen(event, sequence)

    async def idle(self) -> None:
        """Partition 0 with nothing new to read: the statements that fell due meanwhile."""
        async with self.lock:
            await _issue(self.conn, self.js, self.issuer)

    async def __call__(self, converted: pipeline.Converted) -> None:
        try:
            async with self.lock:
                await self._store(converted)
        except Exception as err:
            self.failure = err
            raise
        if converted.last_sequence >= self.catch_up_to:
            health.HEALTH.done("catch-up")  # the backlog there was at the start is stored

    async def _store(self, converted: pipeline.Converted) -> None:
        p = self.partitioning
        if p.partitions > 1:
            converted.keep(await self.share.owned(converted))
        for msg, reason in await self.share.dead_letters(converted.poison):
            await eventlog.dead_letter(self.js, NAME, msg, reason)
        try:
            await self._apply(converted.entries)
        except UNSTORABLE:
            await self._apply_one_by_one(converted)
        if p.first:
            await _issue(self.conn, self.js, self.issuer)

    async def _apply(self, entries: list[sink.Entry]) -> None:
        """Apply a batch in one transaction with its position. A failure commits nothing and is
        raised: :data:`UNSTORABLE` to be handled event by event, anything else for :func:`run`
        to reconnect and resume from the stored position (which, after a Postgres crash, is the
        one Postgres kept, not the one this process last wrote)."""
        with observability.BATCH_SECONDS.labels(service=NAME).time():
            await sink.apply_batch(self.conn, entries, self.partitioning.projection,
                                   partitions=self.partitioning.partitions)
        observability.APPLIED_SEQUENCE.labels(service=NAME).set(entries[-1][0])

    async def _apply_one_by_one(self, converted: pipeline.Converted) -> None:
        """A batch Postgres refuses for its content: each event on its own, and one it refuses
        dead-lettered with the reason and passed over (its position still recorded), so that
        nothing after it waits for a write that can never succeed."""
        for entry, msg in zip(converted.entries, converted.messages, strict=True):
            try:
                await self._apply([entry])
            except UNSTORABLE as err:
                await eventlog.dead_letter(self.js, NAME, msg, f"Postgres cannot store this event: {err}")
                await self._apply([(entry[0], entry[1], [])])


async def _issue(conn: asyncpg.Connection, js, issuer: statements.Issuer) -> None:
    """Statements that fell due with this batch; a failure is retried after the next batch."""
    try:
        await issuer.issue_due(conn, js)
    except (*PG_UNAVAILABLE, *eventlog.BROKER_ERRORS) as err:
        log.warning("issuing statements failed; retrying later", extra={"error": repr(err)})


async def run_until_stopped(settings: Settings, stop: asyncio.Event, grace_s: float = STOP_GRACE_S) -> None:
    """:func:`run` until ``stop``; then at most ``grace_s`` more, even while it retries a
    dependency that is down (the retry is cancelled)."""
    task = asyncio.create_task(run(settings, stop))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            done, _ = await asyncio.wait({task}, timeout=grace_s)
            if not done:
                log.info("stopping while retrying; the next start resumes from the stored position")
                task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        stopping.cancel()
        task.cancel()


def main() -> None:
    settings = Settings.from_env()
    observability.setup(NAME, level=settings.log_level, fmt=settings.log_format, metrics_port=settings.metrics_port,
                        metrics_addr=settings.metrics_addr,
                        otel_exporter=settings.otel_exporter, trace_dir=settings.trace_dir)

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_until_stopped(settings, stop)

    try:
        asyncio.run(_main())
    finally:
        observability.shutdown()


if __name__ == "__main__":
    main()
