"""Quota, scheduler and the sim executor, each a service against a real nats-server: a job
goes from admitted to succeeded, failures are retried, cancels stop work, and a restarted
decision service re-derives nothing that is already in the log."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from conftest import eventually, running, service_settings
from runtime import eventlog
from runtime.clock import ScaledClock
from runtime.loop import DecisionService
from schemas import DEFAULT_PRIORITY_CLASSES, JobAdmitted, JobCancelRequested, JobSpec, JobSubmitted, QueueConfigured, new_event, parse_event
from schemas.node import NodeInfo
from schemas.queue import FlavorQuota
from services.executor.sim import SimExecutorCore
from services.quota.domain import QuotaCore
from services.scheduler.domain import SchedulerCore

NOW = datetime(2026, 1, 1, tzinfo=UTC)
CLUSTER = [NodeInfo(name=f"n{i}", gpu_flavor="a100", gpu_count=4, gpu_memory_mib=40960) for i in range(2)]
CLOCK = ScaledClock(time_scale=100.0)  # a 100 s job takes a second


def services(nats_server):
    def make(name, core):
        return DecisionService(name, core, service_settings(nats_server, name), CLOCK)
    return [make("quota", QuotaCore()), make("scheduler", SchedulerCore()), make("executor", SimExecutorCore(CLUSTER))]


async def admit(log: eventlog.EventLog, job_id: str, **spec) -> None:
    fields = {"kind": "training", "queue": "q", "team": "team-a", "image": "img", "gpus": 2,
              "expected_runtime_seconds": 100.0}
    fields.update(spec)
    s = new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=NOW, key="1",
                  spec=JobSpec(**fields), submitter="u", intake_sequence=1)
    seq = await log.append(s, expected_last_seq=0)
    pc = DEFAULT_PRIORITY_CLASSES[s.spec.priority_class]
    await log.append(new_event(JobAdmitted, aggregate_id=job_id, producer="admission", occurred_at=CLOCK.now(), key="d",
                               cause=s, queue=s.spec.queue, priority=pc.value, preemptible=pc.preemptible),
                     expected_last_seq=seq)


async def history(js, job_id: str, reasons: bool = False) -> list[str]:
    """The job's event types in order; pending reasons only when asked."""
    types = [parse_event(m.data).type async for m in eventlog.read(js, subjects=[f"gpusched.job.{job_id}.>"])]
    return types if reasons else [t for t in types
                                  if t not in ("QuotaPendingReasonChanged", "SchedulingPendingReasonChanged")]


def ends_with(js, job_id: str, last: str):
    async def check():
        h = await history(js, job_id)
        return h if h and h[-1] == last else None
    return check


@pytest.fixture
async def log(admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(new_event(QueueConfigured, aggregate_id="q", producer="config", occurred_at=NOW, key="1", name="q",
                               allowed_teams=("team-a",), quotas=(FlavorQuota(flavor="a100", nominal=6),)))
    return log


async def test_jobs_run_to_success_within_quota(nats_server, admin_js, log):
    quota, scheduler, executor = services(nats_server)
    async with running(quota), running(scheduler), running(executor):
        for i in range(4):
            await admit(log, f"job-{i}")
        for i in range(4):
            h = await eventually(ends_with(admin_js, f"job-{i}", "QuotaReleased"), timeout_s=20)
            assert h == ["JobSubmitted", "JobAdmitted", "QuotaReserved", "JobScheduled", "JobStarted",
                         "JobSucceeded", "QuotaReleased"]
    # nominal 6 with 2-GPU jobs: the fourth waited for a release, and the log says why
    reserved = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=["gpusched.job.*.quota_reserved"])]
    succeeded = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=["gpusched.job.*.succeeded"])]
    assert reserved[-1].occurred_at >= min(s.occurred_at for s in succeeded)
    waited = reserved[-1].aggregate_id
    [why] = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=[f"gpusched.job.{waited}.quota_pending"])]
    assert why.reason.value == "nominal-exhausted"
    assert why.message == "queue q nominal a100 6, used 6; needs 2 more; no cohort to borrow from"
    assert why.position == 1


