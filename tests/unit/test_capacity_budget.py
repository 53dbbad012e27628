"""The GPU-hour budget's rule, in quota's capacity module: the period, spent (weighted by flavor)
and left. The quota core decides with it and the reports (CLI, API, console) state it with it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas.queue import FlavorQuota, GpuHourBudget
from services.quota import capacity
from tests.unit.builders import queue


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize(("period", "at", "start", "renews"), [
    ("day", "2026-11-04T13:45:00", "2026-11-04T00:00:00", "2026-11-05T00:00:00"),
    ("week", "2026-11-04T13:45:00", "2026-11-02T00:00:00", "2026-11-09T00:00:00"),  # Wednesday -> Monday
    ("month", "2026-11-04T13:45:00", "2026-11-01T00:00:00", "2026-12-01T00:00:00"),
    ("month", "2026-12-31T23:59:59", "2026-12-01T00:00:00", "2027-01-01T00:00:00"),
])
def test_budget_period(period, at, start, renews):
    assert capacity.period_start(period, _at(at)) == _at(start)
    assert capacity.next_period(period, _at(start)) == _at(renews)


def test_budget_spent_and_left_are_weighted_by_flavor():
    q = queue("research", quotas={"a100": 4, "l4": 2}, budget=GpuHourBudget(gpu_hours=100.0))
    q = q.model_copy(update={"quotas": (FlavorQuota(flavor="a100", nominal=4, weight=10.0),
                                        FlavorQuota(flavor="l4", nominal=2, weight=2.5))})
    spent = capacity.budget_spent(q, {"a100": 2.0, "l4": 4.0})  # 2 × 10 + 4 × 2.5
    assert spent == 30.0
    assert capacity.budget_left(q, spent) == 70.0
    assert capacity.flavor_weight(q, "h100") == 1.0  # a flavor the queue does not know weighs 1
    assert capacity.budget_left(queue("solo"), 5.0) is None  # no budget
