"""What the API reads from the accounting read models (Postgres): jobs with filters and paging,
queues with their usage, nodes and GPUs by flavor, usage and summaries. Every function takes the
team a caller may see (None: all teams) and never returns another team's rows."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import asyncpg

from gpusched.gateway import queue_usage as quota_usage
from services.accounting import queries

JOB_STATES = ("submitted", "rejected", "queued", "reserved", "scheduled", "running", "succeeded", "failed",
              "retrying", "preempted", "preempting", "cancelling", "cancelled")
PLACED_STATES = ("scheduled", "running", "preempting", "cancelling")
"""Job states (the ``jobs.state`` column) in which an attempt holds GPUs on its nodes."""
LIST_COLUMNS = ("job_id", "team", "project", "queue", "kind", "priority_class", "submitter", "state", "attempt",
                "total_gpus", "flavor", "nodes", "reason", "message", "submitted_at", "started_at", "finished_at")


CURSOR_PATTERN = r"^(n|[0-9]{1,16})~[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
"""A page's cursor: the last row's submission time (microseconds since the epoch; ``n``: none)
and job id. Readable, and any cursor of this form is a valid place in the order."""


def encode_cursor(row: dict[str, Any]) -> str:
    at = row["submitted_at"]
    return f"{'n' if at is None else int(at.timestamp() * 1_000_000)}~{row['job_id']}"


def decode_cursor(cursor: str) -> tuple[datetime | None, str]:
    at, _, job_id = cursor.partition("~")
    return (None if at == "n" else datetime.fromtimestamp(int(at) / 1_000_000, UTC)), job_id


async def list_jobs(conn: asyncpg.Connection, *, team: str | None, state: str | None = None, queue: str | None = None,
                    kind: str | None = None, submitter: str | None = None, limit: int = 50,
                    cursor: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first; a page of ``limit`` rows and the cursor of the next page (None: the last)."""
    after_at, after_id = decode_cursor(cursor) if cursor else (None, None)
    rows = await conn.fetch(
        f"""SELECT {', '.join(LIST_COLUMNS)} FROM jobs
            WHERE ($1::text IS NULL OR team = $1) AND ($2::text IS NULL OR state = $2)
              AND ($3::text IS NULL OR queue = $3) AND ($4::text IS NULL OR kind = $4)
              AND ($5::text IS NULL OR submitter = $5)
              AND ($6::text IS NULL OR (coalesce(submitted_at, 'epoch'::timestamptz), job_id)
                                       < (coalesce($7::timestamptz, 'epoch'::timestamptz), $6))
            ORDER BY coalesce(submitted_at, 'epoch'::timestamptz) DESC, job_id DESC LIMIT $8""",
        team, state, queue, kind, submitter, after_id, after_at, limit + 1)
    page = [dict(r) for r in rows[:limit]]
    return page, (encode_cursor(page[-1]) if len(rows) > limit else None)


async def get_job(conn: asyncpg.Connection, job_id: str) -> dict[str, Any] | None:
    return await queries.get_job(conn, job_id)


async def job_positions(conn: asyncpg.Connection, job_ids: list[str]) -> dict[str, int]:
    """Each waiting job's position among its queue's waiting jobs (1: next), by submission."""
    rows = await conn.fetch(
        """SELECT job_id, position FROM (
               SELECT job_id, row_number() OVER (PARTITION BY queue ORDER BY submitted_at, job_id) AS position
               FROM jobs WHERE state = ANY($2::text[]) AND queue IN (SELECT queue FROM jobs WHERE job_id = ANY($1)))
           w WHERE job_id = ANY($1)""", job_ids, queries.WAITING_FOR["quota"])
    return {r["job_id"]: r["position"] for r in rows}


async def queue_team(conn: asyncpg.Connection) -> dict[str, tuple[str, ...]]:
    """Queue -> the teams that may submit to it."""
    rows = await conn.fetch("SELECT name, config->'allowed_teams' AS teams FROM queues WHERE NOT deleted")
    return {r["name"]: tuple(json.loads(r["teams"] or "[]")) for r in rows}


