"""The API's routes under ``/v1`` (docs/api.md). Each route states the roles it admits; a member
sees and acts for its own team only (another team's job is a 404, as if it did not exist)."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from gpusched.gateway import answers, commands, history, queue_usage
from gpusched.gateway.port import Answer
from gpusched.api import telemetry
from gpusched.api.auth import Identity, forbidden, identity, require, team_filter
from gpusched.api.bus import TenantEvent
from gpusched.api.problems import FieldError, Problem, ProblemDetails, from_malformed, from_validation, invalid
from gpusched.errors import UserError
from schemas import SubmitJob
from schemas.auth import Role
from schemas.commands import RESERVED_JOB_ID_PREFIX, MalformedCommand, identity_problem, parse_command
from schemas.envelope import NAME_PATTERN, Timestamp
from schemas.jobstate import JobState
from services.accounting import chargeback as chargeback_rules, focus as focus_rules, queries

JOB_ID_PATTERN = f"^({NAME_PATTERN[1:-1]}|{RESERVED_JOB_ID_PREFIX}[0-9]+)$"
READERS = (Role.MEMBER, Role.OPERATOR, Role.ADMIN)
"""Who reads jobs and queues (a chargeback reader sees usage only)."""
USAGE_READERS = (Role.MEMBER, Role.OPERATOR, Role.ADMIN, Role.CHARGEBACK)
TERMINAL = ("JobSucceeded", "JobCancelled", "JobRejected")
PROBLEM = {"model": ProblemDetails}
"""An error response: its content is application/problem+json (gpusched.api.app._openapi says so)."""
ERRORS = {400: PROBLEM, 401: PROBLEM, 403: PROBLEM, 422: PROBLEM,
          503: {**PROBLEM, "description": "The read models are not ready yet (accounting has not created them): "
                                          "retry after Retry-After seconds"}}

router = APIRouter(prefix="/v1", responses=ERRORS)
Me = Annotated[Identity, Depends(identity)]
JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN, max_length=63, description="A job id")]
TeamName = Annotated[str, Path(pattern=NAME_PATTERN, max_length=63)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Decision(BaseModel):
    job_id: str
    intake_sequence: int
    decision: Literal["admitted", "rejected", "pending"] = Field(
        description="pending: no answer within the wait; follow GET /v1/jobs/{job_id}")
    repeat: bool = Field(default=False, description="The job existed: this submission changed nothing")
    queue: str | None = None


class CancelRequest(Strict):
    reason: str = Field(default="", max_length=1024)


def _whole(value: Any) -> Any:
    """JSON Schema's "integer" includes 3.0: read it as 3 (a fraction stays refused)."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53 else value


class CheckpointRequest(Strict):
    attempt: Annotated[int, Field(ge=1, le=1_000_000), BeforeValidator(_whole)]
    checkpointed_at: Timestamp | None = None
    step: Annotated[int, Field(ge=0, le=2**53), BeforeValidator(_whole)] | None = None
    location: str = Field(default="", max_length=1024)


class Answered(BaseModel):
    job_id: str
    intake_sequence: int
    outcome: str = Field(description="The event that answered the command, or pending")
    repeat: bool = False


def _state(request: Request):
    return request.app.state


async def _job_visible(request: Request, me: Identity, job_id: str) -> dict[str, Any]:
    """The job's read-model row, if ``me`` may see it; else 404 (also for another team's job)."""
    async with _state(request).pool.acquire() as conn:
        job = await queries.get_job(conn, job_id)
    if job is None or not me.sees_team(job["team"]):
        raise Problem(404, "not-found", "Not found", f"no job {job_id!r} (or not yet in the read models)",
                      job_id=job_id)
    return job


WaitS = Annotated[float, Query(ge=0, le=30, description="Seconds to wait for admission's answer (0: do not wait)")]


