"""The Python SDK against the running platform, and the CLI through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gpusched import AsyncClient, Client, Forbidden, InvalidInput, NotFound, Rejected, Unauthorized
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
        assert final["state"] == "succeeded" and final["submitter"] == "alice"
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
        assert rejected.value.reason and rejected.value.job_id
        with pytest.raises(InvalidInput) as invalid:
            gs.submit({**job_document(None, "team-a")["spec"], "gpus": -1})
        assert invalid.value.errors[0]["field"] == "body.spec.gpus"
        with pytest.raises(Forbidden):
            gs.submit(job_document(None, "team-b"))
        with pytest.raises(NotFound):
            gs.get("no-such-job")
    with pytest.raises(Unauthorized), Client(api_stack.url, "gst_aaaaaaaaaaaa_" + "b" * 43) as stranger:
        stranger.get("x")


def test_stream_checkpoint_and_cancel(api_stack):
    with client(api_stack) as gs:
        job_id = gs.submit(job_document(new_id(), "team-a", runtime_s=3000)).job_id
        running = gs.wait(job_id, states=("running",), timeout_s=60)
        assert running["attempt"] == 1
        assert gs.checkpoint(job_id, 1, step=100, location="s3://ckpt/100").outcome == "JobCheckpointed"
        assert gs.cancel(job_id, "done with it").outcome in ("JobCancelRequested", "JobCancelled")
        seen = []
        for streamed in gs.stream(job_id):  # history, then live, until the job ends
            seen.append(streamed.name)
        assert seen[:2] == ["JobSubmitted", "JobAdmitted"] and "JobCheckpointed" in seen and "JobCancelled" in seen
        assert gs.wait(job_id, timeout_s=30)["state"] == "cancelled"


async def test_the_async_client(api_stack):
    async with AsyncClient(api_stack.url, api_stack.tokens["alice"]) as gs:
        job_id = (await gs.submit(job_document(new_id("async"), "team-a", runtime_s=2))).job_id
        assert (await gs.wait(job_id, timeout_s=90))["state"] == "succeeded"
        names = [e.name async for e in gs.stream(job_id)]
        assert "JobSucceeded" in names
        found = [j["job_id"] async for j in gs.jobs(page_size=2)]
        assert job_id in found and len(found) == len(set(found))


def test_the_cli_submits_through_the_api(api_stack, tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job_document(new_id("cli"), "team-a")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env.update(GPUSCHED_API_URL=api_stack.url, GPUSCHED_API_TOKEN=api_stack.tokens["alice"],
               GPUSCHED_CONNECTION_FILE=str(tmp_path / "none.json"))
    gpusched = Path(sys.executable).parent / "gpusched"
    done = subprocess.run([str(gpusched), "submit", "-f", str(job_file), "--output", "json"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["decision"] == "JobAdmitted"
    job_file.write_text(json.dumps(job_document(new_id("cli"), "team-a", queue_name="q-team-b")))
    rejected = subprocess.run([str(gpusched), "submit", "-f", str(job_file), "--output", "json"], env=env,
                              capture_output=True, text=True, timeout=60)
    assert rejected.returncode == 1 and "rejected:" in rejected.stderr
    assert json.loads(rejected.stdout)["field"] in ("spec.queue", "spec.team")  # team-a may not use q-team-b
