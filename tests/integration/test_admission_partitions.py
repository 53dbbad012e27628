"""Admission partitioned by team against a real nats-server, with the admission credential: two
partitions decide every team's jobs once between them, a job id two teams of different partitions
ask for at once goes to one (the other is answered duplicate-job-id), poison is dead-lettered
once, and a partition that starts after partition 0 misses none of its teams' commands."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from datetime import UTC, datetime

import pytest

from conftest import eventually, running, service_settings
from runtime import eventlog, lease, snapshot
from runtime.teams import partition_of
from schemas import NodeRegistered, QueueConfigured, new_event, parse_event
from schemas.node import NodeInfo
from schemas.queue import FlavorQuota
from services.admission.__main__ import AdmissionService, durable_names
from services.admission.domain import AdmissionCore, Partition
from tests.unit.builders import service_spec

NOW = datetime(2026, 1, 1, tzinfo=UTC)
TEAMS = ("team-a", "team-b", "team-c", "team-d")
P0 = [t for t in TEAMS if partition_of(t, 2) == 0]
P1 = [t for t in TEAMS if partition_of(t, 2) == 1]


def test_both_partitions_have_teams():
    assert P0 and P1


@pytest.fixture
async def configured(admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(new_event(QueueConfigured, aggregate_id="research", producer="config", occurred_at=NOW, key="1",
                               name="research", allowed_teams=TEAMS, quotas=(FlavorQuota(flavor="a100", nominal=8),)))
    await log.append(new_event(NodeRegistered, aggregate_id="n1", producer="executor", occurred_at=NOW, key="1",
                               node=NodeInfo(name="n1", gpu_flavor="a100", gpu_count=8, gpu_memory_mib=40960)))
    return admin_js


def partition(nats_server, k: int, count: int = 2, **settings) -> AdmissionService:
    return AdmissionService("admission", AdmissionCore(partition=Partition(count, k)),
                            service_settings(nats_server, "admission", **settings))


async def submit(js, team: str, job_id: str | None = None) -> int:
    body = {"spec": {"kind": "training", "queue": "research", "team": team, "image": "img", "gpus": 1}}
    if job_id:
        body["job_id"] = job_id
    return (await js.publish(f"gpusched.intake.{team}.submit", json.dumps(body).encode())).seq


async def events(js) -> list:
    return [parse_event(m.data) async for m in eventlog.read(js, subjects=["gpusched.job.>"])]


async def dead(js, name: str) -> list:
    return [m async for m in eventlog.read(js, stream=eventlog.DLQ_STREAM, subjects=[f"gpusched.deadletter.{name}"])]


async def test_two_partitions_decide_every_job_once(nats_server, configured):
    js = configured
    async with running(partition(nats_server, 0)) as p0, running(partition(nats_server, 1)) as p1:
        for i in range(10):
            for team in TEAMS:
                await submit(js, team)

        async def decided():
            log = await events(js)
            return len([e for e in log if e.type == "JobAdmitted"]) == 40 and log
        log = await eventually(decided, timeout_s=30)
        per_job = Counter((e.aggregate_id, e.type) for e in log)
        assert set(per_job.values()) == {1}  # one JobSubmitted and one JobAdmitted each
        assert {e.spec.team for e in log if e.type == "JobSubmitted"} == set(TEAMS)
        # each holds its own teams' jobs only
        assert {j.team for j in p0.core.state.jobs.values()} == set(P0)
        assert {j.team for j in p1.core.state.jobs.values()} == set(P1)

        # Two teams of different partitions ask for one job id at once: one gets it.
        await asyncio.gather(submit(js, P0[0], "shared-id"), submit(js, P1[0], "shared-id"))

        async def answered():
            log = await events(js)
            subs = [e for e in log if e.type == "JobSubmitted" and e.aggregate_id == "shared-id"]
            refused = [e for e in log if e.type == "JobRejected" and e.requested_job_id == "shared-id"]
            return (subs, refused) if subs and refused else None
        subs, refused = await eventually(answered, timeout_s=30)
        assert len(subs) == 1 and len(refused) == 1
        assert refused[0].reason == "duplicate-job-id" and refused[0].team != subs[0].spec.team

        # The other team cancels the job: refused by its own partition, dead-lettered once.
        loser = refused[0].team
        await js.publish(f"gpusched.intake.{loser}.cancel", json.dumps({"job_id": "shared-id"}).encode())
        # Poison on the log (not a job's) and on the intake (no team): dead-lettered once each.
        await js.publish("gpusched.queue.broken.configured", b"not json")
        await js.publish("gpusched.intake.nobody", b"{}")
        end = await eventlog.last_sequence(js)
        await eventually(lambda: p0.applied_seq >= end and p1.applied_seq >= end)

        async def dead_lettered():
            intake = await dead(js, "admission.intake")
            return len(intake) == 2 and len(await dead(js, "admission")) == 1 and intake
        intake = await eventually(dead_lettered, timeout_s=15)
        await asyncio.sleep(0.5)  # nothing more comes
        assert len(await dead(js, "admission")) == 1 and len(await dead(js, "admission.intake")) == 2
        # once by itself, not only by the dead letters' de-duplication window (2 minutes)
        assert p0.dead_letters("gpusched.queue.broken.configured") and not p1.dead_letters("gpusched.queue.broken.configured")
        for e in (e for e in log if e.type == "JobSubmitted"):
            owner = partition_of(e.spec.team, 2)
            assert [p.dead_letters(f"gpusched.job.{e.aggregate_id}.admitted") for p in (p0, p1)] == [owner == 0, owner == 1]
        reasons = sorted(m.headers["Gpusched-Reason"] for m in intake)
        assert any("does not exist (among the jobs of team" in r for r in reasons) and any("unknown intake subject" in r for r in reasons)

    names = {c.name async for c in _consumers(js, eventlog.INTAKE_STREAM)}
    assert {"admission-intake", "admission-intake-p1"} <= names
    assert {"admission", "admission-p1"} <= {c.name async for c in _consumers(js, eventlog.EVENTS_STREAM)}


async def _consumers(js, stream):
    for info in await js.consumers_info(stream):
        yield info.config


async def test_a_partition_starting_after_partition_0_misses_none_of_its_commands(nats_server, configured):
    """Partition 0 creates partition 1's intake durable before it passes over partition 1's
    commands; a snapshot of one admission is not taken for partition 0's."""
    js = configured
    async with running(partition(nats_server, 0, count=1)):
        await submit(js, P1[0], "before")
        await eventually(lambda: _admitted(js, "before"))
    async with running(partition(nats_server, 0)) as p0:
        await eventually(lambda: p0.applied_seq > 0)
        await submit(js, P1[0], "waiting")
        await submit(js, P0[0], "mine")
        await eventually(lambda: _admitted(js, "mine"))
        assert not await _admitted(js, "waiting")
        assert {j.team for j in p0.core.state.jobs.values()} == {P0[0]}  # not folded from one admission's snapshot
        async with running(partition(nats_server, 1)):
            await eventually(lambda: _admitted(js, "waiting"))
    assert durable_names("admission", 1) == ("admission-p1", "admission-intake-p1")


