"""The loop every decision service runs around its pure core.

1. rebuild: load the service's snapshot, if it has a usable one (runtime/snapshot.py), and fold
   the log after it (the whole log without one) into the core's state;
2. consume: a durable pull consumer delivers new events in stream order; poison messages go to
   the dead-letter subject; each valid event is folded in;
3. decide: once the state includes every event this service wrote itself, ask the core what
   follows and append it, each append conditional on the aggregate's last sequence;
4. ack the batch, after its consequences are in the log;
5. now and then, and on a clean stop, save a snapshot of the state.

With ``lease_ttl_s`` set, the service is single-active (runtime/lease.py): after the rebuild it
stands by, following the log, until it holds its lease, and only then consumes and decides. It
renews the lease every third of the ttl; a process that loses it stops deciding at once and exits
(non-zero: its supervisor starts it again, as a standby). A clean stop releases it.

A crash anywhere is safe: the next start rebuilds from the log, re-derives the same decisions with
the same event ids, and JetStream de-duplicates or the concurrency check refuses them.

Nothing a message holds stops the loop, and no failure ends the process:

* poison — an event that does not parse, or that ``evolve`` raises on — is dead-lettered with
  the reason and passed over (acked). ``evolve`` may have changed part of the state before it
  raised (the cores fold in place); it is deterministic, so a rebuild folds the same events in
  the same order, passes over the same event at the same point and reaches the same state:
  live and rebuilt states agree. A rebuild only skips it; the live path already dead-lettered it.
* ``decide`` raising is logged and counted (``gpusched_decide_failures_total``); the core is told
  its decisions were not recorded and the next cycle decides again.
* a broker that is away (any of :data:`eventlog.TRANSIENT_ERRORS`, or a JetStream API error)
  stops the batch; after a growing pause the loop reads what it missed from the log from its
  applied position (so nothing is skipped, whatever the durable consumer redelivers later),
  binds its durable consumer again and goes on. An unacknowledged message is redelivered a
  bounded number of times (:data:`eventlog.MAX_DELIVER`); the loop never naks, so a message
  reaches its last delivery only if processes died holding it, and the next process's rebuild
  has folded it (redeliveries at or below the applied position are acked unread).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from typing import Protocol

from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge

from runtime import eventlog, health, observability, snapshot
from runtime.lease import Lease
from runtime.clock import Clock, ScaledClock
from runtime.settings import Settings
from schemas.envelope import Event
from schemas.registry import event_subject, parse_event

log = logging.getLogger(__name__)

APPEND_WINDOW = 128  # appends in flight at once (different aggregates only)
STOP_GRACE_S = 3.0  # on stop(), how long the side loop may take to end its pass (a fetch waits 1 s)
LOG_EVERY_S = 30.0  # a failure that repeats every cycle is logged at most this often
END_CHECK_EVERY_S = 1.0  # an idle main loop compares the log's end with its position at most this often

DECIDE_FAILURES = Counter("gpusched_decide_failures_total",
                          "Decision cycles whose decide() raised; retried on the next cycle", ["service"])
ACTIVE = Gauge("gpusched_active", "1 while this process decides for its service (it holds the lease, or "
                                  "runs without one); 0 while it stands by", ["service"])


class LeaseLost(Exception):
    """This process no longer holds its service's lease: it must stop deciding."""


class Core(Protocol):
    """A pure decision core: no I/O, no wall clock."""

    def evolve(self, event: Event) -> None:
        """Fold one event from the log into the state. The only way state changes."""

    def decide(self, now: datetime) -> list[Event]:
        """Decisions that follow from the current state and are not yet in the log."""

    def decisions_refused(self) -> None:
        """Some decisions returned by ``decide`` were not recorded; they must be derived again."""


class SnapshotCore(Core, Protocol):
    """A core whose state can be saved and loaded (runtime/snapshot.py)."""

    def snapshot_state(self) -> object:
        """The folded state, picklable; what a fold of the same events would hold."""

    def restore_state(self, state: object) -> None:
        """Take a state from ``snapshot_state`` (of a core built the same way) as if it had been
        folded here; nothing decided before the snapshot counts as on its way to the log."""


def aggregate_key(event: Event) -> tuple[str, str]:
    return (type(event).aggregate, event.aggregate_id)


