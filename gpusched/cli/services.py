"""`gpusched deploy`, `scale`, `report-load`, `delete-service` and `services`: inference services
from the CLI (docs/serving.md). As `submit` does: through the HTTP API when the connection names
one (`make run`'s does), else the team's intake subjects over NATS and the read models."""


import csv
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from gpusched.gateway import commands
from gpusched.gateway.connection import Connection
from gpusched.userinput import UserError
from services.accounting import queries


def _answered(service: str, answer: commands.Answer) -> dict[str, Any]:
    """Admission's answer over NATS, in the shape the API gives it (gpusched.api.serving.ServiceAnswer)."""
    event = answer.event
    return {"service": service, "intake_sequence": getattr(event, "intake_sequence", None), "outcome": event.type,
            "repeat": answer.repeat, "generation": getattr(event, "generation", None)}


def load_curve(path: Path) -> list[tuple[float, float]]:
    """(offset seconds, requests per second) rows of a CSV, in time order; a header row is allowed.
    UserError naming the file and line of the first bad row."""
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise UserError(f"{path}: {err.strerror}") from None
    points: list[tuple[float, float]] = []
    for n, row in enumerate(csv.reader(lines), start=1):
        if not row or (n == 1 and not row[0].strip().replace(".", "", 1).isdigit()):
            continue  # blank, or the header
        try:
            offset, rps = float(row[0]), float(row[1])
        except (IndexError, ValueError):
            raise UserError(f"{path}:{n}: expected seconds,requests_per_second (numbers), got {','.join(row)!r}") from None
        if offset < 0 or rps < 0 or not math.isfinite(offset + rps) or (points and offset < points[-1][0]):
            raise UserError(f"{path}:{n}: offsets and loads are finite, at least 0, and offsets never go back; "
                            f"got {offset:g},{rps:g}")
        points.append((offset, rps))
    if not points:
        raise UserError(f"{path}: no rows; expected seconds,requests_per_second rows")
    return points


def register(app: typer.Typer, *, emit: Callable, run: Callable, with_pg: Callable, with_js: Callable,
             guarded: Callable, through_api: Callable, output_option, output_enum, on_behalf_option) -> None:
    Output = output_enum

    def send(team: str, verb: str, command, service: str, on_behalf_of: str | None, api_call) -> dict[str, Any]:
        """Through the API (``api_call(client)``) when the connection names one, else over NATS."""
        connection = Connection.resolve()
        if connection.api_url:
            if on_behalf_of is not None:
                raise UserError(f"{verb}: --on-behalf-of is for the operator's NATS credential; through the API the "
                                "token names who acts")
            return through_api(connection, f"{verb} of service {service}", api_call)
        answer = run(with_js(lambda js: commands.service_command(js, team, verb, command, service, on_behalf_of)))
        return _answered(service, answer)

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
        spec = command.spec
        emit(send(spec.team, "deploy", command, spec.name, on_behalf_of,
                  lambda gs: gs.deploy(command.model_dump(mode="json", exclude_none=True))), output)

    @app.command()
    @guarded
    def scale(service: str, replicas: int = typer.Argument(..., min=0),
              team: str = typer.Option(..., help="Team owning the service"),
              on_behalf_of: Optional[str] = on_behalf_option, output: Output = output_option) -> None:
        """Ask for REPLICAS replicas of SERVICE; the controller keeps them within the spec's min and max."""
        command = commands.scale_command(service, replicas)
        emit(send(team, "scale", command, service, on_behalf_of, lambda gs: gs.scale(service, replicas)), output)

    @app.command("report-load")
    @guarded
    def report_load(service: str,
                    requests_per_second: Optional[float] = typer.Argument(None, min=0, help="One report"),
                    team: str = typer.Option(..., help="Team owning the service"),
                    curve: Optional[Path] = typer.Option(None, help="Or a load curve: a CSV of seconds,requests_per_second "
                                                                    "rows, reported at those offsets"),
                    speed: float = typer.Option(1.0, min=0.001, help="With --curve: curve seconds per real second "
                                                                     "(the dev stack's time scale keeps them in step)"),
                    on_behalf_of: Optional[str] = on_behalf_option, output: Output = output_option) -> None:
        """Report SERVICE's load, as its ingress would: what a requests_per_replica autoscaling rule
        reads. One value, or a curve from a file played at ``--speed``."""
        if (requests_per_second is None) == (curve is None):
            raise UserError("report-load: give either REQUESTS_PER_SECOND or --curve FILE")
        points = [(0.0, requests_per_second)] if curve is None else load_curve(curve)
        reported, started = [], time.monotonic()
        for offset, rps in points:
            time.sleep(max(0.0, started + offset / speed - time.monotonic()))
            answer = send(team, "load", commands.load_command_for(service, rps), service, on_behalf_of,
                          lambda gs: gs.report_load(service, rps))
            reported.append({**answer, "offset_s": offset, "requests_per_second": rps})
        emit(reported[0] if curve is None else reported, output)

    @app.command("delete-service")
    @guarded
    def delete_service(service: str, team: str = typer.Option(..., help="Team owning the service"),
                       on_behalf_of: Optional[str] = on_behalf_option, output: Output = output_option) -> None:
        """Delete a service: its replicas are retired (their jobs cancelled)."""
        command = commands.delete_command(service)
        emit(send(team, "delete", command, service, on_behalf_of, lambda gs: gs.delete_service(service)), output)

    @app.command()
    def services(service: Optional[str] = typer.Argument(None, help="One service: its replicas"),
                 team: Optional[str] = typer.Option(None, help="Only this team's services"),
                 output: Output = output_option) -> None:
        """Services with desired and ready replicas; with SERVICE, each replica's state, node and why."""
        connection = Connection.resolve()
        if service is None:
            rows = (through_api(connection, "listing", lambda gs: gs.services()) if connection.api_url
                    else run(with_pg(lambda conn: queries.services(conn, team))))
            emit([r for r in rows if team in (None, r["team"])], output, columns=[
                "service", "team", "queue", "generation", "desired", "ready", "starting", "pending", "requested"])
            return
        rows = (through_api(connection, "listing", lambda gs: gs.service(service)["replicas_detail"])
                if connection.api_url else run(with_pg(lambda conn: queries.service_replicas(conn, service))))
        emit(rows, output, columns=["job_id", "generation", "state", "attempt", "nodes", "reason", "ready_at"])
