"""A command whose events are refused on every delivery is dead-lettered on its last delivery
with the reason, not dropped by the server's delivery limit (issue 21, deliverable 2)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from conftest import connect_as, eventually, running, service_settings
from runtime import eventlog
from schemas import NodeRegistered, QueueConfigured, new_event
from schemas.node import NodeInfo
from schemas.queue import FlavorQuota
from services.admission.__main__ import AdmissionService
from services.admission.domain import AdmissionCore

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class RefusingAdmission(AdmissionService):

    """Every append refused, as a concurrency conflict on the job would be each time."""

    async def append_all(self, log_, events, basis=None):
        return {(type(e).aggregate, e.aggregate_id) for e in events}


async def test_a_command_refused_on_every_delivery_is_dead_lettered_on_the_last(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(new_event(QueueConfigured, aggregate_id="research", producer="config", occurred_at=NOW, key="1",
                               name="research", allowed_teams=("team-a",),
                               quotas=(FlavorQuota(flavor="a100", nominal=8),)))
    await log.append(new_event(NodeRegistered, aggregate_id="n1", producer="executor", occurred_at=NOW, key="1",
                               node=NodeInfo(name="n1", gpu_flavor="a100", gpu_count=8, gpu_memory_mib=40960)))
    service = RefusingAdmission("admission", AdmissionCore(), service_settings(nats_server, "admission"))
    tenant = await connect_as(nats_server, "team-a")
    try:
        async with running(service):
            spec = {"kind": "training", "queue": "research", "team": "team-a", "image": "img", "gpus": 1}
            ack = await tenant.jetstream().publish("gpusched.intake.team-a.submit",
                                                   json.dumps({"job_id": "unlucky", "spec": spec}).encode())

            async def dead_letter():
                async for msg in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM):
                    if (msg.headers or {}).get("Gpusched-Original-Sequence") == str(ack.seq):
                        return msg.headers
                return None

            headers = await eventually(dead_letter, timeout_s=30)
    finally:
        await tenant.close()
    assert f"not recorded after {eventlog.MAX_DELIVER} deliveries" in headers["Gpusched-Reason"]


async def test_the_intake_consumer_redelivers_on_its_own_delay_and_an_old_one_is_brought_up_to_it(admin_js):
    """nats-server honours a nak's delay only once on a consumer with a backoff list: the intake
    durable has none, and one created with the list is updated at bind."""
    from services.admission.__main__ import INTAKE_DURABLE

    await eventlog.durable_consumer(admin_js, stream=eventlog.INTAKE_STREAM, durable=INTAKE_DURABLE)
    assert (await admin_js.consumer_info(eventlog.INTAKE_STREAM, INTAKE_DURABLE)).config.backoff
    await eventlog.durable_consumer(admin_js, stream=eventlog.INTAKE_STREAM, durable=INTAKE_DURABLE, backoff=False)
    info = await admin_js.consumer_info(eventlog.INTAKE_STREAM, INTAKE_DURABLE)
    assert not info.config.backoff and info.config.max_deliver == eventlog.MAX_DELIVER
