"""The `gpusched` command line. Reads come from the Postgres read models or the event log;
changes are only ever published as commands or configuration events. Every command takes
``--output json``."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sys
from datetime import UTC, date, datetime
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text
from rich.table import Table

from gpusched import permissions, userinput
from gpusched.cli import accounting as accounting_cli
from gpusched.gateway import commands
from gpusched.gateway import history
from gpusched.cli import log as log_cli
from gpusched.config import pricebook
from gpusched.config import queues as queueconfig
from gpusched.gateway import queue_usage as quota_usage
from gpusched.cli import services as service_cli
from gpusched.cli import tokens as token_cli
from gpusched.cli import whatif as whatif_cli
from gpusched.gateway.connection import Connection
from gpusched.userinput import UserError
from runtime import eventlog, observability
from runtime.settings import Settings
from schemas import JobRejected
from schemas.envelope import NAME_PATTERN
from services.accounting import queries

app = typer.Typer(help="gpusched: GPU job scheduling on an event log.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
dev_app = typer.Typer(help="Local platform for development and demos.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")
console = Console(width=None if Console().is_terminal else 200)
err_console = Console(stderr=True, width=None if Console(stderr=True).is_terminal else 200)


class Output(str, Enum):
    table = "table"
    json = "json"


OutputOpt = typer.Option(Output.table, "--output", "-o", help="table or json")
OnBehalfOpt = typer.Option(
    None, "--on-behalf-of",
    help="With the operator's credential: the user it acts for, recorded in the event (default: $USER)")


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return str(value)


def emit(data: Any, output: Output, columns: list[str] | None = None, title: str | None = None) -> None:
    if output == Output.json:
        print(json.dumps(data, default=_json_default, indent=2))
        return
    rows = data if isinstance(data, list) else [data]
    if not rows:
        console.print("(nothing)")
        return
    columns = columns or list(rows[0].keys())
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        # Text, not markup: values such as "[3, 4]" or a pattern are shown as they are.
        table.add_row(*(Text("" if r.get(c) is None else str(r.get(c))) for c in columns))
    console.print(table)


async def with_pg(query) -> Any:
    """Run ``query(conn)`` on a fresh read-model connection."""
    conn = await Connection.resolve().pg()
    try:
        return await query(conn)
    finally:
        await conn.close()


async def with_js(action) -> Any:
    """Run ``action(js)`` on a fresh NATS connection."""
    nc = await Connection.resolve().nats()
    try:
        return await action(nc.jetstream())
    finally:
        await nc.close()


def run(coro) -> Any:
    try:
        return asyncio.run(coro)
    except UserError as err:
        userinput.print_error(err_console, str(err))
        raise typer.Exit(2) from None


def guarded(fn):
    """A UserError raised before connecting (a bad file or argument) ends the command like one
    raised later: one line on stderr, exit status 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            userinput.print_error(err_console, str(err))
            raise typer.Exit(2) from None
    return wrapper


def answered(answer: commands.Answer) -> dict[str, Any]:
    """The answer's fields for the output: the deciding event's type (and a rejection's reason)."""
    event = answer.event
    out: dict[str, Any] = {"decision": event.type, "repeat": answer.repeat}
    if isinstance(event, JobRejected):
        out.update(reason=event.reason.value, field=event.field, message=event.message)
    return out


@app.command()
@guarded
def init(team: list[str] = typer.Option([], "--team", help="Also provision this team's tenant stream (repeat)")) -> None:
    """Create or update the JetStream streams, and each named team's tenant stream (needs the
    admin user). Streams deny message delete and purge; that cannot be undone."""
    bad = [t for t in team if not re.fullmatch(NAME_PATTERN, t) or t in permissions.RESERVED
           or permissions.cluster_executor(t)]
    if bad:
        raise UserError(f"--team {bad[0]!r} is not a team name; accepted: a DNS label ({NAME_PATTERN}) other than "
                        f"{', '.join(sorted(permissions.RESERVED))} and executor-<cluster>")

    async def go():
        nc = await Connection.resolve().nats()
        try:
            await eventlog.provision(nc.jetstream(), eventlog.StreamLimits.from_settings(Settings.from_env()),
                                     teams=tuple(team))
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
    command = commands.submit_command_from_file(file)
    connection = Connection.resolve()
    if connection.api_url:
        result = through_api(connection, "submission", lambda gs: _submitted(gs, command, wait, on_behalf_of))
        emit(result, output)
        if result["decision"] == "JobRejected":
            err_console.print(Text.assemble(("rejected: ", "red"), f"{result['reason']}: {result['message']}"),
                              soft_wrap=True)
            raise typer.Exit(1)
        return

    async def go():
        nc = await connection.nats()
        observability.client_tracing()
        try:
            js = nc.jetstream()
            with observability.tracer().start_as_current_span("gpusched submit", attributes={"job": command.job_id}):
                seq = await commands.publish_command(js, command.spec.team, "submit", command,
                                                     on_behalf_of=on_behalf_of)
                trace_id = observability.current_trace_id()
            result: dict[str, Any] = {"job_id": command.job_id, "intake_sequence": seq, "decision": None,
                                      "trace_id": trace_id}
            if wait:
                answer = await commands.wait_for_decision(js, command.job_id, seq)
                commands.refused("submission", answer, command.job_id, seq)
                result.update(answered(answer))
            return result
        finally:
            await nc.close()
    result = run(go())
    emit(result, output)
    if result["decision"] == "JobRejected":
        err_console.print(Text.assemble(("rejected: ", "red"), f"{result['reason']}: {result['message']}"),
                          soft_wrap=True)
        raise typer.Exit(1)


