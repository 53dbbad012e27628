"""The `gpusched` command line. Reads come from the Postgres read models or the event log;
changes are only ever published as commands or configuration events. Every command takes
``--output json``."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Optional

import typer

from gpusched.cli.common import (OnBehalfOpt, Output, OutputOpt, app, connection, console, dev_app, emit, err_console,
                                 guarded, print_error, run, through_gateway, with_js)

__all__ = ["app", "dev_app", "main", "accounting_cli"]


def _rejected_exit(result: dict[str, Any]) -> None:
    """A rejected submission: its reason on stderr, exit status 1."""
    if result["decision"] == "JobRejected":
        from rich.text import Text

        err_console.print(Text.assemble(("rejected: ", "red"), f"{result['reason']}: {result['message']}"),
                          soft_wrap=True)
        raise typer.Exit(1)


@app.command()
@guarded
def init(team: list[str] = typer.Option([], "--team", help="Also provision this team's tenant stream (repeat)")) -> None:
    """Create or update the JetStream streams, and each named team's tenant stream (needs the
    admin user). Streams deny message delete and purge; that cannot be undone."""
    import re

    from gpusched import permissions
    from gpusched.cli.common import connection
    from gpusched.userinput import UserError
    from runtime import eventlog
    from runtime.settings import Settings
    from schemas.envelope import NAME_PATTERN

    bad = [t for t in team if not re.fullmatch(NAME_PATTERN, t) or t in permissions.RESERVED
           or permissions.cluster_executor(t)]
    if bad:
        raise UserError(f"--team {bad[0]!r} is not a team name; accepted: a DNS label ({NAME_PATTERN}) other than "
                        f"{', '.join(sorted(permissions.RESERVED))} and executor-<cluster>")

    async def go():
        nc = await connection().nats()
        try:
            await eventlog.provision(nc.jetstream(), eventlog.StreamLimits.from_settings(Settings.from_env()),
                                     teams=tuple(team))
        except eventlog.UnknownTeam as err:  # each team's stream is in its own account
            raise UserError(str(err)) from None
        finally:
            await nc.close()
    run(go())
    console.print("streams provisioned" + (f" (tenant streams: {', '.join(team)})" if team else ""))


@app.command()
@guarded
def submit(
    file: Path = typer.Option(..., "-f", "--file", help="Job YAML: a job spec, or a SubmitJob with `spec:`"),
    wait: bool = typer.Option(True, help="Wait for admission's decision"),
    on_behalf_of: Optional[str] = OnBehalfOpt,
    output: Output = OutputOpt,
) -> None:
    """Submit a job as the connection's credential (a team's, or the operator's on behalf of a
    user). Exits 1 when admission rejects it, 2 when the file is refused, admission dead-letters
    the command or no decision comes in time."""
    from gpusched.gateway import commands

    command = commands.submit_command_from_file(file)
    answer = through_gateway(lambda gw: gw.submit(command, wait=wait, on_behalf_of=on_behalf_of))
    result: dict[str, Any] = {"job_id": answer.job_id, "intake_sequence": answer.intake_sequence,
                              "decision": answer.decision, "trace_id": answer.trace_id, "repeat": answer.repeat}
    if answer.rejected:
        result.update(reason=answer.reason, field=answer.field, message=answer.message)
    emit(result, output)
    _rejected_exit(result)


@app.command("cancel")
@guarded
def cancel_cmd(job_id: str,
               team: Optional[str] = typer.Option(None, help="Team owning the job (default: found from the job's id)"),
               reason: str = typer.Option("", help="Why"),
               wait: bool = typer.Option(True, help="Wait for the platform to record or refuse the request"),
               on_behalf_of: Optional[str] = OnBehalfOpt,
               output: Output = OutputOpt) -> None:
    """Ask to cancel a job. Exits 2 with admission's reason when it refuses the request (no such
    job, another team's job, an id no team has); a job that had already ended is reported as such."""
    from gpusched.gateway import commands

    async def call(gw):
        owner = team or await commands.team_of(gw, job_id)
        return await gw.cancel(job_id, owner, reason, wait=wait, on_behalf_of=on_behalf_of)
    answer = through_gateway(call)
    emit({"job_id": job_id, "intake_sequence": answer.intake_sequence, "decision": answer.decision,
          "repeat": answer.repeat}, output)


