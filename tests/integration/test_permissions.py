"""Security by default: each service and each tenant reaches only the subjects it needs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import nats
import pytest

from conftest import connect_as
from runtime import eventlog
from schemas import (GpuTelemetry, JobScheduled, NodeAssignment, NodeTelemetryReported, QuotaReserved, dumps,
                     event_subject, new_event)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
DENIED = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.APIError, TimeoutError)


async def _publish(server, user: str, subject: str, payload: bytes = b"{}") -> bool:
    """True when JetStream stored the message."""
    nc = await connect_as(server, user)
    try:
        await nc.jetstream().publish(subject, payload, timeout=1)
        return True
    except DENIED:
        return False
    finally:
        await nc.close()


async def test_tenant_may_only_use_its_own_intake(nats_server, admin_js):
    assert await _publish(nats_server, "team-a", "gpusched.intake.team-a.submit")
    assert not await _publish(nats_server, "team-a", "gpusched.intake.team-b.submit")
    assert not await _publish(nats_server, "team-a", "gpusched.job.x.admitted")
    assert await eventlog.last_sequence(admin_js, eventlog.INTAKE_STREAM) == 1
    assert await eventlog.last_sequence(admin_js) == 0


async def test_a_service_publishes_only_the_event_types_it_produces(nats_server, admin_js):
    reserved = new_event(QuotaReserved, aggregate_id="j1", producer="quota", occurred_at=NOW, key="1",
                         attempt=1, queue="q", flavor="f", gpus=1)
    scheduled = new_event(JobScheduled, aggregate_id="j1", producer="scheduler", occurred_at=NOW, key="1",
                          attempt=1, flavor="f", placement=(NodeAssignment(node="n", gpus=1),))
    telemetry = new_event(NodeTelemetryReported, aggregate_id="gpu-1.rack-1", producer="executor", occurred_at=NOW,
                          key="w1", node="gpu-1.rack-1", window_start=NOW - timedelta(seconds=60), window_end=NOW,
                          gpu_count=1, gpus=(GpuTelemetry(index=0, samples=6, utilization=0.5, memory_used_mib=1,
                                                          memory_total_mib=2),))
    for user, event, allowed in [("quota", reserved, True), ("quota", scheduled, False),
                                 ("scheduler", scheduled, True), ("executor", reserved, False),
                                 ("executor", telemetry, True), ("scheduler", telemetry, False),
                                 ("accounting", telemetry, False)]:
        nc = await connect_as(nats_server, user)
        try:
            js = nc.jetstream()
            if allowed:
                await eventlog.EventLog(js).append(event)
            else:
                with pytest.raises(DENIED):
                    await js.publish(event_subject(event), dumps(event), timeout=1)
        finally:
            await nc.close()
    assert await eventlog.last_sequence(admin_js) == 3


async def test_services_and_operator_cannot_manage_streams(nats_server, admin_js):
    for user in ("quota", "operator", "team-a"):
        nc = await connect_as(nats_server, user)
        try:
            with pytest.raises(DENIED):
                await nc.jetstream(timeout=1).delete_stream(eventlog.EVENTS_STREAM)
        finally:
            await nc.close()
    info = await admin_js.stream_info(eventlog.EVENTS_STREAM)
    assert info.config.name == eventlog.EVENTS_STREAM


async def test_wrong_password_is_refused(nats_server):
    with pytest.raises(Exception):
        await nats.connect(nats_server.url(), user="quota", password="wrong", connect_timeout=2,
                           max_reconnect_attempts=0, allow_reconnect=False)
