"""The operator's time machine against a real nats-server and Postgres: times are event time
(the platform clock's occurred_at, here hours away from JetStream's wall-clock stamps), found in
the log exactly even where producers' events interleave out of time order; `gpusched replay
--into --to SEQ|TIME` builds a shadow as of a past point and says so, and is refused for live,
for a swap and for a compare; a compare that differs exits 1 with --output json too; `gpusched
log` browses and filters the log; a statement's first_sequence is its period's first event."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from conftest import connect_as, eventually, service_settings
from gpusched.cli import accounting as accounting_cli
from runtime import eventlog
from runtime.clock import ScaledClock
from schemas import JobRejected, RejectReason, new_event, parse_event
from services.accounting import __main__ as accounting
from runtime import eventtime
from services.accounting import queries, replay
from tests.unit import builders as b

REPO = Path(__file__).resolve().parents[2]


def job(job_id: str, team: str, times: list[datetime]) -> list:
    """A job's events from submission to success at six times (submitted, admitted, reserved,
    scheduled, started, succeeded)."""
    submitted, admitted, reserved, scheduled, started, ended = times
    return [b.submitted(job_id, b.spec(team=team), when=submitted), b.admitted(job_id, when=admitted),
            b.reserved(job_id, when=reserved), b.scheduled(job_id, when=scheduled),
            b.started(job_id, when=started), b.succeeded(job_id, started_at=started, when=ended)]


def ahead_clock() -> ScaledClock:
    """The demo's platform clock (120 times the wall clock) started 5 wall minutes ago: its event
    times run 10 hours ahead of the wall clock JetStream stamps messages with."""
    return ScaledClock(time_scale=120.0, epoch=time.time() - 300)


async def append(js, events: list) -> list[int]:
    log = eventlog.EventLog(js)
    return [await log.append(e) for e in events]


@pytest.fixture
def gs(nats_server, pg_dsn):
    """`gpusched ARGS` as the operator, in a subprocess: the CompletedProcess."""
    env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_PG_DSN": pg_dsn,
           "GPUSCHED_CONNECTION_FILE": "/nonexistent"}

    def call(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args], env=env, capture_output=True, text=True,
                              timeout=120, cwd=REPO)
    return call


@pytest_asyncio.fixture
async def admin_nc(nats_server, admin_js):
    nc = await connect_as(nats_server, "admin")
    yield nc
    await nc.close()


async def fetch(dsn: str, sql: str, *args):
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


# -- event time in the log -------------------------------------------------------------------------------


async def test_event_time_lookups_agree_with_a_scan_of_the_log(admin_js):
    """At every time around the events, and up to two ends: the first sequence at or after T and
    the end of the log as of T agree with a brute-force scan, in a log out of time order by up to
    40 s (the skew given: 45 s), with a run of messages that are not events and a run of three late
    events (stamped 10 hours earlier, as `gpusched apply` stamps config events with the wall clock
    while the demo's platform runs ahead), all stamped 10 hours ahead of JetStream's stamps."""
    import random

    rng = random.Random(7)
    base = ahead_clock().now()
    skew = timedelta(seconds=45)
    stamps = [base + timedelta(seconds=10 * i + rng.uniform(-20, 20)) for i in range(100)]
    stamps[50:50] = [base - timedelta(hours=10, minutes=m) for m in (3, 2, 1)]
    times: dict[int, datetime] = {}
    for i, when in enumerate(stamps):
        if i == 30:  # more messages in a row than a search's probe reads
            for _ in range(eventtime.LATE_RUN + 4):
                await admin_js.publish("gpusched.job.poison.submitted", b"not an event")
        (seq,) = await append(admin_js, [b.submitted(f"e{i}", when=when)])
        times[seq] = when

    def log_time(seq: int) -> datetime:  # the newest event time logged up to seq
        return max(t for s, t in times.items() if s <= seq)

    probes = [base + timedelta(seconds=20 * k) for k in range(-2, 53)]
    probes += [base - timedelta(hours=10, minutes=2), base - timedelta(hours=1)]
    for hi in (None, 70):
        upto = max(times) if hi is None else hi
        for when in probes:
            first = min((s for s, t in times.items() if t >= when and s <= upto), default=None)
            last = max((s for s, t in times.items() if t <= when and s <= upto and log_time(s) <= when + skew),
                       default=0)
            assert await eventtime.first_at(admin_js, when, hi=hi, skew=skew) == first, (hi, when)
            assert await eventtime.last_at(admin_js, when, hi=hi, skew=skew) == last, (hi, when)
    # within the bound, the end of the log as of T is the last event at or before T: no event is missed
    normal = {s: t for s, t in times.items() if t > base - timedelta(hours=1)}
    for when in probes[:-2]:
        end = await eventtime.last_at(admin_js, when, skew=skew)
        assert {s for s, t in normal.items() if t <= when} <= set(range(1, end + 1)), when

    assert await eventlog.first_sequence_at(admin_js, base) is None  # JetStream's stamps are 10 hours earlier
    assert await eventtime.first_at(admin_js, base - timedelta(minutes=1)) == 1
    assert await eventtime.event_time(admin_js, 31) is None  # the message that is not an event
    assert await eventtime.first_at(admin_js, base + timedelta(days=1)) is None


# -- replay as of a past point -------------------------------------------------------------------------------


async def test_replay_into_a_shadow_as_of_a_past_point_by_sequence_and_by_event_time(admin_js, pg_dsn, gs):
    """`--to TIME` stops after the last event that happened by then on the platform clock (10
    hours ahead of JetStream's stamps), `--to SEQ` after that sequence; the shadow records the
    point, and the output says it. `--from TIME` is event time too."""
    clock = ahead_clock()
    config = await append(admin_js, [b.queue("research", ("team-a", "team-b"), when=clock.now())])
    before = await append(admin_js, job("j1", "team-a", [clock.now() for _ in range(6)])
                          + job("j2", "team-b", [clock.now() for _ in range(6)]))
    await asyncio.sleep(0.3)  # 36 s of platform time
    cut = clock.now()
    await asyncio.sleep(0.3)
    after = await append(admin_js, job("j3", "team-a", [clock.now() for _ in range(6)]))
    assert cut > datetime.now(UTC) + timedelta(hours=9)

    by_time = gs("replay", "--into", "past", "--to", cut.isoformat(), "-o", "json")
    assert by_time.returncode == 0, by_time.stderr
    result = json.loads(by_time.stdout)
    assert result["as_of"]["sequence"] == before[-1] == result["position"]
    assert result["applied"] == len(config) + len(before) and "compare" not in result
    assert result["as_of"]["describe"] == f"as of seq {before[-1]} / time {cut.isoformat()}"
    assert sorted(r["job_id"] for r in await fetch(pg_dsn, "SELECT job_id FROM past.jobs")) == ["j1", "j2"]
    (row,) = await fetch(pg_dsn, "SELECT * FROM past.as_of")
    assert (row["sequence"], row["to_time"]) == (before[-1], cut)
    comment = (await fetch(pg_dsn, "SELECT obj_description('past'::regnamespace, 'pg_namespace') AS c"))[0]["c"]
    assert comment == f"gpusched read models as of seq {before[-1]} / time {cut.isoformat()}"
    with pytest.raises(replay.ReplayError, match="past point"):
        await replay.swap(pg_dsn, admin_js, "past")

    mid = before[len(before) // 2]
    by_seq = gs("replay", "--into", "past", "--to", str(mid))
    assert by_seq.returncode == 0, by_seq.stderr
    assert f"now at {mid} as of seq {mid} / time " in by_seq.stdout
    (row,) = await fetch(pg_dsn, "SELECT * FROM past.as_of")
    assert row["sequence"] == mid and row["to_time"] is None and row["newest_event_time"] is not None

    # a window from an event time: j3 only (the stamps' lookup would have found nothing after `cut`)
    assert gs("replay").returncode == 0  # live, caught up
    window = gs("replay", "--into", "window", "--from", cut.isoformat(), "-o", "json")
    assert window.returncode == 1, window.stderr  # a window differs from live: exit 1, JSON too
    assert json.loads(window.stdout)["applied"] == len(after)
    assert [r["job_id"] for r in await fetch(pg_dsn, 'SELECT job_id FROM "window".jobs')] == ["j3"]


async def test_a_past_point_is_refused_for_live_for_a_swap_and_for_a_compare(admin_js, gs):
    await append(admin_js, job("j1", "team-a", [b.at(i) for i in range(6)]))
    refusals = {
        ("--to", "3"): "--to needs --into SHADOW: the live read models cannot be moved back",
        ("--into", "s", "--to", "3", "--swap"): "--swap with --to: a shadow as of a past point cannot become the live",
        ("--into", "s", "--to", "3", "--compare"): "--compare with --to: a shadow as of a past point differs from live",
        ("--into", "s", "--to", "99"): "--to 99: the log ends at sequence 6",
        ("--into", "s", "--from", "5", "--to", "3"): "--from 5 is after --to 3",
        ("--into", "s", "--to", "noon"): "--to 'noon': accepted: a stream sequence (e.g. 1200) or an event time",
    }
    for args, message in refusals.items():
        proc = gs("replay", *args)
        assert proc.returncode == 2 and message in " ".join(proc.stderr.split()), (args, proc.stderr)
    assert gs("replay", "--into", "s", "--to", "3", "--no-compare").returncode == 0


async def test_a_compare_that_differs_exits_1_with_json_output_too(admin_js, pg_dsn, gs):
    await append(admin_js, job("j1", "team-a", [b.at(i) for i in range(6)]))
    assert gs("replay").returncode == 0
    same = gs("replay", "--into", "shadow", "-o", "json")
    assert same.returncode == 0 and all(r["equal"] for r in json.loads(same.stdout)["compare"])
    await fetch(pg_dsn, "UPDATE public.jobs SET state = 'failed' WHERE job_id = 'j1'")
    differs = gs("replay", "--into", "shadow", "-o", "json")
    assert differs.returncode == 1
    assert [r["table"] for r in json.loads(differs.stdout)["compare"] if not r["equal"]] == ["jobs"]
    assert gs("replay", "--into", "shadow").returncode == 1


# -- gpusched log -------------------------------------------------------------------------------------------


async def test_log_browses_and_filters_the_whole_log(admin_js, gs):
    clock = ahead_clock()
    first = await append(admin_js, [b.queue("research", ("team-a", "team-b"), when=clock.now()),
                                     b.team_configured("team-a", when=clock.now()), b.node("n1", when=clock.now())])
    early = await append(admin_js, job("j1", "team-a", [clock.now() for _ in range(6)])
                         + job("j2", "team-b", [clock.now() for _ in range(6)]))
    await asyncio.sleep(0.3)
    cut = clock.now()
    await asyncio.sleep(0.3)
    rejected = new_event(JobRejected, aggregate_id="r1", producer="admission", occurred_at=clock.now(), key="1",
                         reason=RejectReason.UNKNOWN_QUEUE, message="no queue x", team="team-a")
    late = await append(admin_js, job("j3", "team-a", [clock.now() for _ in range(6)]) + [rejected])
    poison = (await admin_js.publish("gpusched.job.p1.submitted", b"not an event")).seq
    everything = first + early + late + [poison]

    def lines(*args: str) -> list[dict]:
        proc = gs("log", *args, "-o", "ndjson")
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line) for line in proc.stdout.splitlines()]

    every = lines()
    assert [e["sequence"] for e in every] == everything
    assert every[-1] == {"sequence": poison, "subject": "gpusched.job.p1.submitted", "event": None}
    assert parse_event({k: v for k, v in every[0].items() if k != "sequence"}).type == "QueueConfigured"

    starts = lines("--type", "JobSubmitted", "--type", "JobStarted")
    # the subject filters: the message that is not an event is on a JobSubmitted subject, so it comes too
    assert {e.get("type") for e in starts} == {"JobSubmitted", "JobStarted", None} and len(starts) == 7
    assert [e["type"] for e in lines("--aggregate", "queue")] == ["QueueConfigured"]
    assert [e["sequence"] for e in lines("--id", "j1")] == early[:6]
    assert [e["type"] for e in lines("--aggregate", "node", "--id", "n1")] == ["NodeRegistered"]

    team_a = lines("--team", "team-a")
    assert [e["sequence"] for e in team_a] == [first[1], *early[:6], *late]
    assert {e["aggregate_id"] for e in team_a} == {"team-a", "j1", "j3", "r1"}
    assert [e["aggregate_id"] for e in lines("--team", "team-a", "--type", "JobSubmitted")] == ["j1", "j3"]
    assert lines("--team", "team-b", "--aggregate", "team") == []

    assert [e["sequence"] for e in lines("--from", cut.isoformat())] == late + [poison]
    assert [e["sequence"] for e in lines("--to", cut.isoformat())] == first + early
    assert [e["sequence"] for e in lines("--from", "3", "--to", "5")] == [3, 4, 5]
    assert [e["aggregate_id"] for e in lines("--team", "team-a", "--from", cut.isoformat(), "--type",
                                             "JobSucceeded")] == ["j3"]

    paged = gs("log", "--limit", "2", "-o", "ndjson")
    assert [json.loads(line)["sequence"] for line in paged.stdout.splitlines()] == everything[:2]
    assert f"--from {everything[2]}" in paged.stderr
    table = gs("log", "--aggregate", "node")
    assert table.returncode == 0 and "NodeRegistered" in table.stdout and "n1" in table.stdout
    assert "(not an event)" in gs("log", "--id", "p1").stdout
    bad = gs("log", "--type", "JobExploded")
    assert bad.returncode == 2 and "--type 'JobExploded' is not an event type; accepted: ApiTokenIssued" in bad.stderr
    bad = gs("log", "--team", "team-a", "--aggregate", "node")
    assert bad.returncode == 2 and "events of aggregate node belong to no team" in " ".join(bad.stderr.split())


# -- a statement's log range -----------------------------------------------------------------------------------


async def test_a_statements_first_sequence_is_the_first_event_of_its_period(nats_server, admin_js, pg_dsn, gs,
                                                                            monkeypatch):
    """October's configuration and job come first; November's first event is a JobAdmitted, and
    events around midnight interleave (one stamped in November before one stamped in October,
    within the skew): first_sequence is that first November event, in the issued statement, its
    verification by replay and the CLI's statement alike."""
    oct31 = datetime(2026, 10, 31, 23, 0, tzinfo=UTC)
    nov1 = datetime(2026, 11, 1, tzinfo=UTC)

    def minutes(t: datetime, m: float) -> datetime:
        return t + timedelta(minutes=m)
    setup = [b.queue("research", ("team-a",), when=datetime(2026, 10, 20, tzinfo=UTC)),
             b.price_book({"a100": 2.0}, effective_from=datetime(2026, 10, 1, tzinfo=UTC),
                          when=datetime(2026, 10, 20, tzinfo=UTC))]
    october = job("oct", "team-a", [minutes(oct31, m) for m in (0, 1, 2, 3, 4, 30)])
    november = job("nov", "team-a", [nov1 - timedelta(seconds=10), nov1 + timedelta(seconds=10), minutes(nov1, 1),
                                      minutes(nov1, 2), minutes(nov1, 3), minutes(nov1, 60)])
    # the November job's admission is logged before its (late by 20 s) October submission
    logged = setup + october + [november[1], november[0], *november[2:]]
    seqs = await append(admin_js, logged)
    first_of_november = seqs[len(setup) + len(october)]
    await append(admin_js, [b.node("n9", when=datetime(2026, 12, 1, 2, tzinfo=UTC))])

    for name, value in {**nats_server.env("operator"), "GPUSCHED_PG_DSN": pg_dsn,
                        "GPUSCHED_CONNECTION_FILE": "/nonexistent"}.items():
        monkeypatch.setenv(name, value)  # for the verification in this process
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(service_settings(nats_server, "accounting", pg_dsn=pg_dsn), stop))
    try:
        async def issued():  # October's and November's
            found = [parse_event(m.data) async for m in eventlog.read(admin_js, subjects=["gpusched.statement.>"])]
            return {s.period: s for s in found} if len(found) == 2 else None
        statements = await eventually(issued, timeout_s=60)  # a loaded box once took over 15 s
        assert statements["2026-10"].first_sequence == 1
        st = statements["2026-11"]
        assert st.first_sequence == first_of_november and st.last_sequence == seqs[-1] + 1
        verified = await accounting_cli._verify(st.aggregate_id, _quiet())
        assert verified["verified"] and verified["first_sequence"] == first_of_november

        async def caught_up():
            rows = await fetch(pg_dsn, "SELECT last_sequence FROM projection_position")
            return rows and rows[0]["last_sequence"] >= await eventlog.last_sequence(admin_js)
        await eventually(caught_up)
        body = json.loads(gs("chargeback", "--period", "2026-11", "--format", "json").stdout)
        assert body["first_sequence"] == first_of_november
        october_body = json.loads(gs("chargeback", "--period", "2026-10", "--format", "json").stdout)
        assert october_body["first_sequence"] == 1
        conn = await asyncpg.connect(pg_dsn)
        try:
            future = await queries.statement(conn, "2027-01", "team", log=admin_js)
        finally:
            await conn.close()
        assert future["first_sequence"] == future["last_sequence"] + 1  # nothing of January logged: an empty range
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _quiet():
    """The CLI's stderr console, silenced under pytest."""
    from rich.console import Console
    return Console(file=open(os.devnull, "w"))
