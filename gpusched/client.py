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

import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from schemas import Event, JobSpec, SubmitJob, parse_event

FINAL_STATES = ("succeeded", "failed", "cancelled", "rejected")
FAILED_SETTLE_S = 2.0
"""A job in state ``failed`` is final when no retry follows within this long (quota schedules one
right after the failure when the job's retry policy allows it)."""
POLL_S = 0.5


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
        from gpusched.commands import submit_command_from_file

        return submit_command_from_file(Path(job)).model_dump(mode="json", exclude_none=True)
    if isinstance(job, dict):
        return dict(job) if "spec" in job else {"spec": dict(job)}
    raise TypeError(f"a {type(job).__name__} is not a job; accepted: SubmitJob, JobSpec, a dict or a file path")


def _settings(url: str | None, token: str | None) -> tuple[str, str]:
    url = url or os.environ.get("GPUSCHED_API_URL")
    token = token or os.environ.get("GPUSCHED_API_TOKEN")
    if not url:
        raise ValueError("no API URL: pass url= or set GPUSCHED_API_URL (make run prints it)")
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


class _Events:
    """Server-sent-event lines to :class:`StreamedEvent`s (the text/event-stream format)."""

    def __init__(self) -> None:
        self.name, self.id, self.data = "message", None, []

    def line(self, line: str) -> StreamedEvent | None:
        if line == "":
            if not self.data:
                return None
            data = "\n".join(self.data)
            out = StreamedEvent(self.name, self.id, data)
            if self.name.startswith(("Job", "Quota", "Scheduling", "Preemption", "Reclaim")):
                out.event = parse_event(data)
            self.name, self.id, self.data = "message", None, []
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


class _Waiting:
    """When a wait is over: the job's state is one of ``states`` (``failed`` only once it stayed
    so for FAILED_SETTLE_S, when waiting for the final states); WaitTimeout past the deadline."""

    def __init__(self, job_id: str, states: tuple[str, ...], timeout_s: float) -> None:
        self.job_id, self.states, self.timeout_s = job_id, states, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.failed_since: float | None = None

    def done(self, job: dict[str, Any] | None) -> bool:
        now = time.monotonic()
        state = job["state"] if job else None
        if state in self.states:
            if state != "failed" or self.states != FINAL_STATES:
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
                   wait_s: float = 10.0) -> Answered:
        body = {"attempt": attempt, "location": location, **({"step": step} if step is not None else {})}
        return _fields(Answered, self._call("POST", f"/v1/jobs/{job_id}/checkpoints", json=body, params={"wait": wait_s}))

    def usage(self, **params: Any) -> Any:
        return self._call("GET", "/v1/usage", params=params)

    def queues(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/queues")

    def stream(self, job_id: str) -> Iterator[StreamedEvent]:
        """The job's events: its history, then live, until it ends or the server ends the stream."""
        yield from self._stream(f"/v1/jobs/{job_id}/stream")

    def team_stream(self, team: str) -> Iterator[StreamedEvent]:
        """The team's job events from now on, until the server ends the stream (reconnect to go on)."""
        yield from self._stream(f"/v1/teams/{team}/stream")

    def _stream(self, path: str) -> Iterator[StreamedEvent]:
        with self._http.stream("GET", path, headers={"Accept": "text/event-stream"}) as response:
            if response.status_code >= 400:
                response.read()
                _answer(response)
            parser = _Events()
            for line in response.iter_lines():
                if (event := parser.line(line)) is not None:
                    yield event

    def wait(self, job_id: str, *, states: tuple[str, ...] = FINAL_STATES, timeout_s: float = 3600.0) -> dict[str, Any]:
        """The job's row once its state is one of ``states`` (a ``failed`` one when no retry
        followed within FAILED_SETTLE_S); WaitTimeout after ``timeout_s``."""
        waiting = _Waiting(job_id, states, timeout_s)
        while True:
            try:
                job = self.get(job_id)
            except NotFound:
                job = None
            if waiting.done(job):
                return job
            time.sleep(POLL_S)


class AsyncClient:
    """The API, for asyncio: the methods of :class:`Client`, awaited (streams are async iterators)."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout_s: float = 60.0) -> None:
        self.url, token = _settings(url, token)
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
                         wait_s: float = 10.0) -> Answered:
        body = {"attempt": attempt, "location": location, **({"step": step} if step is not None else {})}
        return _fields(Answered, await self._call("POST", f"/v1/jobs/{job_id}/checkpoints", json=body,
                                           params={"wait": wait_s}))

    async def stream(self, job_id: str) -> AsyncIterator[StreamedEvent]:
        async for event in self._stream(f"/v1/jobs/{job_id}/stream"):
            yield event

    async def team_stream(self, team: str) -> AsyncIterator[StreamedEvent]:
        async for event in self._stream(f"/v1/teams/{team}/stream"):
            yield event

    async def _stream(self, path: str) -> AsyncIterator[StreamedEvent]:
        async with self._http.stream("GET", path, headers={"Accept": "text/event-stream"}) as response:
            if response.status_code >= 400:
                await response.aread()
                _answer(response)
            parser = _Events()
            async for line in response.aiter_lines():
                if (event := parser.line(line)) is not None:
                    yield event

    async def wait(self, job_id: str, *, states: tuple[str, ...] = FINAL_STATES,
                   timeout_s: float = 3600.0) -> dict[str, Any]:
        """As :meth:`Client.wait`."""
        import asyncio

        waiting = _Waiting(job_id, states, timeout_s)
        while True:
            try:
                job = await self.get(job_id)
            except NotFound:
                job = None
            if waiting.done(job):
                return job
            await asyncio.sleep(POLL_S)
