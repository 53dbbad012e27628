"""Accounting adapter: durable consumer -> converter -> Postgres sink (position in the same
transaction). Single active instance: a second one would race the position row."""

from __future__ import annotations

import asyncio
import logging
import signal

import asyncpg
from pydantic import ValidationError

from gpusched import eventlog, observability
from gpusched.settings import Settings
from services.accounting import projection, sink

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
    if not settings.pg_dsn:
        raise SystemExit("GPUSCHED_PG_DSN is required by the accounting service")
    conn = await connect_pg(settings.pg_dsn)
    await sink.migrate(conn)
    nc = await eventlog.connect(settings, "gpusched-accounting")
    js = nc.jetstream()
    try:
        await eventlog.wait_for_streams(js)
        start = await sink.position(conn) + 1
        sub = await eventlog.durable_consumer(js, stream=eventlog.EVENTS_STREAM, durable=NAME, start_seq=start)
        while not stop.is_set():
            msgs = await eventlog.fetch(sub, settings.batch_size, settings.tick_s)
            if not msgs:
                continue
            batch: list[tuple[int, list[projection.Op]]] = []
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                kind = (msg.headers or {}).get("Gpusched-Type", "event")
                with observability.span_from_headers(f"accounting {kind}", msg.headers, sequence=seq):
                    try:
                        event = eventlog.parse_message(msg)
                        ops = projection.convert(event, seq)
                    except (ValueError, ValidationError, LookupError) as err:
                        await eventlog.dead_letter(js, NAME, msg, f"cannot project: {err}")
                        ops = []
                    else:
                        observability.EVENTS_CONSUMED.labels(service=NAME, type=event.type).inc()
                batch.append((seq, ops))
            try:
                with observability.BATCH_SECONDS.labels(service=NAME).time():
                    await sink.apply_batch(conn, batch)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as err:
                # Nothing of the batch is committed: let JetStream redeliver it.
                log.warning("postgres write failed; batch will be redelivered", extra={"error": repr(err)})
                for msg in msgs:
                    await msg.nak(delay=1.0)
                await conn.close()
                conn = await connect_pg(settings.pg_dsn)
                continue
            observability.APPLIED_SEQUENCE.labels(service=NAME).set(batch[-1][0])
            for msg in msgs:
                await msg.ack()
    finally:
        await nc.close()
        await conn.close()


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
