"""Nothing a message holds stops a decision loop (issue 21): a real nats-server, the real quota
core with a fault put in on purpose. An event the core cannot fold in is dead-lettered and passed
over, live and at rebuild alike; a decide() that raises is retried on the next cycle; the
process goes on; durable consumers redeliver a bounded number of times."""

from __future__ import annotations

import asyncio
from datetime import datetime

from conftest import eventually, running, service_settings
from runtime import eventlog, loop
from runtime.loop import DecisionService
from schemas import Event, parse_event
from services.quota.domain import QuotaCore
from tests.unit.builders import admitted, queue, submitted

DLQ = "gpusched.deadletter.quota"


class FaultyCore(QuotaCore):
    """The quota core, except that evolve raises on any event of job ``bad`` and decide raises
    its first ``decide_failures`` times."""

    def __init__(self, decide_failures: int = 0) -> None:
        super().__init__()
        self.decide_failures = decide_failures
        self.folded: list[str] = []

    def evolve(self, event: Event) -> None:
        if event.aggregate_id == "bad":
            raise KeyError("no such thing")
        super().evolve(event)
        self.folded.append(event.event_id)

    def decide(self, now: datetime) -> list[Event]:
        if self.decide_failures > 0:
            self.decide_failures -= 1
            raise ZeroDivisionError("a bug in decide")
        return super().decide(now)


def quota(nats_server, core: QuotaCore) -> DecisionService:
    # no snapshots: a restart here is a rebuild from the whole log, the path under test
    return DecisionService("quota", core, service_settings(nats_server, "quota", snapshot_every=0))


async def job(log: eventlog.EventLog, job_id: str) -> None:
    await log.append(submitted(job_id))
    await log.append(admitted(job_id))


async def reserved(js, job_id: str) -> bool:
    return bool([m async for m in eventlog.read(js, subjects=[f"gpusched.job.{job_id}.quota_reserved"])])


async def dead_letters(js) -> list:
    return [m async for m in eventlog.read(js, stream=eventlog.DLQ_STREAM, subjects=[DLQ])]


