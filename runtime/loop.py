"""The loop every decision service runs around its pure core.

1. rebuild: fold the whole log (sequence 1 .. last at start) into the core's state;
2. consume: a durable pull consumer delivers new events in stream order; poison messages go to
   the dead-letter subject; each valid event is folded in;
3. decide: once the state includes every event this service wrote itself, ask the core what
   follows and append it, each append conditional on the aggregate's last sequence;
4. ack the batch, after its consequences are in the log.

A crash anywhere is safe: the next start rebuilds from the log, re-derives the same decisions with
the same event ids, and JetStream de-duplicates or the concurrency check refuses them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable
from datetime import datetime
from typing import Protocol

from nats.aio.msg import Msg
from pydantic import ValidationError

from runtime import eventlog, observability
from runtime.clock import Clock, ScaledClock
from runtime.settings import Settings
from schemas.envelope import Event
from schemas.registry import parse_event

log = logging.getLogger(__name__)

APPEND_WINDOW = 128  # appends in flight at once (different aggregates only)


class Core(Protocol):
    """A pure decision core: no I/O, no wall clock."""

    def evolve(self, event: Event) -> None:
        """Fold one event from the log into the state. The only way state changes."""

    def decide(self, now: datetime) -> list[Event]:
        """Decisions that follow from the current state and are not yet in the log."""

    def decisions_refused(self) -> None:
        """Some decisions returned by ``decide`` were not recorded; they must be derived again."""


def aggregate_key(event: Event) -> tuple[str, str]:
    return (type(event).aggregate, event.aggregate_id)


class DecisionService:
    def __init__(self, name: str, core: Core, settings: Settings, clock: Clock | None = None) -> None:
        self.name = name
        self.core = core
        self.settings = settings
        self.clock = clock or ScaledClock(settings.time_scale, settings.clock_epoch)
        self.applied_seq = 0
        self.own_high_water = 0  # highest sequence this service appended
        self.last_seq: dict[tuple[str, str], int] = {}
        self.trace_ctx: dict[str, dict[str, str]] = {}
        self._stop = asyncio.Event()
        self._caught_up = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    def _apply(self, msg: Msg) -> Event | None:
        seq = msg.metadata.sequence.stream
        if seq <= self.applied_seq:
            return None
        event = parse_event(msg.data)
        self.core.evolve(event)
        self.applied_seq = seq
        self.last_seq[aggregate_key(event)] = seq
        if type(event).aggregate == "job":
            ctx = observability.trace_headers(msg.headers)
            if ctx:
                self.trace_ctx[event.aggregate_id] = ctx
        observability.EVENTS_CONSUMED.labels(service=self.name, type=event.type).inc()
        return event

    async def rebuild(self, js) -> int:
        end = await eventlog.last_sequence(js)
        count = 0
        async for msgs in eventlog.read_batches(js, to_seq=end):
            for msg in msgs:
                try:
                    self._apply(msg)
                except (ValueError, ValidationError):
                    # The live consumer dead-letters it; rebuilding only skips it.
                    self.applied_seq = eventlog.sequence(msg)
            count += len(msgs)
        self.applied_seq = max(self.applied_seq, end)
        log.info("rebuilt state from the log", extra={"events": count, "last_sequence": end})
        return end

    async def wait_caught_up(self) -> None:
        """Until the state includes every event this service appended."""
        while self.applied_seq < self.own_high_water:
            self._caught_up.clear()
            await self._caught_up.wait()

    async def side_loop(self, js, appender: eventlog.EventLog) -> None:
        """A second input some services have (admission's intake). Runs beside the main loop;
        returning ends the service, so the default waits for stop()."""
        await self._stop.wait()

    async def append_all(self, log_: eventlog.EventLog, events: Iterable[Event]) -> set[tuple[str, str]]:
        """Append decisions; returns the aggregates whose decisions were refused (concurrency
        conflict) or failed transiently. Those are re-derived on a later cycle.

        One aggregate's events are appended in order, each conditional on the one before;
        different aggregates are independent, so their appends are pipelined."""
        groups: dict[tuple[str, str], list[Event]] = {}
        for event in events:
            groups.setdefault(aggregate_key(event), []).append(event)
        refused: set[tuple[str, str]] = set()
        window = asyncio.Semaphore(APPEND_WINDOW)

        async def append_group(key: tuple[str, str], group: list[Event]) -> None:
            async with window:
                for event in group:
                    if not await self._append_one(log_, key, event):
                        refused.add(key)  # the rest of the group assumed this one
                        return

        await asyncio.gather(*(append_group(k, g) for k, g in groups.items()))
        return refused

    async def _append_one(self, log_: eventlog.EventLog, key: tuple[str, str], event: Event) -> bool:
        # The decision is a span in the job's trace (continued from the job's latest event); the
        # append carries this span's context on to whoever consumes the event.
        parent = self.trace_ctx.get(event.aggregate_id, {}) if key[0] == "job" else {}
        with observability.span_from_headers(f"{self.name} {event.type}", parent, job=event.aggregate_id):
            try:
                seq = await log_.append(event, expected_last_seq=self.last_seq.get(key, 0))
            except eventlog.ConcurrencyConflict as err:
                observability.CONFLICTS.labels(service=self.name).inc()
                log.info("decision refused, re-deciding after catch-up", extra={"reason": str(err)})
                return False
            except eventlog.TRANSIENT_ERRORS as err:
                log.warning("append failed, will retry", extra={"type": event.type, "error": repr(err)})
                return False
        self.last_seq[key] = max(self.last_seq.get(key, 0), seq)
        self.own_high_water = max(self.own_high_water, seq)
        observability.DECISIONS.labels(service=self.name, type=event.type).inc()
        return True

    async def run(self) -> None:
        nc = await eventlog.connect(self.settings, f"gpusched-{self.name}")
        js = nc.jetstream()
        try:
            await eventlog.wait_for_streams(js)
            end = await self.rebuild(js)
            sub = await eventlog.durable_consumer(
                js, stream=eventlog.EVENTS_STREAM, durable=self.name, start_seq=end + 1
            )
            appender = eventlog.EventLog(js)
            log.info("consuming", extra={"durable": self.name})
            main = asyncio.create_task(self._main_loop(js, sub, appender))
            side = asyncio.create_task(self.side_loop(js, appender))
            done, _ = await asyncio.wait({main, side}, return_when=asyncio.FIRST_COMPLETED)
            # Either loop ending ends the service: stop() ends the main loop; a side loop that
            # fails takes the process down so that its supervisor restarts it.
            for task in (main, side):
                if task not in done:
                    task.cancel()
            for task in (main, side):
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        finally:
            await nc.close()

    async def _main_loop(self, js, sub, appender: eventlog.EventLog) -> None:
        while not self._stop.is_set():
            msgs = await eventlog.fetch(sub, self.settings.batch_size, self.settings.tick_s)
            with observability.BATCH_SECONDS.labels(service=self.name).time():
                for msg in msgs:
                    try:
                        self._apply(msg)
                    except (ValueError, ValidationError) as err:
                        await eventlog.dead_letter(js, self.name, msg, f"invalid event: {err}")
                observability.APPLIED_SEQUENCE.labels(service=self.name).set(self.applied_seq)
                if self.applied_seq >= self.own_high_water:
                    self._caught_up.set()
                    if await self.append_all(appender, self.core.decide(self.clock.now())):
                        self.core.decisions_refused()
                for msg in msgs:
                    await msg.ack()


def run_service(name: str, build_core, service_class: type[DecisionService] = DecisionService) -> None:
    """Entry point shared by the services: settings, observability, signals, loop."""
    settings = Settings.from_env()
    observability.setup(
        name,
        level=settings.log_level,
        fmt=settings.log_format,
        metrics_port=settings.metrics_port,
        otel_exporter=settings.otel_exporter,
        trace_dir=settings.trace_dir,
    )
    clock = ScaledClock(settings.time_scale, settings.clock_epoch)

    async def main() -> None:
        service = service_class(name, build_core(settings, clock), settings, clock)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop)
        await service.run()

    try:
        asyncio.run(main())
    finally:
        observability.shutdown()
