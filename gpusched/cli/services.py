"""`gpusched deploy`, `scale`, `report-load`, `delete-service` and `services`: inference services
from the CLI (docs/serving.md), through the connection's gateway (gpusched.gateway.port): the
HTTP API when the connection names one (`make run`'s does), else the team's intake subjects over
NATS and the read models."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path
from typing import Any, Optional

import typer

from gpusched.cli.common import OnBehalfOpt, Output, OutputOpt, app, emit, guarded, through_gateway
from gpusched.errors import UserError


def _answered(answer) -> dict[str, Any]:
    """The gateway's answer, in the shape the API gives it (gpusched.api.serving.ServiceAnswer)."""
    return {"service": answer.service, "intake_sequence": answer.intake_sequence, "outcome": answer.decision,
            "repeat": answer.repeat, "generation": answer.generation}


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


@app.command()
@guarded
def deploy(
    file: Path = typer.Option(..., "-f", "--file", help="Service YAML: a service spec, or a DeployService with `spec:`"),
    on_behalf_of: Optional[str] = OnBehalfOpt,
    output: Output = OutputOpt,
) -> None:
    """Deploy an inference service, or roll out a new spec of one. Exits 2 with admission's
    reason when it refuses (a queue the team may not use, replicas that could never run)."""
    from gpusched.gateway import commands

    command = commands.deploy_command_from_file(file)
    emit(_answered(through_gateway(lambda gw: gw.deploy(command, on_behalf_of=on_behalf_of))), output)


@app.command()
@guarded
def scale(service: str, replicas: int = typer.Argument(..., min=0),
          team: str = typer.Option(..., help="Team owning the service"),
          on_behalf_of: Optional[str] = OnBehalfOpt, output: Output = OutputOpt) -> None:
    """Ask for REPLICAS replicas of SERVICE; the controller keeps them within the spec's min and max."""
    emit(_answered(through_gateway(lambda gw: gw.scale(team, service, replicas, on_behalf_of=on_behalf_of))), output)


@app.command("report-load")
@guarded
def report_load(service: str,
                requests_per_second: Optional[float] = typer.Argument(None, min=0, help="One report"),
                team: str = typer.Option(..., help="Team owning the service"),
                curve: Optional[Path] = typer.Option(None, help="Or a load curve: a CSV of seconds,requests_per_second "
                                                                "rows, reported at those offsets"),
                speed: float = typer.Option(1.0, min=0.001, help="With --curve: curve seconds per real second "
                                                                 "(the dev stack's time scale keeps them in step)"),
                on_behalf_of: Optional[str] = OnBehalfOpt, output: Output = OutputOpt) -> None:
    """Report SERVICE's load, as its ingress would: what a requests_per_replica autoscaling rule
    reads. One value, or a curve from a file played at ``--speed``."""
    if (requests_per_second is None) == (curve is None):
        raise UserError("report-load: give either REQUESTS_PER_SECOND or --curve FILE")
    points = [(0.0, requests_per_second)] if curve is None else load_curve(curve)

    async def play(gw) -> list[dict[str, Any]]:
        import asyncio

        reported, started = [], time.monotonic()
        for offset, rps in points:
            await asyncio.sleep(max(0.0, started + offset / speed - time.monotonic()))
            answer = await gw.report_load(team, service, rps, on_behalf_of=on_behalf_of)
            reported.append({**_answered(answer), "offset_s": offset, "requests_per_second": rps})
        return reported
    reported = through_gateway(play)
    emit(reported[0] if curve is None else reported, output)


@app.command("delete-service")
@guarded
def delete_service(service: str, team: str = typer.Option(..., help="Team owning the service"),
                   on_behalf_of: Optional[str] = OnBehalfOpt, output: Output = OutputOpt) -> None:
    """Delete a service: its replicas are retired (their jobs cancelled)."""
    emit(_answered(through_gateway(lambda gw: gw.delete_service(team, service, on_behalf_of=on_behalf_of))), output)


@app.command()
def services(service: Optional[str] = typer.Argument(None, help="One service: its replicas"),
             team: Optional[str] = typer.Option(None, help="Only this team's services"),
             output: Output = OutputOpt) -> None:
    """Services with desired and ready replicas; with SERVICE, each replica's state, node and why."""
    if service is None:
        rows = through_gateway(lambda gw: gw.services(team))
        emit([r for r in rows if team in (None, r["team"])], output, columns=[
            "service", "team", "queue", "generation", "desired", "ready", "starting", "pending", "requested"])
        return
    rows = through_gateway(lambda gw: gw.service_replicas(service))
    emit(rows, output, columns=["job_id", "generation", "state", "attempt", "nodes", "reason", "ready_at"])
