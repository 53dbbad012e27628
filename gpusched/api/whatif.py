"""The what-if as the applications run it (``gpusched whatif`` and the console's what-if page):
the recorded log read into a :class:`gpusched.sim.whatif.Recording`, and a changes file (a
queues file) turned into the events it makes against the configuration at the window's start.
The replay and the report are gpusched/sim/whatif.py's."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any

from gpusched.config import queues as queueconfig
from gpusched.errors import UserError
from gpusched.sim import whatif

RECORDED_TYPES = frozenset({
    "JobSubmitted", "JobAdmitted", "JobRejected", "JobCancelRequested", "QuotaReserved", "JobScheduled",
    "PreemptionRequested", "ReclaimRequested", "QuotaReleased", "JobRetryScheduled",
    "QuotaPendingReasonChanged", "SchedulingPendingReasonChanged", "JobStarted", "JobSucceeded",
    "JobFailed", "JobPreempted", "JobCancelled",
    "QueueConfigured", "QueueDeleted", "CohortConfigured", "PolicyConfigured", "PriceBookUpdated",
    "NodeRegistered", "NodeUpdated",
})
"""What the what-if reads of the log: a job's decisions (with their times: the baseline replays
each service's lag) and ends, configuration, nodes and prices (not the wait reasons, telemetry, statements or tokens). The log is read whole and each
payload's type looked at before it is parsed: a consumer filtered on these types' subjects makes
the server deliver in bursts (measured: 14× slower on a 27,000-event log)."""
_TYPE = re.compile(rb'"type":"(\w+)"')  # the envelope's: the first "type" key of an event's JSON


def recorded_type(payload: bytes) -> bool:
    found = _TYPE.search(payload)
    return found is not None and found.group(1).decode() in RECORDED_TYPES


async def record(js, first: int | datetime | None, last: int | datetime | None, *,
                 direct: bool = False) -> whatif.Recording:
    """The recorded log as a :class:`whatif.Recording`, its window from ``first`` to ``last``
    (a sequence bound is the event time of the event at that sequence). ``direct``: read it by
    direct gets, one message at a time, as the API's user may (it creates no consumer); else by
    an ordered consumer, in batches."""
    from runtime import eventlog
    from schemas import parse_event

    rec = whatif.Recording(start=first if isinstance(first, datetime) else None,
                           end=last if isinstance(last, datetime) else None,
                           from_seq=first if isinstance(first, int) else None,
                           to_seq=last if isinstance(last, int) else None)
    batches = _direct_batches(js) if direct else eventlog.read_batches(js, client=eventlog.client_of(js),
                                                                         payloads=True, batch=4096)
    async for batch in batches:
        for seq, payload in batch:
            if recorded_type(payload):
                rec.add(seq, parse_event(payload))
    if isinstance(first, int) and rec.start is None:
        raise UserError(f"--log: FROM {first} is past the log's last sequence")
    return rec


async def _direct_batches(js, batch: int = 512):
    """The log's (sequence, payload) pairs by direct gets of the next message, in lists."""
    from nats.js.errors import NotFoundError

    from runtime import eventlog

    seq, out = 1, []
    while True:
        try:
            raw = await js.get_msg(eventlog.EVENTS_STREAM, seq=seq, direct=True, next=True, subject=">")
        except NotFoundError:
            break
        out.append((raw.seq, raw.data))
        seq = raw.seq + 1
        if len(out) >= batch:
            yield out
            out = []
    if out:
        yield out


def changes_of(path: Path | None, recording: whatif.Recording) -> tuple[list, list[dict[str, str]]]:
    """The events a changes file makes against the configuration at the window's start, and
    their descriptions (as ``gpusched apply --dry-run`` gives them)."""
    from gpusched import userinput

    if path is None:
        return [], []
    return changes_from(userinput.read_document(path), path, recording)


def changes_from(document: Any, source: str | Path, recording: whatif.Recording) -> tuple[list, list[dict[str, str]]]:
    """:func:`changes_of` for a document already read (``source`` names it in errors)."""
    parsed = queueconfig.parse_queues(document, source)
    config = queueconfig.fold(whatif.at_start(recording))
    start, _ = recording.window
    events = [e for e in queueconfig.plan(parsed, config, start) if isinstance(e, whatif.CONFIG_TYPES)]
    return events, [{"event": e.type, "name": e.aggregate_id, "change": queueconfig.describe_change(e, config)}
                    for e in events]


def options_from_env(policy: str | None) -> whatif.Options:
    """The scheduler's placement policy and default preemption limits, from the variables the
    scheduler reads (docs/scheduling.md), so the replay places as the live scheduler does."""
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


def fidelity_lines(result: dict[str, Any]) -> list[str]:
    """The baseline's fidelity, first in every report: how many jobs the replay with no change
    decided as the log did, and each team's waits, recorded → baseline."""
    f = result["fidelity"]
    lines = []
    d = f["decisions"]
    if d is not None:
        share = f"{100 * d['share']:.1f} %" if d["share"] is not None else "–"
        lines.append(f"baseline fidelity: {d['same']} of {d['jobs']} jobs decided as the log did ({share}; "
                     f"{d['same_with_times']} at the same times)")
    else:
        lines.append("baseline fidelity: the trace records no decisions")
    for team, waits in f["waits"].items():
        parts = []
        for name, figure in (("p50", "wait_p50_s"), ("p95", "wait_p95_s")):
            w = waits[figure]
            err = "" if w["error"] is None else f" ({100 * w['error']:.1f} % off)"
            parts.append(f"wait {name} {number(w['actual'])} → {number(w['baseline'])} s{err}")
        lines.append(f"  {team}: " + ", ".join(parts) + "  (log → baseline)")
    return lines


def number(value) -> str:
    """A figure as the report prints it (– for none)."""
    return "–" if value is None else f"{value:g}"


def cell(figure: str, value, currency: str | None = None) -> str:
    """A figure as the console's what-if page shows it: a wait (``*_s``) as a duration, the cost
    with the price book's currency, the rest as :func:`number` prints it."""
    from gpusched.api.readable import money
    from schemas.wording import duration

    if value is None:
        return "–"
    if figure.endswith("_s"):
        return duration(value)
    if figure == "cost" and currency:
        return money(value, currency)
    return number(value)


def delta_cell(figure: str, value, currency: str | None = None) -> str:
    """A change as the what-if page shows it: signed, in the figure's unit; empty for none."""
    if not value:
        return ""
    return ("+" if value > 0 else "-") + cell(figure, abs(value), currency)


def read_text(text: str, source: str) -> Any:
    """A changes file given as text (the console's upload or textarea), read as a file is, its
    errors naming ``source``."""
    import tempfile

    from gpusched import userinput

    with tempfile.TemporaryDirectory(prefix="gpusched-whatif-") as tmp:
        path = Path(tmp) / "queues.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            return userinput.read_document(path)
        except UserError as err:
            raise UserError(str(err).replace(str(path), source)) from None


async def run_text(js, text: str, source: str) -> dict[str, Any]:
    """The whole log replayed with no change and under the changes file ``text``: the report
    (the console's what-if page). The replay runs in a worker thread."""
    import asyncio

    document = read_text(text, source)
    recording = await record(js, None, None, direct=True)
    changes, described = changes_from(document, source, recording)
    options = options_from_env(None)
    result, _ = await asyncio.to_thread(whatif.whatif, recording, changes, whatif.overridden_by(changes), options,
                                        described)
    return result