async def queues(conn: asyncpg.Connection, team: str | None) -> list[dict[str, Any]]:
    """Per queue and flavor: nominal, limits, used, borrowed, lent, pending, and the GPU-hour
    budget with what is left of it this period. A team sees the queues it may submit to."""
    rows = await quota_usage.queue_usage(conn)
    allowed = await queue_team(conn)
    budgets = {r["name"]: json.loads(r["budget"]) if r["budget"] else None for r in await conn.fetch(
        "SELECT name, config->'budget' AS budget FROM queues WHERE NOT deleted")}
    spent: dict[tuple[str, str], float] = {}
    for period in {b["period"] for b in budgets.values() if b}:
        for queue, hours in (await _usage_since(conn, _period_start(period, datetime.now(UTC)))).items():
            spent[(queue, period)] = hours
    out = []
    for r in rows:
        if team is not None and team not in allowed.get(r["queue"], ()):
            continue
        budget = budgets.get(r["queue"])
        r["teams"] = list(allowed.get(r["queue"], ()))
        r["budget_gpu_hours"] = budget["gpu_hours"] if budget else None
        r["budget_period"] = budget["period"] if budget else None
        r["budget_left_gpu_hours"] = (None if not budget else
                                      round(budget["gpu_hours"] - spent.get((r["queue"], budget["period"]), 0.0), 3))
        out.append(r)
    return out


def _period_start(period: str, now: datetime) -> datetime:
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day
    if period == "week":
        return day.fromordinal(day.toordinal() - day.weekday()).replace(tzinfo=UTC)
    return day.replace(day=1)


async def _usage_since(conn: asyncpg.Connection, start: datetime) -> dict[str, float]:
    """GPU-hours per queue held since ``start`` (ended attempts and running ones), unweighted:
    what the budget is spent on (the quota service's weighting by flavor is not applied here)."""
    ledger = await conn.fetch(
        """SELECT queue, sum(extract(epoch FROM ended_at - greatest(started_at, $1)) * gpus) / 3600.0 AS hours
           FROM usage_ledger WHERE ended_at > $1 GROUP BY queue""", start)
    running = await conn.fetch(
        """SELECT queue, sum(extract(epoch FROM now() - greatest(started_at, $1)) * total_gpus) / 3600.0 AS hours
           FROM jobs WHERE state = ANY($2::text[]) AND started_at IS NOT NULL GROUP BY queue""",
        start, list(PLACED_STATES))
    out: dict[str, float] = {}
    for r in [*ledger, *running]:
        out[r["queue"]] = out.get(r["queue"], 0.0) + float(r["hours"] or 0.0)
    return out