@app.command("cancel")
@guarded
def cancel_cmd(job_id: str, team: str = typer.Option(..., help="Team owning the job"),
               reason: str = typer.Option("", help="Why"),
               wait: bool = typer.Option(True, help="Wait for the platform to record or refuse the request"),
               on_behalf_of: Optional[str] = OnBehalfOpt,
               output: Output = OutputOpt) -> None:
    """Ask to cancel a job. Exits 2 with admission's reason when it refuses the request (no such
    job, another team's job); a job that had already ended is reported as such."""
    connection = Connection.resolve()
    if connection.api_url:
        _no_on_behalf_through_api(on_behalf_of, "cancel")
        emit(through_api(connection, "cancel request", lambda gs: _answered_by_api(
            "cancel request", gs.cancel(job_id, reason, wait_s=commands.WAIT_S if wait else 0), wait)), output)
        return

    async def go(js):
        seq = await commands.cancel(js, job_id, team, reason=reason, on_behalf_of=on_behalf_of)
        result: dict[str, Any] = {"job_id": job_id, "intake_sequence": seq, "decision": None}
        if wait:
            answer = await commands.wait_for_cancel(js, job_id, seq)
            commands.refused("cancel request", answer, job_id, seq)
            result.update(answered(answer))
        return result
    emit(run(with_js(go)), output)


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
    connection = Connection.resolve()
    if connection.api_url:
        _no_on_behalf_through_api(on_behalf_of, "checkpoint")
        emit(through_api(connection, "checkpoint report", lambda gs: _checkpointed_by_api(
            gs, job_id, attempt, step, location, when, wait)), output)
        return

    async def go(js):
        seq = await commands.report_checkpoint(js, job_id, team, attempt, checkpointed_at=when, step=step,
                                               location=location, on_behalf_of=on_behalf_of)
        recorded = await commands.wait_for_checkpoint(js, job_id, seq) if wait else None
        return {"job_id": job_id, "attempt": attempt, "intake_sequence": seq,
                "checkpointed_at": None if recorded is None else recorded.checkpointed_at}
    emit(run(with_js(go)), output)


def through_api(connection: Connection, what: str, call) -> dict[str, Any]:
    """``call(client)`` with the SDK client of the API the connection names; the API's refusal
    (but a rejection, which the caller reports) as a UserError naming the problem."""
    import httpx

    from gpusched.sdk.client import ApiError

    try:
        with connection.client() as gs:
            return call(gs)
    except ApiError as err:
        fields = "; ".join(f"{e.get('field')}: {e.get('message')}" for e in err.errors)
        raise UserError(f"the API refused the {what}: {err.detail}{f' ({fields})' if fields else ''}") from None
    except httpx.HTTPError as err:
        raise UserError(f"cannot reach the API at {connection.api_url}: {err!r} (is `make run` running?)") from None


def _submitted(gs, command, wait: bool, on_behalf_of: str | None) -> dict[str, Any]:
    from gpusched.sdk.client import Rejected

    result: dict[str, Any] = {"job_id": command.job_id, "intake_sequence": None, "decision": None}
    # the same fields as over NATS but trace_id (the API's request carries the trace)
    try:
        done = gs.submit(command, wait_s=commands.WAIT_S if wait else 0, on_behalf_of=on_behalf_of)
    except Rejected as err:
        if err.reason == "dead-letter":
            raise
        field = err.errors[0]["field"].removeprefix("body.") if err.errors else None
        return {**result, "decision": "JobRejected", "reason": err.reason, "field": field, "message": err.detail,
                "repeat": False}
    result.update(job_id=done.job_id, intake_sequence=done.intake_sequence, repeat=done.repeat,
                  decision={"admitted": "JobAdmitted", "pending": None}[done.decision])
    if wait and done.decision == "pending":
        raise UserError(f"no answer to the submission (intake sequence {done.intake_sequence}) within "
                        f"{commands.WAIT_S:.0f} s; see `gpusched events {command.job_id}`")
    return result


