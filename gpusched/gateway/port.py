"""The applications' one gateway to the platform (the port; cosmicpython's bootstrap and Kueue's
GenericJob are the models): submit, cancel, checkpoint, deploy, scale, report_load,
delete_service, each waiting for the platform's answer, and the reads the CLI shows. Two
adapters implement it:

- :mod:`gpusched.gateway.log`: NATS and Postgres, the operator's (commands on the intake
  subjects, answers read from the event log, reads from the read models);
- :mod:`gpusched.gateway.http`: the HTTP API through the SDK's AsyncClient, a tenant's.

:meth:`gpusched.gateway.connection.Connection.gateway` picks one, once; a command of the CLI
calls the gateway and never asks which transport carries it. Every command returns one
:class:`Answer`; a refusal that is no decision (a dead letter, no answer in time, a transport
that cannot be reached) is a ``UserError`` naming it.

This module imports nothing heavy: the CLI starts without nats, asyncpg, httpx or the contract's
models (docs/performance.md, "CLI start")."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from schemas.commands import DeployService, SubmitJob


@dataclass(frozen=True)
class Answer:
    """The platform's answer to one command, whichever transport carried it.

    ``decision``: the type of the event that decided it (JobAdmitted, JobRejected,
    JobCancelRequested, JobCheckpointed, ServiceDeployed, ...), None when not waited for.
    ``repeat``: the command changed nothing (the job or the spec was there already). A
    rejection has its ``reason`` (the code), ``field``, ``message`` and the id it is
    ``filed_under`` (``rejected-<intake sequence>``); an admission its ``queue``.
    ``dead_letter``: admission's reason for refusing a command it could not read or apply (no
    decision). Made by :func:`gpusched.gateway.answers.answer_of` for the CLI and the API alike;
    the adapters turn a dead letter or no answer in time into a ``UserError``, the API into
    409 and 202."""

    intake_sequence: int | None
    decision: str | None = None
    job_id: str | None = None
    service: str | None = None
    repeat: bool = False
    reason: str | None = None
    field: str | None = None
    message: str | None = None
    generation: int | None = None
    checkpointed_at: datetime | None = None
    trace_id: str | None = None
    queue: str | None = None
    filed_under: str | None = None
    dead_letter: str | None = None

    @property
    def pending(self) -> bool:
        """No decision (yet): not waited for, or no answer within the wait."""
        return self.decision is None and self.dead_letter is None

    @property
    def rejected(self) -> bool:
        return self.decision == "JobRejected"

    def fields(self) -> dict[str, Any]:
        return asdict(self)


WAIT_S = 15.0
"""How long a command waits for the platform's answer by default (gpusched.gateway.commands.WAIT_S)."""


class Gateway(Protocol):
    """What the applications ask of the platform. Use as an async context manager: the adapter
    opens its connection on first use and closes it on exit."""

    async def __aenter__(self) -> "Gateway": ...
    async def __aexit__(self, *exc: object) -> None: ...

    # -- commands: each waits for admission's answer unless ``wait`` is False ----------------
    async def submit(self, command: "SubmitJob", *, wait: bool = True, on_behalf_of: str | None = None) -> Answer: ...
    async def cancel(self, job_id: str, team: str, reason: str = "", *, wait: bool = True,
                     on_behalf_of: str | None = None) -> Answer: ...
    async def checkpoint(self, job_id: str, team: str, attempt: int, *, step: int | None = None, location: str = "",
                         checkpointed_at: datetime | None = None, wait: bool = True,
                         on_behalf_of: str | None = None) -> Answer: ...
    async def deploy(self, command: "DeployService", *, on_behalf_of: str | None = None) -> Answer: ...
    async def scale(self, team: str, service: str, replicas: int, *, on_behalf_of: str | None = None) -> Answer: ...
    async def report_load(self, team: str, service: str, requests_per_second: float, *,
                          on_behalf_of: str | None = None) -> Answer: ...
    async def delete_service(self, team: str, service: str, *, on_behalf_of: str | None = None) -> Answer: ...

    # -- reads ---------------------------------------------------------------------------------
    async def job(self, job_id: str) -> dict[str, Any]: ...
    async def jobs(self, team: str | None = None, state: str | None = None, limit: int = 50) -> list[dict[str, Any]]: ...
    async def services(self, team: str | None = None) -> list[dict[str, Any]]: ...
    async def service_replicas(self, service: str) -> list[dict[str, Any]]: ...
    async def why(self, job_id: str) -> dict[str, Any]:
        """Why the job waits (gpusched.gateway.history.explain) with its ``position`` in its queue.
        An adapter that reads the read models itself (the log's) adds ``queue_now`` while the job
        waits for quota: its queue's usage now (gpusched.gateway.queue_usage.queue_now); the API
        does not give it."""
    async def events(self, job_id: str) -> list[dict[str, Any]]:
        """The job's events in log order, each a JSON mapping with its stream ``sequence``."""
    async def queues(self) -> list[dict[str, Any]]:
        """Per queue and flavor: quota, use, pending jobs, budget (gpusched.gateway.queue_usage)."""
    async def chargeback(self, period: str, by: str = "team") -> dict[str, Any]:
        """The period's statement as of the log's now (services.accounting.queries.statement)."""
    async def summary(self) -> dict[str, Any]:
        """Jobs by state, wait p50/p95, failures, utilization (services.accounting.queries.summary)."""
