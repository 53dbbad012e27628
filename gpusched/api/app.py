"""The API application: settings, its NATS and Postgres connections, the routes, the console."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import asyncpg
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from gpusched.api import bus, console, problems, routes, serving, telemetry
from gpusched.gateway.commands import Answer
from gpusched.api.auth import Authenticator
from runtime import eventlog, health, observability
from runtime.settings import ConfigError, Settings, env_address, env_number
from schemas import SubmitJob, parse_event
from schemas.commands import DeployService, Principal
from schemas.envelope import Contract
from schemas.export import ContractSchema
from schemas.job import rejection_id
from schemas.registry import SUBJECT_PREFIX

log = logging.getLogger(__name__)


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


class Gateway:
    """Sends commands as the caller (a :class:`Principal`) through the FastStream publishers,
    and finds the earlier decision of a job submitted before."""

    def __init__(self, publishers: dict[str, object], js: JetStreamContext) -> None:
        self.publishers = publishers
        self.js = js

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

    async def earlier_decision(self, team: str, job_id: str, intake_seq: int | None = None) -> tuple[int, Answer] | None:
        """The intake sequence and admission decision of ``team``'s job already in the log (a
        repeat), or the rejection of the command at ``intake_seq`` (a repeat of a rejected one).
        Another team's job of that id is not a repeat (and its decision is not the caller's to
        see): admission rejects the command as a duplicate job id."""
        if intake_seq is not None:
            rejected = await self._last(f"{SUBJECT_PREFIX}.job.{rejection_id(intake_seq)}.rejected")
            if rejected is not None:
                return intake_seq, Answer(rejected, repeat=True)
        submitted = await self._last(f"{SUBJECT_PREFIX}.job.{job_id}.submitted")
        if submitted is None or submitted.spec.team != team:
            return None
        decision = (await self._last(f"{SUBJECT_PREFIX}.job.{job_id}.admitted")
                    or await self._last(f"{SUBJECT_PREFIX}.job.{job_id}.rejected"))
        return None if decision is None else (submitted.intake_sequence, Answer(decision, repeat=True))

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


def create_app(settings: ApiSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        runtime = settings.runtime
        nc = await eventlog.connect(runtime, "api")
        pool = await asyncpg.create_pool(runtime.pg_dsn, min_size=1, max_size=10)
        broker = bus.new_broker(runtime)
        decisions, hub = bus.Decisions(), bus.Hub(nc)
        publishers = bus.declare_publishers(broker)
        await broker.start()
        await bus.listen_for_answers(nc, decisions)
        js = nc.jetstream()
        app.state.settings, app.state.pool, app.state.js = settings, pool, js
        app.state.decisions, app.state.hub = decisions, hub
        app.state.gateway = Gateway(publishers, js)
        app.state.auth = Authenticator(pool)
        app.state.broker = broker
        # /readyz on the metrics port: not ready while Postgres (tokens, every read) does not answer
        postgres = asyncio.create_task(health.watch("postgres", lambda: pool.fetchval("SELECT 1")))
        try:
            yield
        finally:
            postgres.cancel()
            await broker.stop()
            await pool.close()
            await nc.close()

    app = FastAPI(title="gpusched API", version="1", lifespan=lifespan,
                  description="Submit and follow GPU jobs; queues, cluster, usage. docs/api.md.")
    problems.install(app)
    app.add_middleware(telemetry.Telemetry)
    app.include_router(routes.router)
    app.include_router(serving.router)
    console.install(app)

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app
