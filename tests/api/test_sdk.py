"""The Python SDK against the running platform, and the CLI through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpusched import AsyncClient, Client, Forbidden, InvalidInput, NotFound, Rejected, Unauthorized, WaitTimeout
from gpusched_sdk import Job, JobState, Why
from gpusched.gateway.connection import Connection
from gpusched.userinput import UserError
from schemas import JobSpec, SubmitJob
from tests.api.stack import job_document


def new_id(prefix: str = "sdk") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def client(api_stack, holder: str = "alice") -> Client:
    return Client(api_stack.url, api_stack.tokens[holder])


def test_submit_from_a_dict_a_file_and_models_then_wait(api_stack, tmp_path):
    spec = job_document(None, "team-a", runtime_s=2)["spec"]
    path = tmp_path / "job.yaml"
    path.write_text(f"job_id: {new_id()}\nspec:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in spec.items()))
    with client(api_stack) as gs:
        answers = [gs.submit(spec), gs.submit({"job_id": new_id(), "spec": spec}), gs.submit(path),
                   gs.submit(JobSpec(**spec)), gs.submit(SubmitJob(job_id=new_id(), spec=JobSpec(**spec)))]
        assert {a.decision for a in answers} == {"admitted"}
        final = gs.wait(answers[0].job_id, timeout_s=90)
        assert isinstance(final, Job) and final.state is JobState.SUCCEEDED and final.submitter == "alice"
        assert final["state"] == "succeeded"  # a result also reads as a mapping
        assert isinstance(final.finished_at, datetime) and final.finished_at.tzinfo is not None
        assert final.started_at <= final.finished_at
        kinds = [e.type for e in gs.events(answers[0].job_id)]
        assert kinds[0] == "JobSubmitted" and "JobSucceeded" in kinds


def test_idempotent_repeat_and_typed_errors(api_stack):
    with client(api_stack) as gs:
        key = uuid.uuid4().hex
        first = gs.submit(job_document(None, "team-a"), idempotency_key=key)
        again = gs.submit(job_document(None, "team-a"), idempotency_key=key)
        assert again.job_id == first.job_id and again.repeat and not first.repeat
        with pytest.raises(Rejected) as rejected:
            gs.submit(job_document(None, "team-a", queue_name="q-team-b"))
        assert rejected.value.reason == "forbidden" and rejected.value.job_id and rejected.value.status == 409
        with pytest.raises(InvalidInput) as invalid:
            gs.submit({**job_document(None, "team-a")["spec"], "gpus": -1})
        assert invalid.value.errors[0]["field"] == "body.spec.gpus"
        with pytest.raises(Forbidden):
            gs.submit(job_document(None, "team-b"))
        with pytest.raises(Forbidden):
            next(iter(gs.team_stream("team-b")))
        with pytest.raises(NotFound):
            gs.get("no-such-job")
        with pytest.raises(ValueError, match="states"):
            gs.wait("no-such-job", states=("finished",))
    with pytest.raises(Unauthorized), Client(api_stack.url, "gst_aaaaaaaaaaaa_" + "b" * 43) as stranger:
        stranger.get("x")


def test_stream_checkpoint_and_cancel(api_stack):
    with client(api_stack) as gs:
        job_id = gs.submit(job_document(new_id(), "team-a", runtime_s=3000)).job_id
        running = gs.wait(job_id, states=("running",), timeout_s=60)
        assert running.attempt == 1 and isinstance(running.started_at, datetime)
        why = gs.why(job_id)
        assert isinstance(why, Why) and isinstance(why.since, datetime)
        # The read model may show "running" a moment before admission has read the JobStarted
        # (each follows the log on its own): a refusal for "no running attempt" is retried.
        deadline = time.monotonic() + 10
        while True:
            try:
                checkpointed = gs.checkpoint(job_id, 1, step=100, location="s3://ckpt/100")
                break
            except Rejected as refused:
                if "no running attempt" not in str(refused) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert checkpointed.outcome == "JobCheckpointed"
        assert gs.cancel(job_id, "done with it").outcome in ("JobCancelRequested", "JobCancelled")
        deadline = time.monotonic() + 60
        while True:  # history, then live, until the job ends or the stack's 2 s limit: reconnect as a client does
            seen = [streamed.name for streamed in gs.stream(job_id)]
            if "JobCancelled" in seen or time.monotonic() > deadline:
                break
        assert seen[:2] == ["JobSubmitted", "JobAdmitted"] and "JobCheckpointed" in seen and "JobCancelled" in seen
        assert gs.wait(job_id, timeout_s=30)["state"] == "cancelled"


def test_wait_outlives_the_servers_stream_limit_and_times_out(api_stack):
    """The stack ends each stream after 2 s: a wait reconnects until the job ends."""
    with client(api_stack) as gs:
        job_id = gs.submit(job_document(new_id(), "team-a", runtime_s=5)).job_id
        assert gs.wait(job_id, timeout_s=90)["state"] == "succeeded"
        long = gs.submit(job_document(new_id(), "team-a", runtime_s=3000)).job_id
        with pytest.raises(WaitTimeout, match="waited for succeeded"):
            gs.wait(long, states=("succeeded",), timeout_s=3)
        gs.cancel(long, "test over")


async def test_the_async_client(api_stack):
    async with AsyncClient(api_stack.url, api_stack.tokens["alice"]) as gs:
        job_id = (await gs.submit(job_document(new_id("async"), "team-a", runtime_s=2))).job_id
        assert (await gs.wait(job_id, timeout_s=90))["state"] == "succeeded"
        names = [e.name async for e in gs.stream(job_id)]
        assert "JobSucceeded" in names
        found = [j.job_id async for j in gs.jobs(page_size=2)]
        assert job_id in found and len(found) == len(set(found))
        with pytest.raises(NotFound):
            await gs.why("no-such-job")


async def test_the_team_stream_shows_the_teams_new_jobs(api_stack):
    """Live only, and the stack ends a stream after 2 s: under load the notifier's copies can come
    later than that, so the client reconnects (as a real one does) until it has seen the job."""
    async with AsyncClient(api_stack.url, api_stack.tokens["alice"]) as gs:
        stream = gs.team_stream("team-a").__aiter__()
        opened = await anext(stream)
        assert opened.name == "open" and opened.event is None
        job_id = (await gs.submit(job_document(new_id("team"), "team-a", runtime_s=3000), wait_s=0)).job_id
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while "JobStarted" not in seen and time.monotonic() < deadline:
            seen += [e.name async for e in stream if e.event is not None and e.event.aggregate_id == job_id]
            stream = gs.team_stream("team-a").__aiter__()
        assert "JobStarted" in seen, seen  # the job's events reached the team's stream
        await gs.cancel(job_id, "test over", wait_s=0)


def test_the_cli_submits_checkpoints_and_cancels_through_the_api(api_stack, tmp_path):
    job_file = tmp_path / "job.json"
    job_id = new_id("cli")
    job_file.write_text(json.dumps(job_document(job_id, "team-a", runtime_s=3000)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}  # no NATS: only the API
    env.update(GPUSCHED_API_URL=api_stack.url, GPUSCHED_API_TOKEN=api_stack.tokens["alice"],
               GPUSCHED_CONNECTION_FILE=str(tmp_path / "none.json"))
    gpusched = Path(sys.executable).parent / "gpusched"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(gpusched), *args, "--output", "json"], env=env, capture_output=True, text=True,
                              timeout=60)

    done = cli("submit", "-f", str(job_file))
    assert done.returncode == 0, done.stderr
    # the fields `gpusched submit` prints over NATS too; the trace is the API request's, not the CLI's
    assert json.loads(done.stdout) == {"job_id": job_id, "intake_sequence": json.loads(done.stdout)["intake_sequence"],
                                       "decision": "JobAdmitted", "repeat": False, "trace_id": None}
    with client(api_stack) as gs:
        started = gs.wait(job_id, states=("running",), timeout_s=60).started_at
    at = (started.astimezone(UTC) + timedelta(seconds=1)).replace(tzinfo=None, microsecond=0).isoformat()  # UTC
    reported = cli("checkpoint", job_id, "--team", "team-a", "--attempt", "1", "--step", "7", "--at", at)
    assert reported.returncode == 0, reported.stderr
    assert json.loads(reported.stdout)["checkpointed_at"].startswith(at)
    refused = cli("checkpoint", job_id, "--team", "team-a", "--attempt", "1", "--on-behalf-of", "carol")
    assert refused.returncode == 2 and "--on-behalf-of" in refused.stderr
    cancelled = cli("cancel", job_id, "--team", "team-a", "--reason", "enough")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["decision"] in ("JobCancelRequested", "JobCancelled")
    unknown = cli("cancel", "no-such-job", "--team", "team-a")
    assert unknown.returncode == 2 and "no-such-job" in unknown.stderr
    job_file.write_text(json.dumps(job_document(new_id("cli"), "team-a", queue_name="q-team-b")))
    rejected = subprocess.run([str(gpusched), "submit", "-f", str(job_file), "--output", "json"], env=env,
                              capture_output=True, text=True, timeout=60)
    assert rejected.returncode == 1 and "rejected:" in rejected.stderr
    assert json.loads(rejected.stdout)["field"] in ("spec.queue", "spec.team")  # team-a may not use q-team-b


def test_the_connection_files_token_goes_only_to_its_api(tmp_path, monkeypatch):
    for name in ("GPUSCHED_NATS_URL", "GPUSCHED_API_URL", "GPUSCHED_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    saved = tmp_path / "connection.json"
    saved.write_text(json.dumps({"nats_url": "nats://127.0.0.1:4999", "api_url": "http://127.0.0.1:8099",
                                 "api_token": "from-the-file"}))
    monkeypatch.setenv("GPUSCHED_CONNECTION_FILE", str(saved))
    assert (Connection.resolve().api_url, Connection.resolve().api_token) == ("http://127.0.0.1:8099", "from-the-file")
    monkeypatch.setenv("GPUSCHED_API_URL", "https://elsewhere.example")
    assert Connection.resolve().api_token is None
    monkeypatch.setenv("GPUSCHED_API_URL", "127.0.0.1:8099")
    monkeypatch.setenv("GPUSCHED_API_TOKEN", "t")
    with pytest.raises(UserError, match="accepted: http:// or https://"):
        Connection.resolve().client()
    monkeypatch.delenv("GPUSCHED_API_URL")
    monkeypatch.setenv("GPUSCHED_NATS_URL", "nats://another:4222")
    assert Connection.resolve().api_url is None


def test_server_sent_event_lines_parse_as_the_format_says():
    from gpusched_sdk.client import _Events

    parser = _Events()
    lines = [": ping", "", "event: open", 'data: {"team":', 'data:  "team-a"}', "", "event: gone", "id: 7", "",
             "data: plain", ""]
    got = [e for line in lines if (e := parser.line(line)) is not None]
    assert [(e.name, e.id, e.data, e.event) for e in got] == [
        ("open", None, '{"team":\n "team-a"}', None), ("message", None, "plain", None)]