def subject_scope(subject: str) -> str:
    """The aggregate a subject belongs to (``gpusched.<aggregate>.<id>``): known for any message
    on the log, poison or not, so the concurrency check's sequence counts every message."""
    return subject.rsplit(".", 1)[0]


def failure(err: BaseException) -> str:
    """One line: the exception and where it was raised."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


class DecisionService:
    def __init__(self, name: str, core: Core, settings: Settings, clock: Clock | None = None) -> None:
        self.name = name  # metrics, dead letters, logs
        self.instance = name  # its durable consumer, lease and snapshot bucket (one per partition)
        self.core = core
        self.settings = settings
        self.clock = clock or ScaledClock(settings.time_scale, settings.clock_epoch, settings.clock_start)
        self.applied_seq = 0
        self.own_high_water = 0  # highest sequence this service appended
        self.last_seq: dict[str, int] = {}  # subject_scope -> newest sequence seen
        self.trace_ctx: dict[str, dict[str, str]] = {}
        self._stop = asyncio.Event()
        self._caught_up = asyncio.Event()
        self._logged_at: dict[str, float] = {}
        self.snapshots: snapshot.SnapshotStore | None = None
        self._snapshot_seq = 0  # the applied position the newest snapshot holds
        self._log_id: str | None = None  # the event stream's creation time, once known
        self._snapshot_at = time.monotonic()
        self.lease: Lease | None = None  # a single-active service's, once it is active
        self._end_checked = 0.0  # monotonic time the main loop last compared the log's end with its position
        self._consumed_counters: dict[str, Counter] = {}

    def stop(self) -> None:
        self._stop.set()
        self._caught_up.set()  # wait_caught_up returns: the main loop folds nothing more

    def passes_over(self, subject: str) -> bool:
        """Whether a message on ``subject`` surely changes nothing in the state, so that it need not
        be parsed (a partitioned service: another partition's job). Its position still counts."""
        return False

    def dead_letters(self, subject: str) -> bool:
        """Whether this process dead-letters poison on ``subject`` (a partitioned service: the
        partition that would have folded it, so that it is dead-lettered once)."""
        return True

    def _fold(self, msg: Msg) -> str | None:
        """Fold one message from the log into the state. Returns why it is poison (it was passed
        over), or None (folded, passed over unread, or at or below the applied position: already in)."""
        seq = eventlog.sequence(msg)
        if seq <= self.applied_seq:
            return None
        if self.passes_over(msg.subject):
            self.applied_seq = seq
            self.last_seq[subject_scope(msg.subject)] = seq
            return None
        try:
            event = parse_event(msg.data)
        except Exception as err:  # ValueError, ValidationError, or whatever odd input provokes
            reason = f"invalid event: {err}"
        else:
            try:
                self.core.evolve(event)
                reason = None
            except Exception as err:
                reason = f"{self.name} cannot fold this event in (evolve raised {failure(err)})"
        self.applied_seq = seq
        self.last_seq[subject_scope(msg.subject)] = seq
        if reason is None:
            self._remember_trace(event, msg)
            self._consumed(event.type).inc()
        return reason

    def _consumed(self, type_: str):
        """This service's consumed-events counter of one event type (looked up once per type: the
        lookup costs more than the count, on every event)."""
        counter = self._consumed_counters.get(type_)
        if counter is None:
            counter = self._consumed_counters[type_] = observability.EVENTS_CONSUMED.labels(service=self.name,
                                                                                            type=type_)
        return counter

    def _remember_trace(self, event: Event, msg: Msg) -> None:
        if type(event).aggregate == "job":
            ctx = observability.trace_headers(msg.headers)
            if ctx:
                self.trace_ctx[event.aggregate_id] = ctx

    async def rebuild(self, js) -> int:
        """Fold the log from the applied position to its current end; returns the end. At start
        this is the whole log; after a broker outage, what the live feed may have missed. Poison
        is passed over as the live path passes it over (which dead-letters it)."""
        end = await eventlog.last_sequence(js)
        count = 0
        async for msgs in eventlog.read_batches(js, from_seq=self.applied_seq + 1, to_seq=end):
            for msg in msgs:
                reason = self._fold(msg)
                if reason is not None:
                    log.warning("passed over a poison event", extra={"sequence": eventlog.sequence(msg),
                                                                     "reason": reason[:500]})
            count += len(msgs)
        self._read_to(end)
        (log.info if count else log.debug)("folded the log in", extra={"events": count, "last_sequence": end})
        return end

    def _read_to(self, end: int) -> None:
        """After a read of the log up to ``end``: every message up to it was folded (the event
        stream's sequences have no gaps), or the read ended early and the position stays where
        the read got to. Taking ``end`` as read anyway would leave events out of the state for
        good (a scheduler then preempting a job that had ended, again and again)."""
        if self.applied_seq < end:
            raise eventlog.ReadEndedEarly(f"the read of the log ended at sequence {self.applied_seq}, before {end}")

    async def wait_caught_up(self) -> None:
        """Until the state includes every event this service appended, or the service is stopped."""
        while self.applied_seq < self.own_high_water and not self._stop.is_set():
            self._caught_up.clear()
            await self._caught_up.wait()

    async def wait_applied(self, seq: int, timeout_s: float) -> None:
        """Until the state includes the log up to ``seq``, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while self.applied_seq < seq and time.monotonic() < deadline and not self._stop.is_set():
            await asyncio.sleep(0.02)

    async def side_loop(self, js, appender: eventlog.EventLog) -> None:
        """A second input some services have (admission's intake). Runs beside the main loop;
        returning ends the service, so the default waits for stop()."""
        await self._stop.wait()

    def basis(self, events: Iterable[Event]) -> dict[str, int]:
        """The last sequence of each aggregate of ``events`` as the state holds it now: what
        decisions taken now are conditional on (:meth:`append_all`)."""
        return {scope: self.last_seq.get(scope, 0) for scope in {subject_scope(event_subject(e)) for e in events}}

    async def append_all(self, log_: eventlog.EventLog, events: Iterable[Event],
                         basis: dict[str, int] | None = None) -> set[tuple[str, str]]:
        """Append decisions; returns the aggregates whose decisions were refused (concurrency
        conflict) or failed transiently. Those are re-derived on a later cycle.

        One aggregate's events are appended in order, the first conditional on the aggregate's
        last sequence in ``basis`` (:meth:`basis` when the decisions were taken; default: now),
        each later one on the one before; different aggregates are independent, so their appends
        are pipelined. A decision taken beside the main loop (admission's intake) must give its
        basis: the main loop may fold an event of the aggregate between the decision and its
        append, and a condition read then would let a decision on the older state through."""
        groups: dict[tuple[str, str], list[Event]] = {}
        for event in events:
            groups.setdefault(aggregate_key(event), []).append(event)
        if basis is None:
            basis = self.basis(e for group in groups.values() for e in group)
        refused: set[tuple[str, str]] = set()
        todo = iter(groups.items())

        async def appender() -> None:  # APPEND_WINDOW of these take the groups in turn
            for key, group in todo:
                last: int | None = basis[subject_scope(event_subject(group[0]))]
                for event in group:
                    if (last := await self._append_one(log_, event, last)) is None:
                        refused.add(key)  # the rest of the group assumed this one
                        break

        await asyncio.gather(*(appender() for _ in range(min(APPEND_WINDOW, len(groups)))))
        return refused

    async def _append_one(self, log_: eventlog.EventLog, event: Event, expected_last_seq: int) -> int | None:
        """Append one decision if its aggregate's last sequence is still ``expected_last_seq``;
        its sequence, or None (refused, or not appended)."""
        # The decision is a span in the job's trace (continued from the job's latest event); the
        # append carries this span's context on to whoever consumes the event. When nothing
        # exports spans, the append carries the job's trace context on as it came.
        job = type(event).aggregate == "job"
        parent = self.trace_ctx.get(event.aggregate_id) if job else None
        scope = subject_scope(event_subject(event))
        if self.lease is not None and not self.lease.current():
            return None  # paused past the lease, or it is being lost: decided again once renewed
        with observability.span_if_recording(f"{self.name} {event.type}", parent, job=event.aggregate_id):
            try:
                seq = await log_.append(event, expected_last_seq=expected_last_seq,
                                        headers=None if observability.recording() else parent)
            except eventlog.ConcurrencyConflict as err:
                observability.CONFLICTS.labels(service=self.name).inc()
                log.info("decision refused, re-deciding after catch-up", extra={"reason": str(err)})
                return None
            except Exception as err:  # the broker away or refusing: derived again next cycle
                self._log_throttled(f"append {event.type}", "append failed, will retry",
                                    type=event.type, error=failure(err))
                return None
        self.last_seq[scope] = max(self.last_seq.get(scope, 0), seq)
        self.own_high_water = max(self.own_high_water, seq)
        observability.DECISIONS.labels(service=self.name, type=event.type).inc()
        return seq

    async def run(self) -> None:
        health.HEALTH.waiting_for("rebuild")  # ready once the state has caught up with the log
        nc = await eventlog.connect(self.settings, f"gpusched-{self.name}")
        js = nc.jetstream()
        try:
            await eventlog.wait_for_streams(js)
            if self.settings.snapshot_every and hasattr(self.core, "snapshot_state"):
                self.snapshots = snapshot.SnapshotStore(js, self.instance, self.settings.stream_replicas)
                await self._restore(js)
            if not await self._retrying("rebuild", lambda: self.rebuild(js)):
                return
            health.HEALTH.done("rebuild")
            lease = None
            if self.settings.lease_ttl_s > 0:
                lease = Lease(js, self.instance, self.settings.lease_ttl_s, replicas=self.settings.stream_replicas)
                if not await self._retrying("stand by", lambda: self._stand_by(js, lease)) or not lease.held:
                    return  # stopped while standing by
            ACTIVE.labels(service=self.name).set(1)
            self.lease = lease
            if lease is not None:
                health.HEALTH.role = "active"
            appender = eventlog.EventLog(js)
            log.info("consuming", extra={"durable": self.instance})
            tasks = [asyncio.create_task(self._main_loop(js, appender)),
                     asyncio.create_task(self._retrying("side loop", lambda: self.side_loop(js, appender)))]
            if lease is not None:
                tasks.append(asyncio.create_task(self._keep(lease)))
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if self._stop.is_set():
                # A clean stop lets the side loop end its pass rather than cancel it: cancelled in
                # a fetch, it would leave its pull request on the broker, which can hand the next
                # intake command to this closing connection (redelivered only after ack_wait).
                done, _ = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
            # Any task ending ends the service: stop() ends the main loop; a side loop that fails
            # for anything but the broker, or a lost lease, takes the process down (its
            # supervisor restarts it).
            for task in tasks:
                if task not in done:
                    task.cancel()
            for task in tasks:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
            ACTIVE.labels(service=self.name).set(0)
            if lease is not None and not lease.held and not self._stop.is_set():
                # lost, and a loop saw it before _keep's LeaseLost was awaited here
                raise LeaseLost(f"{self.name}: the lease was lost")
            if self._stop.is_set():
                await self._save_snapshot()
                if lease is not None:
                    await lease.release()
        finally:
            await eventlog.close(nc)

    async def _stand_by(self, js, lease: Lease) -> None:
        """Follow the log until this process holds the lease (or is stopped: ``lease.held`` says)."""
        ACTIVE.labels(service=self.name).set(0)
        health.HEALTH.role = "standby"
        waited = time.monotonic()
        while not self._stop.is_set():
            if await asyncio.wait_for(lease.try_acquire(), timeout=lease.ttl_s / 3):
                log.info("active: took the lease", extra={"holder": lease.holder, "applied_seq": self.applied_seq,
                                                          "stood_by_s": round(time.monotonic() - waited, 3)})
                return
            await self.rebuild(js)  # the state stays warm: a takeover folds only the last moments
            health.HEALTH.jetstream = True
            await self._pause(lease.ttl_s / 3)

    async def _keep(self, lease: Lease) -> None:
        """Renew the lease every third of its ttl, each try bounded by a quarter of it; raise
        LeaseLost when it is gone (another process wrote it), or when a renewal failed and the
        next one could not land before the key may age out: no sooner than the ttl after the
        start of the last renewal that got through. So this process stops deciding before any
        other can take the lease."""
        ttl = lease.ttl_s
        while not self._stop.is_set():
            await self._pause(ttl / 3)
            try:
                if not await asyncio.wait_for(lease.renew(), timeout=ttl / 4):
                    lease.lose()
                    raise LeaseLost(f"{self.name}: another process holds the lease now")
            except (asyncio.TimeoutError, *eventlog.BROKER_ERRORS) as err:
                # lease.since: the start of the last write of it known to have got through
                if time.monotonic() + ttl / 3 + ttl / 4 >= lease.since + ttl:
                    lease.lose()
                    raise LeaseLost(f"{self.name}: the lease could not be renewed before it may age out "
                                    f"({ttl:g} s ttl; {err!r})") from err

    async def _restore(self, js) -> None:
        """Start from the saved snapshot when there is a usable one. Never fails the start: the
        log is whole, so without a snapshot the rebuild folds all of it."""
        assert self.snapshots is not None
        started = time.perf_counter()
        try:
            info = await js.stream_info(eventlog.EVENTS_STREAM)
            self._log_id = str(info.created)
            saved = await self.snapshots.load(snapshot.code_version(self.core), self._log_id, info.state.last_seq)
            if saved is None:
                return
            self.core.restore_state(saved.state)  # type: ignore[attr-defined]
        except Exception as err:
            log.warning("snapshot not loaded: folding the whole log", extra={"error": failure(err)})
            return
        self.applied_seq = self._snapshot_seq = saved.applied_seq
        self.last_seq = saved.last_seq
        log.info("state loaded from a snapshot", extra={"applied_seq": saved.applied_seq,
                                                        "seconds": round(time.perf_counter() - started, 3)})

    async def _save_snapshot(self) -> None:
        """Save the state as of the applied position (unless the newest snapshot holds it). A
        failure is logged: the next snapshot, or the log, covers it."""
        if self.snapshots is None or self._log_id is None or self.applied_seq <= self._snapshot_seq:
            return
        started = time.perf_counter()
        saved = snapshot.Snapshot(snapshot.code_version(self.core), self._log_id, self.applied_seq, dict(self.last_seq),
                                  self.core.snapshot_state())  # type: ignore[attr-defined]
        try:
            size = await self.snapshots.save(saved)
        except Exception as err:
            self._log_throttled("snapshot", "snapshot not saved", error=failure(err))
            return
        self._snapshot_seq, self._snapshot_at = saved.applied_seq, time.monotonic()
        log.info("snapshot saved", extra={"applied_seq": saved.applied_seq, "bytes": size,
                                          "seconds": round(time.perf_counter() - started, 3)})

    def _snapshot_due(self) -> bool:
        return (self.snapshots is not None
                and self.applied_seq - self._snapshot_seq >= self.settings.snapshot_every
                and time.monotonic() - self._snapshot_at >= self.settings.snapshot_min_interval_s)

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[object]]) -> bool:
        """Run ``attempt`` until it gets through the broker, pausing longer after each failure;
        False when the service was stopped first."""
        failures = 0
        while not self._stop.is_set():
            try:
                await attempt()
                return True
            except eventlog.BROKER_ERRORS as err:
                failures += 1
                health.HEALTH.jetstream = False
                log.warning(f"{what}: NATS unavailable, retrying", extra={"error": repr(err), "failures": failures})
                await self._pause(eventlog.retry_delay(failures))
        return False

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    async def _subscribe(self, js):
        """Read what the log holds past the applied position, then bind the durable consumer
        (created at the next sequence if it does not exist)."""
        await self.rebuild(js)
        return await eventlog.durable_consumer(js, stream=eventlog.EVENTS_STREAM, durable=self.instance,
                                               start_seq=self.applied_seq + 1)

    async def _main_loop(self, js, appender: eventlog.EventLog) -> None:
        sub = None
        failures = 0
        while not self._stop.is_set():
            if not await self._lease_current():
                return  # lost: run() ends the process (_keep raised LeaseLost)
            try:
                if sub is None:
                    sub = await self._subscribe(js)
                msgs = await eventlog.fetch(sub, self.settings.batch_size, self.settings.tick_s)
                health.HEALTH.jetstream = True
                if not msgs and time.monotonic() >= self._end_checked + END_CHECK_EVERY_S:
                    # Idle: the log's last messages may have gone to another process (_handle_batch)
                    self._end_checked = time.monotonic()
                    end = await eventlog.last_sequence(js)
                    if end > self.applied_seq and not await self._read_missed(js, end):
                        continue  # stopped
                await self._handle_batch(js, appender, msgs)
                failures = 0
                if self._snapshot_due():
                    await self._save_snapshot()
            except eventlog.BROKER_ERRORS as err:
                # The batch stopped part way: its unacked rest comes again (skipped if folded),
                # and the next _subscribe reads whatever was not folded from the log.
                failures += 1
                health.HEALTH.jetstream = False
                log.warning("NATS unavailable; catching up from the log when it is back",
                            extra={"error": repr(err), "failures": failures})
                sub = await _unsubscribe(sub)
                await self._pause(eventlog.retry_delay(failures))

    async def _lease_current(self) -> bool:
        """Wait while the lease is held but not current (this process was paused, or a renewal is
        late); False once it is lost, or when stopped. Without a lease: True unless stopped."""
        while self.lease is not None and self.lease.held and not self.lease.current() and not self._stop.is_set():
            await self._pause(0.05)
        return (self.lease is None or self.lease.held) and not self._stop.is_set()

    async def _fold_live(self, js, msg: Msg) -> bool:
        """Fold one message of the live feed, dead-lettering it when it is poison (here: see
        :meth:`dead_letters`). False when stopped before the dead letter went out (the message
        stays unacked, so the next process sees it again)."""
        reason = self._fold(msg)
        return reason is None or not self.dead_letters(msg.subject) or await self._retrying(
            "dead letter", lambda: eventlog.dead_letter(js, self.name, msg, reason))

    async def _read_missed(self, js, end: int) -> bool:
        """Fold the log from the applied position to ``end`` as the live feed folds it: what the
        shared durable consumer delivered to another process (a deposed active that fetched
        after a pause). False when stopped part way."""
        log.info("reading from the log what the durable consumer delivered elsewhere",
                 extra={"from_seq": self.applied_seq + 1, "to_seq": end})
        async for msgs in eventlog.read_batches(js, from_seq=self.applied_seq + 1, to_seq=end):
            for msg in msgs:
                if not await self._fold_live(js, msg):
                    return False
        self._read_to(end)
        return True

    async def _handle_batch(self, js, appender: eventlog.EventLog, msgs: list[Msg]) -> None:
        with observability.BATCH_SECONDS.labels(service=self.name).time():
            for msg in msgs:
                # A gap before it: the durable consumer delivered the messages in between to
                # another process (which acked or dropped them); they come from the log, in order.
                gap = eventlog.sequence(msg) > self.applied_seq + 1
                if gap and not await self._read_missed(js, eventlog.sequence(msg) - 1):
                    return  # stopped: unacked, so the next process sees the batch again
                if not await self._fold_live(js, msg):
                    return
            observability.APPLIED_SEQUENCE.labels(service=self.name).set(self.applied_seq)
            if self.applied_seq >= self.own_high_water:
                self._caught_up.set()
                if await self.append_all(appender, self._decide()):
                    self.core.decisions_refused()
            for msg in msgs:
                await msg.ack()

    def _decide(self) -> list[Event]:
        """The core's decisions; none this cycle when it raises (counted, logged, tried again)."""
        try:
            return self.core.decide(self.clock.now())
        except Exception as err:
            DECIDE_FAILURES.labels(service=self.name).inc()
            self._log_throttled("decide", "decide failed; deciding again next cycle", error=failure(err))
            self.core.decisions_refused()
            return []

    def _log_throttled(self, key: str, message: str, **extra) -> None:
        """Log a failure that may repeat every cycle at most every LOG_EVERY_S per key."""
        now = time.monotonic()
        if now - self._logged_at.get(key, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged_at[key] = now
            log.error(message, extra=extra)


async def _unsubscribe(sub) -> None:
    """Drop a subscription the broker may already have forgotten; returns None (no subscription)."""
    if sub is not None:
        try:
            await sub.unsubscribe()
        except Exception:  # the connection is away: the client forgets it anyway
            pass
    return None


def run_service(name: str, build_core, service_class: type[DecisionService] = DecisionService) -> None:
    """Entry point shared by the services: settings, observability, signals, loop."""
    settings = Settings.from_env()
    observability.setup(
        name,
        level=settings.log_level,
        fmt=settings.log_format,
        metrics_port=settings.metrics_port, metrics_addr=settings.metrics_addr,
        otel_exporter=settings.otel_exporter,
        trace_dir=settings.trace_dir,
    )
    clock = ScaledClock(settings.time_scale, settings.clock_epoch, settings.clock_start)

    async def main() -> None:
        service = service_class(name, build_core(settings, clock), settings, clock)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop)
        await service.run()

    try:
        asyncio.run(main())
    except LeaseLost as err:
        log.error("lease lost; exiting so that this process starts again as a standby", extra={"error": str(err)})
        raise SystemExit(3) from err
    finally:
        observability.shutdown()
