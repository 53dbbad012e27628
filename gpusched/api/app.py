"""The API application: settings, its NATS and Postgres connections, the routes, the console,
/docs, and the security headers of every response."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpusched.api import bus, console, problems, routes, serving, telemetry
from gpusched.api.auth import Authenticator
from gpusched.gateway import answers, commands
from gpusched.gateway.port import Answer
from runtime import eventlog, health, observability
from runtime.settings import ConfigError, Settings, env_address, env_number
from schemas import SubmitJob, parse_event
from schemas.commands import DeployService, Principal
from schemas.envelope import Contract
from schemas.export import ContractSchema
from schemas.job import rejection_id
from schemas.registry import SUBJECT_PREFIX

log = logging.getLogger(__name__)
DUPLICATE_WAIT_S = 2.0
"""How long a duplicate of a command with no decision in the log waits for one."""


@dataclass(frozen=True)
class ApiSettings:
    """GPUSCHED_API_ADDR / _PORT: where it listens; GPUSCHED_API_STREAM_MAX_S: how long one
    server-sent-event stream stays open (clients reconnect); the rest is runtime.settings."""

    runtime: Settings
    addr: str = "127.0.0.1"
    port: int = 8080
    stream_max_s: float = 300.0

    @classmethod
    def from_env(cls) -> "ApiSettings":
        runtime = Settings.from_env()
        if not runtime.pg_dsn:
            raise ConfigError("GPUSCHED_PG_DSN is not set; accepted: a postgresql:// DSN of the accounting read models")
        return cls(runtime=runtime, addr=env_address("GPUSCHED_API_ADDR", "127.0.0.1"),
                   port=int(env_number("GPUSCHED_API_PORT", 8080, minimum=1, maximum=65535, integer=True)),
                   stream_max_s=env_number("GPUSCHED_API_STREAM_MAX_S", 300.0, minimum=0.1, maximum=86_400))


class Commands:
    """The API's transport for the gateway's commands (built by gpusched.gateway.commands, as the
    CLI builds them): sends one as the caller (a :class:`Principal`) through the FastStream
    publishers, waits for its answer on the answer subscription (gpusched.gateway.answers.Subscribed)
    and answers with the port's :class:`Answer` (gpusched.gateway.answers.answer_of), which the
    routes translate into HTTP."""

    def __init__(self, publishers: dict[str, object], js: JetStreamContext, subscribed: answers.Subscribed) -> None:
        self.publishers = publishers
        self.js = js
        self.subscribed = subscribed

    async def send(self, who: Principal, command: Contract,
                   headers: dict[str, str] | None = None) -> tuple[int, bool]:
        """(intake sequence, duplicate): a duplicate (the same Nats-Msg-Id within the stream's
        window) has the first one's sequence."""
        hdrs = dict(headers or {})
        observability.inject_trace(hdrs)
        publisher = self.publishers[f"{who.verb}/{'operator' if who.operator else 'user'}"]
        with telemetry.PUBLISH.labels(who.verb).time():
            ack = await publisher.publish(command, subject=who.subject(SUBJECT_PREFIX), headers=hdrs,
                                          stream=eventlog.INTAKE_STREAM, timeout=10)
        return ack.seq, bool(ack.duplicate)

    async def _wait(self, verb: str, awaited: answers.Awaited, wait_s: float) -> answers.Decided | None:
        if wait_s <= 0:
            return None
        with telemetry.DECISION_WAIT.labels(verb).time():
            return await self.subscribed.wait(awaited, wait_s)

    async def run(self, who: Principal, command: Contract, awaited: Callable[[int], answers.Awaited],
                  wait_s: float, **fields: Any) -> Answer:
        """Send ``command`` and wait up to ``wait_s`` for what ``awaited(intake_seq)`` names."""
        seq, _ = await self.send(who, command)
        return answers.answer_of(await self._wait(who.verb, awaited(seq), wait_s), seq, **fields)

    async def submit(self, who: Principal, command: SubmitJob, wait_s: float) -> Answer:
        """Submit ``command`` (its job id set: gpusched.gateway.commands.submission) and wait for
        admission's answer. A keyed resend of the same spec is answered by the decision in the
        log (a repeat) without sending; another spec is sent, for admission to reject
        (duplicate-idempotency-key), as over NATS (docs/publishing.md, "Resending")."""
        job_id, spec = command.job_id, command.spec
        keyed = bool(spec.idempotency_key)
        if keyed and (earlier := await self.earlier_decision(command)) is not None:
            return earlier
        seq, duplicate = await self.send(who, command, {"Nats-Msg-Id": commands.submit_message_id(command)})
        if duplicate:  # JetStream kept the first of these: its answer may be older than the subscription keeps
            if (earlier := await self.earlier_decision(command, seq)) is not None:
                return earlier
            wait_s = min(wait_s, DUPLICATE_WAIT_S)  # the first is still undecided, or admission refused it
        decided = await self._wait("submit", answers.for_submit(job_id, seq, keyed=keyed, spec=spec), wait_s)
        return answers.answer_of(decided, seq, job_id=job_id, repeat=duplicate)

    async def earlier_decision(self, command: SubmitJob, intake_seq: int | None = None) -> Answer | None:
        """The admission decision of the caller's team's job of this id and spec already in the
        log (a repeat), or the rejection of the command at ``intake_seq`` (a repeat of a rejected
        one). Another team's job of that id is not a repeat (and its decision is not the
        caller's to see), nor is a job of another spec (admission compares the spec's digest):
        admission rejects those commands."""
        job_id, spec = command.job_id, command.spec
        if intake_seq is not None:
            rejected = await self._last(f"{SUBJECT_PREFIX}.job.{rejection_id(intake_seq)}.rejected")
            if rejected is not None:
                return answers.answer_of(answers.Decided(rejected, repeat=True), intake_seq, job_id=job_id)
        submitted = await self._last(f"{SUBJECT_PREFIX}.job.{job_id}.submitted")
        if (submitted is None or submitted.spec.team != spec.team
                or submitted.spec.model_dump_json() != spec.model_dump_json()):
            return None
        decision = (await self._last(f"{SUBJECT_PREFIX}.job.{job_id}.admitted")
                    or await self._last(f"{SUBJECT_PREFIX}.job.{job_id}.rejected"))
        if decision is None:
            return None
        return answers.answer_of(answers.Decided(decision, repeat=True), submitted.intake_sequence, job_id=job_id)

    async def _last(self, subject: str):
        try:
            raw = await self.js.get_msg(eventlog.EVENTS_STREAM, subject=subject, direct=True)
        except NotFoundError:
            return None
        return parse_event(raw.data)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, with the contract's SubmitJob and DeployService (strict, as admission reads them)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (SubmitJob, DeployService):
        schema = model.model_json_schema(schema_generator=ContractSchema, ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    problem = {"$ref": "#/components/schemas/ProblemDetails"}
    for ops in doc["paths"].values():  # problems are application/problem+json, not application/json
        for op in ops.values():
            for response in op.get("responses", {}).values():
                content = response.get("content", {})
                if any(media.get("schema") == problem for media in content.values()):
                    response["content"] = {"application/problem+json": {"schema": problem}}
    app.openapi_schema = doc
    return doc


CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'self'", "script-src 'self'", "style-src 'self'", "img-src 'self' data:", "object-src 'none'",
    "frame-ancestors 'none'", "base-uri 'none'", "form-action 'self'"))
