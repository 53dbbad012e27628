"""`gpusched deploy`, `scale`, `delete-service` and `services`: inference services from the CLI
(docs/serving.md). The commands go to the team's intake subjects over NATS, as `submit` does;
the listing reads the read models."""


import asyncio
import csv
import math
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
        _nats_only("report-load")

        async def play(js) -> list[dict[str, Any]]:
            out, started = [], asyncio.get_running_loop().time()
            for offset, rps in points:
                await asyncio.sleep(max(0.0, started + offset / speed - asyncio.get_running_loop().time()))
                answer = await commands.service_command(js, team, "load", commands.load_command_for(service, rps),
                                                        service, on_behalf_of)
                out.append({"service": service, "offset_s": offset, "requests_per_second": rps, **_answered(answer)})
            return out
        reported = run(with_js(play))
        emit(reported[0] if curve is None else reported, output)

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
