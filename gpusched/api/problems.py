"""One error shape for every API error: RFC 9457 problem details (``application/problem+json``).

``errors`` lists each offending input with the field's location (``body.spec.gpus``,
``query.limit``, ``header.Idempotency-Key``), what was wrong and, where there is a closed set,
what is accepted."""

from __future__ import annotations

from typing import Any

import asyncpg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.commands import MalformedCommand

MEDIA_TYPE = "application/problem+json"
TYPE_BASE = "https://gpusched.dev/problems/"


class FieldError(BaseModel):
    field: str = Field(description="Where: body.<path>, query.<name>, path.<name> or header.<name>")
    message: str
    accepted: str | None = Field(default=None, description="What is accepted there, where that is a closed set")


class ProblemDetails(BaseModel):
    type: str = Field(description="A URI naming the kind of problem")
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[FieldError] = Field(default_factory=list)
    job_id: str | None = None
    reason: str | None = Field(default=None, description="The platform's reason code (a rejection, a dead letter)")


class Problem(Exception):
    """Raise to answer with a problem document."""

    def __init__(self, status: int, kind: str, title: str, detail: str, *, errors: list[FieldError] | None = None,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.status, self.kind, self.title, self.detail = status, kind, title, detail
        self.errors = errors or []
        self.headers = headers
        self.extra = extra

    def document(self, instance: str | None) -> dict[str, Any]:
        body = ProblemDetails(type=TYPE_BASE + self.kind, title=self.title, status=self.status, detail=self.detail,
                              instance=instance, errors=self.errors, **self.extra)
        return body.model_dump(exclude_none=True)


NOT_READY_RETRY_S = 5
"""Retry-After of a 503 answered before the read models exist: accounting creates them when it
starts, within seconds."""
NOT_READY_ERRORS = (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError)
"""What a read of the read models raises before accounting has created them (the CLI says the
same errors are "not ready yet": gpusched.gateway.connection.read_models_ready)."""


def not_ready(err: Exception) -> Problem:
    """503: the read models do not exist yet (a platform just started, or accounting not running);
    the same request answers once accounting has created them."""
    return Problem(503, "not-ready", "Not ready",
                   f"the read models are not ready yet; retry in {NOT_READY_RETRY_S} s (accounting has not created "
                   f"them: {err})", headers={"Retry-After": str(NOT_READY_RETRY_S)})


def invalid(errors: list[FieldError], detail: str | None = None) -> Problem:
    first = errors[0]
    return Problem(422, "invalid-input", "Invalid input", detail or f"{first.field}: {first.message}", errors=errors)


def _location(loc: tuple | list) -> str:
    return ".".join(str(part) for part in loc) or "body"


def _accepted(err: dict[str, Any]) -> str | None:
    ctx = err.get("ctx") or {}
    if "expected" in ctx:
        return str(ctx["expected"])
    if "pattern" in ctx:
        return f"a string matching {ctx['pattern']}"
    for key, text in (("ge", ">= {}"), ("gt", "> {}"), ("le", "<= {}"), ("lt", "< {}"), ("max_length", "at most {} long"),
                      ("min_length", "at least {} long")):
        if key in ctx:
            return text.format(ctx[key])
    return None


def from_validation(err: ValidationError, prefix: str = "body") -> Problem:
    return invalid([FieldError(field=_location([prefix, *e["loc"]]), message=e["msg"], accepted=_accepted(e))
                    for e in err.errors(include_url=False)])


def from_malformed(err: MalformedCommand) -> Problem:
    return invalid([FieldError(field=f"body.{err.field}" if err.field else "body", message=err.message)])


def respond(problem: Problem, request: Request) -> JSONResponse:
    return JSONResponse(problem.document(request.url.path), status_code=problem.status, media_type=MEDIA_TYPE,
                        headers=problem.headers)


def install(app: FastAPI) -> None:
    """Every error, FastAPI's own included, as a problem document."""

    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        return respond(exc, request)

    async def _not_ready(request: Request, exc: Exception) -> JSONResponse:
        return respond(not_ready(exc), request)

    for error in NOT_READY_ERRORS:  # a read before accounting created the tables, auth's included
        app.add_exception_handler(error, _not_ready)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [FieldError(field=_location(e["loc"]), message=e["msg"], accepted=_accepted(e)) for e in exc.errors()]
        return respond(invalid(errors or [FieldError(field="body", message="invalid request")]), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not-found", 405: "method-not-allowed", 401: "unauthorized", 403: "forbidden"}
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # every method of the path, not only those of the first route matched
            headers["Allow"] = ", ".join(_methods(app, request.url.path))
        problem = Problem(exc.status_code, kinds.get(exc.status_code, "http-error"), str(exc.detail), str(exc.detail),
                          headers=headers or None)
        return respond(problem, request)


def _methods(app: FastAPI, path: str) -> list[str]:
    methods: set[str] = set()
    for route in app.routes:
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(path):
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)