async def test_failed_attempt_is_retried_and_preserves_attempt_numbers(nats_server, admin_js, log):
    quota, scheduler, executor = services(nats_server)
    async with running(quota), running(scheduler), running(executor):
        await admit(log, "flaky", annotations={"sim.gpusched.io/exit-code": "3", "sim.gpusched.io/fail-attempts": "1",
                                               "sim.gpusched.io/failure-reason": "evicted"},
                    retry={"max_attempts": 2, "backoff_seconds": 10})
        await admit(log, "broken", annotations={"sim.gpusched.io/exit-code": "1"}, retry={"max_attempts": 3})
        flaky = await eventually(ends_with(admin_js, "flaky", "QuotaReleased"), timeout_s=20)
        # wait until the second attempt's release, not the first one's
        flaky = await eventually(lambda: _count(admin_js, "flaky", "QuotaReleased", 2), timeout_s=20)
        broken = await eventually(ends_with(admin_js, "broken", "QuotaReleased"), timeout_s=20)
    assert flaky == ["JobSubmitted", "JobAdmitted", "QuotaReserved", "JobScheduled", "JobStarted", "JobFailed",
                     "QuotaReleased", "JobRetryScheduled", "QuotaReserved", "JobScheduled", "JobStarted",
                     "JobSucceeded", "QuotaReleased"]
    # exit-code failures are not in the default retry_on: no retry
    assert broken[-2:] == ["JobFailed", "QuotaReleased"]


async def _count(js, job_id, event_type, n):
    h = await history(js, job_id)
    return h if h.count(event_type) >= n else None


async def test_cancel_stops_a_running_job(nats_server, admin_js, log):
    quota, scheduler, executor = services(nats_server)
    async with running(quota), running(scheduler), running(executor):
        await admit(log, "long", expected_runtime_seconds=100_000.0)
        await eventually(ends_with(admin_js, "long", "JobStarted"))
        last = await eventlog.last_sequence(admin_js)
        await log.append(new_event(JobCancelRequested, aggregate_id="long", producer="admission", occurred_at=CLOCK.now(),
                                   key="c", requested_by="alice"))
        h = await eventually(ends_with(admin_js, "long", "QuotaReleased"))
    assert h[-3:] == ["JobCancelRequested", "JobCancelled", "QuotaReleased"]
    assert last > 0


async def test_restarted_services_rebuild_and_decide_nothing_twice(nats_server, admin_js, log):
    quota, scheduler, executor = services(nats_server)
    async with running(quota), running(scheduler), running(executor):
        for i in range(3):
            await admit(log, f"r-{i}")
        for i in range(3):
            await eventually(ends_with(admin_js, f"r-{i}", "QuotaReleased"), timeout_s=20)
    before = await eventlog.last_sequence(admin_js)
    quota2, scheduler2, executor2 = services(nats_server)
    async with running(quota2), running(scheduler2), running(executor2):
        await admit(log, "r-new")
        await eventually(ends_with(admin_js, "r-new", "QuotaReleased"), timeout_s=20)
    after = await eventlog.last_sequence(admin_js)
    # exactly the new job's 7 events were added: nothing about r-0..r-2 was decided again
    assert after - before == 7


