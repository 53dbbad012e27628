"""Accounting adapter: the log from the stored position, through the ingest pipeline
(converter -> batch -> Postgres sink, position in the same transaction). Single active
instance: a second one would race the position row."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import asyncpg
from runtime import eventlog, observability
from runtime.clock import ScaledClock
from runtime.settings import Settings
from services.accounting import metrics, pipeline, sink, statements

log = logging.getLogger("accounting")
NAME = "accounting"

UNSTORABLE = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError)
"""Postgres refusing what a batch holds: the same batch will be refused again, unlike a lost
connection or a server restart, which :func:`_apply` rides out by retrying."""


async def connect_pg(dsn: str) -> asyncpg.Connection:
    delay = 0.5
    while True:
        try:
            return await asyncpg.connect(dsn)
        except (OSError, asyncpg.PostgresError) as err:
            log.warning("postgres unavailable, retrying", extra={"error": repr(err)})
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5)


async def run(settings: Settings, stop: asyncio.Event) -> None:
    """Project the log into Postgres, strictly in stream order, from the stored position.

    The position lives in Postgres, written in the transaction that writes the rows, so the
    consumer need not remember anything: an ephemeral in-order reader starts at position + 1, and
    after any failure (NATS or Postgres) the loop starts again from the stored position. A batch
    that fails to commit is retried as it is; no later event is applied before it."""
    if not settings.pg_dsn:
        raise SystemExit("GPUSCHED_PG_DSN is required by the accounting service")
    issuer = statements.Issuer(statements.IssuerConfig.from_env())
    conn = await connect_pg(settings.pg_dsn)
    await sink.migrate(conn)
    collector = (metrics.register(settings.pg_dsn, now=ScaledClock(settings.time_scale, settings.clock_epoch).now)
                 if settings.metrics_port else None)
    nc = await eventlog.connect(settings, "gpusched-accounting")
    js = nc.jetstream()
    store = _Store(js, conn, settings, issuer)
    try:
        await eventlog.wait_for_streams(js)
        while not stop.is_set():
            position = await sink.position(store.conn)
            batches = eventlog.read_batches(js, from_seq=position + 1, follow=True, batch=settings.batch_size,
                                            idle_s=settings.tick_s)
            try:
                await pipeline.run(_until(stop, batches), store, trace="accounting", observe=store.observe)
            except eventlog.TRANSIENT_ERRORS as err:
                log.warning("NATS unavailable; resuming from the stored position", extra={"error": repr(err)})
                await asyncio.sleep(0.5)
    finally:
        if collector is not None:
            metrics.unregister(collector)
        await nc.close()
        await store.conn.close()


async def _until(stop: asyncio.Event, batches):
    """The reader's batches until ``stop`` is set (checked at least every idle tick)."""
    async with contextlib.aclosing(batches):
        async for msgs in batches:
            if stop.is_set():
                return
            yield msgs


class _Store:
    """The live end of the pipeline: a batch's poison dead-lettered, the batch applied (retried
    on a new connection until Postgres takes it), then the statements that fell due."""

    def __init__(self, js, conn: asyncpg.Connection, settings: Settings, issuer: statements.Issuer) -> None:
        self.js, self.conn, self.settings, self.issuer = js, conn, settings, issuer

    def observe(self, event) -> None:
        observability.EVENTS_CONSUMED.labels(service=NAME, type=event.type).inc()
        self.issuer.observe(event.occurred_at)

    async def __call__(self, converted: pipeline.Converted) -> None:
        for msg, reason in converted.poison:
            await eventlog.dead_letter(self.js, NAME, msg, reason)
        try:
            self.conn = await _apply(self.conn, self.settings, converted.entries)
        except UNSTORABLE:
            self.conn = await self._apply_one_by_one(converted)
        await _issue(self.conn, self.js, self.issuer)

    async def _apply_one_by_one(self, converted: pipeline.Converted) -> asyncpg.Connection:
        """A batch Postgres refuses for its content: each event on its own, and one it refuses
        dead-lettered with the reason and passed over (its position still recorded), so that
        nothing after it waits for a write that can never succeed."""
        for entry, msg in zip(converted.entries, converted.messages, strict=True):
            try:
                self.conn = await _apply(self.conn, self.settings, [entry])
            except UNSTORABLE as err:
                await eventlog.dead_letter(self.js, NAME, msg, f"Postgres cannot store this event: {err}")
                self.conn = await _apply(self.conn, self.settings, [(entry[0], entry[1], [])])
        return self.conn


async def _issue(conn: asyncpg.Connection, js, issuer: statements.Issuer) -> None:
    """Statements that fell due with this batch; a failure is retried after the next batch."""
    try:
        await issuer.issue_due(conn, js)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, *eventlog.TRANSIENT_ERRORS) as err:
        log.warning("issuing statements failed; retrying later", extra={"error": repr(err)})


async def _apply(conn: asyncpg.Connection, settings: Settings, entries: list[sink.Entry]) -> asyncpg.Connection:
    """Apply a batch, retrying the same batch until Postgres takes it; :data:`UNSTORABLE` is
    raised, not retried."""
    while True:
        try:
            with observability.BATCH_SECONDS.labels(service=NAME).time():
                await sink.apply_batch(conn, entries)
            break
        except UNSTORABLE:
            raise
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as err:
            # Nothing of the batch is committed; try the same batch again on a new connection.
            log.warning("postgres write failed; retrying the batch", extra={"error": repr(err)})
            await asyncio.sleep(1.0)
            try:
                await conn.close()
            except Exception:
                pass
            conn = await connect_pg(settings.pg_dsn)
    observability.APPLIED_SEQUENCE.labels(service=NAME).set(entries[-1][0])
    return conn


def main() -> None:
    settings = Settings.from_env()
    observability.setup(NAME, level=settings.log_level, fmt=settings.log_format, metrics_port=settings.metrics_port,
                        otel_exporter=settings.otel_exporter, trace_dir=settings.trace_dir)

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run(settings, stop)

    try:
        asyncio.run(_main())
    finally:
        observability.shutdown()


if __name__ == "__main__":
    main()
