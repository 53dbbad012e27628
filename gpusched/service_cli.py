"""`gpusched deploy`, `scale`, `delete-service` and `services`: inference services from the CLI
(docs/serving.md). The commands go to the team's intake subjects over NATS, as `submit` does;
the listing reads the read models."""


from pathlib import Path
from typing import Any, Callable, Optional

import typer

from gpusched import commands
from gpusched.connection import Connection
from gpusched.userinput import UserError
from services.accounting import queries


def _answered(answer: commands.Answer) -> dict[str, Any]:
    event = answer.event
    out: dict[str, Any] = {"event": event.type, "repeat": answer.repeat}
    for name in ("generation", "replicas", "intake_sequence"):
        if (value := getattr(event, name, None)) is not None:
            out[name] = value
    return out


def _nats_only(what: str) -> None:
    if Connection.resolve().api_url:
        raise UserError(f"{what}: the CLI sends service commands over NATS only; with an API token use the API's "
                        "/v1/services routes (docs/api.md), or a NATS credential (unset GPUSCHED_API_URL)")


def register(app: typer.Typer, *, emit: Callable, run: Callable, with_pg: Callable, with_js: Callable,
             guarded: Callable, output_option, output_enum, on_behalf_option) -> None:
    Output = output_enum

    @app.command()
    @guarded
    def deploy(
        file: Path = typer.Option(..., "-f", "--file", help="Service YAML: a service spec, or a DeployService with `spec:`"),
        on_behalf_of: Optional[str] = on_behalf_option,
        output: Output = output_option,
    ) -> None:
        """Deploy an inference service, or roll out a new spec of one. Exits 2 with admission's
        reason when it refuses (a queue the team may not use, replicas that could never run)."""
        command = commands.deploy_command_from_file(file)
        _nats_only("deploy")
        spec = command.spec
        answer = run(with_js(lambda js: commands.service_command(js, spec.team, "deploy", command, spec.name,
                                                                on_behalf_of)))
        emit({"service": spec.name, **_answered(answer)}, output)

    @app.command()
    @guarded
    def scale(service: str, replicas: int = typer.Argument(..., min=0),
              team: str = typer.Option(..., help="Team owning the service"),
              on_behalf_of: Optional[str] = on_behalf_option, output: Output = output_option) -> None:
        """Ask for REPLICAS replicas of SERVICE; the controller keeps them within the spec's min and max."""
        command = commands.scale_command(service, replicas)
        _nats_only("scale")
        answer = run(with_js(lambda js: commands.service_command(js, team, "scale", command, service, on_behalf_of)))
        emit({"service": service, **_answered(answer)}, output)

    @app.command("report-load")
    @guarded
    def report_load(service: str, requests_per_second: float = typer.Argument(..., min=0),
                    team: str = typer.Option(..., help="Team owning the service"),
                    on_behalf_of: Optional[str] = on_behalf_option, output: Output = output_option) -> None:
        """Report SERVICE's load, as its ingress would: what a requests_per_replica autoscaling rule reads."""
        command = commands.load_command_for(service, requests_per_second)
        _nats_only("report-load")
        answer = run(with_js(lambda js: commands.service_command(js, team, "load", command, service, on_behalf_of)))
        emit({"service": service, **_answered(answer)}, output)

    @app.command("delete-service")
    @guarded
    def delete_service(service: str, team: str = typer.Option(..., help="Team owning the service"),
                       on_behalf_of: Optional[str] = on_behalf_option, output: Output = output_option) -> None:
        """Delete a service: its replicas are retired (their jobs cancelled)."""
        command = commands.delete_command(service)
        _nats_only("delete-service")
        answer = run(with_js(lambda js: commands.service_command(js, team, "delete", command, service, on_behalf_of)))
        emit({"service": service, **_answered(answer)}, output)

    @app.command()
    def services(service: Optional[str] = typer.Argument(None, help="One service: its replicas"),
                 team: Optional[str] = typer.Option(None, help="Only this team's services"),
                 output: Output = output_option) -> None:
        """Services with desired and ready replicas; with SERVICE, each replica's state, node and why."""
        if service is None:
            emit(run(with_pg(lambda conn: queries.services(conn, team))), output, columns=[
                "service", "team", "queue", "generation", "desired", "ready", "starting", "pending", "requested"])
            return
        emit(run(with_pg(lambda conn: queries.service_replicas(conn, service))), output, columns=[
            "job_id", "generation", "state", "attempt", "nodes", "reason", "ready_at"])
