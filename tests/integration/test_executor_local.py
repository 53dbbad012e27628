"""The executor service with the local backend against a real nats-server: the decision loop,
the reconcile side loop and the log together; a restarted service adopts, re-derives nothing."""

from __future__ import annotations

from datetime import UTC, datetime

from conftest import eventually, running, service_settings
from runtime import eventlog
from schemas import JobCancelRequested, JobScheduled, JobSpec, JobSubmitted, new_event, parse_event
from schemas.job import NodeAssignment
from services.executor.lifecycle import BackendCore
from services.executor.local import LocalBackend
from services.executor.service import ExecutorService


def executor(nats_server, root):
    return ExecutorService("executor", BackendCore(), service_settings(nats_server, "executor"),
                           backend=LocalBackend(root, node_name="local-0", telemetry_s=1), sync_s=0.1)


async def schedule(log: eventlog.EventLog, job_id: str, script: str) -> None:
    now = datetime.now(UTC)
    spec = JobSpec(kind="batch", queue="q", team="team-a", image="-", gpus=0, command=("sh", "-c", script))
    seq = await log.append(new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=now,
                                     key="1", spec=spec, submitter="u", intake_sequence=1), expected_last_seq=0)
    await log.append(new_event(JobScheduled, aggregate_id=job_id, producer="scheduler", occurred_at=now, key="1",
                               attempt=1, flavor="cpu", placement=(NodeAssignment(node="local-0", gpus=0),)),
                     expected_last_seq=seq)


async def types(js, job_id: str) -> list[str]:
    return [parse_event(m.data).type async for m in eventlog.read(js, subjects=[f"gpusched.job.{job_id}.>"])]


def ends_with(js, job_id: str, last: str):
    async def check():
        t = await types(js, job_id)
        return t if t and t[-1] == last else None
    return check


async def test_local_jobs_run_fail_and_cancel_through_the_log(nats_server, admin_js, tmp_path):
    log = eventlog.EventLog(admin_js)
    async with running(executor(nats_server, tmp_path)):
        await schedule(log, "ok", "echo hello from $GPUSCHED_JOB_ID; sleep 0.5")
        await schedule(log, "bad", "exit 7")
        await schedule(log, "long", "sleep 600")
        assert await eventually(ends_with(admin_js, "ok", "JobSucceeded"), timeout_s=20) == [
            "JobSubmitted", "JobScheduled", "JobStarted", "JobSucceeded"]
        await eventually(ends_with(admin_js, "bad", "JobFailed"), timeout_s=20)
        await eventually(ends_with(admin_js, "long", "JobStarted"), timeout_s=20)
    # down; then up again: the long job is adopted, not started twice
    async with running(executor(nats_server, tmp_path)):
        last = await eventlog.last_sequence(admin_js)
        await log.append(new_event(JobCancelRequested, aggregate_id="long", producer="admission",
                                   occurred_at=datetime.now(UTC), key="c", requested_by="u"))
        assert await eventually(ends_with(admin_js, "long", "JobCancelled"), timeout_s=40) == [
            "JobSubmitted", "JobScheduled", "JobStarted", "JobCancelRequested", "JobCancelled"]
        assert last > 0
    failed = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=["gpusched.job.bad.failed"])]
    assert failed[0].exit_code == 7
    assert (tmp_path / "runs/ok-a1-m0/log").read_text() == "hello from ok\n"
    assert len(list((tmp_path / "runs").glob("long-*"))) == 1
