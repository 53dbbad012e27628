"""``gpusched whatif``: the recorded log (or an Alibaba-format trace) replayed under a changed
configuration, beside what actually happened (gpusched/sim/whatif.py; docs/whatif.md)."""


from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from gpusched.cli.points import parse_time
from gpusched.errors import UserError

if TYPE_CHECKING:
    from gpusched.config import queues as queueconfig
    from gpusched.sim import whatif

# Light on purpose (docs/performance.md, "CLI start"): the simulator, the event log, the contract
# and the scheduler's placement are imported by the functions that use them.

RECORDED_TYPES = frozenset({
    "JobSubmitted", "JobAdmitted", "JobRejected", "JobCancelRequested", "QuotaReserved", "JobScheduled",
    "PreemptionRequested", "JobStarted", "JobSucceeded", "JobFailed", "JobPreempted", "JobCancelled",
    "QueueConfigured", "QueueDeleted", "CohortConfigured", "PolicyConfigured", "PriceBookUpdated",
    "NodeRegistered", "NodeUpdated",
})
"""What the what-if reads of the log: a job's decisions and ends, configuration, nodes and prices
(not the wait reasons, telemetry, statements or tokens). The log is read whole and each
payload's type looked at before it is parsed: a consumer filtered on these types' subjects makes
the server deliver in bursts (measured: 14× slower on a 27,000-event log)."""
_TYPE = re.compile(rb'"type":"(\w+)"')  # the envelope's: the first "type" key of an event's JSON


def recorded_type(payload: bytes) -> bool:
    found = _TYPE.search(payload)
    return found is not None and found.group(1).decode() in RECORDED_TYPES


def parse_range(text: str) -> tuple[int | datetime | None, int | datetime | None]:
    """``FROM..TO``, either end a stream sequence or an event time (ISO 8601 with a zone, or a
    date), either end may be empty; ``..`` or empty: the whole log."""
    if text.strip() in ("", ".."):
        return None, None
    if ".." not in text:
        raise UserError(f"--log {text!r}: not a range; accepted: FROM..TO, FROM.., ..TO or .., each end a stream "
                        "sequence (e.g. 1200) or an event time (e.g. 2026-11-01T00:00:00Z)")
    lo, hi = (part.strip() for part in text.split("..", 1))

    def end(part: str, which: str) -> int | datetime | None:
        if not part:
            return None
        if part.isdigit():
            if int(part) < 1:
                raise UserError(f"--log {text!r}: {which} {part}: stream sequences start at 1")
            return int(part)
        try:
            return parse_time(part, f"--log {which}")
        except UserError:
            raise UserError(f"--log {text!r}: {which} {part!r} is neither a stream sequence nor a time with a zone; "
                            "accepted: e.g. 1200 or 2026-11-01T00:00:00Z") from None
    first, last = end(lo, "FROM"), end(hi, "TO")
    if first is not None and last is not None and type(first) is type(last) and first > last:  # type: ignore[operator]
        raise UserError(f"--log {text!r}: FROM is after TO; accepted: FROM <= TO")
    return first, last


async def record(js, first: int | datetime | None, last: int | datetime | None) -> whatif.Recording:
    """The recorded log as a :class:`whatif.Recording`, its window from ``first`` to ``last``
    (a sequence bound is the event time of the event at that sequence)."""
    from gpusched.sim import whatif
    from runtime import eventlog
    from schemas import parse_event

    rec = whatif.Recording(start=first if isinstance(first, datetime) else None,
                           end=last if isinstance(last, datetime) else None,
                           from_seq=first if isinstance(first, int) else None,
                           to_seq=last if isinstance(last, int) else None)
    async for batch in eventlog.read_batches(js, client=eventlog.client_of(js), payloads=True, batch=4096):
        for seq, payload in batch:
            if recorded_type(payload):
                rec.add(seq, parse_event(payload))
    if isinstance(first, int) and rec.start is None:
        raise UserError(f"--log: FROM {first} is past the log's last sequence")
    return rec


def config_at(events: list) -> queueconfig.QuotaConfig:
    """The queue, cohort and policy configuration that ``events`` (in log order) leave."""
    from gpusched.config import queues as queueconfig
    from schemas import CohortConfigured, PolicyConfigured, QueueConfigured, QueueDeleted

    config = queueconfig.QuotaConfig({}, {})
    for e in events:
        if isinstance(e, QueueConfigured):
            config.queues[e.name] = e
        elif isinstance(e, QueueDeleted):
            config.queues.pop(e.name, None)
        elif isinstance(e, CohortConfigured):
            config.cohorts[e.name] = e
        elif isinstance(e, PolicyConfigured):
            config.policy = e
    return config


