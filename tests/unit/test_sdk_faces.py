"""The SDK (sdk/, gpusched_sdk) without a platform: its two faces are one API, it imports none of
the server, its job states are the contract's, and it reads job files as admission does."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import threading
from datetime import datetime

import pytest

import gpusched
import gpusched_sdk
from gpusched_sdk import AsyncClient, Client, JobFileError, JobState
from gpusched_sdk.client import StreamedEvent, _Waiting, event_state, job_document
from gpusched_sdk.contract import jobstate
from gpusched_sdk.sync import public_methods

HTTP_ADAPTER_USES = {"submit", "cancel", "checkpoint", "deploy", "scale", "report_load", "delete_service", "get", "jobs",
                     "events", "why", "queues", "usage", "services", "service", "wait", "stream", "whoami"}


def test_the_sync_face_has_every_method_of_the_async_core_with_its_signature():
    core = {n for n in public_methods(AsyncClient) if n != "aclose"}
    face = {n for n in public_methods(Client) if n != "close"}
    assert core == face
    assert HTTP_ADAPTER_USES <= core  # what gpusched.gateway.http calls
    for name in sorted(core):
        a, s = inspect.signature(getattr(AsyncClient, name)), inspect.signature(getattr(Client, name))
        assert list(a.parameters.values()) == list(s.parameters.values()), name
        assert getattr(Client, name).__doc__ == getattr(AsyncClient, name).__doc__
    assert inspect.signature(Client.__init__) == inspect.signature(AsyncClient.__init__)
    assert not any(inspect.iscoroutinefunction(m) for m in public_methods(Client).values())


def test_the_server_re_exports_the_sdk():
    assert gpusched.Client is Client and gpusched.AsyncClient is AsyncClient
    assert gpusched.Rejected is gpusched_sdk.Rejected


def test_importing_the_sdk_imports_nothing_of_the_server():
    code = ("import sys, gpusched_sdk; print(sorted({m.split('.')[0] for m in sys.modules}))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                           cwd="/").stdout.replace("'", '"')))
    assert "gpusched_sdk" in loaded and "pydantic" in loaded and "httpx" in loaded
    assert not loaded & {"fastapi", "asyncpg", "nats", "kubernetes", "runtime", "services", "schemas", "gpusched",
                         "yaml", "uvicorn", "starlette"}


def test_a_wait_accepts_the_contracts_job_states_and_follows_its_event_map():
    assert gpusched_sdk.FINAL_STATES is jobstate.FINAL_STATES and JobState is jobstate.JobState
    for state in JobState:
        _Waiting("j", (state.value,), 1)
    with pytest.raises(ValueError, match="accepted: submitted, rejected, queued"):
        _Waiting("j", ("finished",), 1)
    for name, state in jobstate.EVENT_STATES.items():
        assert event_state(StreamedEvent(name, None, "{}")) == state
    assert event_state(StreamedEvent("JobCheckpointed", None, "{}")) is None
    requeued = StreamedEvent("JobRetryScheduled", None, "{}", event=type("E", (), {"after": "JobPreempted"})())
    assert event_state(requeued) is JobState.QUEUED


def test_results_are_typed():
    job = gpusched_sdk.Job.model_validate({"job_id": "j-1", "state": "running", "started_at": "2026-12-05T10:00:00Z",
                                           "submitted_at": None, "newer_field": 1})
    assert job.state is JobState.RUNNING and job.started_at == datetime.fromisoformat("2026-12-05T10:00:00+00:00")
    assert job["newer_field"] == 1 and job.get("missing") is None
    with pytest.raises(KeyError):
        job["missing"]
    why = gpusched_sdk.Why.model_validate({"job_id": "j-1", "last_event": "JobAdmitted",
                                           "since": "2026-12-05T10:00:00+00:00", "reason": {"code": "quota-exhausted",
                                           "since": "2026-12-05T10:00:01+00:00", "position": 2}, "history": []})
    assert isinstance(why.reason.since, datetime) and why.reason.position == 2


def test_job_documents_from_files_and_models(tmp_path):
    from schemas import JobSpec, SubmitJob  # the server's contract: the same models under another name

    spec = {"kind": "training", "queue": "q-team-a", "team": "team-a", "image": "registry.example/t:1", "gpus": 1}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    assert job_document(path) == {"spec": spec}
    path.write_text(json.dumps({**spec, "gpus": -1}))
    with pytest.raises(JobFileError, match=r"job.json: spec.gpus"):
        job_document(path)
    (tmp_path / "job.yaml").write_text("spec:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in spec.items()))
    assert job_document(tmp_path / "job.yaml") == {"spec": spec}
    with pytest.raises(JobFileError, match="nothing.json"):
        job_document(tmp_path / "nothing.json")
    assert job_document(JobSpec(**spec))["spec"]["gpus"] == 1
    assert job_document(SubmitJob(job_id="j-x", spec=JobSpec(**spec)))["job_id"] == "j-x"
    with pytest.raises(TypeError, match="not a job"):
        job_document(gpusched_sdk.Me(name="a", role="member"))


def test_the_sync_face_closes_its_loop_and_raises_the_cores_errors(monkeypatch):
    import httpx

    gs = Client("http://127.0.0.1:9", "t", timeout_s=2)
    with pytest.raises(httpx.ConnectError):
        gs.get("j-1")
    with pytest.raises(httpx.ConnectError):
        next(iter(gs.stream("j-1")))
    gs.close()
    assert not gs._portal.thread.is_alive()
    monkeypatch.delenv("GPUSCHED_API_URL", raising=False)
    threads = threading.active_count()
    with pytest.raises(ValueError, match="no API URL"):
        Client(None, "t")
    assert threading.active_count() == threads  # a client that could not be made leaves no loop behind
