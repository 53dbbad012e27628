"""Snapshots through a real nats-server, with the service's own credential: a clean stop saves the
state in the service's Object Store bucket, the next start loads it and folds only the tail, and
decides on from there as a start without it would. A snapshot from other code or another log is
ignored (the whole log is folded)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from conftest import connect_as, eventually, reset_log, service_settings
from runtime import eventlog, snapshot
from runtime.loop import DecisionService
from services.quota.domain import QuotaCore
from tests.unit.builders import admitted, queue, submitted
from tests.unit.test_snapshots import canonical, through_snapshot


class CountingCore(QuotaCore):
    """Quota, counting the events it folds."""

    def __init__(self) -> None:
        super().__init__()
        self.folded = 0

    def evolve(self, event) -> None:
        self.folded += 1
        super().evolve(event)


@pytest.fixture
async def fresh_bucket(nats_server, admin_js):
    """No snapshot left by an earlier test."""
    with contextlib.suppress(Exception):
        await admin_js.delete_object_store(snapshot.bucket("quota"))
    yield
    with contextlib.suppress(Exception):
        await admin_js.delete_object_store(snapshot.bucket("quota"))


async def run_until(js, service: DecisionService, done=None) -> None:
    """Start the service, wait for ``done()`` and for it to have folded the log (read with
    ``js``) to its end, stop it cleanly (which saves the snapshot)."""
    end = await eventlog.last_sequence(js)
    task = asyncio.create_task(service.run())
    try:
        await eventually(lambda: service.applied_seq >= end, timeout_s=20)
        if done is not None:
            await eventually(done, timeout_s=20)
    finally:
        service.stop()
        await asyncio.wait_for(task, 15)


async def reservations(js) -> dict[str, int]:
    out: dict[str, int] = {}
    async for m in eventlog.read(js, subjects=["gpusched.job.*.quota_reserved"]):
        job = m.subject.split(".")[2]
        out[job] = out.get(job, 0) + 1
    return out


async def full_fold(js) -> QuotaCore:
    core = QuotaCore()
    async for m in eventlog.read(js):
        core.evolve(eventlog.parse_message(m))
    return core


def service(nats_server, core) -> DecisionService:
    # snapshot_every high: the only snapshot is the one a clean stop saves
    return DecisionService("quota", core, service_settings(nats_server, "quota", snapshot_every=1_000_000))


async def test_a_restart_loads_the_snapshot_and_folds_only_the_tail(nats_server, admin_js, fresh_bucket, caplog):
    log = eventlog.EventLog(admin_js)
    await log.append(queue(quotas={"a100": 64}))
    for i in range(20):
        await log.append(submitted(f"j{i}", seq=i + 1))
        await log.append(admitted(f"j{i}"))
    first = CountingCore()
    await run_until(admin_js, service(nats_server, first), lambda: _count(admin_js, 20))
    saved_at = await eventlog.last_sequence(admin_js)
    assert first.folded == saved_at  # the first start had no snapshot: it folded everything

    for i in range(20, 25):  # the tail, written while quota was down
        await log.append(submitted(f"j{i}", seq=i + 1))
        await log.append(admitted(f"j{i}"))
    tail = await eventlog.last_sequence(admin_js) - saved_at
    second = CountingCore()
    with caplog.at_level(logging.INFO, logger="runtime.loop"):
        await run_until(admin_js, service(nats_server, second), lambda: _count(admin_js, 25))
    assert any(r.getMessage() == "state loaded from a snapshot" for r in caplog.records), [getattr(r, "error", "") for r in caplog.records]
    # it folded the tail and the five reservations it appended, nothing before the snapshot
    assert second.folded == tail + 5
    assert all(n == 1 for n in (await reservations(admin_js)).values())  # no decision taken twice
    # the state it ended with, less what its own cycles cached, is the whole log's
    assert canonical(through_snapshot(second, QuotaCore).state) == canonical((await full_fold(admin_js)).state)


async def test_a_snapshot_of_other_code_or_another_log_is_ignored(nats_server, admin_js, fresh_bucket, monkeypatch):
    log = eventlog.EventLog(admin_js)
    await log.append(queue(quotas={"a100": 64}))
    await log.append(submitted("j0"))
    await log.append(admitted("j0"))
    await run_until(admin_js, service(nats_server, QuotaCore()), lambda: _count(admin_js, 1))
    end = await eventlog.last_sequence(admin_js)

    monkeypatch.setattr(snapshot, "code_version", lambda core: "another-version")
    other_code = CountingCore()
    await run_until(admin_js, service(nats_server, other_code))
    assert other_code.folded == end  # the whole log
    monkeypatch.undo()

    # the same code, but the log provisioned again: the bucket's snapshot is of the old log
    await run_until(admin_js, service(nats_server, QuotaCore()))  # a snapshot of this code
    await reset_log(admin_js)
    await eventlog.EventLog(admin_js).append(queue(quotas={"a100": 64}))
    other_log = CountingCore()
    await run_until(admin_js, service(nats_server, other_log))
    assert other_log.folded == 1
    assert other_log.state.jobs == {}


async def test_another_service_cannot_read_or_write_the_snapshot(nats_server, admin_js, fresh_bucket):
    await run_until(admin_js, service(nats_server, QuotaCore()))
    await eventlog.EventLog(admin_js).append(queue())
    await run_until(admin_js, service(nats_server, QuotaCore()))  # saves one: the log moved
    assert await (await admin_js.object_store(snapshot.bucket("quota"))).get_info(snapshot.OBJECT)
    nc = await connect_as(nats_server, "scheduler")
    try:
        js = nc.jetstream()
        with pytest.raises(Exception):
            store = await js.object_store(snapshot.bucket("quota"))
            await store.get(snapshot.OBJECT)
    finally:
        await nc.close()


async def _count(js, n: int) -> bool:
    return len(await reservations(js)) >= n