def options_from_env(policy: str | None) -> whatif.Options:
    """The scheduler's placement policy and default preemption limits, from the variables the
    scheduler reads (docs/scheduling.md), so the replay places as the live scheduler does."""
    from gpusched.sim import whatif
    from runtime.settings import ConfigError, env_choice, env_value
    from services.scheduler.__main__ import flavor_policies, preemption_limits  # the variables' one parser
    from services.scheduler.placement import Policy

    accepted = tuple(p.value for p in Policy)
    try:
        chosen = policy or env_choice("GPUSCHED_SCHEDULER_POLICY", Policy.BEST_FIT.value, accepted)
        if chosen not in accepted:
            raise UserError(f"--policy {chosen!r}: accepted: {', '.join(accepted)}")
        limits = preemption_limits()
        by_flavor = flavor_policies(env_value("GPUSCHED_SCHEDULER_POLICY_BY_FLAVOR", "") or "")
    except ConfigError as err:
        raise UserError(str(err)) from None
    return whatif.Options(policy=Policy(chosen), flavor_policies=by_flavor, limits=limits)


def changes_of(path: Path | None, recording: whatif.Recording) -> tuple[list, list[dict[str, str]]]:
    """The events a changes file makes against the configuration at the window's start, and
    their descriptions (as ``gpusched apply --dry-run`` gives them)."""
    from gpusched import userinput
    from gpusched.config import queues as queueconfig
    from gpusched.sim import whatif

    if path is None:
        return [], []
    parsed = queueconfig.parse_queues(userinput.read_document(path), path)
    config = config_at(whatif.at_start(recording))
    start, _ = recording.window
    events = [e for e in queueconfig.plan(parsed, config, start) if isinstance(e, whatif.CONFIG_TYPES)]
    return events, [{"event": e.type, "name": e.aggregate_id, "change": queueconfig.describe_change(e, config)}
                    for e in events]


def render(result: dict[str, Any], console) -> None:
    """The report as tables: per group, each figure actual → what-if."""
    from rich.markup import escape
    from rich.table import Table

    from gpusched.sim import whatif

    w, d = result["window"], result["decisions"]
    console.print(f"window {w['from']} .. {w['to']} ({w['seconds'] / 3600:.1f} h), {w['capacity_gpus']:g} GPUs, "
                  f"{w['log_events']} events read")
    for c in result["changes"]:
        console.print(escape(f"  {c['event']} {c['name']}: {c['change']}"))  # [name] is not markup
    if d is not None:
        console.print(f"decisions: {d['same']} of {d['jobs']} jobs decided the same ({d['same_with_times']} at the "
                      "same times)")
    for title, groups in (("team", result["teams"]), ("queue", result["queues"])):
        table = Table(title=f"per {title}: actual → what-if")
        table.add_column(title)
        for f in whatif.FIGURES:
            table.add_column(f, justify="right")
        for name, cols in groups.items():
            table.add_row(name, *(_cell(cols["actual"][f], cols["whatif"][f]) for f in whatif.FIGURES))
        console.print(table)


def _cell(a, b) -> str:
    if a == b:
        return "–" if a is None else f"{a:g}"
    return f"{'–' if a is None else f'{a:g}'} → {'–' if b is None else f'{b:g}'}"


# The commands register on the one app (gpusched.cli.common) when this module is imported.
from gpusched.cli.common import app, run, with_js, guarded, console, err_console  # noqa: E402
from gpusched.cli.common import Output, OutputOpt  # noqa: E402
output_option, output_enum = OutputOpt, Output


@app.command("whatif")
@guarded
def whatif_cmd(
    log_range: str = typer.Option("..", "--log", help="The recorded log's window: FROM..TO (stream sequences or "
                                                      "event times; either end may be left out); default: all"),
    apply: Optional[Path] = typer.Option(None, "--apply", help="Changes: a queues file (gpusched apply's format: "
                                                               "priority_classes, preemption_limits, cohorts, "
                                                               "queues); none: replay as configured"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="An Alibaba-format trace directory to replay "
                                                               "instead of the log"),
    policy: Optional[str] = typer.Option(None, help="Placement policy (default: GPUSCHED_SCHEDULER_POLICY, "
                                                    "as the scheduler)"),
    limit: Optional[int] = typer.Option(None, min=1, help="With --trace: only the first N tasks"),
    output: Output = output_option,
) -> None:
    """Replay recorded history through the real decision cores under changed priority classes,
    preemption limits and quotas, and compare per team and per queue with what happened."""
    from gpusched.sim import whatif

    options = options_from_env(policy)
    began = time.monotonic()
    if trace is not None:
        from gpusched.sim import trace as tracesim
        from gpusched.sim import whatif_trace
        try:
            recording = whatif_trace.recording(trace, limit)
        except tracesim.TraceError as err:
            raise UserError(str(err)) from None
    else:
        first, last = parse_range(log_range)
        recording = run(with_js(lambda js: record(js, first, last)))
    changes, described = changes_of(apply, recording)
    result, _ = whatif.whatif(recording, changes, whatif.overridden_by(changes), options, described)
    if output == Output.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        render(result, console)
    err_console.print(f"[dim]replayed {recording.events} events in {time.monotonic() - began:.1f} s[/dim]")
