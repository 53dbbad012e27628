"""`gpusched log`: browse and filter the whole event log (the GPUSCHED_EVENTS stream) as a table
or JSON lines. Registered onto the main app by :mod:`gpusched.cli.main`.

Filters on type, aggregate and id become subject filters of the reader's consumer
(``gpusched.<aggregate>.<id>.<token>``, schemas.registry), so the server sends only what matches.
A team is not in the subject: ``--team`` reads the job ids of the team's jobs first (its
JobSubmitted events, and the JobRejected of commands that came on its intake subjects), then keeps
those jobs' events and the team's own (TeamConfigured). No other aggregate belongs to one team."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING, Any, Optional

import typer

from gpusched.cli.points import check_range, parse_point
from gpusched.errors import UserError

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from schemas.envelope import Event

# Light on purpose (docs/performance.md, "CLI start"): nats, the event log and the contract's
# registry are imported by the functions that use them.

AGGREGATES: tuple[str, ...] = ("cluster", "cohort", "job", "node", "policy", "pricebook", "queue", "service",
                               "statement", "team", "token")
"""The aggregate families of the log (the second subject token): those of schemas.registry's
event types, written out here so that `--help` need not import the contract
(tests/unit/test_cli_start.py checks they agree)."""

TEAM_AGGREGATES = ("job", "team")
"""The aggregates whose events belong to one team: a team's jobs, and the team itself."""

DETAIL_LEFT_OUT = ("event_id", "type", "schema_version", "aggregate_id", "occurred_at", "producer", "causation_id",
                   "correlation_id", "spec")


@dataclass(frozen=True)
class Query:
    """What to read: subject filters (None: every subject), a sequence range, and what the
    subjects cannot say (a team's job ids)."""
    subjects: list[str] | None
    team: str | None = None
    from_seq: int | None = None
    from_time: datetime | None = None
    to_seq: int | None = None
    to_time: datetime | None = None


def build_query(types: list[str], aggregate: str | None, aggregate_id: str | None, team: str | None,
                start: tuple[int | None, datetime | None], end: tuple[int | None, datetime | None]) -> Query:
    """Check the filters (UserError naming the option, the value and what is accepted) and turn
    them into subject filters."""
    from schemas.envelope import NAME_PATTERN
    from schemas.registry import EVENT_TYPES_BY_NAME, SUBJECT_PREFIX, subject_suffix, subject_token

    unknown = [t for t in types if t not in EVENT_TYPES_BY_NAME]
    if unknown:
        raise UserError(f"--type {unknown[0]!r} is not an event type; accepted: {', '.join(sorted(EVENT_TYPES_BY_NAME))}")
    if aggregate is not None and aggregate not in AGGREGATES:
        raise UserError(f"--aggregate {aggregate!r} is not an aggregate; accepted: {', '.join(AGGREGATES)}")
    if aggregate is not None:
        other = [t for t in types if EVENT_TYPES_BY_NAME[t].aggregate != aggregate]
        if other:
            raise UserError(f"--type {other[0]} is an event of aggregate {EVENT_TYPES_BY_NAME[other[0]].aggregate}, "
                            f"not {aggregate}; accepted with --aggregate {aggregate}: "
                            f"{', '.join(sorted(n for n, c in EVENT_TYPES_BY_NAME.items() if c.aggregate == aggregate))}")
    if aggregate_id is not None and not aggregate_id.strip():
        raise UserError("--id '': accepted: an aggregate id (a job id, a queue, node or team name, ...)")
    if team is not None:
        if not re.fullmatch(NAME_PATTERN, team):
            raise UserError(f"--team {team!r} is not a team name; accepted: a DNS label ({NAME_PATTERN})")
        asked = [("--aggregate", aggregate, aggregate)] if aggregate is not None else [
            ("--type", t, EVENT_TYPES_BY_NAME[t].aggregate) for t in types]
        for option, value, family in asked:
            if family not in TEAM_AGGREGATES:
                raise UserError(f"--team with {option} {value}: events of aggregate {family} belong to no team; "
                                "--team matches the events of the team's jobs and of the team itself (aggregates "
                                f"{', '.join(TEAM_AGGREGATES)})")
    check_range(start, end)
    token = subject_token(aggregate_id) if aggregate_id is not None else "*"
    if types:
        subjects = [f"{SUBJECT_PREFIX}.{EVENT_TYPES_BY_NAME[t].aggregate}.{token}.{subject_suffix(t)}" for t in types]
    elif aggregate is not None:
        subjects = [f"{SUBJECT_PREFIX}.{aggregate}.{token}.>"]
    elif team is not None:
        subjects = [f"{SUBJECT_PREFIX}.job.{token}.>", f"{SUBJECT_PREFIX}.team.{token}.>"]
    elif aggregate_id is not None:
        subjects = [f"{SUBJECT_PREFIX}.*.{token}.>"]
    else:
        subjects = None
    return Query(sorted(set(subjects)) if subjects else None, team, *start, *end)