async def test_an_event_evolve_raises_on_is_dead_lettered_and_the_loop_goes_on(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(queue())
    core = FaultyCore()
    async with running(quota(nats_server, core)) as service:
        await eventually(lambda: service.applied_seq >= 1)
        await job(log, "bad")
        await job(log, "good")
        await eventually(lambda: reserved(admin_js, "good"))
        dead = await eventually(lambda: dead_letters(admin_js))
    assert [m.headers["Gpusched-Original-Subject"] for m in dead] == ["gpusched.job.bad.submitted",
                                                                      "gpusched.job.bad.admitted"]
    assert "evolve raised KeyError" in dead[0].headers["Gpusched-Reason"]
    assert not await reserved(admin_js, "bad")

    # A rebuild passes over the same events: the same state, and nothing dead-lettered again.
    again = FaultyCore()
    async with running(quota(nats_server, again)) as rebuilt:
        await eventually(lambda: rebuilt.applied_seq >= service.applied_seq)
    assert again.folded == core.folded
    assert len(await dead_letters(admin_js)) == 2


async def test_poison_after_a_jobs_last_event_does_not_block_its_decisions(nats_server, admin_js):
    """A poison message on a job's subjects counts for the job's concurrency check: the next
    decision about the job is appended against it, not refused for ever."""
    log = eventlog.EventLog(admin_js)
    await log.append(queue())
    await job(log, "j1")
    await admin_js.publish("gpusched.job.j1.admitted", b"{not json")
    async with running(quota(nats_server, FaultyCore())):
        await eventually(lambda: reserved(admin_js, "j1"))


async def test_poison_live_is_dead_lettered_with_its_reason(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(queue())
    async with running(quota(nats_server, FaultyCore())) as service:
        await eventually(lambda: service.applied_seq >= 1)
        await admin_js.publish("gpusched.job.j2.submitted", b"{not json")
        await job(log, "j3")
        await eventually(lambda: reserved(admin_js, "j3"))
        [dead] = await eventually(lambda: dead_letters(admin_js))
    assert dead.headers["Gpusched-Reason"].startswith("invalid event")
    assert dead.data == b"{not json"


async def test_decide_raising_is_retried_next_cycle_and_counted(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(queue())
    before = loop.DECIDE_FAILURES.labels(service="quota")._value.get()
    service = quota(nats_server, FaultyCore(decide_failures=5))
    async with running(service):
        await job(log, "j4")
        await eventually(lambda: reserved(admin_js, "j4"))
        assert not service._stop.is_set()
    assert loop.DECIDE_FAILURES.labels(service="quota")._value.get() - before == 5


async def test_durable_consumers_redeliver_a_bounded_number_of_times(admin_js):
    await eventlog.durable_consumer(admin_js, stream=eventlog.EVENTS_STREAM, durable="bounded", ack_wait_s=2)
    info = await admin_js.consumer_info(eventlog.EVENTS_STREAM, "bounded")
    assert info.config.max_deliver == eventlog.MAX_DELIVER
    assert info.config.backoff == [2, 4, 8, 16, 32]


async def test_a_durable_made_without_limits_is_given_them(admin_js):
    from nats.js.api import AckPolicy, ConsumerConfig

    await admin_js.add_consumer(eventlog.EVENTS_STREAM, ConsumerConfig(
        durable_name="old", ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=-1))
    await eventlog.durable_consumer(admin_js, stream=eventlog.EVENTS_STREAM, durable="old")
    info = await admin_js.consumer_info(eventlog.EVENTS_STREAM, "old")
    assert info.config.max_deliver == eventlog.MAX_DELIVER
    assert info.config.backoff[0] == 30


async def test_the_last_delivery_is_known(admin_js):
    await admin_js.publish("gpusched.job.j5.submitted", b"x")
    sub = await eventlog.durable_consumer(admin_js, stream=eventlog.EVENTS_STREAM, durable="naks", ack_wait_s=0.5)
    for delivery in range(1, eventlog.MAX_DELIVER + 1):
        [msg] = await eventlog.fetch(sub, 1, 5)
        assert eventlog.last_delivery(msg) == (delivery == eventlog.MAX_DELIVER)
        await msg.nak()
    assert await eventlog.fetch(sub, 1, 1) == []  # the server gave up on it


async def test_what_the_durable_consumer_delivers_to_another_process_is_read_from_the_log(nats_server, admin_js):
    """Two clients of one durable consumer: a deposed active that fetched after its pause, and
    acked (or will drop) what it got, beside the new active. The active reads from the log every
    message it did not get, in order, before the next one it gets (runtime/loop.py,
    _handle_batch): every job is decided, and every event folded once."""
    log = eventlog.EventLog(admin_js)
    await log.append(queue(quotas={"a100": 30}))
    core = FaultyCore()
    service = quota(nats_server, core)
    taken: list[int] = []
    async with running(service):
        await eventually(lambda: service.applied_seq >= 1)
        other = await admin_js.pull_subscribe_bind(durable="quota", stream=eventlog.EVENTS_STREAM)

        async def deposed() -> None:
            while True:
                for msg in await eventlog.fetch(other, 1, 0.05):
                    taken.append(eventlog.sequence(msg))
                    await msg.ack()

        thief = asyncio.create_task(deposed())
        try:
            for i in range(30):
                await job(log, f"k{i}")
            await eventually(lambda: _all_reserved(admin_js, 30), timeout_s=30)
        finally:
            thief.cancel()
        end = await eventlog.last_sequence(admin_js)
        await eventually(lambda: service.applied_seq >= end)
    assert taken, "the other client got nothing: the test did not exercise the path"
    folded = [m async for m in eventlog.read(admin_js)]
    assert sorted(core.folded) == sorted(parse_event(m.data).event_id for m in folded)


async def _all_reserved(js, count: int) -> bool:
    return all([await reserved(js, f"k{i}") for i in range(count)])


async def test_a_read_of_the_log_that_ends_early_is_read_again_not_taken_as_whole(nats_server, admin_js, monkeypatch):
    """A cluster changing leaders can end a read of the log before the sequence it was to reach,
    without an error (the cluster chaos run saw a scheduler skip a job's JobSucceeded this way and
    preempt the ended job for ever). The fault is put in here: the first read stops after two
    messages. The rebuild raises ReadEndedEarly with the position where the read got to, and the
    next rebuild folds the rest."""
    log = eventlog.EventLog(admin_js)
    await log.append(queue())
    for k in range(3):
        await job(log, f"early-{k}")
    end = await eventlog.last_sequence(admin_js)
    real = eventlog.read_batches

    async def ends_early(js, **kwargs):
        async for msgs in real(js, **kwargs):
            yield msgs[:2]
            return
    core = FaultyCore()
    service = quota(nats_server, core)
    js = admin_js
    monkeypatch.setattr(eventlog, "read_batches", ends_early)
    try:
        await service.rebuild(js)
    except eventlog.ReadEndedEarly as err:
        assert f"ended at sequence 2, before {end}" in str(err)
    else:
        raise AssertionError("a read that ended early was taken as the whole log")
    assert service.applied_seq == 2 and len(core.folded) == 2
    monkeypatch.setattr(eventlog, "read_batches", real)
    assert await service.rebuild(js) == end
    assert service.applied_seq == end and len(core.folded) == end