async def _admitted(js, job_id: str) -> bool:
    return "JobAdmitted" in [parse_event(m.data).type async for m in eventlog.read(js, subjects=[f"gpusched.job.{job_id}.>"])]


async def _settled(js, *durables: str) -> None:
    """Until each intake durable has nothing left to deliver or acknowledge."""
    async def idle():
        for durable in durables:
            info = await js.consumer_info(eventlog.INTAKE_STREAM, durable)
            if info.num_pending or info.num_ack_pending:
                return False
        return True
    await eventually(idle, timeout_s=20)
    await asyncio.sleep(0.3)


async def _service_log(js) -> list[tuple[str, int | None]]:
    return [(e.type, getattr(e, "generation", None))
            async for e in _parsed(eventlog.read(js, subjects=["gpusched.service.>"]))]


async def _parsed(msgs):
    async for m in msgs:
        yield parse_event(m.data)


async def test_a_durable_left_from_an_earlier_partitioning_hands_nothing_again(nats_server, configured):
    """2 partitions, then 1, then 2 again: partition 1's intake durable of the first time is not
    used again (it would hand partition 1 the commands the single admission handled, and delete
    the service deployed again)."""
    js, team = configured, P1[0]
    spec = {"spec": service_spec(name="chat", team=team, desired=1, lo=1, hi=2).model_dump(mode="json")}

    async def send(verb: str, body: dict) -> None:
        await js.publish(f"gpusched.intake.{team}.{verb}", json.dumps(body).encode())

    async with running(partition(nats_server, 0)), running(partition(nats_server, 1)):
        await send("deploy", spec)
        await eventually(lambda: _has(js, ("ServiceDeployed", 1)))
        await _settled(js, "admission-intake", "admission-intake-p1")
    async with running(partition(nats_server, 0, count=1)):
        await send("delete", {"service": "chat"})
        await send("deploy", spec)
        await send("scale", {"service": "chat", "replicas": 2})
        await eventually(lambda: _has(js, ("ScaleRequested", None)))
        await _settled(js, "admission-intake")
    before = await _service_log(js)
    assert before == [("ServiceDeployed", 1), ("ServiceDeleted", None), ("ServiceDeployed", 2), ("ScaleRequested", None)]
    async with running(partition(nats_server, 0)), running(partition(nats_server, 1)):
        await send("scale", {"service": "chat", "replicas": 1})
        await eventually(lambda: _has(js, ("ScaleRequested", None), count=2))
        await _settled(js, "admission-intake", "admission-intake-p1")
    assert await _service_log(js) == [*before, ("ScaleRequested", None)]


