"""Accounting commands of the `gpusched` CLI: usage roll-ups and time travel, the price book,
chargeback statements (and verifying one by replay), replay into a shadow with compare and swap,
and the operations metrics. Registered onto the main app by :mod:`gpusched.cli.main`."""


from __future__ import annotations

import functools
import json
import sys
import uuid
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from gpusched.cli.points import check_range, parse_point, parse_time
from gpusched.errors import UserError

# Light on purpose (docs/performance.md, "CLI start"): nats, the event log, the price book and
# accounting's services are imported by the commands that use them.

PROJECTIONS = ("read-models",)
"""The projections `replay` rebuilds: services.accounting.replay.PROJECTIONS, written out here so
that `--help` need not import the replay (tests/unit/test_cli_start.py checks they agree)."""


class Format(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    focus = "focus"


class MetricsFormat(str, Enum):
    table = "table"
    json = "json"
    prometheus = "prometheus"


def _dimensions(value: str) -> list[str]:
    return [d.strip() for d in value.split(",") if d.strip()]


def _pg_dsn() -> str:
    from gpusched.gateway.connection import Connection

    dsn = Connection.resolve().pg_dsn
    if not dsn:
        raise UserError("no Postgres configured: set GPUSCHED_PG_DSN or start `make run`")
    return dsn


def _chargeback_call(fn, *args, **kwargs):
    from services.accounting import chargeback

    try:
        return fn(*args, **kwargs)
    except chargeback.ChargebackError as err:
        raise UserError(str(err)) from None


class _Bar:
    """A rich progress bar over stream sequences (on stderr, so stdout stays parseable)."""

    def __init__(self, console, label: str, start: int, end: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.start, self.end = start, end
        self.progress = Progress(TextColumn(f"[bold]{label}[/bold]"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]:>9} ev/s"), TimeRemainingColumn(),
                                 console=console, transient=False)
        self.task = self.progress.add_task(label, total=max(0, end - start + 1), rate="-")

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def __call__(self, p: replay_mod.Progress) -> None:
        task = self.progress.tasks[0]
        speed = task.speed
        self.progress.update(self.task, completed=p.last_sequence - self.start + 1,
                             rate=f"{speed:,.0f}" if speed else "-")


async def publish(js, events: list) -> None:
    """Append configuration events in order; UserError naming the first one the broker refused
    (the ones before it are in the log)."""
    import nats.errors

    from runtime import eventlog

    log = eventlog.EventLog(js)
    for i, e in enumerate(events):
        try:
            await log.append(e)
        except nats.errors.Error as err:
            raise UserError(f"{e.type} for {e.aggregate_id} was not published ({i} of {len(events)} events were): "
                            f"{err!r}") from None


async def apply_price_file(js, parsed: pricebook.PriceBooksFile, dry_run: bool) -> list[dict[str, Any]]:
    """Publish the PriceBookUpdated events that make the log's price books equal the file's
    (none with ``dry_run``); the changes, described."""
    from gpusched.config import pricebook
    from gpusched.gateway import commands

    books = await pricebook.current(js)
    events = pricebook.plan(parsed, books, await commands.config_time(js))
    if not dry_run:
        await publish(js, events)
    return [{"event": e.type, "name": e.aggregate_id, "change": pricebook.describe(e, books)} for e in events]


# The commands register on the one app (gpusched.cli.common) when this module is imported.
from gpusched.cli.common import (app, emit, run, through_gateway, with_pg, with_js, with_pg_and_log,  # noqa: E402
                                 console, err_console)
from gpusched.cli.common import Output, OutputOpt  # noqa: E402
output_option, output_enum = OutputOpt, Output


def guarded(fn):
    """Bad arguments found before connecting are shown like the errors `run` shows."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            raise UserError_exit(err_console, str(err)) from None
    return wrapper

@app.command()
@guarded
def usage(
    by: str = typer.Option("team,flavor", help="Roll-up dimensions, comma-separated: team, project, queue, flavor, day"),
    period: Optional[str] = typer.Option(None, help="Only the parts of attempts that ran in this month (YYYY-MM)"),
    as_of: Optional[str] = typer.Option(None, "--as-of", help="Usage up to this event time (platform clock; "
                                        "ISO 8601 with a zone, or a date), running attempts included"),
    output: Output = output_option,
) -> None:
    """GPU-hours (guaranteed / borrowed / lost), wait p50/p95 and cost per group, from the usage ledger."""
    from services.accounting import chargeback, queries

    dims = _dimensions(by)
    when = parse_time(as_of, "--as-of") if as_of else None
    if period is not None:
        _chargeback_call(chargeback.parse_period, period)
    _chargeback_call(chargeback.rollup, [], [], dims)  # validates the dimensions before connecting
    rows = run(with_pg_and_log(lambda conn, js: queries.rollup(conn, dims, period=period, as_of=when, log=js)))
    if output == Output.table:
        for r in rows:
            for k, v in r.items():
                if isinstance(v, float):
                    r[k] = round(v, 3)
    emit(rows, output)

@app.command()
@guarded
def prices(
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="pricebook.yaml to publish (else: list)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the changes, publish nothing"),
    output: Output = output_option,
) -> None:
    """Publish a price book file (PriceBookUpdated), or list the price book history."""
    from gpusched.config import pricebook

    parsed = pricebook.read(file) if file is not None else None  # checked whole before connecting

    async def go(js):
        if parsed is not None:
            return await apply_price_file(js, parsed, dry_run)
        books = await pricebook.current(js)
        return [{"name": e.name, "effective_from": e.effective_from, "currency": e.currency,
                 "gpu_prices": {p.flavor: p.gpu_hour for p in e.gpu_prices},
                 "cpu_core_hour": e.cpu_core_hour, "memory_gib_hour": e.memory_gib_hour,
                 "idle_quota": e.idle_quota} for _, e in sorted(books.items(), key=lambda kv: (kv[0][0], kv[0][1]))]
    emit(run(with_js(go)), output, title="dry run: nothing published" if dry_run and file else None)

@app.command("chargeback")
@guarded
def chargeback_cmd(
    period: Optional[str] = typer.Option(None, help="Calendar month, YYYY-MM (UTC)"),
    by: str = typer.Option("team", help="team, project, queue or flavor"),
    format: Format = typer.Option(Format.table, "--format",
                                  help="table, csv, json or focus (FOCUS 1.2 CSV, docs/accounting.md#focus-export)"),
    issued: bool = typer.Option(False, "--issued", help="List the statements accounting has issued"),
    verify: Optional[str] = typer.Option(None, "--verify", metavar="STATEMENT_ID",
                                         help="Re-derive an issued statement by replaying the log; compare checksums"),
    output: Output = output_option,
) -> None:
    """A chargeback statement for a period: usage, borrowed, lost and idle GPU-hours and cost per group,
    with the log range it covers and its checksum."""
    from services.accounting import chargeback, focus, queries

    if format in (Format.csv, Format.focus) and output == Output.json:
        raise UserError_exit(err_console, f"--format {format.value} and --output json ask for two formats; give one: "
                                          f"--format {format.value} or --format json / -o json (the statement's JSON)")
    fmt = Format.json if output == Output.json else format
    if verify:
        if fmt in (Format.csv, Format.focus):
            raise UserError_exit(err_console, "--verify answers in table or json; accepted: --format table|json")
        result = run(_verify(verify, err_console))
        if fmt == Format.json:
            print(json.dumps(result, indent=2, default=str))
        else:
            ok = "[green]verified[/green]" if result["verified"] else "[red]MISMATCH[/red]"
            console.print(f"{result['statement_id']}: {ok}\n  issued:    {result['issued_checksum']}\n"
                          f"  re-derived: {result['replayed_checksum']}\n"
                          f"  log range {result['first_sequence']}..{result['last_sequence']}")
        if not result["verified"]:
            raise typer.Exit(1)
        return
    if issued:
        rows = run(with_pg(lambda conn: queries.issued(conn, period)))
        if fmt in (Format.csv, Format.focus):  # every issued statement (jcs-sha256; older ones carry no items)
            render = chargeback.to_csv if fmt == Format.csv else focus.to_focus
            sys.stdout.write(render(*(
                {**r["body"], "statement_id": r["statement_id"], "first_sequence": r["first_sequence"],
                 "last_sequence": r["last_sequence"], "checksum": r["checksum"], "provisional": False}
                for r in rows if r["body"].get("checksum_alg") == chargeback.CHECKSUM_ALG and r["group_by"] == by)))
        elif fmt == Format.json:
            print(json.dumps(rows, indent=2, default=str))
        else:
            emit([{k: v for k, v in r.items() if k != "body"} for r in rows], Output.table)
        return
    if period is None:
        raise UserError_exit(err_console, "--period is required (YYYY-MM), e.g. --period 2026-11")
    _chargeback_call(chargeback.parse_period, period)
    if by not in chargeback.STATEMENT_DIMENSIONS:
        raise UserError_exit(err_console, f"--by {by!r} is not accepted; accepted: "
                                          f"{', '.join(chargeback.STATEMENT_DIMENSIONS)}")
    body = through_gateway(lambda gw: gw.chargeback(period, by))
    if fmt == Format.json:
        print(json.dumps(body, indent=2))
    elif fmt == Format.csv:
        sys.stdout.write(chargeback.to_csv(body))
    elif fmt == Format.focus:
        sys.stdout.write(focus.to_focus(body))
    else:
        rows = [{by: line["key"], **{k: v for k, v in line.items() if k != "key"}} for line in body["lines"]]
        emit(rows, Output.table, title=f"chargeback {period} by {by} ({body['idle_quota']}, {body['currency']})")
        console.print(f"total {body['total_cost']} {body['currency']}; {body['total_gpu_hours']} GPU-hours; "
                      f"log {body['first_sequence']}..{body['last_sequence']}; "
                      f"{body['checksum']}" + (" (period still open: provisional)" if body["provisional"] else ""))

@app.command("replay")
@guarded
def replay_cmd(
    projection: str = typer.Option("read-models", help=f"Projection to rebuild: {', '.join(PROJECTIONS)}"),
    from_: Optional[str] = typer.Option(None, "--from", metavar="SEQ|TIME",
                                        help="Start at a stream sequence, or at the first event that happened "
                                             "at or after an event time (platform clock; ISO 8601 with a zone)"),
    to: Optional[str] = typer.Option(None, "--to", metavar="SEQ|TIME",
                                     help="With --into: the read models as of a past point: stop after a stream "
                                          "sequence, or after the last event that happened at or before an "
                                          "event time. No compare, no swap"),
    into: Optional[str] = typer.Option(None, "--into", help="Shadow schema to rebuild (e.g. shadow); default: live"),
    compare: Optional[bool] = typer.Option(None, "--compare/--no-compare",
                                           help="Compare the shadow with live (row counts, checksums); "
                                                "default: on, off with --to"),
    swap: bool = typer.Option(False, help="Then make the shadow the live read models"),
    batch: int = typer.Option(20_000, min=1, max=100_000, help="Events per transaction"),
    output: Output = output_option,
) -> None:
    """Rebuild read models from the log (with a progress bar), compare a shadow with live, swap
    them, or build a shadow as of a past point (--to). A time is event time. Exits 1 when a
    compare finds differences."""
    from services.accounting import replay as replay_mod

    if projection not in replay_mod.PROJECTIONS:
        raise UserError_exit(err_console, f"--projection {projection!r} is not a projection; accepted: "
                                          f"{', '.join(replay_mod.PROJECTIONS)}")
    start, end = parse_point(from_, "--from"), parse_point(to, "--to")
    check_range(start, end)
    if into is not None:
        try:
            replay_mod.check_schema(into)
        except replay_mod.ReplayError as err:
            raise UserError_exit(err_console, str(err))
    if swap and into is None:
        raise UserError_exit(err_console, "--swap needs --into SHADOW (the schema to make live)")
    if to is not None:
        past_point_options(into, compare, swap)
    result = run(_replay(into, *start, compare if compare is not None else to is None, swap, batch, err_console,
                         to_seq=end[0], to_time=end[1]))
    differs = bool(result.get("compare")) and not all(r["equal"] for r in result["compare"]) and not swap
    if output == Output.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        at = f" {result['as_of']['describe']}" if result.get("as_of") else ""
        console.print(f"replayed {result['applied']} events into {result['target']} "
                      f"(now at {result['position']}{at}) in {result['seconds']:.1f}s")
        if result.get("compare"):
            emit(result["compare"], Output.table, title=f"{result['target']} vs live")
        if result.get("retired"):
            console.print(f"swapped: live is the rebuilt models; the old ones are in schema {result['retired']}")
    if differs:
        raise typer.Exit(1)

def past_point_options(into: str | None, compare: bool | None, swap: bool) -> None:
    """--to builds a shadow as of a past point: refused for live, with --swap and with --compare."""
    if into is None:
        raise UserError_exit(err_console, "--to needs --into SHADOW: the live read models cannot be moved back to "
                                          "a past point; build a shadow as of it (e.g. --into shadow --to 1200) "
                                          "and query that schema")
    if swap:
        raise UserError_exit(err_console, "--swap with --to: a shadow as of a past point cannot become the live "
                                          "read models (live would move back in time); leave out --to to "
                                          "rebuild a shadow that can be swapped in")
    if compare:
        raise UserError_exit(err_console, "--compare with --to: a shadow as of a past point differs from live by "
                                          "everything logged since, so there is nothing to compare; leave out "
                                          "--compare (it is off with --to)")

@app.command("metrics")
@guarded
def metrics_cmd(
    format: MetricsFormat = typer.Option(MetricsFormat.table, "--format", help="table, json or prometheus"),
    output: Output = output_option,
) -> None:
    """Operations metrics from the read models: GPU allocation, measured utilization and allocated-idle
    GPU time (NVML telemetry), wait p50/p95, congestion, failures, team cost."""
    from services.accounting import metrics, queries

    fmt = MetricsFormat.json if output == Output.json else format
    async def at_log_now(conn, js, fn):
        return await fn(conn, await queries.log_now(conn, js))
    if fmt == MetricsFormat.prometheus:
        sys.stdout.write(run(with_pg_and_log(lambda conn, js: at_log_now(conn, js, metrics.exposition))).decode())
        return
    samples = run(with_pg_and_log(lambda conn, js: at_log_now(conn, js, metrics.gather)))
    rows = [{"metric": s.name, "labels": ",".join(f"{k}={v}" for k, v in s.labels), "value": s.value}
            for s in samples]
    emit(rows, Output.json if fmt == MetricsFormat.json else Output.table)
    if fmt == MetricsFormat.table and not metrics.has_telemetry(samples):
        console.print(f"GPU utilization: no NVML telemetry reported in the last {metrics.TELEMETRY_WINDOW_S:g} s "
                      "(the local executor reports it where NVML finds GPUs; on Kubernetes, read NVIDIA's "
                      "DCGM exporter)", highlight=False)


def UserError_exit(err_console, message: str):  # noqa: N802 - reads as a raise
    from gpusched.userinput import print_error

    print_error(err_console, message)
    return typer.Exit(2)


async def _replay(into, from_seq, from_time, compare, swap, batch, err_console, *, to_seq: int | None = None,
                  to_time: datetime | None = None) -> dict[str, Any]:
    """Replay into live (``into`` None) or rebuild a shadow. ``to_seq``/``to_time`` (a shadow
    only): as of that past point, recorded in the shadow."""
    import time

    from gpusched.gateway.connection import Connection
    from runtime import eventlog
    from services.accounting import replay as replay_mod, sink

    dsn = _pg_dsn()
    nc = await Connection.resolve().nats()
    js = nc.jetstream()
    t0 = time.perf_counter()
    try:
        live = await replay_mod.connect(dsn)
        try:
            await sink.migrate(live)
            rows = await sink.partition_rows(live)
            live_pos = max((seq for seq, _ in rows.values()), default=0)  # the furthest partition's
            partitioned = len(rows) > 1
        finally:
            await live.close()
        target = into or "public"
        if into is None and partitioned:
            raise UserError("the live read models are projected by several accounting partitions "
                            "(GPUSCHED_ACCOUNTING_PARTITIONS): a replay into live would race them; accepted: "
                            "--into <shadow> and then --swap, which the partitions ride through")
        past = to_seq is not None or to_time is not None
        if past:
            last = await eventlog.last_sequence(js)
            if to_seq is not None and to_seq > last:
                raise UserError(f"--to {to_seq}: the log ends at sequence {last}; accepted: a sequence up to {last}, "
                                "or an event time")
            end = await replay_mod.resolve_end(js, to_seq, to_time)
        else:
            end = live_pos if into is not None else await eventlog.last_sequence(js)
        if into is not None:
            with _Bar(err_console, f"replay → {target}", from_seq or 1, end) as bar:
                progress = await replay_mod.rebuild(nc, dsn, into, from_seq=from_seq, from_time=from_time,
                                                    to_seq=end, to_time=to_time, as_of=past, batch=batch, on_batch=bar)
        conn = await replay_mod.connect(dsn, target)
        try:
            if into is None:
                begin = max(await sink.position(conn) + 1, from_seq or 1)
                with _Bar(err_console, f"replay → {target}", begin, end) as bar:
                    progress = await replay_mod.replay(nc, conn, from_seq=from_seq, from_time=from_time, to_seq=end,
                                                       batch=batch, writer_process=(dsn, target), on_batch=bar)
            position = await sink.position(conn)
            point = await replay_mod.point(conn, target)
        finally:
            await conn.close()
        result: dict[str, Any] = {"target": target, "applied": progress.applied, "position": position,
                                  "seconds": time.perf_counter() - t0}
        if point is not None:
            result["as_of"] = {"sequence": point.sequence, "to_time": point.to_time,
                               "newest_event_time": point.newest_event_time, "describe": point.describe()}
        if into is not None and compare:
            result["compare"] = await replay_mod.compare(dsn, into)
        if swap:
            try:
                result["retired"] = await replay_mod.swap(dsn, js, into)
            except replay_mod.ReplayError as err:
                raise UserError(str(err)) from None
        return result
    finally:
        await nc.close()


async def _verify(statement_id: str, err_console) -> dict[str, Any]:
    """Replay the log 1..last_sequence into a scratch schema, recompute the statement there and
    compare its checksum with the issued one."""
    from gpusched.gateway.connection import Connection
    from runtime import eventlog
    from schemas import ChargebackStatementIssued, parse_event
    from schemas.registry import SUBJECT_PREFIX, subject_token
    from services.accounting import chargeback, queries, replay as replay_mod, target

    dsn = _pg_dsn()
    nc = await Connection.resolve().nats()
    js = nc.jetstream()
    scratch = f"verify_{uuid.uuid4().hex[:8]}"
    try:
        found = None
        async for msg in eventlog.read(js, subjects=[f"{SUBJECT_PREFIX}.statement.{subject_token(statement_id)}.issued"]):
            found = parse_event(msg.data)
        if not isinstance(found, ChargebackStatementIssued):
            raise UserError(f"statement {statement_id!r} is not in the log; list them with `gpusched chargeback --issued`")
        if found.checksum_alg != chargeback.CHECKSUM_ALG:
            raise UserError(f"statement {statement_id!r} has checksum_alg {found.checksum_alg!r} (issued by an earlier "
                            f"release, float figures): this release re-derives only {chargeback.CHECKSUM_ALG!r} statements")
        try:
            with _Bar(err_console, "verify", 1, found.last_sequence) as bar:
                await replay_mod.rebuild(nc, dsn, scratch, to_seq=found.last_sequence, on_batch=bar)
            conn = await replay_mod.connect(dsn, scratch)
            try:
                body = await queries.statement(conn, found.period, found.group_by, log=js,
                                               as_of=chargeback.parse_period(found.period)[1],
                                               last_sequence=found.last_sequence)
            finally:
                await conn.close()
        finally:
            await target.drop(dsn, scratch)
        return {"statement_id": statement_id, "period": found.period, "group_by": found.group_by,
                "first_sequence": found.first_sequence, "last_sequence": found.last_sequence,
                "issued_checksum": found.checksum, "replayed_checksum": body["checksum"],
                "verified": body["checksum"] == found.checksum, "replayed": body}
    finally:
        await nc.close()