def json_body(schema: str) -> dict:
    """``openapi_extra`` of a route that reads its body itself (strict, as on NATS): a required
    JSON body of the named contract schema."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema}"}}}}}


@router.post("/jobs", status_code=201, response_model=Decision, tags=["jobs"],
             openapi_extra=json_body("SubmitJob"),
             responses={200: {"model": Decision, "description": "An idempotent repeat: the job existed"},
                        202: {"model": Decision, "description": "Sent; no answer within the wait"},
                        409: {**PROBLEM, "description": "Admission rejected the job (reason, field, accepted values)"}})
async def submit(request: Request, response: Response, me: Me, wait: WaitS = 10.0,
                 idempotency_key: Annotated[str | None, Header(
                     alias="Idempotency-Key", min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$",
                     description="Retrying with the same key returns the same job")] = None) -> Decision:
    """Submit a job (a SubmitJob document: ``{"spec": {...}}``, the same as on NATS) and wait for
    admission's answer: 201 admitted, 409 rejected by admission (with the reason), 422 invalid
    input, 202 when no answer came within ``wait``, 200 for a repeat of an existing job."""
    require(me, Role.MEMBER, Role.OPERATOR, Role.ADMIN)
    raw = await request.body()
    try:
        command = parse_command(SubmitJob, raw)
    except MalformedCommand as err:
        raise from_malformed(err) from None
    except ValidationError as err:
        raise from_validation(err) from None
    principal = me.principal(command.spec.team, "submit")
    if idempotency_key is not None:
        if command.spec.idempotency_key not in (None, idempotency_key):
            raise invalid([FieldError(field="header.Idempotency-Key",
                                      message="differs from spec.idempotency_key; give one or make them equal")])
        command = command.model_copy(update={"spec": command.spec.model_copy(update={"idempotency_key": idempotency_key})})
    command = commands.acting_for(command, principal, me.name)
    if (problem := identity_problem(command, principal)) is not None:  # it names someone else as the sender
        raise forbidden(f"body.{problem[0]}: {problem[1]}")
    # the contract's job id rule and message id, as the CLI sends them (gpusched.gateway.commands)
    answer = await _state(request).commands.submit(principal, commands.submission(command), wait)
    return _decision(response, answer)


def _refused(answer: Answer, **names: str) -> None:
    """409 for a command admission dead-lettered (it could not read or apply it)."""
    if answer.dead_letter is not None:
        raise Problem(409, "refused", "Refused by admission", answer.dead_letter, reason="dead-letter", **names)


def _decision(response: Response, answer: Answer) -> Decision:
    """The HTTP form of admission's answer to a submission (gpusched.gateway.answers.answer_of)."""
    job_id, seq = answer.job_id, answer.intake_sequence
    if answer.pending:
        response.status_code = 202
        return Decision(job_id=job_id, intake_sequence=seq, decision="pending")
    _refused(answer, job_id=job_id)
    if answer.rejected:
        raise Problem(409, "rejected", "Rejected", answer.message, job_id=answer.filed_under or job_id,
                      reason=answer.reason,
                      errors=[FieldError(field=f"body.{answer.field}", message=answer.message)] if answer.field else [])
    if answer.repeat:
        response.status_code = 200
    return Decision(job_id=job_id, intake_sequence=seq, decision="admitted", repeat=answer.repeat, queue=answer.queue)


@router.get("/jobs", tags=["jobs"])
async def list_jobs(request: Request, me: Me,
                    team: Annotated[str | None, Query(pattern=NAME_PATTERN, max_length=63)] = None,
                    state: Annotated[Literal[tuple(s.value for s in JobState)] | None, Query()] = None,  # type: ignore[valid-type]
                    queue: Annotated[str | None, Query(pattern=NAME_PATTERN, max_length=63)] = None,
                    kind: Annotated[Literal["training", "inference", "evaluation", "batch"] | None, Query()] = None,
                    submitter: Annotated[str | None, Query(min_length=1, max_length=253)] = None,
                    limit: Annotated[int, Query(ge=1, le=500)] = 50,
                    cursor: Annotated[str | None, Query(pattern=queries.CURSOR_PATTERN, description=(
                        "The next_cursor of the previous page"))] = None) -> dict[str, Any]:
    """Jobs, newest first, a page at a time (``next_cursor``: the next page; null: the last).
    Each waiting job carries its position in its queue."""
    require(me, *READERS)
    async with _state(request).pool.acquire() as conn:
        page = await queries.jobs_page(conn, team=team_filter(me, team), state=state, queue=queue, kind=kind,
                                       submitter=submitter, limit=limit, cursor=cursor)
    return {"items": page.items, "next_cursor": page.next_cursor}


@router.get("/jobs/{job_id}", tags=["jobs"], responses={404: PROBLEM})
async def get_job(request: Request, me: Me, job_id: JobId) -> dict[str, Any]:
    """One job: state, times, placement, usage per attempt."""
    require(me, *READERS)
    return await _job_visible(request, me, job_id)


