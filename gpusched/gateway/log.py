"""The gateway's NATS + Postgres adapter (gpusched.gateway.port), the operator's: commands on the
intake subjects of the connection's credential (gpusched.gateway.commands), answers read from the
event log (gpusched.gateway.answers.wait_in_log, made into the port's Answer by answer_of), reads
from the log (gpusched.gateway.history) and the read models (services.accounting.queries)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from gpusched.gateway.port import Answer
from gpusched.userinput import UserError

if TYPE_CHECKING:
    from gpusched.gateway.connection import Connection
    from schemas.commands import DeployService, SubmitJob


class LogGateway:
    def __init__(self, connection: "Connection") -> None:
        self.connection = connection
        self._nc = None

    async def __aenter__(self) -> "LogGateway":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._nc is not None:
            await self._nc.close()
            self._nc = None

    async def js(self):
        if self._nc is None:
            self._nc = await self.connection.nats()
        return self._nc.jetstream()

    async def _pg(self, query) -> Any:
        return await self.connection.read(query)

    # -- commands ------------------------------------------------------------------------------
    async def _command(self, what: str, team: str, verb: str, command, awaited, *, wait: bool, hint: str,
                       on_behalf_of: str | None, headers: dict[str, str] | None = None, **fields: Any) -> Answer:
        """Publish ``command``; unless ``wait`` is False, read its answer from the log
        (gpusched.gateway.answers: ``awaited(intake_seq)`` says what to wait for)."""
        from gpusched.gateway import answers, commands

        js = await self.js()
        seq, duplicate = await commands.publish(js, team, verb, command, headers=headers, on_behalf_of=on_behalf_of)
        fields.setdefault("repeat", duplicate)
        if not wait:
            return answers.answer_of(None, seq, **fields)
        decided = await answers.wait_in_log(js, awaited(seq), commands.WAIT_S)
        return commands.refused(what, answers.answer_of(decided, seq, **fields), hint)

    async def submit(self, command: "SubmitJob", *, wait: bool = True, on_behalf_of: str | None = None) -> Answer:
        from gpusched.gateway import answers, commands
        from runtime import observability

        command = commands.submission(command)
        job_id, spec = command.job_id, command.spec
        observability.client_tracing()
        with observability.tracer().start_as_current_span("gpusched submit", attributes={"job": job_id}):
            trace_id = observability.current_trace_id()
            return await self._command(
                "submission", spec.team, "submit", command,
                lambda seq: answers.for_submit(job_id, seq, keyed=bool(spec.idempotency_key), spec=spec),
                wait=wait, hint=commands.job_hint(job_id), on_behalf_of=on_behalf_of,
                headers={"Nats-Msg-Id": commands.submit_message_id(command)}, job_id=job_id, trace_id=trace_id)

    async def cancel(self, job_id: str, team: str, reason: str = "", *, wait: bool = True,
                     on_behalf_of: str | None = None) -> Answer:
        from gpusched.gateway import answers, commands

        return await self._command("cancel request", team, "cancel", commands.cancel_command(job_id, reason),
                                   lambda seq: answers.for_cancel(job_id, seq), wait=wait,
                                   hint=commands.job_hint(job_id), on_behalf_of=on_behalf_of, job_id=job_id,
                                   repeat=False)

    async def checkpoint(self, job_id: str, team: str, attempt: int, *, step: int | None = None, location: str = "",
                         checkpointed_at: datetime | None = None, wait: bool = True,
                         on_behalf_of: str | None = None) -> Answer:
        from gpusched.gateway import answers, commands

        command = commands.checkpoint_command(job_id, attempt, checkpointed_at=checkpointed_at, step=step,
                                              location=location)
        return await self._command("checkpoint report", team, "checkpoint", command,
                                   lambda seq: answers.for_checkpoint(job_id, seq), wait=wait,
                                   hint=commands.job_hint(job_id), on_behalf_of=on_behalf_of, job_id=job_id,
                                   repeat=False)

    async def _service(self, team: str, verb: str, command, service: str, on_behalf_of: str | None) -> Answer:
        from gpusched.gateway import answers

        unchanged = command.spec if verb == "deploy" else None
        return await self._command(f"{verb} of service {service}", team, verb, command,
                                   lambda seq: answers.for_service(service, seq, unchanged), wait=True,
                                   hint="see `gpusched dlq`", on_behalf_of=on_behalf_of, service=service,
                                   repeat=False)

    async def deploy(self, command: "DeployService", *, on_behalf_of: str | None = None) -> Answer:
        return await self._service(command.spec.team, "deploy", command, command.spec.name, on_behalf_of)

    async def scale(self, team: str, service: str, replicas: int, *, on_behalf_of: str | None = None) -> Answer:
        from gpusched.gateway import commands

        return await self._service(team, "scale", commands.scale_command(service, replicas), service, on_behalf_of)

    async def report_load(self, team: str, service: str, requests_per_second: float, *,
                          on_behalf_of: str | None = None) -> Answer:
        from gpusched.gateway import commands

        return await self._service(team, "load", commands.load_command_for(service, requests_per_second), service,
                                   on_behalf_of)

    async def delete_service(self, team: str, service: str, *, on_behalf_of: str | None = None) -> Answer:
        from gpusched.gateway import commands

        return await self._service(team, "delete", commands.delete_command(service), service, on_behalf_of)

    # -- reads ---------------------------------------------------------------------------------
    async def job(self, job_id: str) -> dict[str, Any]:
        from services.accounting import queries

        found = await self._pg(lambda conn: queries.get_job(conn, job_id))
        if found is None:
            raise UserError(f"job {job_id!r} is not in the read model (yet); try `gpusched events {job_id}`")
        return found

    async def jobs(self, team: str | None = None, state: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        from services.accounting import queries

        return await self._pg(lambda conn: queries.list_jobs(conn, team, state, limit))

    async def services(self, team: str | None = None) -> list[dict[str, Any]]:
        from services.accounting import queries

        return await self._pg(lambda conn: queries.services(conn, team))

    async def service_replicas(self, service: str) -> list[dict[str, Any]]:
        from services.accounting import queries

        return await self._pg(lambda conn: queries.service_replicas(conn, service))

    async def why(self, job_id: str) -> dict[str, Any]:
        """The job's history explained (the log), with its position in its queue now and, while it
        waits for quota, its queue's usage now (``queue_now``): both from the read models, None
        without Postgres configured or reachable (the log's reasons still stand)."""
        from gpusched.gateway import history, queue_usage
        from gpusched.gateway.connection import read_models_ready

        js = await self.js()
        try:
            conn = await self.connection.pg()
        except UserError:
            conn = None
        try:
            with read_models_ready():
                found = await history.why(js, job_id, conn)
                if found["reason"] and found["queue"]:
                    found["queue_now"] = (None if conn is None
                                          else await queue_usage.queue_now(conn, found["queue"], js))
            return found
        finally:
            if conn is not None:
                await conn.close()

    async def events(self, job_id: str) -> list[dict[str, Any]]:
        from gpusched.gateway import history

        return [{"sequence": s, **e.model_dump(mode="json")} for s, e in await history.job_events(await self.js(), job_id)]

    async def queues(self) -> list[dict[str, Any]]:
        from gpusched.gateway import queue_usage

        js = await self.js()
        return await self._pg(lambda conn: queue_usage.queue_usage(conn, js))

    async def chargeback(self, period: str, by: str = "team") -> dict[str, Any]:
        from services.accounting import queries

        js = await self.js()
        try:
            return await self._pg(lambda conn: queries.statement(conn, period, by, log=js))
        except ValueError as err:
            raise UserError(f"--period: {err}") from None

    async def summary(self) -> dict[str, Any]:
        from services.accounting import queries

        js = await self.js()
        return await self._pg(lambda conn: queries.summary(conn, None, js))