async def test_reclaim_preempts_a_borrower_and_gives_the_owner_its_quota(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    for name, nominal in (("owner", 4), ("borrower", 0)):
        await log.append(new_event(QueueConfigured, aggregate_id=name, producer="config", occurred_at=NOW, key="1",
                                   name=name, cohort="shared", allowed_teams=("team-a",),
                                   quotas=(FlavorQuota(flavor="a100", nominal=nominal),)))
    quota, scheduler, executor = services(nats_server)
    async with running(quota), running(scheduler), running(executor):
        await admit(log, "borrowing", queue="borrower", gpus=4, expected_runtime_seconds=100_000.0,
                    priority_class="batch-low")
        await eventually(ends_with(admin_js, "borrowing", "JobStarted"))
        await admit(log, "owned", queue="owner", gpus=4)
        owned = await eventually(ends_with(admin_js, "owned", "QuotaReleased"), timeout_s=20)
        borrowing = await history(admin_js, "borrowing")
    assert owned == ["JobSubmitted", "JobAdmitted", "QuotaReserved", "JobScheduled", "JobStarted", "JobSucceeded",
                     "QuotaReleased"]
    assert borrowing[:9] == ["JobSubmitted", "JobAdmitted", "QuotaReserved", "JobScheduled", "JobStarted",
                             "ReclaimRequested", "JobPreempted", "QuotaReleased", "JobRetryScheduled"]
    # requeued as attempt 2, and it may not borrow again while the owner holds its quota
    assert "JobFailed" not in borrowing


async def test_priority_preemption_requeues_the_victim_and_runs_the_urgent_job(nats_server, admin_js):
    """Quota admits more than the nodes hold: the scheduler makes room for an inference job by
    preempting the batch attempt that loses the least work; the victim is requeued, not failed."""
    log = eventlog.EventLog(admin_js)
    await log.append(new_event(QueueConfigured, aggregate_id="big", producer="config", occurred_at=NOW, key="1",
                               name="big", allowed_teams=("team-a",), quotas=(FlavorQuota(flavor="a100", nominal=16),)))
    quota, scheduler, executor = services(nats_server)
    async with running(quota), running(scheduler), running(executor):
        for name in ("batch-0", "batch-1"):
            await admit(log, name, queue="big", gpus=4, expected_runtime_seconds=100_000.0, priority_class="batch-low")
            await eventually(ends_with(admin_js, name, "JobStarted"))
        await admit(log, "urgent", queue="big", gpus=4, priority_class="inference-sla")
        urgent = await eventually(ends_with(admin_js, "urgent", "QuotaReleased"), timeout_s=20)
        victims = {name: await history(admin_js, name) for name in ("batch-0", "batch-1")}
        preemptions = [parse_event(m.data) async for m in
                       eventlog.read(admin_js, subjects=["gpusched.job.*.preemption_requested"])]
    assert urgent == ["JobSubmitted", "JobAdmitted", "QuotaReserved", "JobScheduled", "JobStarted", "JobSucceeded",
                      "QuotaReleased"]
    (p,) = preemptions
    assert p.for_job == "urgent" and p.grace_seconds == DEFAULT_PRIORITY_CLASSES["batch-low"].preemption_grace_seconds
    # batch-1 started later, so it had lost less work: it is the victim
    assert p.aggregate_id == "batch-1"
    assert victims["batch-1"][:9] == ["JobSubmitted", "JobAdmitted", "QuotaReserved", "JobScheduled", "JobStarted",
                                      "PreemptionRequested", "JobPreempted", "QuotaReleased", "JobRetryScheduled"]
    assert "JobFailed" not in victims["batch-1"] and "PreemptionRequested" not in victims["batch-0"]


async def test_four_quarter_gpu_jobs_share_one_gpu_of_quota_and_one_gpu(nats_server, admin_js, log):
    """A queue with one L4 of quota and one time-sliced L4: four quarter-GPU jobs hold a quarter of
    the quota each and run side by side on the one GPU; a fifth waits for quota, and says so."""
    l4 = [NodeInfo(name="l4-0", gpu_flavor="l4", gpu_count=1, gpu_memory_mib=23034, gpu_sharable=True)]
    await log.append(new_event(QueueConfigured, aggregate_id="shared", producer="config", occurred_at=NOW, key="1",
                               name="shared", allowed_teams=("team-a",), quotas=(FlavorQuota(flavor="l4", nominal=1),)))
    core = {"quota": QuotaCore(), "scheduler": SchedulerCore(), "executor": SimExecutorCore(l4)}
    quota, scheduler, executor = (DecisionService(n, c, service_settings(nats_server, n), CLOCK) for n, c in core.items())
    async with running(quota), running(scheduler), running(executor):
        for i in range(5):
            await admit(log, f"quarter-{i}", queue="shared", kind="inference", gpus=1, gpu_milli=250,
                        expected_runtime_seconds=100_000.0)
        for i in range(4):
            await eventually(ends_with(admin_js, f"quarter-{i}", "JobStarted"), timeout_s=20)
        why = await eventually(lambda: _reason(admin_js, "quarter-4"), timeout_s=20)
    reserved = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=["gpusched.job.*.quota_reserved"])]
    assert sorted((e.aggregate_id, e.gpus, e.gpu_milli) for e in reserved) == [
        (f"quarter-{i}", 1, 250) for i in range(4)]
    scheduled = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=["gpusched.job.*.scheduled"])]
    assert {(p.node, p.gpu_indices, p.gpu_milli) for e in scheduled for p in e.placement} == {("l4-0", (0,), 250)}
    assert why.message == "queue shared nominal l4 1, used 1; needs 0.25 more; no cohort to borrow from"


async def _reason(js, job_id):
    found = [parse_event(m.data) async for m in eventlog.read(js, subjects=[f"gpusched.job.{job_id}.quota_pending"])]
    return found[-1] if found else None
