"""The gateway's HTTP adapter (gpusched.gateway.port), a tenant's: the HTTP API through the SDK's
AsyncClient (its public methods only). The API waits for admission's answer itself; this adapter
translates the SDK's results and errors into the port's :class:`Answer` and ``UserError``."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from gpusched.gateway.port import WAIT_S, Answer
from gpusched.userinput import UserError

if TYPE_CHECKING:
    from gpusched.gateway.connection import Connection
    from schemas.commands import DeployService, SubmitJob


def _sdk():
    """The SDK's module (imported when a command runs: httpx and the models are not light)."""
    import gpusched_sdk as client

    return client


class HttpGateway:
    def __init__(self, connection: "Connection") -> None:
        self.connection = connection
        self._client = None

    async def __aenter__(self) -> "HttpGateway":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _gs(self):
        if self._client is None:
            if not self.connection.api_token:
                raise UserError(f"the API at {self.connection.api_url} needs a token: set GPUSCHED_API_TOKEN "
                                "(`gpusched token issue`)")
            try:
                self._client = _sdk().AsyncClient(self.connection.api_url, self.connection.api_token)
            except ValueError as err:
                raise UserError(str(err)) from None
        return self._client

    async def _call(self, what: str, call) -> Any:
        """``await call(client)``; the API's refusal (but a rejection, which the caller answers
        with) as a UserError naming the problem, as one that cannot reach it."""
        import httpx

        sdk = _sdk()
        try:
            return await call(self._gs())
        except sdk.Rejected:
            raise
        except sdk.ApiError as err:
            raise UserError(_refusal(what, err)) from None
        except httpx.HTTPError as err:
            raise UserError(f"cannot reach the API at {self.connection.api_url}: {err!r} "
                            "(is `make run` running?)") from None

    @staticmethod
    def _no_on_behalf(on_behalf_of: str | None, what: str) -> None:
        """Through the API the token names who acts (the API records an operator's own name)."""
        if on_behalf_of is not None:
            raise UserError(f"--on-behalf-of: the API does not take it for a {what} (it records the token's holder); "
                            "leave it out, or unset GPUSCHED_API_URL to send the command over NATS")

    # -- commands ------------------------------------------------------------------------------
    async def submit(self, command: "SubmitJob", *, wait: bool = True, on_behalf_of: str | None = None) -> Answer:
        sdk = _sdk()
        try:
            done = await self._call("submission", lambda gs: gs.submit(command, wait_s=WAIT_S if wait else 0,
                                                                      on_behalf_of=on_behalf_of))
        except sdk.Rejected as err:
            if err.reason == "dead-letter":
                raise UserError(_refusal("submission", err)) from None
            field = err.errors[0]["field"].removeprefix("body.") if err.errors else None
            return Answer(None, decision="JobRejected", job_id=command.job_id, reason=err.reason, field=field,
                          message=err.detail, filed_under=err.job_id)
        if wait and done.decision == "pending":
            raise UserError(f"no answer to the submission (intake sequence {done.intake_sequence}) within "
                            f"{WAIT_S:.0f} s; see `gpusched events {done.job_id}`")
        return Answer(done.intake_sequence, decision={"admitted": "JobAdmitted"}.get(done.decision),
                      job_id=done.job_id, repeat=done.repeat, queue=done.queue)

    async def cancel(self, job_id: str, team: str, reason: str = "", *, wait: bool = True,
                     on_behalf_of: str | None = None) -> Answer:
        self._no_on_behalf(on_behalf_of, "cancel")
        answer = await self._call("cancel request", lambda gs: gs.cancel(job_id, reason, wait_s=WAIT_S if wait else 0))
        return self._answered("cancel request", answer, wait)

    async def checkpoint(self, job_id: str, team: str, attempt: int, *, step: int | None = None, location: str = "",
                         checkpointed_at: datetime | None = None, wait: bool = True,
                         on_behalf_of: str | None = None) -> Answer:
        self._no_on_behalf(on_behalf_of, "checkpoint")
        answer = await self._call("checkpoint report", lambda gs: gs.checkpoint(
            job_id, attempt, step=step, location=location, checkpointed_at=checkpointed_at,
            wait_s=WAIT_S if wait else 0))
        recorded = None
        if answer.outcome == "JobCheckpointed":  # its time, from the recorded event
            events = await self._call("checkpoint report", lambda gs: gs.events(job_id))
            recorded = next((e.checkpointed_at for e in reversed(events) if e.type == "JobCheckpointed"
                             and e.intake_sequence == answer.intake_sequence), None)
        return Answer(answer.intake_sequence, decision=None if answer.outcome == "pending" else answer.outcome,
                      job_id=job_id, checkpointed_at=recorded)

    def _answered(self, what: str, answer, wait: bool) -> Answer:
        if answer.outcome == "pending":
            if wait:
                raise UserError(f"no answer to the {what} (intake sequence {answer.intake_sequence}) within "
                                f"{WAIT_S:.0f} s; see `gpusched events {answer.job_id}` and `gpusched dlq`")
            return Answer(answer.intake_sequence, job_id=answer.job_id)
        return Answer(answer.intake_sequence, decision=answer.outcome, job_id=answer.job_id, repeat=answer.repeat)

    async def _service(self, verb: str, service: str, on_behalf_of: str | None, call) -> Answer:
        self._no_on_behalf(on_behalf_of, f"{verb} of a service")
        answer = await self._call(f"{verb} of service {service}", call)
        return Answer(answer["intake_sequence"], decision=answer["outcome"], service=answer["service"],
                      repeat=answer["repeat"], generation=answer.get("generation"))

    async def deploy(self, command: "DeployService", *, on_behalf_of: str | None = None) -> Answer:
        document = command.model_dump(mode="json", exclude_none=True)
        return await self._service("deploy", command.spec.name, on_behalf_of, lambda gs: gs.deploy(document))

    async def scale(self, team: str, service: str, replicas: int, *, on_behalf_of: str | None = None) -> Answer:
        return await self._service("scale", service, on_behalf_of, lambda gs: gs.scale(service, replicas))

    async def report_load(self, team: str, service: str, requests_per_second: float, *,
                          on_behalf_of: str | None = None) -> Answer:
        return await self._service("load", service, on_behalf_of,
                                   lambda gs: gs.report_load(service, requests_per_second))

    async def delete_service(self, team: str, service: str, *, on_behalf_of: str | None = None) -> Answer:
        return await self._service("delete", service, on_behalf_of, lambda gs: gs.delete_service(service))

    # -- reads ---------------------------------------------------------------------------------
    async def job(self, job_id: str) -> dict[str, Any]:
        return _plain(await self._call("job", lambda gs: gs.get(job_id)))

    async def jobs(self, team: str | None = None, state: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        async def listing(gs) -> list[dict[str, Any]]:
            rows = []
            async for row in gs.jobs(page_size=min(limit, 500), team=team, state=state):
                rows.append(_plain(row))
                if len(rows) >= limit:
                    break
            return rows
        return await self._call("listing", listing)

    async def services(self, team: str | None = None) -> list[dict[str, Any]]:
        rows = await self._call("listing", lambda gs: gs.services())
        return [r for r in map(_plain, rows) if team in (None, r.get("team"))]

    async def service_replicas(self, service: str) -> list[dict[str, Any]]:
        return [_plain(r) for r in (await self._call("listing", lambda gs: gs.service(service)))["replicas_detail"]]

    async def why(self, job_id: str) -> dict[str, Any]:
        # the fields the API gave (times as datetimes, as the log's adapter gives them), no defaults added
        return (await self._call("why", lambda gs: gs.why(job_id))).model_dump(exclude_unset=True)

    async def events(self, job_id: str) -> list[dict[str, Any]]:
        pairs = await self._call("events", lambda gs: gs.events(job_id, with_sequence=True))
        return [{"sequence": seq, **e.model_dump(mode="json")} for seq, e in pairs]

    async def queues(self) -> list[dict[str, Any]]:
        return await self._call("queues", lambda gs: gs.queues())

    async def chargeback(self, period: str, by: str = "team") -> dict[str, Any]:
        return await self._call("chargeback", lambda gs: gs.chargeback(period, group_by=by))

    async def summary(self) -> dict[str, Any]:
        return await self._call("summary", lambda gs: gs.summary())


def _refusal(what: str, err) -> str:
    fields = "; ".join(f"{e.get('field')}: {e.get('message')}" for e in err.errors)
    return f"the API refused the {what}: {err.detail}{f' ({fields})' if fields else ''}"


def _plain(row: Any) -> dict[str, Any]:
    """A row as a plain mapping (the SDK's typed results dump to their JSON fields)."""
    return row.model_dump(mode="json") if hasattr(row, "model_dump") else dict(row)
