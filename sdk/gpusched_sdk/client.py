"""The client of gpusched's HTTP API (docs/api.md, docs/sdk.md): :class:`AsyncClient` is the one
implementation; :class:`gpusched_sdk.Client` is its synchronous face, made from it (sync.py).

    from gpusched_sdk import AsyncClient

    async with AsyncClient() as gs:           # GPUSCHED_API_URL, GPUSCHED_API_TOKEN
        job = await gs.submit({"kind": "training", "queue": "research", "team": "team-research",
                               "image": "registry.example/train:1", "gpus": 8}, idempotency_key="run-42")
        final = await gs.wait(job.job_id, timeout_s=3600)   # a Job: final.state, final.finished_at

Errors are typed from the API's problem documents (errors.py). The job states a wait accepts and
the event-to-state map are the contract's (``gpusched_sdk.contract.jobstate``)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ValidationError

from .contract.commands import MalformedCommand, SubmitJob, parse_command
from .contract.envelope import Event
from .contract.jobstate import FINAL_STATES, JobState, state_after
from .contract.registry import EVENT_TYPES_BY_NAME, parse_event
from .errors import ERRORS, ApiError, JobFileError, NotFound, WaitTimeout
from .models import Answered, Job, Me, ServiceAnswer, Submitted, Why

FAILED_SETTLE_S = 2.0
"""A job in state ``failed`` is final when no retry follows within this long (quota schedules one
right after the failure when the job's retry policy allows it)."""
CATCH_UP_S = 5.0
"""How long a wait reads the job's row after an event that may end it: the read models follow
the event log, a little behind."""
POLL_S = 0.2
MAX_JOB_FILE_BYTES = 1024 * 1024


@dataclass
class StreamedEvent:
    """One server-sent event: its name (the event type), id, and the event itself (None for
    the stream's own ``open`` event)."""

    name: str
    id: str | None
    data: str
    event: Event | None = field(default=None)


def job_document(job: Any) -> dict[str, Any]:
    """A SubmitJob document from: a dict (a SubmitJob with ``spec``, or a bare spec), a path to a
    JSON or YAML job file (checked against the contract, JobFileError naming the file and the
    field), or a pydantic SubmitJob or JobSpec (the SDK's contract models, or the server's
    ``schemas`` ones: the same contract under another name)."""
    if isinstance(job, BaseModel):
        name = type(job).__name__
        if name not in ("SubmitJob", "JobSpec") or not type(job).__module__.endswith(("commands", "job")):
            raise TypeError(f"a {name} is not a job; accepted: SubmitJob, JobSpec, a dict or a file path")
        document = job.model_dump(mode="json", exclude_none=True)
        return document if name == "SubmitJob" else {"spec": document}
    if isinstance(job, (str, Path)):
        return _job_file(Path(job))
    if isinstance(job, dict):
        return dict(job) if "spec" in job else {"spec": dict(job)}
    raise TypeError(f"a {type(job).__name__} is not a job; accepted: SubmitJob, JobSpec, a dict or a file path")


def _job_file(path: Path) -> dict[str, Any]:
    """A job file's SubmitJob document, checked as admission checks a command."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise JobFileError(f"{path}: {err.strerror or err}") from None
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise JobFileError(f"{path}: larger than {MAX_JOB_FILE_BYTES} bytes; accepted: files of at most 1 MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise JobFileError(f"{path}: not UTF-8; accepted: UTF-8 text") from None
    if path.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        try:
            document = json.loads(text)
        except ValueError as err:
            raise JobFileError(f"{path}: not JSON ({err})") from None
    else:
        try:
            import yaml
        except ImportError:
            raise JobFileError(f"{path}: a YAML job file needs PyYAML (pip install 'gpusched-sdk[yaml]'); "
                               "accepted without it: a JSON file") from None
        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise JobFileError(f"{path}: not YAML: {err}") from None
    if not isinstance(document, dict):
        raise JobFileError(f"{path}: (root): expected a mapping with the job spec, got {type(document).__name__}")
    document = document if "spec" in document else {"spec": document}
    try:
        parse_command(SubmitJob, json.dumps(document, default=_json_value).encode())
    except TypeError as err:
        raise JobFileError(f"{path}: {err}; accepted: strings, numbers, booleans, null, mappings and lists") from None
    except MalformedCommand as err:
        raise JobFileError(f"{path}: {err.field}: {err.message}") from None
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise JobFileError(f"{path}: {where}: {first['msg']}") from None
    return json.loads(json.dumps(document, default=_json_value))


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):  # YAML reads an unquoted time as one
        return value.isoformat()
    raise TypeError(f"a {type(value).__name__} value is not accepted")


def _settings(url: str | None, token: str | None) -> tuple[str, str]:
    url = url or os.environ.get("GPUSCHED_API_URL")
    token = token or os.environ.get("GPUSCHED_API_TOKEN")
    if not url:
        raise ValueError("no API URL: pass url= or set GPUSCHED_API_URL (make run prints it)")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"API URL {url!r} is not one; accepted: http:// or https:// and a host, "
                         "e.g. http://127.0.0.1:8080")
    if not token:
        raise ValueError("no API token: pass token= or set GPUSCHED_API_TOKEN (`gpusched token issue`)")
    return url.rstrip("/"), token


def _answer(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            problem = response.json()
        except ValueError:
            problem = {"detail": response.text[:500]}
        raise ERRORS.get(response.status_code, ApiError)(response.status_code, problem)
    if response.headers.get("content-type", "").startswith("text/csv"):
        return response.text
    return response.json()


def _checkpoint_body(attempt: int, step: int | None, location: str, at: datetime | None) -> dict[str, Any]:
    body: dict[str, Any] = {"attempt": attempt, "location": location}
    if step is not None:
        body["step"] = step
    if at is not None:
        body["checkpointed_at"] = (at if at.tzinfo else at.replace(tzinfo=UTC)).isoformat()
    return body


def _read_until(timeout_s: float, until: float | None) -> httpx.Timeout | None:
    """A stream's timeouts when it must end by the monotonic time ``until``: no read waits past it."""
    if until is None:
        return None
    return httpx.Timeout(timeout_s, read=max(0.1, min(timeout_s, until - time.monotonic())))


class _Events:
    """Server-sent-event lines to :class:`StreamedEvent`s (the text/event-stream format)."""

    def __init__(self) -> None:
        self.name, self.id, self.data = "message", None, []

    def line(self, line: str) -> StreamedEvent | None:
        if line == "":
            name, id_, data, self.name, self.id, self.data = self.name, self.id, self.data, "message", None, []
            if not data:
                return None
            out = StreamedEvent(name, id_, "\n".join(data))
            if name in EVENT_TYPES_BY_NAME:  # an event of the contract (not the stream's own "open")
                out.event = parse_event(out.data)
            return out
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "event":
            self.name = value
        elif key == "id":
            self.id = value
        elif key == "data":
            self.data.append(value)
        return None


def event_state(streamed: StreamedEvent) -> JobState | None:
    """The job state a streamed event leads to (the contract's map); None for events that do not
    change it."""
    return state_after(streamed.name, getattr(streamed.event, "after", None))


class _Waiting:
    """When a wait is over, as a pure decision over what the stream and the job's row show.

    Over when the row's state is one of ``states`` or a final one (the job can go nowhere else);
    ``failed`` counts only once it stayed so for FAILED_SETTLE_S (a retry may follow), unless
    ``failed`` is waited for explicitly. WaitTimeout past the deadline."""

    def __init__(self, job_id: str, states: tuple[str, ...], timeout_s: float) -> None:
        accepted = [s.value for s in JobState]
        unknown = sorted(set(states) - set(accepted))
        if unknown or not states:
            raise ValueError(f"states: {unknown or 'none given'} not job states; accepted: {', '.join(accepted)}")
        self.job_id, self.states, self.timeout_s = job_id, tuple(JobState(s) for s in states), timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.failed_since: float | None = None
        self.seen: set[str] = set()
        self.settle_failed = set(self.states) == set(FINAL_STATES) or JobState.FAILED not in self.states

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def shows_end(self, streamed: StreamedEvent) -> bool:
        """Whether this event may end the wait (the row is read then); an event seen before (a
        reconnected stream replays the job's history) does not."""
        if streamed.id is not None:
            if streamed.id in self.seen:
                return False
            self.seen.add(streamed.id)
        state = event_state(streamed)
        return state in self.states or state in FINAL_STATES

    def done(self, job: Job | None) -> bool:
        now = time.monotonic()
        state = job.state if job else None
        if state in self.states or state in FINAL_STATES:
            if state != JobState.FAILED or not self.settle_failed:
                return True
            self.failed_since = self.failed_since or now
            if now - self.failed_since >= FAILED_SETTLE_S:
                return True
        else:
            self.failed_since = None
        if now >= self.deadline:
            raise WaitTimeout(f"job {self.job_id} is {state or 'not in the read models'} after {self.timeout_s:.0f} s; "
                              f"waited for {', '.join(self.states)}")
        return False


class AsyncClient:
    """The API, for asyncio. ``url`` and ``token`` default to GPUSCHED_API_URL and
    GPUSCHED_API_TOKEN. Use as an async context manager, or await :meth:`aclose`.

    Every public method here is also :class:`gpusched_sdk.Client`'s, synchronously (made from
    this class: the two cannot differ)."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout_s: float = 60.0) -> None:
        self.url, token = _settings(url, token)
        self._timeout_s = timeout_s
        self._http = httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                                       timeout=httpx.Timeout(timeout_s, read=timeout_s))

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs) -> Any:
        return _answer(await self._http.request(method, path, **kwargs))

    # -- jobs ----------------------------------------------------------------------------------
    async def submit(self, job: Any, *, idempotency_key: str | None = None, wait_s: float = 10.0,
                     on_behalf_of: str | None = None) -> Submitted:
        """Submit and wait up to ``wait_s`` for admission's answer; Rejected when it refuses.
        ``job``: a dict (a SubmitJob or a bare spec), a job file's path, a SubmitJob or a JobSpec."""
        document = job_document(job)
        if on_behalf_of is not None:
            document["on_behalf_of"] = on_behalf_of
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return Submitted.model_validate(await self._call("POST", "/v1/jobs", json=document, headers=headers,
                                                         params={"wait": wait_s}))

    async def cancel(self, job_id: str, reason: str = "", *, wait_s: float = 10.0) -> Answered:
        return Answered.model_validate(await self._call("POST", f"/v1/jobs/{job_id}/cancel", json={"reason": reason},
                                                        params={"wait": wait_s}))

    async def checkpoint(self, job_id: str, attempt: int, *, step: int | None = None, location: str = "",
                         checkpointed_at: datetime | None = None, wait_s: float = 10.0) -> Answered:
        """Report a checkpoint of the running ``attempt`` (taken at ``checkpointed_at``, default:
        when admission receives the report); ``outcome`` JobCheckpointed once recorded."""
        return Answered.model_validate(await self._call(
            "POST", f"/v1/jobs/{job_id}/checkpoints", params={"wait": wait_s},
            json=_checkpoint_body(attempt, step, location, checkpointed_at)))

    async def get(self, job_id: str) -> Job:
        """The job's row: state, times, placement."""
        return Job.model_validate(await self._call("GET", f"/v1/jobs/{job_id}"))

    async def jobs(self, *, page_size: int = 100, **filters: Any) -> AsyncIterator[Job]:
        """Every job matching ``filters`` (team, state, queue, kind, submitter), newest first,
        fetched a page at a time."""
        params: dict[str, Any] = {**{k: v for k, v in filters.items() if v is not None}, "limit": page_size}
        while True:
            page = await self._call("GET", "/v1/jobs", params=params)
            for item in page["items"]:
                yield Job.model_validate(item)
            if not page["next_cursor"]:
                return
            params["cursor"] = page["next_cursor"]

    async def events(self, job_id: str, *, with_sequence: bool = False) -> list[Event] | list[tuple[int, Event]]:
        """The job's events from the log, in order, as the contract's event models; with
        ``with_sequence``, ``(sequence, event)`` pairs, each event with its stream sequence."""
        rows = await self._call("GET", f"/v1/jobs/{job_id}/events")
        parsed = [(e.get("sequence"), parse_event(json.dumps({k: v for k, v in e.items() if k != "sequence"})))
                  for e in rows]
        return parsed if with_sequence else [e for _, e in parsed]

    async def why(self, job_id: str) -> Why:
        """Why the job waits: the current reasons and their history."""
        return Why.model_validate(await self._call("GET", f"/v1/jobs/{job_id}/why"))

    async def queues(self) -> list[dict[str, Any]]:
        """Per queue and flavor: nominal, limits, used, borrowed, lent, pending jobs, budget left."""
        return await self._call("GET", "/v1/queues")

    async def usage(self, **params: Any) -> Any:
        """GPU-hours and cost per group (``by``, ``period``, ``format``: json rows or csv text)."""
        return await self._call("GET", "/v1/usage", params=params)

    async def chargeback(self, period: str, *, group_by: str = "team") -> dict[str, Any]:
        """The month's (``YYYY-MM``) chargeback statement as of the log's now: its items (per
        team, project, queue, flavor and unit price), lines per group, totals, log range,
        checksum (``checksum_alg`` ``jcs-sha256``), ``statement_id`` and whether it is
        ``provisional`` (the period is still open). Every figure is a decimal string (money to
        the currency's minor unit, GPU-hours to 6 places): read it with ``decimal.Decimal``,
        never ``float`` (docs/accounting.md#money). Chargeback readers, operators and admins."""
        return await self._call("GET", "/v1/chargeback", params={"period": period, "group_by": group_by})

    async def summary(self) -> dict[str, Any]:
        """Jobs by state, wait p50/p95 (the usage ledger's) and failures of the last day, GPU
        utilization of the last hour (a member: its team's)."""
        return await self._call("GET", "/v1/metrics/summary")

    async def whoami(self) -> Me:
        """The token's holder, role and team."""
        return Me.model_validate(await self._call("GET", "/v1/whoami"))

    # -- inference services (docs/serving.md) --------------------------------------------------
    async def deploy(self, service: dict[str, Any], *, wait_s: float = 10.0) -> ServiceAnswer:
        """Deploy, or roll out a new spec of, a service: a DeployService document (``{"spec": ...}``)."""
        return ServiceAnswer.model_validate(await self._call("POST", "/v1/services", json=service,
                                                             params={"wait": wait_s}))

    async def scale(self, name: str, replicas: int, *, wait_s: float = 10.0) -> ServiceAnswer:
        return ServiceAnswer.model_validate(await self._call(
            "POST", f"/v1/services/{name}/scale", json={"replicas": replicas}, params={"wait": wait_s}))

    async def report_load(self, name: str, requests_per_second: float, *, wait_s: float = 10.0) -> ServiceAnswer:
        return ServiceAnswer.model_validate(await self._call(
            "POST", f"/v1/services/{name}/load", json={"requests_per_second": requests_per_second},
            params={"wait": wait_s}))

    async def delete_service(self, name: str, *, wait_s: float = 10.0) -> ServiceAnswer:
        return ServiceAnswer.model_validate(await self._call("DELETE", f"/v1/services/{name}",
                                                             params={"wait": wait_s}))

    async def services(self) -> list[dict[str, Any]]:
        return await self._call("GET", "/v1/services")

    async def service(self, name: str) -> dict[str, Any]:
        return await self._call("GET", f"/v1/services/{name}")

    # -- streams and waits ---------------------------------------------------------------------
    def stream(self, job_id: str) -> AsyncIterator[StreamedEvent]:
        """The job's events: its history, then live, until it ends or the server ends the stream
        (GPUSCHED_API_STREAM_MAX_S; open it again to go on)."""
        return self._stream(f"/v1/jobs/{job_id}/stream")

    def team_stream(self, team: str) -> AsyncIterator[StreamedEvent]:
        """The team's job events from now on (the first is ``open``), until the server ends the
        stream (open it again to go on). Forbidden for another team's."""
        return self._stream(f"/v1/teams/{team}/stream")

    async def _stream(self, path: str, until: float | None = None) -> AsyncIterator[StreamedEvent]:
        """The stream's events until the server ends it (or the monotonic time ``until``)."""
        timeout = _read_until(self._timeout_s, until)
        async with self._http.stream("GET", path, headers={"Accept": "text/event-stream"},
                                     **({"timeout": timeout} if timeout else {})) as response:
            if response.status_code >= 400:
                await response.aread()
                _answer(response)
            parser = _Events()
            async for line in response.aiter_lines():
                if (event := parser.line(line)) is not None:
                    yield event
                if until is not None and time.monotonic() >= until:
                    return

    async def _row(self, job_id: str) -> Job | None:
        try:
            return await self.get(job_id)
        except NotFound:
            return None

    async def _follow(self, job_id: str, waiting: _Waiting) -> bool:
        """Read the job's stream until an event may end the wait (True), or the stream ends or
        the wait's time runs out (False)."""
        try:
            async with aclosing(self._stream(f"/v1/jobs/{job_id}/stream", until=waiting.deadline)) as events:
                async for streamed in events:
                    if waiting.shows_end(streamed):
                        return True
        except (NotFound, httpx.ReadTimeout):  # not in the read models yet; nothing came in time
            pass
        return False

    async def wait(self, job_id: str, *, states: tuple[str, ...] = FINAL_STATES, timeout_s: float = 3600.0) -> Job:
        """The job's row once its state is one of ``states`` (job states: the contract's
        JobState) or final (``failed`` once no retry followed within FAILED_SETTLE_S, unless
        ``failed`` is among ``states``); WaitTimeout after ``timeout_s``; ValueError for a state
        that is not one. Follows the job's event stream, reconnecting when the server ends it."""
        waiting = _Waiting(job_id, states, timeout_s)
        while True:
            shown = await self._follow(job_id, waiting)
            reads_until = time.monotonic() + (CATCH_UP_S if shown else 0.0)
            while True:
                job = await self._row(job_id)
                if waiting.done(job):
                    return job
                await asyncio.sleep(min(POLL_S, waiting.left()))
                if time.monotonic() >= reads_until:
                    break
