"""An event Postgres cannot store (valid to the contract, refused by the database) is
dead-lettered by the accounting process, which goes on projecting what follows."""

from __future__ import annotations

import asyncpg

from conftest import eventually
from runtime import eventlog
from tests.integration.test_telemetry import accounting_metrics
from tests.unit.builders import admitted, queue, spec, submitted


async def test_an_event_postgres_refuses_is_dead_lettered_and_the_projection_goes_on(nats_server, admin_js, pg_dsn):
    log = eventlog.EventLog(admin_js)
    await log.append(queue("research"))
    await log.append(submitted("before"))
    # Valid to the contract, but its total memory (16 TiB x 1,024 nodes, in MiB) overflows the
    # read model's integer column. (A NUL, the first such case found, is now refused at parse.)
    await log.append(submitted("huge-job", spec(memory_mib=16_777_216, gang_size=1024)))
    await log.append(submitted("after", spec(gpus=2), seq=3))
    await log.append(admitted("after"))

    async with accounting_metrics(nats_server, admin_js, pg_dsn):
        conn = await asyncpg.connect(pg_dsn)
        try:
            states = dict(await conn.fetch("SELECT job_id, state FROM jobs"))
        finally:
            await conn.close()
    assert states == {"before": "submitted", "after": "queued"}
    dead = await eventually(lambda: _dead_letters(admin_js))
    assert [m.headers["Gpusched-Original-Subject"] for m in dead] == ["gpusched.job.huge-job.submitted"]
    assert "cannot store" in dead[0].headers["Gpusched-Reason"]


async def _dead_letters(js) -> list:
    return [m async for m in eventlog.read(js, stream=eventlog.DLQ_STREAM, subjects=["gpusched.deadletter.accounting"])]