async def read(js: JetStreamContext, query: Query, limit: int) -> tuple[list[tuple[int, Event | None, str]], int | None]:
    """Up to ``limit`` entries (sequence, event or None for a message that is not one, subject)
    in log order, and the sequence to read on from when more match (None: none)."""
    from runtime import eventlog
    from schemas.registry import parse_event

    first, last = await resolve_range(js, query)
    if first is None or first > last:
        return [], None
    belongs = await team_filter(js, query.team, last) if query.team is not None else None
    out: list[tuple[int, Event | None, str]] = []
    batches = eventlog.read_batches(js, subjects=query.subjects, from_seq=first, to_seq=last, batch=min(limit + 1, 2048))
    async with contextlib.aclosing(batches) as reader:
        async for msgs in reader:
            for msg in msgs:
                seq = eventlog.sequence(msg)
                try:
                    event: Event | None = parse_event(msg.data)
                except ValueError:  # pydantic's ValidationError is one
                    event = None
                if belongs is not None and not belongs(msg.subject, event):
                    continue
                if len(out) == limit:
                    return out, seq
                out.append((seq, event, msg.subject))
    return out, None


async def resolve_range(js: JetStreamContext, query: Query) -> tuple[int | None, int]:
    """(first, last) stream sequence of the range, times found by event time; first None: empty."""
    from runtime import eventlog, eventtime

    last = await eventlog.last_sequence(js)
    if query.to_seq is not None:
        last = min(last, query.to_seq)
    if query.to_time is not None:
        last = await eventtime.last_at(js, query.to_time, hi=last)
    first = query.from_seq or 1
    if query.from_time is not None:
        at = await eventtime.first_at(js, query.from_time, hi=last)
        first = max(first, at) if at is not None else None
    return first, last


async def team_filter(js: JetStreamContext, team: str, last: int) -> Callable[[str, Event | None], bool]:
    """Whether a message belongs to ``team``: an event of one of its jobs (up to ``last``, from
    the start of the log: a job submitted before the range has events in it) or of the team."""
    from runtime import eventlog
    from schemas.registry import SUBJECT_PREFIX, parse_event, subject_suffix, subject_token

    jobs: set[str] = set()
    needle = team.encode()
    subjects = [f"{SUBJECT_PREFIX}.job.*.{subject_suffix(t)}" for t in ("JobSubmitted", "JobRejected")]
    async for msg in eventlog.read(js, subjects=subjects, to_seq=last):
        if needle not in msg.data:  # a look before parsing: most jobs are other teams'
            continue
        try:
            event = parse_event(msg.data)
        except ValueError:
            continue
        spec = getattr(event, "spec", None)
        if (spec.team if spec is not None else getattr(event, "team", None)) == team:
            jobs.add(event.aggregate_id)
    own = f"{SUBJECT_PREFIX}.team.{subject_token(team)}."
    job_prefix = f"{SUBJECT_PREFIX}.job."

    def belongs(subject: str, event: Event | None) -> bool:
        if subject.startswith(own):
            return True
        return event is not None and subject.startswith(job_prefix) and event.aggregate_id in jobs
    return belongs