@router.get("/jobs/{job_id}/events", tags=["jobs"], responses={404: PROBLEM})
async def job_events(request: Request, me: Me, job_id: JobId) -> list[dict[str, Any]]:
    """The job's events from the log, in order, each with its stream sequence."""
    require(me, *READERS)
    await _job_visible(request, me, job_id)
    log = await history.job_events(_state(request).js, job_id, seen_by=_viewing_team(me))
    return [{"sequence": s, **e.model_dump(mode="json")} for s, e in log]


def _viewing_team(me: Identity) -> str | None:
    """The team whose view a caller reads events in (a member's); None: the log as it is."""
    return me.team if me.role == Role.MEMBER else None


@router.get("/jobs/{job_id}/why", tags=["jobs"], responses={404: PROBLEM})
async def why(request: Request, me: Me, job_id: JobId) -> dict[str, Any]:
    """Why the job waits: the current attempt's reason, the job's position in its queue now (as
    in GET /v1/jobs) and the reason history."""
    require(me, *READERS)
    await _job_visible(request, me, job_id)
    async with _state(request).pool.acquire() as conn:
        try:
            return await history.why(_state(request).js, job_id, conn)
        except UserError as err:  # no events in the log
            raise Problem(404, "not-found", "Not found", str(err), job_id=job_id) from None


@router.post("/jobs/{job_id}/cancel", tags=["jobs"], response_model=Answered, responses={404: PROBLEM, 409: PROBLEM})
async def cancel(request: Request, me: Me, job_id: JobId, body: CancelRequest, wait: WaitS = 10.0) -> Answered:
    """Ask to cancel the job; answers with the JobCancelRequested (or the end it had reached)."""
    require(me, Role.MEMBER, Role.OPERATOR, Role.ADMIN)
    job = await _job_visible(request, me, job_id)
    principal = me.principal(job["team"], "cancel")
    command = commands.acting_for(commands.cancel_command(job_id, body.reason), principal, me.name)
    answer = await _state(request).commands.run(principal, command, lambda seq: answers.for_cancel(job_id, seq), wait,
                                                job_id=job_id)
    return _answered(answer)


@router.post("/jobs/{job_id}/checkpoints", tags=["jobs"], response_model=Answered, responses={404: PROBLEM, 409: PROBLEM})
async def checkpoint(request: Request, me: Me, job_id: JobId, body: CheckpointRequest, wait: WaitS = 10.0) -> Answered:
    """Report a checkpoint of a running attempt (checkpoint-aware preemption prefers jobs that
    checkpointed recently); answers with the JobCheckpointed admission recorded."""
    require(me, Role.MEMBER, Role.OPERATOR, Role.ADMIN)
    job = await _job_visible(request, me, job_id)
    principal = me.principal(job["team"], "checkpoint")
    command = commands.acting_for(commands.checkpoint_command(
        job_id, body.attempt, checkpointed_at=body.checkpointed_at, step=body.step, location=body.location),
        principal, me.name)
    answer = await _state(request).commands.run(principal, command, lambda seq: answers.for_checkpoint(job_id, seq),
                                                wait, job_id=job_id)
    return _answered(answer)


def _answered(answer: Answer) -> Answered:
    _refused(answer, job_id=answer.job_id)
    return Answered(job_id=answer.job_id, intake_sequence=answer.intake_sequence,
                    outcome=answer.decision or "pending", repeat=answer.repeat)


# -- live events --------------------------------------------------------------------------------


def _sse(event: TenantEvent) -> ServerSentEvent:
    telemetry.STREAMED.inc()
    return ServerSentEvent(raw_data=event.data.decode(), event=event.type, id=event.event_id or None)


async def _stream_job(request: Request, me: Me, job_id: JobId) -> dict[str, Any]:
    """The job a stream follows, checked before the stream starts (a generator's errors would
    come after the response began)."""
    require(me, *READERS)
    return await _job_visible(request, me, job_id)


async def _stream_team(me: Me, team: TeamName) -> str:
    require(me, *READERS)
    if not me.sees_team(team):
        raise forbidden(f"a member of {me.team} sees only its own team's events, not {team!r}'s")
    return team


@router.get("/jobs/{job_id}/stream", tags=["events"], response_class=EventSourceResponse,
            responses={404: PROBLEM})
