"""bench.relay on a real nats-server: 50 submissions go through the whole chain, each relay process
reads and acks every event it is meant to, and the notifier copies every job event."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.relay import ROLES, Relay
from conftest import connect_as
from gpusched.gateway import commands
from runtime import eventlog
from schemas import JobSpec, SubmitJob, parse_event

JOBS = 50
CHAIN = ["JobSubmitted", "JobAdmitted", "QuotaReserved", "JobScheduled", "JobStarted", "JobSucceeded", "QuotaReleased"]


@pytest.mark.parametrize("filtered", [False, True])
async def test_the_relay_carries_every_job_through_the_chain(nats_server, admin_js, filtered):
    nc = await connect_as(nats_server, "operator")
    ojs = nc.jetstream()
    try:
        with Relay(nats_server.env("admin"), filtered=filtered):
            for i in range(JOBS):
                await commands.publish_command(ojs, "team-a", "submit", SubmitJob(
                    job_id=f"relay-{i}", on_behalf_of="bench", spec=JobSpec(
                        kind="batch", queue="bench", team="team-a", image="img", gpus=1, gpu_flavors=("a100",))))
            deadline = time.time() + 60
            while await eventlog.last_sequence(admin_js) < JOBS * len(CHAIN):
                assert time.time() < deadline, f"{await eventlog.last_sequence(admin_js)} events in 60 s"
                await asyncio.sleep(0.1)
            chains: dict[str, list[str]] = {}
            async for m in eventlog.read(admin_js):
                e = parse_event(m.data)
                chains.setdefault(e.aggregate_id, []).append(e.type)
            assert chains == {f"relay-{i}": CHAIN for i in range(JOBS)}
            # every durable has delivered and seen acked all it reads
            while True:
                infos = [await admin_js.consumer_info(stream, name)
                         for stream in (eventlog.EVENTS_STREAM, eventlog.INTAKE_STREAM)
                         for name in [c.name for c in await admin_js.consumers_info(stream)]]
                if all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos):
                    break
                assert time.time() < deadline, [(i.name, i.num_pending, i.num_ack_pending) for i in infos]
                await asyncio.sleep(0.1)
            delivered = {i.name: i.delivered.consumer_seq for i in infos}
            everything = {f"relay-{r}-{'1' if r == 'admission' else '0'}" for r in ROLES}
            if filtered:  # only those that read all job events
                everything = {"relay-accounting-0", "relay-notifier-0"}
            assert {n: delivered[n] for n in everything} == {n: JOBS * len(CHAIN) for n in everything}
            assert delivered["relay-admission-0"] == JOBS  # the intake
            if filtered:
                assert delivered["relay-quota-0"] == delivered["relay-quota-1"] == delivered["relay-scheduler-0"] == JOBS
                assert delivered["relay-serving-0"] == 0
            tenant = await eventlog.tenant_js(admin_js, "team-a").stream_info(eventlog.tenant_stream("team-a"))
            assert tenant.state.messages == JOBS * len(CHAIN)
    finally:
        await nc.close()