def rows(entries: list[tuple[int, Event | None, str]]) -> list[dict[str, Any]]:
    """The table's rows: sequence, event time, type, aggregate id, producer, the rest in brief."""
    out = []
    for seq, event, subject in entries:
        if event is None:
            out.append({"seq": seq, "time": "", "type": "(not an event)", "id": subject, "producer": "", "detail": ""})
            continue
        detail = {k: v for k, v in event.model_dump(mode="json").items() if k not in DETAIL_LEFT_OUT}
        out.append({"seq": seq, "time": event.occurred_at.isoformat(timespec="seconds"), "type": event.type,
                    "id": event.aggregate_id, "producer": event.producer, "detail": json.dumps(detail)[:100]})
    return out


def json_line(seq: int, event: Event | None, subject: str) -> str:
    """One entry as a line of JSON: the event with its stream sequence (a message that is not an
    event: its sequence and subject, ``"event": null``)."""
    if event is None:
        return json.dumps({"sequence": seq, "subject": subject, "event": None})
    return json.dumps({"sequence": seq, **event.model_dump(mode="json")})


# The commands register on the one app (gpusched.cli.common) when this module is imported.
from gpusched.cli.common import app, emit, run, with_js, guarded, console, err_console  # noqa: E402
from gpusched.cli.common import Output  # noqa: E402


class LogOutput(str, Enum):
    """`gpusched log`'s outputs: every command's table and json (one JSON document: an array),
    and ndjson, the one stream of the CLI (one JSON object per line, as the events are read)."""
    table = "table"
    json = "json"
    ndjson = "ndjson"


@app.command("log")
@guarded
def log_cmd(
    type_: list[str] = typer.Option([], "--type", help="Only this event type (repeat for several), e.g. JobStarted"),
    aggregate: Optional[str] = typer.Option(None, "--aggregate", help=f"Only this aggregate: {', '.join(AGGREGATES)}"),
    aggregate_id: Optional[str] = typer.Option(None, "--id", metavar="AGGREGATE_ID",
                                               help="Only this aggregate id (a job id, a queue, node or team name)"),
    team: Optional[str] = typer.Option(None, "--team", help="Only the events of this team's jobs and of the team"),
    from_: Optional[str] = typer.Option(None, "--from", metavar="SEQ|TIME",
                                        help="From a stream sequence, or from the first event that happened at "
                                             "or after an event time (platform clock; ISO 8601 with a zone)"),
    to: Optional[str] = typer.Option(None, "--to", metavar="SEQ|TIME",
                                     help="Up to a stream sequence, or to the last event that happened at or "
                                          "before an event time"),
    limit: int = typer.Option(100, "--limit", min=1, max=1_000_000, help="At most this many events"),
    output: LogOutput = typer.Option(LogOutput.table, "--output", "-o",
                                     help="table, json (one array) or ndjson (one event per line)"),
) -> None:
    """Browse the event log in order, filtered by type, aggregate, id, team and range, as a table,
    a JSON array (-o json) or JSON lines (-o ndjson): each event with its stream sequence. A time is event time, and picks
    the sequences of a range: events a little out of time order around its ends come with it."""
    from rich.text import Text

    query = build_query(type_, aggregate, aggregate_id, team, parse_point(from_, "--from"), parse_point(to, "--to"))
    entries, more = run(with_js(lambda js: read(js, query, limit)))
    if output == LogOutput.ndjson:
        for entry in entries:
            print(json_line(*entry))
    elif output == LogOutput.json:
        emit([json.loads(json_line(*entry)) for entry in entries], Output.json)
    else:
        emit(rows(entries), Output.table)
    if more is not None:
        err_console.print(Text(f"more events match: the next ones from --from {more}"))