async def job_stream(request: Request, me: Me, job_id: JobId, job: Annotated[dict[str, Any], Depends(_stream_job)]):
    """Server-sent events: the job's history, then its events as they happen, until it ends
    (or the stream's time limit; reconnect to go on). Each event's ``event`` is its type, ``id``
    its event id, ``data`` the event as JSON."""
    state = _state(request)
    listener = await state.hub.open(job["team"])
    telemetry.STREAMS.inc()
    try:
        seen: set[str] = set()
        ended = False
        for _, e in await history.job_events(state.js, job_id, seen_by=_viewing_team(me)):
            seen.add(e.event_id)
            ended = ended or e.type in TERMINAL
            yield ServerSentEvent(raw_data=e.model_dump_json(), event=e.type, id=e.event_id)
        async for event in _live(request, listener, lambda: ended):
            if event.job_id != job_id or event.event_id in seen:
                continue
            seen.add(event.event_id)
            ended = event.type in TERMINAL
            yield _sse(event)
    finally:
        telemetry.STREAMS.dec()
        await state.hub.close(job["team"], listener)


async def _live(request: Request, listener, done) -> Any:
    """The listener's events until ``done()``, the hub ends it, the client leaves or the
    stream's time limit passes."""
    deadline = asyncio.get_running_loop().time() + _state(request).settings.stream_max_s
    while not done() and not listener.ended.is_set():
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0 or await request.is_disconnected():
            return
        try:
            yield await asyncio.wait_for(listener.queue.get(), min(left, 5.0))
        except TimeoutError:
            continue


@router.get("/teams/{team}/stream", tags=["events"], response_class=EventSourceResponse)
async def team_stream(request: Request, team: Annotated[str, Depends(_stream_team)]):
    """Server-sent events: every event of the team's jobs from now on, as it happens (copies the
    notifier writes to the team's subjects), until the stream's time limit."""
    state = _state(request)
    listener = await state.hub.open(team)
    telemetry.STREAMS.inc()
    try:
        yield ServerSentEvent(event="open", raw_data=json.dumps({"team": team}))
        async for event in _live(request, listener, lambda: False):
            yield _sse(event)
    finally:
        telemetry.STREAMS.dec()
        await state.hub.close(team, listener)


# -- queues, cluster, usage ---------------------------------------------------------------------


@router.get("/queues", tags=["queues"])
async def queues(request: Request, me: Me) -> list[dict[str, Any]]:
    """Per queue and flavor: nominal, limits, used, borrowed, lent, pending jobs, budget left.
    A member sees the queues its team may submit to."""
    require(me, *READERS)
    async with _state(request).pool.acquire() as conn:
        return await queue_usage.queues_for(conn, team_filter(me, None), _state(request).js)


@router.get("/cohorts", tags=["queues"])
async def cohorts(request: Request, me: Me) -> list[dict[str, Any]]:
    require(me, *READERS)
    async with _state(request).pool.acquire() as conn:
        return [dataclasses.asdict(c) for c in await queries.cohorts(conn)]


@router.get("/nodes", tags=["cluster"])
async def nodes(request: Request, me: Me) -> list[dict[str, Any]]:
    """Each node's GPUs: capacity, used, free (no job is named)."""
    require(me, *READERS)
    async with _state(request).pool.acquire() as conn:
        return await queries.nodes(conn)


@router.get("/gpus", tags=["cluster"])
async def gpus(request: Request, me: Me) -> list[dict[str, Any]]:
    """Per GPU flavor: capacity, used, free, fragmented (free on partly used nodes), largest free block."""
    require(me, *READERS)
    async with _state(request).pool.acquire() as conn:
        return queries.gpus_by_flavor(await queries.nodes(conn))


Dimension = Literal["team", "project", "queue", "flavor", "day"]
MONTH = r"^(19|2[0-9])[0-9]{2}-(0[1-9]|1[0-2])$"
Period = Annotated[str | None, Query(pattern=MONTH, description="A calendar month (UTC), e.g. 2026-12")]
Format = Annotated[Literal["json", "csv"], Query()]


def _csv(rows: list[dict[str, Any]], name: str) -> Response:
    out = io.StringIO()
    if rows:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return Response(out.getvalue(), media_type="text/csv",
                    headers={"Content-Disposition": f'attachment; filename="{name}.csv"'})


