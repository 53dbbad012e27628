"""Admission against a real nats-server: every kind of bad input gets a clear rejection or a
dead-letter record, and valid submissions keep flowing past them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime

import pytest

from conftest import connect_as, eventually, running, service_settings
from runtime import eventlog
from schemas import JobStarted, NodeRegistered, QueueConfigured, new_event, parse_event
from schemas.commands import MAX_COMMAND_BYTES
from schemas.job import rejection_id
from schemas.node import NodeInfo
from schemas.queue import FlavorQuota
from services.admission.__main__ import AdmissionService
from services.admission.domain import AdmissionCore

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def good(job_id: str, **spec) -> dict:
    base = {"kind": "training", "queue": "research", "team": "team-a", "image": "img", "gpus": 2,
            "gpu_flavors": ["a100"]}
    base.update(spec)
    return {"job_id": job_id, "spec": base}


@pytest.fixture
async def admission(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(new_event(QueueConfigured, aggregate_id="research", producer="config", occurred_at=NOW, key="1",
                               name="research", allowed_teams=("team-a",),
                               quotas=(FlavorQuota(flavor="a100", nominal=8),)))
    await log.append(new_event(NodeRegistered, aggregate_id="n1", producer="executor", occurred_at=NOW, key="1",
                               node=NodeInfo(name="n1", gpu_flavor="a100", gpu_count=8, gpu_memory_mib=40960)))
    service = AdmissionService("admission", AdmissionCore(), service_settings(nats_server, "admission"))
    async with running(service):
        tenant = await connect_as(nats_server, "team-a")
        yield admin_js, tenant.jetstream()
        await tenant.close()


async def outcome(js, job_id: str):
    """The admission decision filed under a job id."""
    async def find():
        async for m in eventlog.read(js, subjects=[f"gpusched.job.{job_id}.>"]):
            e = parse_event(m.data)
            if e.type in ("JobAdmitted", "JobRejected"):
                return e
        return None
    return await eventually(find)


async def submit(tenant, payload) -> int:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return (await tenant.publish("gpusched.intake.team-a.submit", data)).seq


@pytest.mark.parametrize(
    "payload, reason, field, in_message",
    [
        ({}, "schema-invalid", "spec", "Field required"),
        (good("x1", gpus=-1), "schema-invalid", "spec.gpus", "greater than or equal to 0"),
        (good("x2", gpus=100000), "schema-invalid", "spec.gpus", "less than or equal to 64"),
        (good("x3", kind="party"), "schema-invalid", "spec.kind", "'training', 'inference', 'evaluation' or 'batch'"),
        ([1, 2, 3], "schema-invalid", "(root)", "should be an object"),
        (good("x4", team="team-b"), "forbidden", "spec.team", "does not match the intake subject"),
    ],
)
async def test_malformed_submissions_are_rejected_by_intake_sequence(admission, payload, reason, field, in_message):
    admin_js, tenant = admission
    seq = await submit(tenant, payload)
    rejected = await outcome(admin_js, rejection_id(seq))
    assert rejected.type == "JobRejected"
    assert (rejected.reason.value, rejected.field) == (reason, field)
    assert in_message in rejected.message
    assert rejected.intake_sequence == seq


@pytest.mark.parametrize(
    "spec, reason, field, in_message",
    [
        ({"queue": "nope"}, "unknown-queue", "spec.queue", "accepted: the queues of team 'team-a': research"),
        ({"gpu_flavors": ["h100"]}, "unknown-flavor", "spec.gpu_flavors", "accepted: a100"),
        ({"gpus": 16}, "unsatisfiable", "spec.gpus", "a100: 8 GPUs"),
        ({"priority_class": "vip"}, "schema-invalid", "spec.priority_class", "accepted: batch-low"),
    ],
)
async def test_well_formed_but_unacceptable_jobs_are_rejected_under_their_id(admission, spec, reason, field, in_message):
    admin_js, tenant = admission
    job_id = f"bad-{reason}"
    await submit(tenant, good(job_id, **spec))
    rejected = await outcome(admin_js, job_id)
    assert rejected.type == "JobRejected"
    assert (rejected.reason.value, rejected.field) == (reason, field)
    assert in_message in rejected.message


async def test_poison_and_oversize_input_do_not_block_valid_submissions(admission):
    admin_js, tenant = admission
    await submit(tenant, b"{not json")
    big = good("huge", env={"PAD": "x" * 8000})
    big["spec"]["args"] = ["y" * 4000] * 20  # over MAX_COMMAND_BYTES, under the 1 MiB stream limit
    assert len(json.dumps(big)) > MAX_COMMAND_BYTES
    big_seq = await submit(tenant, big)
    await admin_js.publish("gpusched.intake.team-a.resubmit", b"{}")  # unknown verb (a tenant may not publish it)
    await submit(tenant, good("fine-1"))

    assert (await outcome(admin_js, "fine-1")).type == "JobAdmitted"
    too_big = await outcome(admin_js, rejection_id(big_seq))
    assert too_big.reason.value == "payload-too-large"
    dead = [m async for m in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM)]
    reasons = sorted(m.headers["Gpusched-Reason"].split(":")[0] for m in dead)
    assert reasons == ["not JSON", "unknown intake subject 'gpusched.intake.team-a.resubmit'; accepted"]
    assert dead[0].data == b"{not json"


async def test_idempotency_key_and_job_id_duplicates(admission):
    admin_js, tenant = admission
    first = good("keyed-1", idempotency_key="run-42")
    await submit(tenant, first)
    assert (await outcome(admin_js, "keyed-1")).type == "JobAdmitted"
    # the same submission again: nothing new happens
    await submit(tenant, first)
    # same key, different spec: rejected, naming the original job
    changed = good("keyed-1", idempotency_key="run-42", gpus=4)
    seq = await submit(tenant, changed)
    dup = await outcome(admin_js, rejection_id(seq))
    assert dup.reason.value == "duplicate-idempotency-key"
    assert "keyed-1" in dup.message
    # a reused job id without a key
    seq2 = await submit(tenant, good("keyed-1"))
    reused = await outcome(admin_js, rejection_id(seq2))
    assert reused.reason.value == "duplicate-job-id"
    await submit(tenant, good("after-dupes"))
    await outcome(admin_js, "after-dupes")
    history = [parse_event(m.data).type async for m in eventlog.read(admin_js, subjects=["gpusched.job.keyed-1.>"])]
    assert history == ["JobSubmitted", "JobAdmitted"]


async def test_a_restarted_admission_rebuilds_and_does_not_decide_twice(nats_server, admission):
    admin_js, tenant = admission
    await submit(tenant, good("before-restart", idempotency_key="k-restart"))
    await outcome(admin_js, "before-restart")
    second = AdmissionService("admission", AdmissionCore(), service_settings(nats_server, "admission"))
    async with running(second):
        # the rebuilt state knows the key: the repeat is a no-op, a new job is admitted
        await submit(tenant, good("before-restart", idempotency_key="k-restart"))
        await submit(tenant, good("after-restart"))
        assert (await outcome(admin_js, "after-restart")).type == "JobAdmitted"
    types = [parse_event(m.data).type async for m in eventlog.read(admin_js, subjects=["gpusched.job.before-restart.>"])]
    assert types == ["JobSubmitted", "JobAdmitted"]


async def test_cancel_requests(admission):
    admin_js, tenant = admission
    await submit(tenant, good("to-cancel"))
    await outcome(admin_js, "to-cancel")
    cancel = json.dumps({"job_id": "to-cancel", "reason": "wrong data"}).encode()
    await tenant.publish("gpusched.intake.team-a.cancel", cancel)
    await tenant.publish("gpusched.intake.team-a.cancel", json.dumps({"job_id": "ghost"}).encode())

    async def cancel_requested():
        return [m async for m in eventlog.read(admin_js, subjects=["gpusched.job.to-cancel.cancel_requested"])]
    [msg] = await eventually(cancel_requested)
    assert parse_event(msg.data).reason == "wrong data"

    async def ghost_dead_lettered():
        return [m async for m in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM)]
    [dead] = await eventually(ghost_dead_lettered)
    assert "'ghost' does not exist" in dead.headers["Gpusched-Reason"]


async def test_checkpoint_reports(admission):
    admin_js, tenant = admission
    await submit(tenant, good("ckpt"))
    await outcome(admin_js, "ckpt")
    start = datetime.now(UTC)
    await eventlog.EventLog(admin_js).append(new_event(
        JobStarted, aggregate_id="ckpt", producer="executor", occurred_at=start, key="1", attempt=1, nodes=("n1",)))

    def report(**fields) -> bytes:
        body = {"job_id": "ckpt", "attempt": 1, "checkpointed_at": datetime.now(UTC).isoformat(),
                "step": 10, "location": "s3://b/ckpt/10"}
        body.update(fields)
        return json.dumps(body).encode()

    async def admitted_start():
        return [m async for m in eventlog.read(admin_js, subjects=["gpusched.job.ckpt.started"])]
    await eventually(admitted_start)
    await tenant.publish("gpusched.intake.team-a.checkpoint", report(attempt=3))
    await tenant.publish("gpusched.intake.team-a.checkpoint", report())

    async def checkpointed():
        return [m async for m in eventlog.read(admin_js, subjects=["gpusched.job.ckpt.checkpointed"])]
    [msg] = await eventually(checkpointed)
    event = parse_event(msg.data)
    assert (event.attempt, event.step, event.location) == (1, 10, "s3://b/ckpt/10")

    async def dead_lettered():
        return [m async for m in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM)]
    [dead] = await eventually(dead_lettered)
    assert "attempt 3 of job ckpt is not running; accepted: 1" in dead.headers["Gpusched-Reason"]


async def test_a_command_nested_thousands_deep_or_holding_nul_is_refused_and_admission_keeps_going(admission):
    """Such a command used to crash admission (RecursionError in the JSON parser: never acked,
    redelivered every ack wait) or pass it and stop the read models (Postgres refuses NUL)."""
    admin_js, tenant = admission
    deep_seq = await submit(tenant, b'{"a":' * 5000 + b"1" + b"}" * 5000)
    nul_seq = await submit(tenant, good("nul-1", args=["ok", "bad\u0000arg"]))
    await tenant.publish("gpusched.intake.team-a.cancel", b'{"job_id": "fine-2", "requested_by": "a\\u0000"}')
    await submit(tenant, good("fine-2"))

    assert (await outcome(admin_js, "fine-2")).type == "JobAdmitted"
    deep = await outcome(admin_js, rejection_id(deep_seq))
    assert (deep.reason.value, deep.field) == ("schema-invalid", "(root)") and "nested 5000 levels" in deep.message
    nul = await outcome(admin_js, rejection_id(nul_seq))
    assert (nul.reason.value, nul.field) == ("schema-invalid", "spec.args.1") and "NUL" in nul.message
    dead = [m async for m in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM)]
    assert [m.headers["Gpusched-Reason"].split(" at offset")[0] for m in dead] == [
        "invalid CancelJob: requested_by: contains a NUL character"]


class _BrokenOnCancel(AdmissionCore):
    def handle_cancel(self, raw, subject_team, now):
        raise RuntimeError("a bug in the core")


async def test_an_exception_in_the_core_dead_letters_that_command_and_admission_keeps_going(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(new_event(QueueConfigured, aggregate_id="research", producer="config", occurred_at=NOW, key="1",
                               name="research", allowed_teams=("team-a",),
                               quotas=(FlavorQuota(flavor="a100", nominal=8),)))
    service = AdmissionService("admission", _BrokenOnCancel(), service_settings(nats_server, "admission"))
    async with running(service):
        tenant = await connect_as(nats_server, "team-a")
        await tenant.jetstream().publish("gpusched.intake.team-a.cancel", b'{"job_id": "x"}')
        await submit(tenant.jetstream(), good("after-the-bug", gpu_flavors=[]))
        assert (await outcome(admin_js, "after-the-bug")).type in ("JobAdmitted", "JobRejected")
        await tenant.close()
    dead = [m async for m in eventlog.read(admin_js, stream=eventlog.DLQ_STREAM)]
    assert [m.headers["Gpusched-Reason"] for m in dead] == [
        "internal error on this command (RuntimeError: a bug in the core); reported as a bug"]


async def test_gpusched_checkpoint_uses_the_platform_clock_and_fails_when_refused(admission, nats_server):
    """Without --at the report carries no time and admission stamps it with the platform clock
    (a wall-clock stamp was refused under a scaled clock, while the CLI printed success)."""
    admin_js, tenant = admission
    await submit(tenant, good("ckpt-cli"))
    await outcome(admin_js, "ckpt-cli")
    await eventlog.EventLog(admin_js).append(new_event(
        JobStarted, aggregate_id="ckpt-cli", producer="executor", occurred_at=datetime.now(UTC), key="1", attempt=1,
        nodes=("n1",)))

    def cli(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
        return subprocess.run([sys.executable, "-m", "gpusched.cli.main", "checkpoint", "ckpt-cli", "--team", "team-a",
                               *args, "-o", "json"], env=env, capture_output=True, text=True, timeout=60)

    refused = await asyncio.to_thread(cli, "--attempt", "2", "--step", "5")
    assert refused.returncode == 2
    assert "refused the checkpoint report" in refused.stderr and "attempt 2 of job ckpt-cli is not running" in refused.stderr
    recorded = await asyncio.to_thread(cli, "--attempt", "1", "--step", "500")
    assert recorded.returncode == 0, recorded.stderr
    [msg] = [m async for m in eventlog.read(admin_js, subjects=["gpusched.job.ckpt-cli.checkpointed"])]
    event = parse_event(msg.data)
    assert (event.step, event.checkpointed_at) == (500, event.occurred_at)  # stamped by admission's clock
    assert json.loads(recorded.stdout)["checkpointed_at"] == event.checkpointed_at.isoformat()
