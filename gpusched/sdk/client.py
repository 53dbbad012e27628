"""The Python SDK: ``gpusched.Client`` (and ``gpusched.AsyncClient``, the same methods to await)
over the HTTP API (docs/api.md, docs/sdk.md), for notebooks, pipelines and the CLI.

    from gpusched import Client

    with Client() as gs:                      # GPUSCHED_API_URL, GPUSCHED_API_TOKEN
        job = gs.submit({"kind": "training", "queue": "research", "team": "team-research",
                         "image": "registry.example/train:1", "gpus": 8}, idempotency_key="run-42")
        print(job.decision, job.job_id)
        final = gs.wait(job.job_id, timeout_s=3600)

Errors are typed from the API's problem documents: :class:`Unauthorized` (401),
:class:`Forbidden` (403), :class:`NotFound` (404), :class:`Rejected` (409: admission rejected or
refused the command; ``reason``), :class:`InvalidInput` (422; ``errors`` names each field), else
:class:`ApiError`. :class:`WaitTimeout` when a wait runs out.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, closing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel

from schemas import Event, JobSpec, SubmitJob, parse_event
from schemas.registry import EVENT_TYPES_BY_NAME

FINAL_STATES = ("succeeded", "failed", "cancelled", "rejected")
FAILED_SETTLE_S = 2.0
"""A job in state ``failed`` is final when no retry follows within this long (quota schedules one
right after the failure when the job's retry policy allows it)."""
CATCH_UP_S = 5.0
"""How long a wait reads the job's row after an event that may end it: the read models follow
the event log, a little behind."""
POLL_S = 0.2


class ApiError(Exception):
    """An error answer of the API: its RFC 9457 problem document, parsed."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        self.type = problem.get("type", "")
        self.detail = problem.get("detail") or problem.get("title") or f"HTTP {status}"
        self.errors: list[dict[str, Any]] = problem.get("errors") or []
        super().__init__(f"{status}: {self.detail}")


class Unauthorized(ApiError):
    """401: no token, or not a valid one (unknown, expired, revoked)."""


class Forbidden(ApiError):
    """403: the token's role or team may not do this."""


class NotFound(ApiError):
    """404: no such job (or another team's), or not yet in the read models."""


class Rejected(ApiError):
    """409: admission rejected the job (``reason``: the RejectReason code) or refused the command."""

    @property
    def reason(self) -> str | None:
        return self.problem.get("reason")

    @property
    def job_id(self) -> str | None:
        return self.problem.get("job_id")


class InvalidInput(ApiError):
    """422: the input is not valid; ``errors`` has each field, what was wrong, what is accepted."""


class WaitTimeout(TimeoutError):
    """A wait ran out before the job reached one of the states waited for."""


_ERRORS = {401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Rejected, 422: InvalidInput}


@dataclass(frozen=True)
class Submitted:
    """Admission's answer to a submission: ``decision`` is ``admitted``, or ``pending`` when no
    answer came within the wait (a rejection raises :class:`Rejected`)."""

    job_id: str
    intake_sequence: int
    decision: str
    repeat: bool = False
    queue: str | None = None


@dataclass(frozen=True)
class Answered:
    """The answer to a cancel or a checkpoint report: the event that answered it, or ``pending``."""

    job_id: str
    intake_sequence: int
    outcome: str
    repeat: bool = False


@dataclass
class StreamedEvent:
    """One server-sent event: its name (the event type), id, and the event itself (None for
    the stream's own ``open`` event)."""

    name: str
    id: str | None
    data: str
    event: Event | None = field(default=None)


def _fields(cls: type, data: dict[str, Any]) -> Any:
    """``cls`` from the answer's fields it knows (a newer API may send more)."""
    names = cls.__dataclass_fields__
    return cls(**{k: v for k, v in data.items() if k in names})


def job_document(job: Any) -> dict[str, Any]:
    """A SubmitJob document from: a dict (a SubmitJob with ``spec``, or a bare spec), a path to a
    YAML or JSON job file (checked as the CLI checks it), or a pydantic SubmitJob or JobSpec."""
    if isinstance(job, SubmitJob):
        return job.model_dump(mode="json", exclude_none=True)
    if isinstance(job, JobSpec):
        return {"spec": job.model_dump(mode="json", exclude_none=True)}
    if isinstance(job, BaseModel):
        raise TypeError(f"a {type(job).__name__} is not a job; accepted: SubmitJob, JobSpec, a dict or a file path")
    if isinstance(job, (str, Path)):
        from gpusched.gateway.commands import submit_command_from_file

        return submit_command_from_file(Path(job)).model_dump(mode="json", exclude_none=True)
    if isinstance(job, dict):
        return dict(job) if "spec" in job else {"spec": dict(job)}
    raise TypeError(f"a {type(job).__name__} is not a job; accepted: SubmitJob, JobSpec, a dict or a file path")


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
        raise _ERRORS.get(response.status_code, ApiError)(response.status_code, problem)
    if response.headers.get("content-type", "").startswith("text/csv"):
        return response.text
    return response.json()


def _submit_request(job: Any, idempotency_key: str | None, wait_s: float,
                    on_behalf_of: str | None) -> tuple[dict, dict, dict]:
    document = job_document(job)
    if on_behalf_of is not None:
        document["on_behalf_of"] = on_behalf_of
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    return document, headers, {"wait": wait_s}


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


_EVENT_STATES = {"JobSubmitted": "submitted", "JobRejected": "rejected", "JobAdmitted": "queued",
                 "QuotaReserved": "reserved", "ReclaimRequested": "preempting", "PreemptionRequested": "preempting",
                 "JobScheduled": "scheduled", "JobStarted": "running", "JobSucceeded": "succeeded",
                 "JobFailed": "failed", "JobPreempted": "preempted", "JobCancelRequested": "cancelling",
                 "JobCancelled": "cancelled"}
"""The job state (the read model's ``state`` column) each job event leads to."""


def event_state(streamed: StreamedEvent) -> str | None:
    """The job state a streamed event leads to; None for events that do not change it."""
    if streamed.name == "JobRetryScheduled" and streamed.event is not None:
        return "preempted" if getattr(streamed.event, "after", None) == "JobPreempted" else "retrying"
    return _EVENT_STATES.get(streamed.name)


class _Waiting:
    """When a wait is over, as a pure decision over what the stream and the job's row show.

    Over when the row's state is one of ``states`` or a final one (the job can go nowhere else);
    ``failed`` counts only once it stayed so for FAILED_SETTLE_S (a retry may follow), unless
    ``failed`` is waited for explicitly. WaitTimeout past the deadline."""

    def __init__(self, job_id: str, states: tuple[str, ...], timeout_s: float) -> None:
        unknown = sorted(set(states) - set(_EVENT_STATES.values()) - {"retrying"})
        if unknown or not states:
            raise ValueError(f"states: {unknown or 'none given'} not job states; accepted: "
                             f"{', '.join(sorted({*_EVENT_STATES.values(), 'retrying'}))}")
        self.job_id, self.states, self.timeout_s = job_id, tuple(states), timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.failed_since: float | None = None
        self.seen: set[str] = set()
        self.settle_failed = states == FINAL_STATES or "failed" not in states

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

    def done(self, job: dict[str, Any] | None) -> bool:
        now = time.monotonic()
        state = job["state"] if job else None
        if state in self.states or state in FINAL_STATES:
            if state != "failed" or not self.settle_failed:
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


class Client:
    """The API, synchronously. ``url`` and ``token`` default to GPUSCHED_API_URL and
    GPUSCHED_API_TOKEN. Use as a context manager, or call :meth:`close`."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout_s: float = 60.0) -> None:
        self.url, token = _settings(url, token)
        self._timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                                  timeout=httpx.Timeout(timeout_s, read=timeout_s))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs) -> Any:
        return _answer(self._http.request(method, path, **kwargs))

    def submit(self, job: Any, *, idempotency_key: str | None = None, wait_s: float = 10.0,
               on_behalf_of: str | None = None) -> Submitted:
        """Submit and wait up to ``wait_s`` for admission's answer. Rejected when it refuses."""
        document, headers, params = _submit_request(job, idempotency_key, wait_s, on_behalf_of)
        return _fields(Submitted, self._call("POST", "/v1/jobs", json=document, headers=headers, params=params))

    def whoami(self) -> dict[str, Any]:
        """The token's holder, role and team."""
        return self._call("GET", "/v1/whoami")

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def jobs(self, *, page_size: int = 100, **filters: Any) -> Iterator[dict[str, Any]]:
        """Every job matching ``filters`` (team, state, queue, kind, submitter), newest first,
        fetched a page at a time."""
        params: dict[str, Any] = {**{k: v for k, v in filters.items() if v is not None}, "limit": page_size}
        while True:
            page = self._call("GET", "/v1/jobs", params=params)
            yield from page["items"]
            if not page["next_cursor"]:
                return
            params["cursor"] = page["next_cursor"]

    def events(self, job_id: str) -> list[Event]:
        return [parse_event(json.dumps({k: v for k, v in e.items() if k != "sequence"}))
                for e in self._call("GET", f"/v1/jobs/{job_id}/events")]

    def why(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/why")

    def cancel(self, job_id: str, reason: str = "", *, wait_s: float = 10.0) -> Answered:
        return _fields(Answered, self._call("POST", f"/v1/jobs/{job_id}/cancel", json={"reason": reason},
                                     params={"wait": wait_s}))

    def checkpoint(self, job_id: str, attempt: int, *, step: int | None = None, location: str = "",
                   checkpointed_at: datetime | None = None, wait_s: float = 10.0) -> Answered:
        """Report a checkpoint of the running ``attempt`` (taken at ``checkpointed_at``, default:
        when admission receives the report); ``outcome`` JobCheckpointed once recorded."""
        return _fields(Answered, self._call("POST", f"/v1/jobs/{job_id}/checkpoints", params={"wait": wait_s},
                                            json=_checkpoint_body(attempt, step, location, checkpointed_at)))

    def usage(self, **params: Any) -> Any:
        return self._call("GET", "/v1/usage", params=params)

    def queues(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/queues")

    # -- inference services (docs/serving.md) --------------------------------------------------
    def deploy(self, service: dict[str, Any], *, wait_s: float = 10.0) -> dict[str, Any]:
        """Deploy, or roll out a new spec of, a service: a DeployService document (``{"spec": ...}``)."""
        return self._call("POST", "/v1/services", json=service, params={"wait": wait_s})

    def scale(self, name: str, replicas: int, *, wait_s: float = 10.0) -> dict[str, Any]:
        return self._call("POST", f"/v1/services/{name}/scale", json={"replicas": replicas}, params={"wait": wait_s})

    def report_load(self, name: str, requests_per_second: float, *, wait_s: float = 10.0) -> dict[str, Any]:
        return self._call("POST", f"/v1/services/{name}/load", json={"requests_per_second": requests_per_second},
                          params={"wait": wait_s})

    def delete_service(self, name: str, *, wait_s: float = 10.0) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/services/{name}", params={"wait": wait_s})

    def services(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/services")

    def service(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/services/{name}")

    def stream(self, job_id: str) -> Iterator[StreamedEvent]:
        """The job's events: its history, then live, until it ends or the server ends the stream
        (GPUSCHED_API_STREAM_MAX_S; open it again to go on)."""
        return self._stream(f"/v1/jobs/{job_id}/stream")

    def team_stream(self, team: str) -> Iterator[StreamedEvent]:
        """The team's job events from now on (the first is ``open``), until the server ends the
        stream (open it again to go on). Forbidden for another team's."""
        return self._stream(f"/v1/teams/{team}/stream")

    def _stream(self, path: str, until: float | None = None) -> Iterator[StreamedEvent]:
        """The stream's events until the server ends it (or the monotonic time ``until``)."""
        timeout = _read_until(self._timeout_s, until)
        with self._http.stream("GET", path, headers={"Accept": "text/event-stream"},
                               **({"timeout": timeout} if timeout else {})) as response:
            if response.status_code >= 400:
                response.read()
                _answer(response)
            parser = _Events()
            for line in response.iter_lines():
                if (event := parser.line(line)) is not None:
                    yield event
                if until is not None and time.monotonic() >= until:
                    return

    def _row(self, job_id: str) -> dict[str, Any] | None:
        try:
            return self.get(job_id)
        except NotFound:
            return None

    def _follow(self, job_id: str, waiting: _Waiting) -> bool:
        """Read the job's stream until an event may end the wait (True), or the stream ends or
        the wait's time runs out (False)."""
        try:
            with closing(self._stream(f"/v1/jobs/{job_id}/stream", until=waiting.deadline)) as events:
                for streamed in events:
                    if waiting.shows_end(streamed):
                        return True
        except (NotFound, httpx.ReadTimeout):  # not in the read models yet; nothing came in time
            pass
        return False

    def wait(self, job_id: str, *, states: tuple[str, ...] = FINAL_STATES, timeout_s: float = 3600.0) -> dict[str, Any]:
        """The job's row once its state is one of ``states`` or final (``failed`` once no retry
        followed within FAILED_SETTLE_S, unless ``failed`` is among ``states``); WaitTimeout after
        ``timeout_s``. Follows the job's event stream, reconnecting when the server ends it."""
        waiting = _Waiting(job_id, states, timeout_s)
        while True:
            shown = self._follow(job_id, waiting)
            reads_until = time.monotonic() + (CATCH_UP_S if shown else 0.0)
            while True:
                job = self._row(job_id)
                if waiting.done(job):
                    return job
                time.sleep(min(POLL_S, waiting.left()))
                if time.monotonic() >= reads_until:
                    break


class AsyncClient:
    """The API, for asyncio: the methods of :class:`Client`, awaited (streams are async iterators)."""

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

    async def submit(self, job: Any, *, idempotency_key: str | None = None, wait_s: float = 10.0,
                     on_behalf_of: str | None = None) -> Submitted:
        document, headers, params = _submit_request(job, idempotency_key, wait_s, on_behalf_of)
        return _fields(Submitted, await self._call("POST", "/v1/jobs", json=document, headers=headers, params=params))

    async def whoami(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/whoami")

    async def get(self, job_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/v1/jobs/{job_id}")

    async def queues(self) -> list[dict[str, Any]]:
        return await self._call("GET", "/v1/queues")

    async def jobs(self, *, page_size: int = 100, **filters: Any) -> AsyncIterator[dict[str, Any]]:
        params: dict[str, Any] = {**{k: v for k, v in filters.items() if v is not None}, "limit": page_size}
        while True:
            page = await self._call("GET", "/v1/jobs", params=params)
            for item in page["items"]:
                yield item
            if not page["next_cursor"]:
                return
            params["cursor"] = page["next_cursor"]

    async def events(self, job_id: str) -> list[Event]:
        return [parse_event(json.dumps({k: v for k, v in e.items() if k != "sequence"}))
                for e in await self._call("GET", f"/v1/jobs/{job_id}/events")]

    async def why(self, job_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/v1/jobs/{job_id}/why")

    async def cancel(self, job_id: str, reason: str = "", *, wait_s: float = 10.0) -> Answered:
        return _fields(Answered, await self._call("POST", f"/v1/jobs/{job_id}/cancel", json={"reason": reason},
                                           params={"wait": wait_s}))

    async def checkpoint(self, job_id: str, attempt: int, *, step: int | None = None, location: str = "",
                         checkpointed_at: datetime | None = None, wait_s: float = 10.0) -> Answered:
        return _fields(Answered, await self._call("POST", f"/v1/jobs/{job_id}/checkpoints", params={"wait": wait_s},
                                                  json=_checkpoint_body(attempt, step, location, checkpointed_at)))

    def stream(self, job_id: str) -> AsyncIterator[StreamedEvent]:
        return self._stream(f"/v1/jobs/{job_id}/stream")

    def team_stream(self, team: str) -> AsyncIterator[StreamedEvent]:
        return self._stream(f"/v1/teams/{team}/stream")

    async def _stream(self, path: str, until: float | None = None) -> AsyncIterator[StreamedEvent]:
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

    async def _row(self, job_id: str) -> dict[str, Any] | None:
        try:
            return await self.get(job_id)
        except NotFound:
            return None

    async def _follow(self, job_id: str, waiting: _Waiting) -> bool:
        try:
            async with aclosing(self._stream(f"/v1/jobs/{job_id}/stream", until=waiting.deadline)) as events:
                async for streamed in events:
                    if waiting.shows_end(streamed):
                        return True
        except (NotFound, httpx.ReadTimeout):
            pass
        return False

    async def wait(self, job_id: str, *, states: tuple[str, ...] = FINAL_STATES,
                   timeout_s: float = 3600.0) -> dict[str, Any]:
        """As :meth:`Client.wait`."""
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
