"""`gpusched queues`: the read models (projected by the real accounting process from a real log)
with quota's own arithmetic for what is borrowed and lent across a nested cohort tree."""

from __future__ import annotations

import json

from conftest import eventually
from runtime import eventlog
from schemas import CohortConfigured, new_event
from tests.integration.test_telemetry import accounting_metrics, cli
from tests.unit.builders import T0, admitted, queue, released, reserved


def cohort(name: str, parent: str | None = None) -> CohortConfigured:
    return new_event(CohortConfigured, aggregate_id=name, producer="config", occurred_at=T0, key=name,
                     name=name, parent=parent)


async def test_queues_report_borrowing_and_lending_across_a_cohort_tree(nats_server, admin_js, pg_dsn):
    log = eventlog.EventLog(admin_js)
    config = [
        cohort("org"), cohort("shared", parent="org"),
        queue("research", quotas={"a100": 4}, cohort="shared"),       # borrows 3 beyond its nominal
        queue("alpha", quotas={"a100": 2}, cohort="org"),             # lends first (name order): 2
        queue("product", quotas={"a100": 4, "l4": 2}, cohort="org"),  # lends the remaining 1 a100
        queue("solo", quotas={"a100": 2}),                            # no cohort: lends nothing
    ]
    holds = [("r1", "research", 4), ("r2", "research", 3), ("p1", "product", 1), ("s1", "solo", 1),
             ("gone", "product", 2)]
    for event in config:
        await log.append(event)
    for job, q, gpus in holds:
        await log.append(admitted(job, q))
        await log.append(reserved(job, q, gpus=gpus))
    await log.append(released("gone", "product", gpus=2))  # a released reservation holds nothing

    async with accounting_metrics(nats_server, admin_js, pg_dsn):
        rows = await eventually(lambda: _queues(nats_server, pg_dsn, expected_rows=5), timeout_s=30)

    got = {(r["queue"], r["flavor"]): (r["used"], r["borrowed"], r["lent"], r["pending_jobs"]) for r in rows}
    assert got == {
        ("alpha", "a100"): (0, 0, 2, 0),
        ("product", "a100"): (1, 0, 1, 0),
        ("product", "l4"): (0, 0, 0, 0),
        ("research", "a100"): (7, 3, 0, 0),
        ("solo", "a100"): (1, 0, 0, 0),
    }


async def _queues(nats_server, pg_dsn: str, expected_rows: int) -> list[dict] | None:
    rows = json.loads(cli(nats_server, pg_dsn, "queues", "-o", "json"))
    return rows if len(rows) == expected_rows else None
