"""`gpusched queues` shows each quota dimension of a queue configured with `gpusched apply`: per
flavor its weight and each priority class's use against its limit, per queue its weighted use
against its weighted limit and its GPU-hour budget, from the read models the real accounting
process projects from a real log."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from conftest import eventually
from runtime import eventlog, eventtime
from services.quota import capacity
from tests.integration.test_apply import apply
from tests.integration.test_telemetry import accounting_metrics, cli
from tests.unit.builders import admitted, released, reserved, spec, submitted

QUEUES = """
queues:
  - name: research
    allowed_teams: [team-a]
    quotas: [{flavor: a100, nominal: 8, weight: 10}, {flavor: l4, nominal: 4, weight: 2.5}]
    weighted_limit: 120
    class_limits: [{priority_class: experiment, max_share: 0.25}]
    budget: {gpu_hours: 1000, period: month}
"""


async def test_queues_shows_weighted_class_and_budget_dimensions(nats_server, admin_js, pg_dsn, tmp_path):
    path = tmp_path / "queues.yaml"
    path.write_text(QUEUES)
    rc, changes = apply(nats_server, path)
    assert rc == 0, changes
    [change] = changes
    assert change["event"] == "QueueConfigured"

    now = datetime.now(UTC)
    held_from, closed = now - timedelta(minutes=30), (now - timedelta(minutes=30), now - timedelta(minutes=10))
    log = eventlog.EventLog(admin_js)
    holds = [("e1", "experiment", "a100", 2, held_from, None), ("t1", "training", "a100", 3, held_from, None),
             ("l1", "training", "l4", 2, held_from, None), ("c1", "experiment", "a100", 2, *closed)]
    for seq, (job, cls, flavor, gpus, since, until) in enumerate(holds, start=1):
        await log.append(submitted(job, spec(queue="research", gpus=gpus, priority_class=cls), seq=seq, when=since))
        await log.append(admitted(job, "research", when=since))
        await log.append(reserved(job, "research", flavor, gpus, when=since))
        if until is not None:
            await log.append(released(job, "research", flavor, gpus, when=until))

    async with accounting_metrics(nats_server, admin_js, pg_dsn):
        rows = await eventually(lambda: _queues(nats_server, pg_dsn), timeout_s=30)
        table = cli(nats_server, pg_dsn, "queues")

    by_flavor = {r["flavor"]: r for r in rows}
    assert {f: (r["used"], r["weight"], r["weighted_used"], r["weighted_limit"], r["class_limits"])
            for f, r in by_flavor.items()} == {
        # 5 a100 × 10 + 2 l4 × 2.5: the queue's weighted use, on each of its rows
        "a100": (5, 10.0, 55.0, 120.0, [{"priority_class": "experiment", "max_share": 0.25, "limit": 2, "used": 2}]),
        "l4": (2, 2.5, 55.0, 120.0, [{"priority_class": "experiment", "max_share": 0.25, "limit": 1, "used": 0}]),
    }
    # Weighted GPU-hours this month: the released reservation's 20 minutes (within the month) and
    # the held ones' time up to the log's now, the newest event time in the log (the queue's
    # configuration, stamped when `gpusched apply` ran): not the wall clock when a door asks, so
    # every door asked at this position agrees.
    log_now = await eventtime.log_time(admin_js, (await admin_js.stream_info(eventlog.EVENTS_STREAM)).state.last_seq)
    start = capacity.period_start("month", log_now)
    closed_hours = 2 * 10 * max(0.0, (closed[1] - max(closed[0], start)).total_seconds()) / 3600

    def held_hours(at: datetime) -> float:
        return 55 * (at - max(held_from, start)).total_seconds() / 3600

    r = by_flavor["a100"]
    assert (r["budget_gpu_hours"], r["budget_period"]) == (1000, "month")
    used = r["budget_used_gpu_hours"]
    assert used == pytest.approx(closed_hours + held_hours(log_now), abs=0.001)
    assert by_flavor["l4"]["budget_used_gpu_hours"] == r["budget_used_gpu_hours"]
    for cell in ("55/120", "experiment 2/2", "experiment 0/1", "/1000 GPU-h per month"):
        assert cell in table


async def _queues(nats_server, pg_dsn: str) -> list[dict] | None:
    rows = json.loads(cli(nats_server, pg_dsn, "queues", "-o", "json"))
    return rows if sum(r["used"] for r in rows) == 7 else None