@router.get("/usage", tags=["usage"], responses={200: {"content": {"text/csv": {}}}})
async def usage(request: Request, me: Me, by: Annotated[list[Dimension], Query()] = ["team", "flavor"],  # noqa: B006
                period: Period = None, format: Format = "json"):
    """GPU-hours and cost per group, prorated to the period; a member gets its team's rows."""
    require(me, *USAGE_READERS)
    try:
        async with _state(request).pool.acquire() as conn:
            rows = await queries.team_usage(conn, team_filter(me, None), list(dict.fromkeys(by)), period,
                                           _state(request).js)
    except ValueError as err:
        raise invalid([FieldError(field="query.period", message=str(err))]) from None
    return _csv(rows, "usage") if format == "csv" else JSONResponse(json.loads(json.dumps(rows, default=str)))


@router.get("/chargeback", tags=["usage"], responses={200: {"content": {"text/csv": {}}}})
async def chargeback(request: Request, me: Me,
                     period: Annotated[str, Query(pattern=MONTH, description="A calendar month (UTC)")],
                     group_by: Literal["team", "project", "queue", "flavor"] = "team",
                     format: Annotated[Literal["json", "csv", "focus"], Query()] = "json"):
    """The period's chargeback statement as of the log's now, as ``gpusched chargeback`` gives it
    (services.accounting.queries.statement): its ``statement_id`` and whether it is ``provisional``
    (the period is still open). Every team's lines: chargeback readers, operators and admins.
    ``format=csv``: the statement's CSV; ``format=focus``: its FOCUS 1.2 export (docs/accounting.md#focus-export),
    each byte for byte what the CLI's ``--format`` of the same name prints."""
    require(me, Role.CHARGEBACK, Role.OPERATOR, Role.ADMIN)
    try:
        async with _state(request).pool.acquire() as conn:
            body = await queries.statement(conn, period, group_by, log=_state(request).js)
    except ValueError as err:
        raise invalid([FieldError(field="query.period", message=str(err))]) from None
    if format == "csv":  # the CLI's CSV, byte for byte: one function renders both
        return Response(chargeback_rules.to_csv(body), media_type="text/csv",
                        headers={"Content-Disposition": f'attachment; filename="{body["statement_id"]}.csv"'})
    if format == "focus":
        return Response(focus_rules.to_focus(body), media_type="text/csv",
                        headers={"Content-Disposition": f'attachment; filename="{body["statement_id"]}-focus.csv"'})
    return JSONResponse(body)


@router.get("/metrics/summary", tags=["usage"])
async def metrics_summary(request: Request, me: Me) -> dict[str, Any]:
    """Jobs by state, wait-time percentiles and failures of the last day, GPU utilization of the
    last hour (a member: its team's jobs)."""
    require(me, *USAGE_READERS)
    async with _state(request).pool.acquire() as conn:
        return await queries.summary(conn, team_filter(me, None) if me.role == Role.MEMBER else None, _state(request).js)


@router.get("/metrics/series", tags=["usage"])
async def metrics_series(request: Request, me: Me, hours: Annotated[int, Query(ge=1, le=168)] = 24,
                         bucket_s: Annotated[int, Query(ge=60, le=86_400)] = 3600) -> list[dict[str, Any]]:
    """Per time bucket: submitted, started, waiting (congestion), median wait, GPU utilization."""
    require(me, *USAGE_READERS)
    if hours * 3600 // bucket_s > 2000:
        raise invalid([FieldError(field="query.bucket_s", message="more than 2,000 buckets",
                                  accepted="hours * 3600 / bucket_s <= 2000")])
    async with _state(request).pool.acquire() as conn:
        return await queries.series(conn, team_filter(me, None) if me.role == Role.MEMBER else None, hours, bucket_s,
                                    _state(request).js)


@router.get("/deadletters", tags=["operations"])
async def deadletters(request: Request, me: Me, limit: Annotated[int, Query(ge=1, le=500)] = 50) -> list[dict[str, Any]]:
    """The newest dead letters with their reasons (operators and admins)."""
    require(me, Role.OPERATOR, Role.ADMIN)
    return await history.dead_letters(_state(request).js, limit)


@router.get("/whoami", tags=["auth"])
async def whoami(me: Me) -> dict[str, Any]:
    return {"token_id": me.token_id, "name": me.name, "role": me.role.value, "team": me.team}


@router.get("/tokens", tags=["auth"])
async def list_tokens(request: Request, me: Me) -> list[dict[str, Any]]:
    """Every token's id, holder, role, team and state (never its hash): admins."""
    require(me, Role.ADMIN)
    return await queries.api_tokens(_state(request).pool)

