"""The event log layer against a real nats-server."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import nats
import pytest

from conftest import reset_log
from runtime import eventlog
from schemas import JobAdmitted, JobSpec, JobSubmitted, new_event

NOW = datetime(2026, 1, 1, tzinfo=UTC)
SPEC = JobSpec(kind="training", queue="q", team="team-a", image="img", gpus=1)


def submitted(job_id: str, key: str = "1") -> JobSubmitted:
    return new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=NOW, key=key,
                     spec=SPEC, submitter="u", intake_sequence=1)


def admitted(job_id: str, cause) -> JobAdmitted:
    return new_event(JobAdmitted, aggregate_id=job_id, producer="admission", occurred_at=NOW, key="d",
                     cause=cause, queue="q", priority=500, preemptible=True)


async def test_append_deduplicates_on_event_id(admin_js):
    log = eventlog.EventLog(admin_js)
    event = submitted("j1")
    first = await log.append(event)
    again = await log.append(event)
    assert again == first
    assert await eventlog.last_sequence(admin_js) == first


async def test_expected_last_subject_sequence_refuses_a_stale_writer(admin_js):
    log = eventlog.EventLog(admin_js)
    s = submitted("j1")
    seq = await log.append(s, expected_last_seq=0)
    # a second "first event" of the same job: the job is not new any more
    with pytest.raises(eventlog.ConcurrencyConflict):
        await log.append(submitted("j1", key="other"), expected_last_seq=0)
    # a writer that has seen the latest event wins; the scope is all of the job's subjects
    seq2 = await log.append(admitted("j1", s), expected_last_seq=seq)
    assert seq2 == seq + 1
    with pytest.raises(eventlog.ConcurrencyConflict):
        await log.append(new_event(JobAdmitted, aggregate_id="j1", producer="admission", occurred_at=NOW, key="x",
                                   queue="q", priority=1, preemptible=True), expected_last_seq=seq)
    # other jobs are unaffected
    await log.append(submitted("j2"), expected_last_seq=0)


async def test_durable_consumer_redelivers_until_acked(admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(submitted("j1"))
    sub = await eventlog.durable_consumer(admin_js, stream=eventlog.EVENTS_STREAM, durable="t1", ack_wait_s=1)
    [msg] = await eventlog.fetch(sub, 10, 2)
    await msg.nak()
    [again] = await eventlog.fetch(sub, 10, 2)
    assert again.metadata.sequence.stream == msg.metadata.sequence.stream
    assert again.metadata.num_delivered == 2
    await again.ack()
    await asyncio.sleep(0.1)
    assert await eventlog.fetch(sub, 10, 0.5) == []
    # binding again resumes after the acked message (durable position)
    await log.append(submitted("j2"))
    sub2 = await eventlog.durable_consumer(admin_js, stream=eventlog.EVENTS_STREAM, durable="t1")
    [nxt] = await eventlog.fetch(sub2, 10, 2)
    assert eventlog.parse_message(nxt).aggregate_id == "j2"


async def test_a_pull_consumer_hands_over_a_batch_waits_for_the_next_and_says_when_it_is_deleted(admin_js):
    """runtime.eventlog.PullConsumer: what is there in one batch, then a wait for the next message
    that ends when it comes (not at the timeout), [] after the timeout, and ConsumerLost when the
    durable is deleted under a waiting fetch (the loops bind it again)."""
    log = eventlog.EventLog(admin_js)
    for i in range(5):
        await log.append(submitted(f"p{i}"))
    sub = await eventlog.durable_consumer(admin_js, stream=eventlog.EVENTS_STREAM, durable="t3")
    first = await eventlog.fetch(sub, 3, 2)
    rest = await eventlog.fetch(sub, 10, 2)
    assert [m.metadata.sequence.stream for m in first + rest] == [1, 2, 3, 4, 5]
    for msg in first + rest:
        await msg.ack()

    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(eventlog.fetch(sub, 10, 5))
    await asyncio.sleep(0.3)
    started = loop.time()
    await log.append(submitted("p5"))
    [late] = await waiting
    assert late.metadata.sequence.stream == 6 and loop.time() - started < 2
    await late.ack()
    started = loop.time()
    assert await eventlog.fetch(sub, 10, 0.5) == [] and 0.4 < loop.time() - started < 1.5

    waiting = asyncio.create_task(eventlog.fetch(sub, 10, 5))
    await asyncio.sleep(0.3)
    await admin_js.delete_consumer(eventlog.EVENTS_STREAM, "t3")
    with pytest.raises(eventlog.ConsumerLost):
        await asyncio.wait_for(waiting, 2)
    await sub.unsubscribe()


async def test_a_following_read_whose_deliveries_never_came_reads_again_from_its_position(admin_js, monkeypatch):
    """Deliveries that never reach the reader (lost on the way, or taken already and resent by a
    consumer that a restarted JetStream cluster brought back at its first sequence) stay
    unacknowledged until ack_wait, 300 s: a following read that received nothing for
    CHECK_IDLE_S while its consumer holds them raises ConsumerLost, so its caller reads again
    from its own position (the chaos run on a cluster saw accounting's projection stall for good)."""
    log = eventlog.EventLog(admin_js)
    for i in range(3):
        await log.append(submitted(f"lost-{i}"))

    async def lost_on_the_way(self, msg) -> None:
        pass

    monkeypatch.setattr(eventlog._PushReader, "take", lost_on_the_way)
    loop = asyncio.get_running_loop()
    started = loop.time()
    batches = eventlog.read_batches(admin_js, follow=True, idle_s=0.5)
    with pytest.raises(eventlog.ConsumerLost, match="has not taken"):
        async for msgs in batches:
            assert msgs == [] and loop.time() - started < eventlog.CHECK_IDLE_S + 5
    assert loop.time() - started >= eventlog.CHECK_IDLE_S


async def test_dead_letter_keeps_reason_and_original_bytes(admin_js):
    await admin_js.publish("gpusched.job.j9.submitted", b"\x00not json")
    sub = await eventlog.durable_consumer(admin_js, stream=eventlog.EVENTS_STREAM, durable="t2")
    [msg] = await eventlog.fetch(sub, 10, 2)
    with pytest.raises(ValueError):
        eventlog.parse_message(msg)
    await eventlog.dead_letter(admin_js, "tester", msg, "invalid event: not JSON")
    await eventlog.dead_letter(admin_js, "tester", msg, "invalid event: not JSON")  # redelivered: one record
    records = [m async for m in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM)]
    assert len(records) == 1
    rec = records[0]
    assert rec.subject == "gpusched.deadletter.tester"
    assert rec.data == b"\x00not json"
    assert rec.headers["Gpusched-Reason"] == "invalid event: not JSON"
    assert rec.headers["Gpusched-Original-Subject"] == "gpusched.job.j9.submitted"
    assert rec.headers["Gpusched-Original-Sequence"] == str(msg.metadata.sequence.stream)


