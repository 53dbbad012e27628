"""The API's routes for inference services under ``/v1/services`` (docs/serving.md, docs/api.md).
A member deploys, scales and deletes its own team's services and sees only those; an operator
acts on behalf of its token's name for any team."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from pydantic import Field, ValidationError

from gpusched.gateway import answers, commands
from gpusched.gateway.port import Answer
from gpusched.api.auth import Identity, require, team_filter
from gpusched.api.problems import Problem, from_malformed, from_validation
from gpusched.api.routes import ERRORS, PROBLEM, READERS, Me, Strict, WaitS, json_body
from schemas.auth import Role
from schemas.commands import DeployService, MalformedCommand, parse_command
from schemas.service import MAX_REPLICAS, SERVICE_NAME_MAX
from schemas.envelope import NAME_PATTERN
from services.accounting import queries

router = APIRouter(prefix="/v1", responses=ERRORS)
ServiceName = Annotated[str, Path(pattern=NAME_PATTERN, max_length=SERVICE_NAME_MAX, description="A service's name")]
ACTORS = (Role.MEMBER, Role.OPERATOR, Role.ADMIN)
REPEAT_WAIT_S = 2.0
"""How long a deploy of the spec the read model shows waits for admission to say otherwise."""


class ServiceAnswer(Strict):
    service: str
    intake_sequence: int = Field(description="The command's place in the intake stream")
    outcome: str = Field(description="The event admission recorded (ServiceDeployed, ScaleRequested, ...), or "
                                     "pending: no answer within the wait")
    repeat: bool = Field(default=False, description="A deploy of the spec the service has: nothing changed")
    generation: int | None = None


class ScaleBody(Strict):
    replicas: int = Field(ge=0, le=MAX_REPLICAS)


class LoadBody(Strict):
    requests_per_second: float = Field(ge=0, le=1e9, allow_inf_nan=False)


async def _visible(request: Request, me: Identity, name: str) -> dict[str, Any]:
    """The service's read-model row if ``me`` may see it; else 404 (also for another team's)."""
    async with request.app.state.pool.acquire() as conn:
        rows = [r for r in await queries.services(conn, None) if r["service"] == name]
    if not rows or not me.sees_team(rows[0]["team"]):
        raise Problem(404, "not-found", "Not found", f"no service {name!r} (or not yet in the read models)",
                      service=name)
    return rows[0]


async def _send(request: Request, me: Identity, team: str, verb: str, command, service: str,
                wait: float) -> Answer:
    """Send a service command as the gateway builds it and wait for admission's answer
    (gpusched.gateway.answers); 409 when admission dead-lettered it."""
    principal = me.principal(team, verb)
    command = commands.acting_for(command, principal, me.name)
    unchanged = command.spec if isinstance(command, DeployService) else None
    answer = await request.app.state.commands.run(principal, command,
                                                  lambda seq: answers.for_service(service, seq, unchanged), wait,
                                                  service=service)
    if answer.dead_letter is not None:
        raise Problem(409, "refused", "Refused by admission", answer.dead_letter, service=service,
                      reason="dead-letter")
    return answer


def _service_answer(answer: Answer) -> ServiceAnswer:
    return ServiceAnswer(service=answer.service, intake_sequence=answer.intake_sequence,
                         outcome=answer.decision or "pending", repeat=answer.repeat, generation=answer.generation)


@router.get("/services", tags=["services"])
async def list_services(request: Request, me: Me) -> list[dict[str, Any]]:
    """Services with their desired replicas and how many are ready, starting and pending. A
    member sees its own team's."""
    require(me, *READERS)
    async with request.app.state.pool.acquire() as conn:
        return await queries.services(conn, team_filter(me, None))


@router.get("/services/{name}", tags=["services"], responses={404: PROBLEM})
async def get_service(request: Request, me: Me, name: ServiceName) -> dict[str, Any]:
    """One service and each of its replicas: state, attempt, node, why."""
    require(me, *READERS)
    row = await _visible(request, me, name)
    async with request.app.state.pool.acquire() as conn:
        return {**row, "replicas_detail": await queries.service_replicas(conn, name)}


@router.post("/services", status_code=201, response_model=ServiceAnswer, tags=["services"],
             openapi_extra=json_body("DeployService"),
             responses={200: {"model": ServiceAnswer, "description": "The service has this spec already"},
                        202: {"model": ServiceAnswer, "description": "Sent; no answer within the wait"},
                        409: {**PROBLEM, "description": "Admission refused it (its replicas would not be admitted)"}})
async def deploy(request: Request, response: Response, me: Me, wait: WaitS = 10.0) -> ServiceAnswer:
    """Deploy a service, or roll out a new spec of the team's (a DeployService document:
    ``{"spec": {...}}``, the same as on NATS)."""
    require(me, *ACTORS)
    try:
        command = parse_command(DeployService, await request.body())
    except MalformedCommand as err:
        raise from_malformed(err) from None
    except ValidationError as err:
        raise from_validation(err) from None
    spec = command.spec
    me.principal(spec.team, "deploy")  # 403 before anything else for another team's service
    async with request.app.state.pool.acquire() as conn:
        current = await queries.service_spec(conn, spec.name)
    same = current is not None and current[0] == spec.team and current[1] == spec
    # Always sent: the read model may lag the log (a rollback to the spec it shows is news to
    # admission). Admission records nothing for the spec the service has, so when the read model
    # shows ours, a short wait with no answer is that repeat.
    answer = await _send(request, me, spec.team, "deploy", command, spec.name, min(wait, REPEAT_WAIT_S) if same else wait)
    if answer.pending and same:
        answer = dataclasses.replace(answer, decision="ServiceDeployed", repeat=True, generation=current[2])
    response.status_code = 202 if answer.pending else 200 if answer.repeat else 201
    return _service_answer(answer)


@router.post("/services/{name}/scale", response_model=ServiceAnswer, tags=["services"],
             responses={404: PROBLEM, 409: PROBLEM})
async def scale(request: Request, me: Me, name: ServiceName, body: ScaleBody, wait: WaitS = 10.0) -> ServiceAnswer:
    """Ask for ``replicas``; the controller keeps them within the spec's min and max."""
    require(me, *ACTORS)
    row = await _visible(request, me, name)
    return _service_answer(await _send(request, me, row["team"], "scale", commands.scale_command(name, body.replicas),
                                       name, wait))


@router.post("/services/{name}/load", response_model=ServiceAnswer, tags=["services"],
             responses={404: PROBLEM, 409: PROBLEM})
async def load(request: Request, me: Me, name: ServiceName, body: LoadBody, wait: WaitS = 10.0) -> ServiceAnswer:
    """Report the service's load (an ingress's job): what a requests_per_replica rule reads."""
    require(me, *ACTORS)
    row = await _visible(request, me, name)
    return _service_answer(await _send(request, me, row["team"], "load",
                                       commands.load_command_for(name, body.requests_per_second), name, wait))


@router.delete("/services/{name}", response_model=ServiceAnswer, tags=["services"],
               responses={404: PROBLEM, 409: PROBLEM})
async def delete(request: Request, me: Me, name: ServiceName, wait: WaitS = 10.0) -> ServiceAnswer:
    """Delete the service: its replicas are retired."""
    require(me, *ACTORS)
    row = await _visible(request, me, name)
    return _service_answer(await _send(request, me, row["team"], "delete", commands.delete_command(name), name, wait))