@app.command("checkpoint")
@guarded
def checkpoint_cmd(
    job_id: str,
    team: str = typer.Option(..., help="Team owning the job"),
    attempt: int = typer.Option(..., min=1, help="The running attempt (as in `gpusched events JOB`)"),
    step: Optional[int] = typer.Option(None, min=0, help="Training step or other progress counter"),
    location: str = typer.Option("", help="Where the checkpoint was written"),
    at: Optional[datetime] = typer.Option(
        None, "--at", help="When it was taken (ISO 8601, UTC if no zone); default: now on the platform clock"),
    wait: bool = typer.Option(True, help="Wait for the platform to record or refuse the report"),
    on_behalf_of: Optional[str] = OnBehalfOpt,
    output: Output = OutputOpt,
) -> None:
    """Report that a running job wrote a checkpoint (preemption then loses only the work since).
    Exits 2 with admission's reason when the platform refuses the report."""
    when = at.replace(tzinfo=UTC) if at is not None and at.tzinfo is None else at
    answer = through_gateway(lambda gw: gw.checkpoint(job_id, team, attempt, step=step, location=location,
                                                      checkpointed_at=when, wait=wait, on_behalf_of=on_behalf_of))
    emit({"job_id": job_id, "attempt": attempt, "intake_sequence": answer.intake_sequence,
          "checkpointed_at": answer.checkpointed_at}, output)