async def test_replay_from_sequence_and_time(admin_js):
    log = eventlog.EventLog(admin_js)
    for i in range(5):
        await log.append(submitted(f"j{i}"))
    all_seqs = [m.metadata.sequence.stream async for m in eventlog.read(admin_js)]
    assert all_seqs == [1, 2, 3, 4, 5]
    assert [m.metadata.sequence.stream async for m in eventlog.read(admin_js, from_seq=4)] == [4, 5]
    assert [m.metadata.sequence.stream async for m in eventlog.read(admin_js, from_seq=2, to_seq=3)] == [2, 3]
    only_j3 = [m.subject async for m in eventlog.read(admin_js, subjects=["gpusched.job.j3.>"])]
    assert only_j3 == ["gpusched.job.j3.submitted"]
    future = datetime.now(UTC) + timedelta(hours=1)
    assert [m async for m in eventlog.read(admin_js, from_time=future)] == []
    past = datetime.now(UTC) - timedelta(hours=1)
    assert len([m async for m in eventlog.read(admin_js, from_time=past)]) == 5


async def _append(js, n: int, prefix: str = "r") -> list[int]:
    log = eventlog.EventLog(js)
    return [await log.append(submitted(f"{prefix}{i}")) for i in range(n)]


def _seqs(batches) -> list[list[int]]:
    return [[eventlog.sequence(m) for m in b] for b in batches]