"""The pages' policy: the origin's own files only. Nothing on a page is inline (no script, no style
attribute, no event handler attribute) and nothing comes from elsewhere, so markup that got into a
page could not run a script; no other site may frame a page."""
HTML_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",  # frame-ancestors 'none', for browsers that predate it
    "Referrer-Policy": "no-referrer",
}


class SecurityHeaders:
    """ASGI middleware: ``X-Content-Type-Options: nosniff`` on every response, and on every HTML
    one (the console, /docs) the :data:`HTML_HEADERS` as well. One place for all routes, so a new
    page cannot forget them; a route's own header of the same name wins."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                added = {"X-Content-Type-Options": "nosniff"}
                if headers.get("content-type", "").startswith("text/html"):
                    added |= HTML_HEADERS
                for name, value in added.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, sending)


def install_docs(app: FastAPI) -> None:
    """/docs: Swagger UI from the files the fastapi-offline package ships (under /docs/static), so
    it works without internet, started by static/swagger-init.js rather than FastAPI's inline
    snippet (the CSP allows no inline script). ReDoc is not served."""
    app.mount("/docs/static", StaticFiles(packages=[("fastapi_offline", "static")]), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        return console.templates.TemplateResponse(request, "docs.html", {"title": app.title,
                                                                          "openapi_url": app.openapi_url})


def create_app(settings: ApiSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        runtime = settings.runtime
        # Not ready before the app has started and Postgres has answered (health.watch below). The
        # pool opens its connections when first used: a Postgres away at start is waited for, not
        # a reason to exit.
        health.HEALTH.waiting_for("startup")
        health.HEALTH.waiting_for("postgres")
        nc = await eventlog.connect(runtime, "api")
        pool = await asyncpg.create_pool(runtime.pg_dsn, min_size=0, max_size=10)
        broker = bus.new_broker(runtime)
        subscribed, hub = answers.Subscribed(), bus.Hub(nc)
        publishers = bus.declare_publishers(broker)
        await broker.start()
        await bus.listen_for_answers(nc, subscribed)
        js = nc.jetstream()
        app.state.settings, app.state.pool, app.state.js = settings, pool, js
        app.state.hub = hub
        app.state.commands = Commands(publishers, js, subscribed)
        app.state.auth = Authenticator(pool)
        app.state.broker = broker
        # /readyz on the metrics port: not ready while Postgres (tokens, every read) does not answer
        postgres = asyncio.create_task(health.watch("postgres", lambda: pool.fetchval("SELECT 1")))
        health.HEALTH.done("startup")
        try:
            yield
        finally:
            postgres.cancel()
            await broker.stop()
            await pool.close()
            await nc.close()

    app = FastAPI(title="gpusched API", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Submit and follow GPU jobs; queues, cluster, usage. docs/api.md.")
    problems.install(app)
    app.add_middleware(telemetry.Telemetry)
    app.add_middleware(SecurityHeaders)
    install_docs(app)
    app.include_router(routes.router)
    app.include_router(serving.router)
    console.install(app)

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app
