"""Accounting adapter: durable consumer -> converter -> Postgres sink (position in the same
transaction). Single active instance: a second one would race the position row."""

from __future__ import annotations

import asyncio
import logging
import signal

import asyncpg
from pydantic import ValidationError

from runtime import eventlog, observability
from runtime.clock import ScaledClock
from runtime.settings import Settings
from services.accounting import metrics, projection, sink, statements

log = logging.getLogger("accounting")
NAME = "accounting"


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
    try:
        await eventlog.wait_for_streams(js)
        while not stop.is_set():
            position = await sink.position(conn)
            try:
                async for msgs in eventlog.tail(js, from_seq=position + 1, batch=settings.batch_size,
                                                idle_s=settings.tick_s):
                    if stop.is_set():
                        break
                    if msgs:
                        conn = await _project(js, conn, settings, msgs, issuer)
                        await _issue(conn, js, issuer)
            except eventlog.TRANSIENT_ERRORS as err:
                log.warning("NATS unavailable; resuming from the stored position", extra={"error": repr(err)})
                await asyncio.sleep(0.5)
    finally:
        if collector is not None:
            metrics.unregister(collector)
        await nc.close()
        await conn.close()


async def _issue(conn: asyncpg.Connection, js, issuer: statements.Issuer) -> None:
    """Statements that fell due with this batch; a failure is retried after the next batch."""
    try:
        await issuer.issue_due(conn, js)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, *eventlog.TRANSIENT_ERRORS) as err:
        log.warning("issuing statements failed; retrying later", extra={"error": repr(err)})


async def _project(js, conn: asyncpg.Connection, settings: Settings, msgs,
                   issuer: statements.Issuer | None = None) -> asyncpg.Connection:
    """Convert a batch and commit it, retrying the same batch until Postgres takes it."""
    batch: list[sink.Entry] = []
    for msg in msgs:
        seq = msg.metadata.sequence.stream
        kind = (msg.headers or {}).get("Gpusched-Type", "event")
        event_id = None
        with observability.span_from_headers(f"accounting {kind}", msg.headers, sequence=seq):
            try:
                event = eventlog.parse_message(msg)
                ops = projection.convert(event, seq)
                event_id = event.event_id
            except (ValueError, ValidationError, LookupError) as err:
                await eventlog.dead_letter(js, NAME, msg, f"cannot project: {err}")
                ops = []
            else:
                observability.EVENTS_CONSUMED.labels(service=NAME, type=event.type).inc()
                if issuer is not None:
                    issuer.observe(event.occurred_at)
        batch.append((seq, event_id, ops))
    while True:
        try:
            with observability.BATCH_SECONDS.labels(service=NAME).time():
                await sink.apply_batch(conn, batch)
            break
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as err:
            # Nothing of the batch is committed; try the same batch again on a new connection.
            log.warning("postgres write failed; retrying the batch", extra={"error": repr(err)})
            await asyncio.sleep(1.0)
            try:
                await conn.close()
            except Exception:
                pass
            conn = await connect_pg(settings.pg_dsn)
    observability.APPLIED_SEQUENCE.labels(service=NAME).set(batch[-1][0])
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