async def test_read_batches_of_a_range_come_whole_in_order_and_stop_at_its_end(admin_js):
    """A bounded read hands over lists of exactly ``batch`` messages (the last one less), never
    a message past ``to_seq``, and the server is asked for no more than the range (its window
    is the range) — with a window smaller than the range, acknowledged as it goes."""
    await _append(admin_js, 30)
    got = [b async for b in eventlog.read_batches(admin_js, from_seq=3, to_seq=24, batch=5)]
    assert _seqs(got) == [list(range(k, min(k + 5, 25))) for k in range(3, 25, 5)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eventlog, "READ_WINDOW", 4)  # the server holds back until the reader acknowledges
        got = [b async for b in eventlog.read_batches(admin_js, from_seq=1, to_seq=30, batch=3)]
    assert [s for b in _seqs(got) for s in b] == list(range(1, 31))
    info = await admin_js.stream_info(eventlog.EVENTS_STREAM)
    assert info.state.consumer_count == 0  # each read's consumer is deleted when it ends


async def test_read_batches_skip_deleted_sequences_and_a_deleted_end(admin_js):
    await reset_log(admin_js, immutable=False)  # the platform's streams refuse message deletes
    await _append(admin_js, 10)
    for seq in (4, 10):
        await admin_js.delete_msg(eventlog.EVENTS_STREAM, seq)
    got = [s async for b in eventlog.read_batches(admin_js, from_seq=2, to_seq=10, batch=100) for s in _seqs([b])[0]]
    assert got == [2, 3, 5, 6, 7, 8, 9]
    assert [s async for b in eventlog.read_batches(admin_js, from_seq=10, to_seq=10) for s in _seqs([b])[0]] == []
    assert [b async for b in eventlog.read_batches(admin_js, from_seq=11)] == []  # past the end
    assert await eventlog.first_sequence_at(admin_js, datetime.now(UTC) - timedelta(hours=1)) == 1
    assert await eventlog.first_sequence_at(admin_js, datetime.now(UTC) + timedelta(hours=1)) is None


async def test_a_following_read_hands_over_new_messages_and_ticks_when_idle(admin_js):
    """follow=True: what is there, then what is appended later, then an empty list per idle
    period; it never ends by itself."""
    await _append(admin_js, 3)
    batches = eventlog.read_batches(admin_js, from_seq=2, follow=True, batch=10, idle_s=0.2)
    try:
        first = await anext(batches)
        assert _seqs([first]) == [[2, 3]]
        assert await anext(batches) == []  # nothing new within idle_s
        await _append(admin_js, 2, prefix="late")
        later: list[int] = []
        while len(later) < 2:
            later += _seqs([await anext(batches)])[0]
        assert later == [4, 5]
    finally:
        await batches.aclose()


async def test_a_following_read_whose_consumer_vanishes_says_so(admin_js, monkeypatch):
    """A server restart loses the reader's (in-memory) consumer: the reader raises a transient
    error, so that its caller starts again from its own position."""
    monkeypatch.setattr(eventlog, "CHECK_IDLE_S", 0.3)
    await _append(admin_js, 1)
    batches = eventlog.read_batches(admin_js, follow=True, idle_s=0.1)
    try:
        assert _seqs([await anext(batches)]) == [[1]]
        for name in [c.name for c in await admin_js.consumers_info(eventlog.EVENTS_STREAM)]:
            await admin_js.delete_consumer(eventlog.EVENTS_STREAM, name)
        with pytest.raises(eventlog.TRANSIENT_ERRORS):
            for _ in range(20):
                await anext(batches)
    finally:
        await batches.aclose()


@pytest.mark.parametrize("raw", [True, False], ids=["raw-delivery-client", "plain-client"])
async def test_a_payload_read_gives_the_messages_sequences_and_payloads(admin_js, nats_server, raw, monkeypatch):
    """payloads=True: (sequence, payload) pairs, the same as the messages' — through a
    RawDeliveryClient (nats-py's per-message handling skipped) and a plain client alike, with a
    window smaller than the range (acknowledged as it goes)."""
    await _append(admin_js, 12)
    want = [(eventlog.sequence(m), m.data) async for m in eventlog.read(admin_js, from_seq=2, to_seq=11)]
    monkeypatch.setattr(eventlog, "READ_WINDOW", 3)
    nc = eventlog.RawDeliveryClient() if raw else nats.NATS()
    await nc.connect(nats_server.url(), user="admin", password=nats_server.creds.users["admin"], connect_timeout=5)
    try:
        got = [p async for b in eventlog.read_batches(nc.jetstream(), from_seq=2, to_seq=11, batch=2, client=nc,
                                                      payloads=True) for p in b]
    finally:
        await nc.close()
    assert got == want and len(got) == 10
    assert not raw or eventlog.RawDeliveryClient.RAW  # the nats-py this project pins keeps the override's hook
