"""Commands that publish wait for the platform's answer and exit non-zero when it refused them
(issue 21, deliverable 3), against a real nats-server and admission: a rejected submission exits
1 with the reason, a dead-lettered cancel exits 2 with admission's reason."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from test_admission import admission, good, outcome, submit  # noqa: F401 - the admission fixture

JOB = {"kind": "training", "queue": "research", "team": "team-a", "image": "img", "gpus": 1, "gpu_flavors": ["a100"]}


async def cli(nats_server, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "gpusched.cli.main", *args, "-o", "json"],
                                   env=env, capture_output=True, text=True, timeout=60)


async def submit_file(nats_server, tmp_path, document: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(document))
    return await cli(nats_server, "submit", "-f", str(path))


async def test_submit_exits_1_with_the_reason_when_rejected(admission, nats_server, tmp_path):
    admitted = await submit_file(nats_server, tmp_path, {"job_id": "fine", "spec": JOB})
    assert admitted.returncode == 0, admitted.stderr
    assert json.loads(admitted.stdout)["decision"] == "JobAdmitted"

    rejected = await submit_file(nats_server, tmp_path, {"job_id": "lost", "spec": {**JOB, "queue": "nope"}})
    assert rejected.returncode == 1
    assert json.loads(rejected.stdout)["reason"] == "unknown-queue"
    assert "rejected: unknown-queue: spec.queue 'nope' does not exist" in rejected.stderr


async def test_submit_of_an_existing_job_id_is_answered_by_its_own_rejection(admission, nats_server, tmp_path):
    """The job id's earlier JobAdmitted is not this submission's answer (it printed "admitted")."""
    assert (await submit_file(nats_server, tmp_path, {"job_id": "taken", "spec": JOB})).returncode == 0
    again = await submit_file(nats_server, tmp_path, {"job_id": "taken", "spec": {**JOB, "gpus": 2}})
    assert again.returncode == 1, again.stdout
    assert json.loads(again.stdout)["reason"] == "duplicate-job-id"

    keyed = {"spec": {**JOB, "idempotency_key": "k1"}}
    first = await submit_file(nats_server, tmp_path, keyed)
    repeat = await submit_file(nats_server, tmp_path, keyed)
    assert (first.returncode, repeat.returncode) == (0, 0), repeat.stderr
    assert json.loads(repeat.stdout)["decision"] == "JobAdmitted" and json.loads(repeat.stdout)["repeat"] is True


async def test_cancel_waits_and_exits_2_when_dead_lettered(admission, nats_server):
    admin_js, tenant = admission
    unknown = await cli(nats_server, "cancel", "no-such-job", "--team", "team-a")
    assert unknown.returncode == 2
    assert "refused the cancel request: CancelJob: job_id 'no-such-job' does not exist" in unknown.stderr

    await submit(tenant, good("to-cancel"))
    await outcome(admin_js, "to-cancel")
    other_team = await cli(nats_server, "cancel", "to-cancel", "--team", "team-b")
    assert other_team.returncode == 2 and "job_id 'to-cancel' does not exist (among the jobs of team 'team-b')" in other_team.stderr
    cancelled = await cli(nats_server, "cancel", "to-cancel", "--team", "team-a", "--reason", "done")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["decision"] == "JobCancelRequested"
    bad_id = await cli(nats_server, "cancel", "Not/A-Job", "--team", "team-a")
    assert bad_id.returncode == 2 and "cancel: job_id: String should match pattern" in bad_id.stderr
