"""Quota's reclaim gives its victim the checkpoint window of the victim's priority class, as the
scheduler's preemption does (runtime.victims.VictimPolicy.grace_seconds; issue 44 item 2)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from schemas.priority import PriorityClass
from services.quota.domain import QuotaCore
from tests.unit.builders import T0, Log, drive, started
from tests.unit.test_quota_cohorts import cq, job


def _reclaim(core: QuotaCore, priority_class: str):
    log = Log()
    drive(core, [cq("owner", "c", a100=1), cq("borrower", "c", a100=0)], T0, log=log)
    drive(core, job("b", "borrower", 1, seq=1, priority=100, priority_class=priority_class), T0, log=log)
    drive(core, [started("b", when=T0)], T0, log=log)
    later = T0 + timedelta(hours=2)  # past every built-in protection window
    drive(core, job("mine", "owner", 1, seq=2, at_s=7200, priority=900), later, log=log)
    (reclaim,) = [e for e in log.events if e.type == "ReclaimRequested"]
    return reclaim


@pytest.mark.parametrize("priority_class, grace", [
    ("training", 60.0), ("deadline-training", 120.0), ("batch-low", 10.0), ("experiment", 30.0),
])
def test_reclaim_carries_the_victims_class_grace(priority_class, grace):
    reclaim = _reclaim(QuotaCore(), priority_class)
    assert (reclaim.aggregate_id, reclaim.grace_seconds) == ("b", grace)


def test_reclaim_grace_comes_from_the_configured_classes():
    classes = {"batch-low": PriorityClass(name="batch-low", value=100, preemptible=True,
                                          preemption_grace_seconds=300)}
    assert _reclaim(QuotaCore(priority_classes=classes), "batch-low").grace_seconds == 300.0