async def cohorts(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    return [dict(r) for r in await conn.fetch("SELECT name, parent FROM cohorts ORDER BY name")]


async def nodes(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """Each node with its GPUs: capacity, used (held by placed attempts), free."""
    held = await conn.fetch(
        """SELECT node, sum(gpus_per_node)::int AS used FROM jobs, unnest(nodes) AS node
           WHERE state = ANY($1::text[]) GROUP BY node""", list(PLACED_STATES))
    used = {r["node"]: r["used"] for r in held}
    out = []
    for r in await conn.fetch("SELECT name, gpu_flavor, gpu_product, gpu_count, gpu_memory_mib, unschedulable, lost "
                              "FROM nodes ORDER BY name"):
        n = dict(r)
        n["used"] = min(used.get(n["name"], 0), n["gpu_count"])
        n["free"] = 0 if (n["lost"] or n["unschedulable"]) else n["gpu_count"] - n["used"]
        out.append(n)
    return out


def gpus_by_flavor(node_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per flavor: capacity, used, free, and fragmented: the free GPUs on nodes that are partly
    used (they cannot take a job that wants a whole node), with the largest free block."""
    flavors: dict[str, dict[str, Any]] = {}
    for n in node_rows:
        if n["lost"]:
            continue
        f = flavors.setdefault(n["gpu_flavor"] or "-", {"flavor": n["gpu_flavor"] or "-", "nodes": 0, "capacity": 0,
                                                        "used": 0, "free": 0, "fragmented": 0, "largest_free_block": 0})
        f["nodes"] += 1
        f["capacity"] += n["gpu_count"]
        f["used"] += n["used"]
        f["free"] += n["free"]
        if 0 < n["free"] < n["gpu_count"]:
            f["fragmented"] += n["free"]
        f["largest_free_block"] = max(f["largest_free_block"], n["free"])
    return [flavors[k] for k in sorted(flavors)]


async def usage(conn: asyncpg.Connection, team: str | None, by: list[str], period: str | None) -> list[dict[str, Any]]:
    """GPU-hours and cost per group (services.accounting.queries.rollup), a team's rows only."""
    groups = sorted({*by, "team"}) if team is not None else by  # a team's rows are told apart by their team
    rows = await queries.rollup(conn, groups, period=period)
    if team is not None:
        rows = [r for r in rows if r.get("team") == team]
    return rows


async def chargeback_statement(conn: asyncpg.Connection, js, period: str, group_by: str) -> dict[str, Any]:
    return await queries.statement(conn, period, group_by, log=js)


async def summary(conn: asyncpg.Connection, team: str | None) -> dict[str, Any]:
    """Counts by state, wait times (admitted -> started) and failures over the last day, GPU
    utilization from telemetry over the last hour."""
    since = datetime.now(UTC).timestamp() - 86_400
    states = await conn.fetch("SELECT state, count(*)::int AS n FROM jobs WHERE ($1::text IS NULL OR team = $1) "
                              "GROUP BY state ORDER BY state", team)
    waits = await conn.fetchrow(
        """SELECT count(*)::int AS n,
                  percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - admitted_at)) AS p50,
                  percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - admitted_at)) AS p95
           FROM jobs WHERE started_at IS NOT NULL AND admitted_at IS NOT NULL AND started_at > to_timestamp($2)
             AND ($1::text IS NULL OR team = $1)""", team, since)
    failures = await conn.fetch(
        """SELECT coalesce(reason, '-') AS reason, count(*)::int AS n FROM jobs
           WHERE state = 'failed' AND finished_at > to_timestamp($2) AND ($1::text IS NULL OR team = $1)
           GROUP BY 1 ORDER BY 2 DESC""", team, since)
    util = await conn.fetchrow(
        """SELECT avg(utilization) AS mean, avg(allocated_utilization) AS allocated, count(*)::int AS windows
           FROM gpu_telemetry WHERE window_end > now() - interval '1 hour'""")
    return {
        "jobs_by_state": {r["state"]: r["n"] for r in states},
        "wait_s": {"started_last_day": waits["n"], "p50": waits["p50"], "p95": waits["p95"]},
        "failures_last_day": {r["reason"]: r["n"] for r in failures},
        "gpu_utilization_last_hour": {"mean": util["mean"], "allocated_mean": util["allocated"],
                                      "windows": util["windows"]},
    }


async def series(conn: asyncpg.Connection, team: str | None, hours: int = 24, bucket_s: int = 3600) -> list[dict[str, Any]]:
    """Over time, per bucket: jobs submitted, started, waiting at the bucket's end (congestion),
    median wait of the jobs started in it, and mean GPU utilization. Time is the platform's
    (the log's newest time, which runs ahead of the wall clock under a time scale)."""
    now = await queries.log_now(conn, datetime.now(UTC))
    rows = await conn.fetch(
        """WITH b AS (SELECT generate_series(date_bin(make_interval(secs => $2), $4::timestamptz - make_interval(hours => $1),
                                                      'epoch'::timestamptz),
                                             $4::timestamptz, make_interval(secs => $2)) AS t0)
           SELECT b.t0,
                  (SELECT count(*) FROM jobs j WHERE j.submitted_at >= b.t0 AND j.submitted_at < b.t0 + make_interval(secs => $2)
                     AND ($3::text IS NULL OR j.team = $3))::int AS submitted,
                  (SELECT count(*) FROM jobs j WHERE j.started_at >= b.t0 AND j.started_at < b.t0 + make_interval(secs => $2)
                     AND ($3::text IS NULL OR j.team = $3))::int AS started,
                  (SELECT count(*) FROM jobs j WHERE j.admitted_at < b.t0 + make_interval(secs => $2)
                     AND coalesce(j.started_at, j.finished_at, 'infinity') >= b.t0 + make_interval(secs => $2)
                     AND ($3::text IS NULL OR j.team = $3))::int AS waiting,
                  (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM j.started_at - j.admitted_at))
                     FROM jobs j WHERE j.started_at >= b.t0 AND j.started_at < b.t0 + make_interval(secs => $2)
                     AND ($3::text IS NULL OR j.team = $3)) AS wait_p50_s,
                  (SELECT avg(g.utilization) FROM gpu_telemetry g WHERE g.window_end >= b.t0
                     AND g.window_end < b.t0 + make_interval(secs => $2)) AS utilization
           FROM b ORDER BY b.t0""", hours, bucket_s, team, now)
    return [dict(r) for r in rows]
