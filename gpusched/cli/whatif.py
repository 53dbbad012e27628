"""``gpusched whatif``: the recorded log (or an Alibaba-format trace) replayed under a changed
configuration, beside what actually happened (gpusched/sim/whatif.py; docs/whatif.md)."""


from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from gpusched.cli.points import parse_time
from gpusched.errors import UserError

if TYPE_CHECKING:
    from gpusched.sim import whatif

# Light on purpose (docs/performance.md, "CLI start"): the simulator, the event log, the contract
# and the scheduler's placement are imported by the functions that use them.


def recorded_type(payload: bytes) -> bool:
    """Whether the what-if reads this payload of the log (gpusched.api.whatif.RECORDED_TYPES)."""
    from gpusched.api import whatif as run

    return run.recorded_type(payload)


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
    from gpusched.api import whatif as run

    return await run.record(js, first, last)


def options_from_env(policy: str | None) -> whatif.Options:
    """The scheduler's placement policy and preemption limits (gpusched.api.whatif.options_from_env)."""
    from gpusched.api import whatif as run

    return run.options_from_env(policy)


def changes_of(path: Path | None, recording: whatif.Recording) -> tuple[list, list[dict[str, str]]]:
    """The events a changes file makes and their descriptions (gpusched.api.whatif.changes_of)."""
    from gpusched.api import whatif as run

    return run.changes_of(path, recording)


def render(result: dict[str, Any], console) -> None:
    """The report: the baseline's fidelity first; then per group and figure what happened, the
    baseline, the change's replay and the change's effect (what-if less baseline)."""
    from rich.markup import escape
    from rich.table import Table

    from gpusched.sim import whatif

    w = result["window"]
    console.print(f"window {w['from']} .. {w['to']} ({w['seconds'] / 3600:.1f} h), {w['capacity_gpus']:g} GPUs, "
                  f"{w['log_events']} events read")
    from gpusched.api.whatif import fidelity_lines, number as _num

    for line in fidelity_lines(result):
        console.print(escape(line))
    for c in result["changes"]:
        console.print(escape(f"  {c['event']} {c['name']}: {c['change']}"))  # [name] is not markup
    changed = result["changed"]
    if result["changes"]:
        console.print(f"the change decides {changed['different']} of {changed['jobs']} jobs differently from the "
                      "baseline")
    else:
        console.print("no change: the what-if column is the baseline")
    for title, groups in (("team", result["teams"]), ("queue", result["queues"])):
        table = Table(title=f"per {title}: actual | baseline (no change) | what-if; Δ = what-if − baseline")
        table.add_column(title)
        table.add_column("figure")
        for column in ("actual", "baseline", "what-if", "Δ"):
            table.add_column(column, justify="right")
        for name, cols in groups.items():
            for i, f in enumerate(whatif.FIGURES):
                delta = cols["delta"][f]
                table.add_row(name if i == 0 else "", f, _num(cols["actual"][f]), _num(cols["baseline"][f]),
                              _num(cols["whatif"][f]), "" if not delta else f"{delta:+g}",
                              end_section=i == len(whatif.FIGURES) - 1)
        console.print(table)


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
    preemption limits and quotas: per team and per queue what happened, the replay with no change
    (the baseline, its fidelity to the log first) and the replay with the change."""
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
