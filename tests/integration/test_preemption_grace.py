"""Notice, then grace, then stop, with the real services (issue 44 item 2): quota reclaims a
borrower of a class whose checkpoint window is 200 s; the ReclaimRequested carries that grace, the
sim executor service stops the attempt at the deadline (notice + grace, platform clock), not at
once, and an executor restarted within the grace keeps that deadline."""

from __future__ import annotations

from contextlib import AsyncExitStack
from datetime import timedelta

import pytest

from conftest import eventually, running, service_settings
from runtime import eventlog
from runtime.loop import DecisionService
from schemas import DEFAULT_PRIORITY_CLASSES, FlavorQuota, QueueConfigured, new_event, parse_event
from schemas.priority import POLICY_ID, PolicyConfigured
from services.executor.sim import SimExecutorCore
from services.quota.domain import QuotaCore
from services.scheduler.domain import SchedulerCore
from tests.integration.test_pipeline import CLOCK, CLUSTER, NOW, admit, ends_with, history

GRACE = 200.0  # platform seconds: 2 wall seconds at the tests' scale of 100


def make(nats_server, name, core):
    return DecisionService(name, core, service_settings(nats_server, name), CLOCK)


async def setup(admin_js) -> eventlog.EventLog:
    log = eventlog.EventLog(admin_js)
    classes = tuple(pc.model_copy(update={"preemption_grace_seconds": GRACE}) if pc.name == "batch-low" else pc
                    for pc in DEFAULT_PRIORITY_CLASSES.values())
    await log.append(new_event(PolicyConfigured, aggregate_id=POLICY_ID, producer="config", occurred_at=NOW,
                               key="grace", priority_classes=classes))
    for name, nominal in (("owner", 4), ("borrower", 0)):
        await log.append(new_event(QueueConfigured, aggregate_id=name, producer="config", occurred_at=NOW, key="1",
                                   name=name, cohort="shared", allowed_teams=("team-a",),
                                   quotas=(FlavorQuota(flavor="a100", nominal=nominal),)))
    return log


async def reclaim_of(admin_js, job_id):
    found = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=[f"gpusched.job.{job_id}.>"])]
    return next((e for e in found if e.type == "ReclaimRequested"), None)


async def preempted_of(admin_js, job_id):
    found = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=[f"gpusched.job.{job_id}.>"])]
    return next((e for e in found if e.type == "JobPreempted"), None)


@pytest.mark.parametrize("restart", [False, True])
async def test_reclaim_notice_then_grace_then_stop(nats_server, admin_js, restart):
    log = await setup(admin_js)
    quota, scheduler = make(nats_server, "quota", QuotaCore()), make(nats_server, "scheduler", SchedulerCore())
    async with running(quota), running(scheduler), AsyncExitStack() as stack:
        await stack.enter_async_context(running(make(nats_server, "executor", SimExecutorCore(CLUSTER))))
        await admit(log, "borrowing", queue="borrower", gpus=4, expected_runtime_seconds=100_000.0,
                    priority_class="batch-low")
        await eventually(ends_with(admin_js, "borrowing", "JobStarted"))
        await admit(log, "owned", queue="owner", gpus=4)
        notice = await eventually(lambda: reclaim_of(admin_js, "borrowing"))
        deadline = notice.occurred_at + timedelta(seconds=GRACE)
        assert notice.grace_seconds == GRACE  # the victim's class's window, not the schema's 30
        assert CLOCK.now() < deadline - timedelta(seconds=50)  # (enough of the window left to look)
        assert "JobPreempted" not in await history(admin_js, "borrowing")  # the notice, no stop yet
        if restart:  # a new executor process, within the grace: the deadline comes from the log
            await stack.aclose()
            await stack.enter_async_context(running(make(nats_server, "executor", SimExecutorCore(CLUSTER))))
        stop = await eventually(lambda: preempted_of(admin_js, "borrowing"), timeout_s=20)
        owned = await eventually(ends_with(admin_js, "owned", "QuotaReleased"), timeout_s=20)
    assert stop.occurred_at == deadline and CLOCK.now() >= deadline
    assert owned[-3:] == ["JobStarted", "JobSucceeded", "QuotaReleased"]
