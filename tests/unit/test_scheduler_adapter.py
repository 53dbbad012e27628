"""The scheduler adapter: configuration from the environment and the fragmentation gauges."""

from __future__ import annotations

import asyncio
import gc

import pytest
from prometheus_client import REGISTRY

from runtime.loop import DecisionService
from runtime.settings import ConfigError
from services.scheduler.__main__ import SchedulerService, build_core
from services.scheduler.domain import SchedulerCore
from services.scheduler.placement import Policy
from tests.unit.builders import T0, admitted, drive, node, reserved, spec, submitted


def test_policy_and_limits_from_the_environment(monkeypatch):
    monkeypatch.setenv("GPUSCHED_SCHEDULER_POLICY", "fgd")
    monkeypatch.setenv("GPUSCHED_PREEMPTION", "off")
    core = build_core(None, None)
    assert core.policy is Policy.FGD and not core.limits.enabled
    monkeypatch.setenv("GPUSCHED_SCHEDULER_POLICY", "random")
    with pytest.raises(ConfigError, match="accepted: first-fit, best-fit, fgd"):
        build_core(None, None)


@pytest.mark.parametrize("value, expected", [
    ("", {}),
    ("a100=fgd-spread, l4=best-fit", {"a100": Policy.FGD_SPREAD, "l4": Policy.BEST_FIT}),
    ("a100", "is not flavor=policy"),
    ("A100=fgd", "is not flavor=policy"),
    ("a100=fgd,a100=best-fit", "given twice"),
    ("a100=random", "names policy 'random'; accepted: first-fit, best-fit, fgd, fgd-spread, fgd-balance"),
])
def test_a_policy_per_flavor_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("GPUSCHED_SCHEDULER_POLICY", "best-fit")
    monkeypatch.setenv("GPUSCHED_SCHEDULER_POLICY_BY_FLAVOR", value)
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            build_core(None, None)
        return
    core = build_core(None, None)
    assert core.flavor_policies == expected and core.policy_for("h100") is Policy.BEST_FIT


def test_gauges_after_a_cycle(monkeypatch):
    monkeypatch.delenv("GPUSCHED_SCHEDULER_POLICY", raising=False)
    core = build_core(None, None)
    drive(core, [node("g1", "gauge-flavor", 8), node("g2", "gauge-flavor", 8),
                 submitted("j", spec(gpus=6)), admitted("j"), reserved("j", flavor="gauge-flavor", gpus=6)], T0)
    value = REGISTRY.get_sample_value
    assert value("gpusched_scheduler_largest_placeable_gang", {"flavor": "gauge-flavor"}) == 8
    assert value("gpusched_scheduler_fragmentation_ratio", {"flavor": "gauge-flavor"}) == pytest.approx(2 / 10)


def test_the_state_is_frozen_after_a_rebuild(monkeypatch):
    async def fold(self, js):
        return 42

    monkeypatch.setattr(DecisionService, "rebuild", fold)
    service = SchedulerService("scheduler", SchedulerCore(), None, clock=object())
    try:
        assert asyncio.run(service.rebuild(None)) == 42
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


async def _why(monkeypatch, events):
    from gpusched.gateway import history

    async def fake_job_events(js, job_id):
        return list(enumerate(events, start=1))
    monkeypatch.setattr(history, "job_events", fake_job_events)
    return await history.why(None, "j")


def test_why_shows_the_scheduling_reason_while_holding_quota(monkeypatch):
    import asyncio

    from tests.unit.builders import at, sched_pending_reason, scheduled

    base = [submitted("j", spec(gpus=8)), admitted("j"), reserved("j", gpus=8)]
    data = asyncio.run(_why(monkeypatch, base + [sched_pending_reason("j", eta=at(600))]))
    assert data["last_event"] == "QuotaReserved" and not data["waiting_for_quota"]
    assert data["scheduling_reason"]["code"] == "fragmentation" and data["scheduling_reason"]["eta"] == at(600)
    placed = asyncio.run(_why(monkeypatch, base + [sched_pending_reason("j"), scheduled("j")]))
    assert placed["scheduling_reason"] is None and len(placed["scheduling_history"]) == 1