def _no_on_behalf_through_api(on_behalf_of: str | None, what: str) -> None:
    """The API records an operator's own name as on-behalf-of for a cancel or a checkpoint."""
    if on_behalf_of is not None:
        raise UserError(f"--on-behalf-of: the API does not take it for a {what} (it records the token's holder); "
                        "leave it out, or unset GPUSCHED_API_URL to send the command over NATS")


def _answered_by_api(what: str, answer, wait: bool) -> dict[str, Any]:
    """The fields `gpusched cancel` prints over NATS, from the API's answer."""
    result: dict[str, Any] = {"job_id": answer.job_id, "intake_sequence": answer.intake_sequence, "decision": None}
    if answer.outcome != "pending":
        result.update(decision=answer.outcome, repeat=answer.repeat)
    elif wait:
        raise UserError(f"no answer to the {what} (intake sequence {answer.intake_sequence}) within "
                        f"{commands.WAIT_S:.0f} s; see `gpusched events {answer.job_id}` and `gpusched dlq`")
    return result


def _checkpointed_by_api(gs, job_id: str, attempt: int, step: int | None, location: str, when, wait: bool):
    """The fields `gpusched checkpoint` prints over NATS: checkpointed_at from the recorded
    JobCheckpointed (None when not waited for or not recorded in time)."""
    answer = gs.checkpoint(job_id, attempt, step=step, location=location, checkpointed_at=when,
                           wait_s=commands.WAIT_S if wait else 0)
    recorded = None
    if answer.outcome == "JobCheckpointed":
        recorded = next((e.checkpointed_at for e in reversed(gs.events(job_id)) if e.type == "JobCheckpointed"
                         and e.intake_sequence == answer.intake_sequence), None)
    return {"job_id": job_id, "attempt": attempt, "intake_sequence": answer.intake_sequence,
            "checkpointed_at": recorded}


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
    document = userinput.read_document(file)
    if pricebook.is_price_file(document):
        books = pricebook.parse(document, file)
        changes = run(with_js(lambda js: accounting_cli.apply_price_file(js, books, dry_run)))
    else:
        queues = queueconfig.parse_queues(document, file)

        async def go(js):
            config = await queueconfig.current_queues(js)
            events = queueconfig.plan(queues, config, datetime.now(UTC), prune=prune)
            if not dry_run:
                await accounting_cli.publish(js, events)
            return [{"event": e.type, "name": e.aggregate_id, "change": queueconfig.describe_change(e, config)}
                    for e in events]
        changes = run(with_js(go))
    emit(changes, output, title="dry run: nothing published" if dry_run else None)


@app.command()
def jobs(team: Optional[str] = None, state: Optional[str] = None, limit: int = 50, output: Output = OutputOpt) -> None:
    """List jobs from the read model."""
    emit(run(with_pg(lambda conn: queries.list_jobs(conn, team, state, limit))), output)


@app.command()
def job(job_id: str, output: Output = OutputOpt) -> None:
    """One job: state, timestamps, placement, usage."""
    async def go():
        conn = await Connection.resolve().pg()
        try:
            found = await queries.get_job(conn, job_id)
        finally:
            await conn.close()
        if found is None:
            raise UserError(f"job {job_id!r} is not in the read model (yet); try `gpusched events {job_id}`")
        return found
    data = run(go())
    if output == Output.json:
        emit(data, output)
    else:
        usage = data.pop("usage")
        emit([{"field": k, "value": v} for k, v in data.items()], output)
        emit(usage, output, title="usage")


@app.command()
def events(job_id: str, output: Output = OutputOpt) -> None:
    """A job's history from the event log."""
    log = run(with_js(lambda js: history.job_events(js, job_id)))
    if output == Output.json:
        emit([{"sequence": s, **e.model_dump(mode="json")} for s, e in log], output)
        return
    rows = []
    for seq, e in log:
        detail = {k: v for k, v in e.model_dump(mode="json").items()
                  if k not in ("event_id", "type", "schema_version", "aggregate_id", "occurred_at",
                               "producer", "causation_id", "correlation_id", "spec")}
        rows.append({"seq": seq, "time": e.occurred_at.isoformat(timespec="seconds"), "type": e.type,
                     "producer": e.producer, "detail": json.dumps(detail)[:100]})
    emit(rows, output)