async def _has(js, entry, count: int = 1) -> bool:
    return (await _service_log(js)).count(entry) >= count


async def test_a_redeploy_after_a_delete_in_one_batch_is_recorded(nats_server, configured):
    """One admission, both commands in one fetched batch: the deploy is handled after the delete
    is recorded (before, it was answered against the service as it was before the batch: the
    same spec, nothing to do, and acknowledged without an event)."""
    js, team = configured, "team-a"
    spec = {"spec": service_spec(name="chat", team=team, desired=1, lo=1, hi=2).model_dump(mode="json")}
    async with running(partition(nats_server, 0, count=1)):
        await js.publish(f"gpusched.intake.{team}.deploy", json.dumps(spec).encode())
        await eventually(lambda: _has(js, ("ServiceDeployed", 1)))
    await js.publish(f"gpusched.intake.{team}.delete", json.dumps({"service": "chat"}).encode())
    await js.publish(f"gpusched.intake.{team}.deploy", json.dumps(spec).encode())
    async with running(partition(nats_server, 0, count=1)):
        await _settled(js, "admission-intake")
    assert await _service_log(js) == [("ServiceDeployed", 1), ("ServiceDeleted", None), ("ServiceDeployed", 2)]


async def test_a_partition_starting_alone_starts_where_partition_0_stopped(nats_server, configured):
    """Partition 1 of 2 starting before partition 0 makes its intake durable after what the
    single admission acknowledged; with its own lease and snapshot bucket (the admission
    credential's rights for partition 1)."""
    js = configured
    async with running(partition(nats_server, 0, count=1)):
        await submit(js, P1[0], "earlier")
        await eventually(lambda: _admitted(js, "earlier"))
        await _settled(js, "admission-intake")
    floor = (await js.consumer_info(eventlog.INTAKE_STREAM, "admission-intake")).ack_floor.stream_seq
    async with running(partition(nats_server, 1, lease_ttl_s=2)) as p1:
        await submit(js, P1[0], "later")
        await eventually(lambda: _admitted(js, "later"))
        assert p1.core.state.jobs["earlier"].intake_sequence < floor + 1
    info = await js.consumer_info(eventlog.INTAKE_STREAM, "admission-intake-p1")
    assert info.config.opt_start_seq == floor + 1 and info.config.description == "partition 1 of 2"
    assert [e.type for e in await events(js) if e.aggregate_id == "earlier"] == ["JobSubmitted", "JobAdmitted"]
    await js.stream_info(lease.stream("admission-p1"))
    await js.stream_info(snapshot.stream("admission-p1"))  # saved on the clean stop


async def test_a_stopped_admission_leaves_no_pull_request_on_the_broker(nats_server, configured):
    """A clean stop lets the intake fetch end: a pull request left waiting on the broker would take
    the next command to the closed connection, for another admission only after ack_wait (30 s)."""
    js = configured
    service = partition(nats_server, 0, count=1)
    async with running(service):
        await submit(js, "team-a", "first")
        await eventually(lambda: _admitted(js, "first"))
        await asyncio.sleep(0.3)  # a fetch is waiting on the broker now
    info = await js.consumer_info(eventlog.INTAKE_STREAM, "admission-intake")
    assert info.num_waiting == 0