@app.command()
@guarded
def apply(
    file: Path = typer.Option(..., "-f", "--file", help="queues.yaml"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the changes, publish nothing"),
    prune: bool = typer.Option(False, help="Delete queues the file does not list"),
    output: Output = OutputOpt,
) -> None:
    """Make the queue configuration (or, for a file with `price_books:`, the price book) equal to a
    file (publishes QueueConfigured / QueueDeleted / PriceBookUpdated). The file is checked whole
    before anything is published."""
    from gpusched import userinput
    from gpusched.config import pricebook
    from gpusched.config import queues as queueconfig

    document = userinput.read_document(file)
    if pricebook.is_price_file(document):
        books = pricebook.parse(document, file)
        from gpusched.cli import accounting as accounting_cli

        changes = run(with_js(lambda js: accounting_cli.apply_price_file(js, books, dry_run)))
    else:
        queues = queueconfig.parse_queues(document, file)

        async def go(js):
            from gpusched.gateway import commands

            config = await queueconfig.current_queues(js)
            events = queueconfig.plan(queues, config, await commands.config_time(js), prune=prune)
            if not dry_run:
                from gpusched.cli.accounting import publish

                await publish(js, events)
            return [{"event": e.type, "name": e.aggregate_id, "change": queueconfig.describe_change(e, config)}
                    for e in events]
        changes = run(with_js(go))
    emit(changes, output, title="dry run: nothing published" if dry_run else None)


@app.command()
def jobs(team: Optional[str] = None, state: Optional[str] = None, limit: int = 50, output: Output = OutputOpt) -> None:
    """List jobs from the read model."""
    emit(through_gateway(lambda gw: gw.jobs(team, state, limit)), output)


@app.command()
def job(job_id: str, output: Output = OutputOpt) -> None:
    """One job: state, timestamps, placement, usage."""
    data = through_gateway(lambda gw: gw.job(job_id))
    if output == Output.json:
        emit(data, output)
    else:
        usage = data.pop("usage")
        emit([{"field": k, "value": v} for k, v in data.items()], output)
        emit(usage, output, title="usage")


@app.command()
def events(job_id: str, output: Output = OutputOpt) -> None:
    """A job's history from the event log."""
    import json

    log = through_gateway(lambda gw: gw.events(job_id))
    if output == Output.json:
        emit(log, output)
        return
    rows = []
    for e in log:
        detail = {k: v for k, v in e.items()
                  if k not in ("sequence", "event_id", "type", "schema_version", "aggregate_id", "occurred_at",
                               "producer", "causation_id", "correlation_id", "spec")}
        rows.append({"seq": e["sequence"], "time": _seconds(e["occurred_at"]), "type": e["type"],
                     "producer": e["producer"], "detail": json.dumps(detail)[:100]})
    emit(rows, output)


def _seconds(when: datetime | str | None) -> str | None:
    """A time to the second (the log's adapter gives datetimes, a JSON answer ISO 8601 text)."""
    if isinstance(when, str):
        when = datetime.fromisoformat(when)
    return None if when is None else when.isoformat(timespec="seconds")


# The sub-CLIs register their commands on the same app (gpusched.cli.common) when imported.
from gpusched.cli import accounting as accounting_cli
from gpusched.cli import log as log_cli  # noqa: F401 - registers `gpusched log`
from gpusched.cli import services as service_cli  # noqa: F401 - registers the service commands
from gpusched.cli import tokens as token_cli  # noqa: F401 - registers `gpusched token`
from gpusched.cli import whatif as whatif_cli  # noqa: F401 - registers `gpusched whatif`


@app.command("why")
def why_cmd(job_id: str, output: Output = OutputOpt) -> None:
    """Why a job waits: its current quota reason, position in its queue, the queue's usage now
    (where the connection reads the read models itself), and the reason history."""
    from rich.markup import escape

    data = through_gateway(lambda gw: gw.why(job_id))
    if output == Output.json:
        emit(data, output)
        return
    r = data["reason"]
    console.print(f"{job_id}: {data['last_event']} since {_seconds(data['since'])}")
    if r:
        position = f", position {data['position']} in its queue" if data.get("position") is not None else ""
        console.print(f"waiting for quota: [bold]{r['code']}[/bold]{position} "
                      f"(recorded {_seconds(r['since'])})\n  {escape(r['message'])}")
        if (now := data.get("queue_now")):
            usage = "; ".join(f"{f['flavor']} nominal {f['nominal']}, used {f['used']}, borrowed {f['borrowed']}, "
                              f"lent {f['lent']}, pending {f['pending_jobs']}" for f in now["flavors"])
            console.print(f"queue {data['queue']} now (read models at sequence {now['position']}): {usage}")
    elif not data["waiting_for_quota"]:
        console.print("not waiting for quota")
    if (sr := data.get("scheduling_reason")):
        eta = f"; ETA {_seconds(sr['eta'])}" if sr.get("eta") else ""
        console.print(f"holds quota, waiting for placement: [bold]{sr['code']}[/bold]{eta}\n  {escape(sr['message'])}")
    if data["history"]:
        emit(data["history"], output, title="reason history")


@app.command()
def logs(job_id: str, attempt: Optional[int] = typer.Option(None, help="Only this attempt"),
         tail: Optional[int] = typer.Option(None, help="Only the last N lines of each run")) -> None:
    """A job's output, from the executor backend's log files (local) or Pod logs (kubernetes)."""
    from rich.markup import escape

    from runtime.settings import Settings
    from services.executor.logs import LogsError, read_logs

    try:
        runs = read_logs(Settings.from_env().executor_backend, job_id, attempt, tail=tail)
    except LogsError as err:
        err_console.print(f"[red]{escape(str(err))}[/red]")
        raise typer.Exit(1) from None
    for source, text in runs:
        if len(runs) > 1:
            err_console.print(f"==> {escape(source)} <==")
        sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")


@app.command()
def queues(output: Output = OutputOpt) -> None:
    """Quota per queue and flavor. A line per queue with what is the queue's (pending jobs, its
    weighted use and limit, its budget), then a line per flavor with that flavor's nominal, limits,
    used, borrowed, lent, weight, weighted use and its classes' use and limits. With -o json, one
    row per queue and flavor (gpusched.gateway.queue_usage: pending_jobs, weighted_* and budget_*
    are the queue's, the same on each of its rows)."""
    rows = through_gateway(lambda gw: gw.queues())
    if output == Output.json:
        emit(rows, output)
        return
    from gpusched.gateway import queue_usage as quota_usage

    emit(quota_usage.table_rows(rows), output, columns=[
        "queue", "cohort", "flavor", "nominal", "borrowing_limit", "lending_limit", "used", "borrowed", "lent",
        "pending_jobs", "weight", "weighted", "classes", "budget"])


@app.command()
def dlq(limit: int = 20, output: Output = OutputOpt) -> None:
    """Dead-lettered messages with their reasons."""
    from gpusched.gateway import history

    async def go():
        nc = await connection().nats()
        try:
            return await history.dead_letters(nc.jetstream(), limit)
        finally:
            await nc.close()
    emit(run(go()), output)


@app.command("sim")
def sim_cmd(
    trace: Optional[Path] = typer.Option(None, "--trace", help="Trace directory (Alibaba 2023 openb format), e.g. ../shared/traces/alibaba-gpu-2023"),
    nodes: Optional[Path] = typer.Option(None, "--nodes", help="Node list CSV (sn, cpu_milli, memory_mib, gpu, model); default: the trace directory's"),
    pods: Optional[Path] = typer.Option(None, "--pods", help="Pod list CSV (name, cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec, times]); default: the trace directory's"),
    policy: list[str] = typer.Option(["first-fit", "best-fit", "fgd", "fgd-balance"], "--policy", "-p",
                                     help="Placement policy; repeat to compare side by side"),
    inflation: Optional[float] = typer.Option(None, "--inflation", help="Workload inflation (ATC '23): sampled tasks arrive and never leave until requests reach RATIO × capacity"),
    seed: int = typer.Option(0, "--seed", help="Sampling seed for --inflation"),
    protocol: str = typer.Option("gpusched", "--protocol", help="With --inflation: gpusched (GPU tasks sampled, read at 13 steps to the target) or fgd (the FGD simulator's workload and curve: docs/scheduling.md)"),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Replay only the first N tasks"),
    output: Output = OutputOpt,
) -> None:
    """Replay a GPU cluster trace through the quota, scheduler and sim-executor cores."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from gpusched.sim import trace as rp
    from services.scheduler.placement import parse_policy

    try:
        policies = [parse_policy(p) for p in policy]
        data = rp.load_trace(trace, nodes=nodes, pods=pods)
    except ValueError as err:
        print_error(str(err))
        raise typer.Exit(2) from None
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=output == Output.json) as bar:
        for pol in policies:
            try:
                if inflation is not None:
                    # Tasks until the target demand: about ratio × capacity / mean demand.
                    mean = sum(t.demand for t in data.tasks) / max(1, len(data.tasks))
                    total = int(inflation * data.capacity / mean) if mean else None
                    task = bar.add_task(f"{pol.value} inflation {inflation}", total=total)
                    results.append(rp.inflation(data, pol, ratio=inflation, seed=seed, protocol=protocol,
                                                progress=lambda n, t=task: bar.advance(t, n)))
                else:
                    ran = sum(1 for t in data.tasks if t.runtime is not None)
                    task = bar.add_task(f"{pol.value} replay", total=min(ran, limit or ran))
                    results.append(rp.replay(data, pol, limit=limit, progress=lambda n, t=task: bar.advance(t, n)))
            except ValueError as err:  # the ratio, the protocol, a pod list replay cannot use
                print_error(str(err))
                raise typer.Exit(2) from None
    if output == Output.json:
        emit(results, output)
        return
    _sim_table(results)


def _sim_table(results: list[dict]) -> None:
    from rich.table import Table

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    table = Table(title=f"trace {results[0]['mode']}: {results[0]['capacity_gpus']} GPUs")
    table.add_column("metric")
    for r in results:
        table.add_column(r["policy"], justify="right")
    if results[0]["mode"] == "replay":
        rows = [("tasks", "tasks"), ("placed", "placed"), ("finished", "finished"),
                ("allocation rate", "allocation_rate"),
                ("unallocated share while tasks wait", "unallocated_share_while_waiting"),
                ("share of time with tasks waiting", "time_with_waiting_share"),
                ("fragmentation ratio (mean)", "fragmentation_mean"),
                ("FGD fragmentation of free capacity (mean)", "fgd_fragmentation_mean")]
        lines = [(label, [r[k] for r in results]) for label, k in rows]
        for metric in ("wait_s", "jct_s"):
            for q in ("p50", "p90", "p99", "mean"):
                lines.append((f"{metric[:-2]} {q} (s)", [r[metric][q] for r in results]))
    else:
        lines = [("arrived demand / capacity", [r["arrived_demand"] for r in results]),
                 ("allocation rate", [r["allocation_rate"] for r in results]),
                 ("unallocated share", [r["unallocated_share"] for r in results]),
                 ("placed tasks", [r["placed"] for r in results])]
        for i, point in enumerate(results[0]["curve"]):
            lines.append((f"allocation at demand {point['arrived_demand']:.2f}",
                          [r["curve"][i]["allocation"] if i < len(r["curve"]) else None for r in results]))
        lines.append(("FGD fragmentation of free capacity at the end",
                      [r["curve"][-1]["fgd_fragmentation"] if r["curve"] else None for r in results]))
    for label, values in lines:
        table.add_row(label, *(fmt(v) for v in values))
    console.print(table)
    if results[0]["mode"] == "replay":
        frag = Table(title="fragmentation over time (sampled): fragmentation ratio / FGD share of free capacity")
        frag.add_column("t (s)")
        for r in results:
            frag.add_column(r["policy"], justify="right")
        for i, point in enumerate(results[0]["series"][:: max(1, len(results[0]["series"]) // 10)]):
            idx = results[0]["series"].index(point)
            frag.add_row(f"{point['t']:.0f}", *(
                f"{fmt(r['series'][idx]['fragmentation'])} / {fmt(r['series'][idx]['fgd_fragmentation'])}"
                if idx < len(r["series"]) else "-" for r in results))
        console.print(frag)


@dev_app.command("up")
def dev_up(
    data_dir: Path = typer.Option(Path(".data"), help="Where NATS, Postgres and logs keep their data"),
    time_scale: float = typer.Option(120.0, help="Platform seconds per wall second (120: a GPU hour in 30 s)"),
    demo: bool = typer.Option(True, help="Submit the demo workload"),
    demo_jobs: int = typer.Option(60, help="Jobs in the demo workload"),
    duration: float = typer.Option(0, help="Stop after this many seconds (0: run until Ctrl-C)"),
    clusters: Optional[str] = typer.Option(None, "--clusters", help="Many clusters, one sim executor each: "
                                           "comma-separated names (east,west); the cluster spec's nodes are dealt "
                                           "out to them (docs/operations.md)"),
    cluster_file: Optional[Path] = typer.Option(None, "--cluster-file", help="A sim cluster spec (groups:) instead "
                                                "of the example's, or a spec per cluster (clusters: name -> groups)"),
    nats_cluster: int = typer.Option(1, "--nats-cluster", min=1, max=5,
                                     help="nats-servers to run: 1, or a JetStream cluster of N on loopback (3: "
                                          "every stream, consumer and bucket replicated on each; docs/operations.md)"),
    clock_start: Optional[str] = typer.Option(None, "--clock-start", metavar="month-end|now|ISO-TIME",
                                              help="Where a fresh data directory's platform clock starts (default "
                                                   "month-end: 6 platform hours before this month's end, so it "
                                                   "closes 3 wall minutes in at 120x; docs/accounting.md); an "
                                                   "existing one keeps its run/clock.json"),
) -> None:
    """Run NATS, Postgres and the services locally, with an optional demo workload."""
    import time

    from gpusched.cli.common import print_error
    from gpusched.dev import clusters as devclusters
    from gpusched.dev.run import parse_clock_start, run_dev
    from gpusched.errors import UserError

    try:
        names = devclusters.parse_names(clusters)
        if clock_start is not None:
            parse_clock_start(clock_start, time.time())  # refused here, before anything starts
    except UserError as err:
        print_error(str(err))
        raise typer.Exit(2) from None
    sys.exit(run_dev(data_dir=data_dir, time_scale=time_scale, demo=demo, demo_jobs=demo_jobs, duration=duration,
                     clusters=names, cluster_file=cluster_file, nats_cluster=nats_cluster, clock_start=clock_start))


@dev_app.command("nats-config")
def dev_nats_config(out: Optional[Path] = typer.Option(None, help="Write here instead of stdout"),
                    cluster: list[str] = typer.Option([], "--cluster", help="Also a credential executor-<CLUSTER> "
                                                      "for that cluster's executor (repeat; many clusters)"),
                    k8s: int = typer.Option(0, "--k8s", min=0, max=9, help="The configuration for k8s/ with this "
                                            "many servers (3: k8s/components/nats; 1: k8s/overlays/dev)"),
                    team: list[str] = typer.Option([], "--team", help="The teams' credentials (repeat); default: "
                                                   "team-research, team-product, team-platform"),
                    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="Clients connect with TLS: "
                                                            "the server's certificate (PEM path on the server)"),
                    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="Its key (with --tls-cert)"),
                    tls_ca: Optional[Path] = typer.Option(None, "--tls-ca", help="Also verify clients: the CA their "
                                                          "certificates must be signed by (with --tls-cert)")) -> None:
    """Print the reference nats-server configuration (deploy/nats-server.conf), or with --k8s the
    one of the NATS StatefulSet in k8s/; with --tls-cert and --tls-key, clients must use TLS
    (docs/operations.md, "TLS")."""
    import re

    from gpusched import permissions
    from gpusched.dev.natsconf import k8s_nats_config, reference_nats_config, tls_block
    from schemas.envelope import NAME_PATTERN

    if (tls_cert is None) != (tls_key is None) or (tls_ca is not None and tls_cert is None):
        raise typer.BadParameter("--tls-cert and --tls-key go together (--tls-ca needs both); accepted: both, "
                                 "both with --tls-ca, or none", param_hint="--tls-cert")
    tls = tls_block(tls_cert, tls_key, tls_ca) if tls_cert is not None and tls_key is not None else None

    bad = [c for c in cluster if not permissions.valid_cluster(c)]
    if bad:
        raise typer.BadParameter(f"{bad[0]!r} is not a cluster name; accepted: a DNS label ({NAME_PATTERN}) not of "
                                 "the form r<digits> or ending in -r<digits>", param_hint="--cluster")
    bad = [t for t in team if not re.fullmatch(NAME_PATTERN, t) or t in permissions.RESERVED
           or permissions.cluster_executor(t)]
    if bad:
        raise typer.BadParameter(f"{bad[0]!r} is not a team name; accepted: a DNS label ({NAME_PATTERN}) other than "
                                 f"{', '.join(sorted(permissions.RESERVED))} and executor-<cluster>", param_hint="--team")
    teams = {"teams": tuple(team)} if team else {}
    text = (k8s_nats_config(k8s, clusters=tuple(cluster), tls=tls, **teams) if k8s
            else reference_nats_config(clusters=tuple(cluster), tls=tls, **teams))
    if out:
        out.write_text(text)
    else:
        print(text, end="")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