accounting_cli.register(app, emit=emit, run=run, with_pg=with_pg, with_js=with_js, output_option=OutputOpt,
                        output_enum=Output, console=console, err_console=err_console)
token_cli.register(app, emit=emit, run=run, with_pg=with_pg, with_js=with_js, guarded=guarded,
                   output_option=OutputOpt, output_enum=Output)
service_cli.register(app, emit=emit, run=run, with_pg=with_pg, with_js=with_js, guarded=guarded,
                     through_api=through_api, output_option=OutputOpt, output_enum=Output,
                     on_behalf_option=OnBehalfOpt)
log_cli.register(app, emit=emit, run=run, with_js=with_js, guarded=guarded, output_option=OutputOpt, output_enum=Output,
                 console=console, err_console=err_console)
whatif_cli.register(app, run=run, with_js=with_js, guarded=guarded, output_option=OutputOpt, output_enum=Output,
                    console=console, err_console=err_console)


@app.command("why")
def why_cmd(job_id: str, output: Output = OutputOpt) -> None:
    """Why a job waits: its current quota reason, position in its queue, the queue's usage now, and
    the reason history."""
    data = run(with_js(lambda js: history.why(js, job_id)))
    if data["reason"] and data["queue"]:
        data["queue_now"] = _queue_now(data["queue"])
    if output == Output.json:
        emit(data, output)
        return
    r = data["reason"]
    console.print(f"{job_id}: {data['last_event']} since {data['since'].isoformat(timespec='seconds')}")
    if r:
        console.print(f"waiting for quota: [bold]{r['code']}[/bold], position {r['position']} in its queue "
                      f"(recorded {r['since'].isoformat(timespec='seconds')})\n  {escape(r['message'])}")
        if (now := data.get("queue_now")):
            usage = "; ".join(f"{f['flavor']} nominal {f['nominal']}, used {f['used']}, borrowed {f['borrowed']}, "
                              f"lent {f['lent']}, pending {f['pending_jobs']}" for f in now["flavors"])
            console.print(f"queue {data['queue']} now (read models at sequence {now['position']}): {usage}")
    elif not data["waiting_for_quota"]:
        console.print("not waiting for quota")
    if (sr := data.get("scheduling_reason")):
        eta = f"; ETA {sr['eta'].isoformat(timespec='seconds')}" if sr["eta"] else ""
        console.print(f"holds quota, waiting for placement: [bold]{sr['code']}[/bold]{eta}\n  {escape(sr['message'])}")
    if data["history"]:
        emit(data["history"], output, title="reason history")


def _queue_now(queue: str) -> dict[str, Any] | None:
    """The queue's usage from the read models (what `gpusched queues` shows); None without Postgres."""
    try:
        return asyncio.run(with_pg(lambda conn: quota_usage.queue_now(conn, queue)))
    except UserError:  # no Postgres configured or reachable: the log's reasons still stand
        return None


@app.command()
def logs(job_id: str, attempt: Optional[int] = typer.Option(None, help="Only this attempt"),
         tail: Optional[int] = typer.Option(None, help="Only the last N lines of each run")) -> None:
    """A job's output, from the executor backend's log files (local) or Pod logs (kubernetes)."""
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
    """Quota per queue and flavor: nominal, limits, used, borrowed, lent, pending; the queue's
    weighted use and limit, its classes' use and limits, its budget."""
    rows = run(with_pg(quota_usage.queue_usage))
    if output == Output.json:
        emit(rows, output)
        return
    emit([{**r, **quota_usage.table_cells(r)} for r in rows], output, columns=[
        "queue", "cohort", "flavor", "nominal", "borrowing_limit", "lending_limit", "used", "borrowed", "lent",
        "pending_jobs", "weight", "weighted", "classes", "budget"])


@app.command()
def dlq(limit: int = 20, output: Output = OutputOpt) -> None:
    """Dead-lettered messages with their reasons."""
    async def go():
        nc = await Connection.resolve().nats()
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
        userinput.print_error(err_console, str(err))
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
                userinput.print_error(err_console, str(err))
                raise typer.Exit(2) from None
    if output == Output.json:
        emit(results, output)
        return
    _sim_table(results)


def _sim_table(results: list[dict]) -> None:
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
) -> None:
    """Run NATS, Postgres and the services locally, with an optional demo workload."""
    from gpusched.dev.run import run_dev

    sys.exit(run_dev(data_dir=data_dir, time_scale=time_scale, demo=demo, demo_jobs=demo_jobs, duration=duration))


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
    from gpusched.dev.stack import k8s_nats_config, reference_nats_config, tls_block

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
