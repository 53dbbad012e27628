"""Reads of the accounting read models: jobs, usage, queues (for the CLI and the applications), and
roll-ups, statements and metrics (the adapter side of :mod:`services.accounting.chargeback`).
This module is the only place outside the projection that knows the read models' tables: the
applications read through it and hold no SQL of their own."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from runtime import eventtime
from schemas import QueueConfigured, ServiceSpec
from services.accounting import chargeback, sink
from services.accounting.chargeback import Attempt, PriceVersion, QuotaVersion

PRICE_BOOK = "default"


async def attempts(conn: asyncpg.Connection, *, ended_from: datetime | None = None, ended_before: datetime | None = None,
                   overlapping: tuple[datetime, datetime] | None = None,
                   max_sequence: int | None = None) -> list[Attempt]:
    """Ledger rows ending in [ended_from, ended_before) or overlapping a window (either), logged
    at or before ``max_sequence``."""
    clauses, args = [], []

    def arg(value: Any) -> str:
        args.append(value)
        return f"${len(args)}"

    window = []
    if ended_from is not None or ended_before is not None:
        part = []
        if ended_from is not None:
            part.append(f"ended_at >= {arg(ended_from)}")
        if ended_before is not None:
            part.append(f"ended_at < {arg(ended_before)}")
        window.append("(" + " AND ".join(part) + ")")
    if overlapping is not None:
        window.append(f"(started_at < {arg(overlapping[1])} AND ended_at > {arg(overlapping[0])})")
    if window:
        clauses.append("(" + " OR ".join(window) + ")")
    if max_sequence is not None:
        clauses.append(f"sequence <= {arg(max_sequence)}")
    where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
    rows = await conn.fetch(
        f"""SELECT job_id, attempt, team, project, queue, flavor, gpus, borrowed_gpus, started_at, ended_at,
                   lost_gpu_seconds, cpu_core_seconds, memory_gib_seconds, wait_seconds
            FROM usage_ledger {where}""", *args)
    return [Attempt(**dict(r)) for r in rows]


async def running_attempts(conn: asyncpg.Connection, until: datetime) -> list[Attempt]:
    """Attempts started before ``until`` that have not ended (no ledger row yet), as if they ran
    until then: the part of a long run inside a closed period is certain before it ends. The
    job row's start is this attempt's when it is at or after the attempt's reservation. GPUs are
    charged as in the ledger (ledger.usage_row): the reservation's thousandths where it has them,
    else a fractional job its fraction of each whole GPU held."""
    rows = await conn.fetch(
        """SELECT j.job_id, j.attempt, j.team, j.project, coalesce(r.queue, j.queue) AS queue,
                  coalesce(r.flavor, j.flavor) AS flavor,
                  coalesce(r.gpu_milli / 1000.0,
                           coalesce(r.gpus, j.total_gpus) * coalesce(j.gpu_milli, 1000) / 1000.0)::float8 AS gpus,
                  coalesce(r.borrowed_milli / 1000.0,
                           coalesce(r.borrowed, 0) * coalesce(j.gpu_milli, 1000) / 1000.0)::float8 AS borrowed_gpus,
                  j.started_at, j.cpu_millis, j.memory_mib,
                  greatest(0, extract(epoch FROM j.started_at - a.queued_at))::float8 AS wait_seconds
           FROM jobs j
           LEFT JOIN reservations r ON r.job_id = j.job_id AND r.attempt = j.attempt
           LEFT JOIN attempts a ON a.job_id = j.job_id AND a.attempt = j.attempt
           WHERE j.state IN ('running', 'preempting', 'cancelling') AND j.started_at < $1
             AND j.started_at >= coalesce(j.reserved_at, j.started_at)
             AND coalesce(r.flavor, j.flavor) IS NOT NULL
             AND NOT EXISTS (SELECT FROM usage_ledger u WHERE u.job_id = j.job_id AND u.attempt = j.attempt)""",
        until)
    out = []
    for r in rows:
        seconds = max(0.0, (until - r["started_at"]).total_seconds())
        out.append(Attempt(job_id=r["job_id"], attempt=r["attempt"], team=r["team"], project=r["project"],
                           queue=r["queue"], flavor=r["flavor"], gpus=r["gpus"], borrowed_gpus=r["borrowed_gpus"],
                           started_at=r["started_at"], ended_at=until,
                           cpu_core_seconds=(r["cpu_millis"] or 0) / 1000.0 * seconds,
                           memory_gib_seconds=(r["memory_mib"] or 0) / 1024.0 * seconds, wait_seconds=r["wait_seconds"]))
    return out


async def price_versions(conn: asyncpg.Connection, name: str = PRICE_BOOK,
                         max_sequence: int | None = None) -> list[PriceVersion]:
    rows = await conn.fetch(
        """SELECT effective_from, sequence, currency, gpu_prices, cpu_core_hour, memory_gib_hour, idle_quota
           FROM price_books WHERE name = $1 AND ($2::bigint IS NULL OR sequence <= $2)""", name, max_sequence)
    return [PriceVersion(**{**dict(r), "gpu_prices": json.loads(r["gpu_prices"])}) for r in rows]


async def quota_versions(conn: asyncpg.Connection, max_sequence: int | None = None) -> list[QuotaVersion]:
    rows = await conn.fetch(
        "SELECT queue, owner, effective_from, quotas, sequence FROM quota_history "
        "WHERE $1::bigint IS NULL OR sequence <= $1", max_sequence)
    return [QuotaVersion(**{**dict(r), "quotas": json.loads(r["quotas"])}) for r in rows]


async def log_now(conn: asyncpg.Connection, wall: datetime) -> datetime:
    """'Now' for a client without the platform clock: the wall clock, or the newest time in the
    read models when the platform runs ahead of it (the dev stack's time scale)."""
    newest = await conn.fetchval(
        "SELECT max(greatest(submitted_at, admitted_at, reserved_at, scheduled_at, started_at, finished_at)) FROM jobs")
    return max(wall, newest) if newest is not None else wall


async def position(conn: asyncpg.Connection) -> int:
    """The stream position up to which the read models hold every event (with accounting
    partitioned, the lowest partition's: :func:`services.accounting.sink.complete_position`)."""
    return await sink.complete_position(conn)


async def statement(conn: asyncpg.Connection, period: str, group_by: str, *, log: JetStreamContext,
                    as_of: datetime | None = None, last_sequence: int | None = None,
                    whole: bool = False) -> dict[str, Any] | None:
    """A statement computed from the read models as they are now (position = last_sequence):
    the ledger rows and the running attempts that overlap the period (up to ``as_of``). Its log
    range is :func:`period_first_sequence` .. last_sequence, found in ``log`` (the event log).
    ``whole``: None unless the read models are at one position (every accounting partition at
    the same one): a job's row holds its state at its partition's position, so a statement is
    only what the log says up to one sequence when all of them are there."""
    start, end = chargeback.parse_period(period)
    until = min(end, as_of) if as_of is not None else end
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        if whole and len({seq for seq, _ in (await sink.partition_rows(conn)).values()}) > 1:
            return None
        seq = await position(conn) if last_sequence is None else last_sequence
        rows = await attempts(conn, overlapping=(start, until), max_sequence=seq)
        rows += await running_attempts(conn, until)
        prices = await price_versions(conn, max_sequence=seq)
        history = await quota_versions(conn, max_sequence=seq)
    first = await period_first_sequence(log, period, seq)
    return chargeback.statement(rows, prices, history, period=period, group_by=group_by, first_sequence=first,
                                last_sequence=seq, as_of=as_of)


async def period_first_sequence(log: JetStreamContext, period: str, last_sequence: int) -> int:
    """The first sequence of a statement's log range: the first event of ``1..last_sequence``
    that happened in the period or later (event time; :func:`eventtime.first_at`), or
    ``last_sequence + 1`` (an empty range) when none did. Events before it count too (a job
    submitted, a price or a quota set earlier), but none of them happened in the period."""
    first = await eventtime.first_at(log, chargeback.parse_period(period)[0], hi=last_sequence)
    return first if first is not None else last_sequence + 1


async def rollup(conn: asyncpg.Connection, by: list[str], *, period: str | None = None,
                 as_of: datetime | None = None, now: datetime | None = None) -> list[dict[str, Any]]:
    """Usage and cost per group, prorated: the parts of attempts inside ``period`` and before
    ``as_of`` (time travel: usage up to that time, running attempts included), attempts still
    running counted up to ``as_of`` or ``now`` (default: the log's newest time). Costs use the
    price book as it is now: a corrected price re-prices history."""
    start, end = chargeback.parse_period(period) if period else (None, None)
    if as_of is not None:
        end = as_of if end is None else min(end, as_of)
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        until = as_of or now or await log_now(conn, datetime.now(UTC))
        if end is not None:
            until = min(until, end)
        rows = await attempts(conn, overlapping=(start or datetime.min.replace(tzinfo=UTC),
                                                 end or datetime.max.replace(tzinfo=UTC)))
        rows += await running_attempts(conn, until)
        prices = await price_versions(conn)
    return chargeback.rollup(rows, prices, by, start=start, end=end)


async def issued(conn: asyncpg.Connection, period: str | None = None) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        """SELECT statement_id, period, group_by, checksum, first_sequence, last_sequence, total_cost, body, sequence
           FROM statements WHERE ($1::text IS NULL OR period = $1) ORDER BY period, group_by, last_sequence""", period)
    return [{**dict(r), "body": json.loads(r["body"])} for r in rows]


# -- jobs, usage and queues, for the applications ----------------------------------------------


async def list_jobs(conn: asyncpg.Connection, team: str | None = None, state: str | None = None,
                    limit: int = 50) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        """SELECT job_id, team, queue, state, attempt, total_gpus, flavor, submitted_at, finished_at
           FROM jobs WHERE ($1::text IS NULL OR team = $1) AND ($2::text IS NULL OR state = $2)
           ORDER BY submitted_at DESC NULLS LAST, job_id LIMIT $3""",
        team, state, limit,
    )
    return [dict(r) for r in rows]


async def get_job(conn: asyncpg.Connection, job_id: str) -> dict[str, Any] | None:
    """The job's row with its ledger rows as ``usage`` (one per attempt), or None."""
    row = await conn.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)
    if row is None:
        return None
    job = dict(row)
    job["usage"] = [dict(r) for r in await conn.fetch(
        "SELECT attempt, flavor, gpus, started_at, ended_at, gpu_seconds, outcome FROM usage_ledger "
        "WHERE job_id = $1 ORDER BY attempt", job_id)]
    return job


async def usage_by_team(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        """SELECT team, flavor, count(*) AS attempts, sum(gpu_seconds) / 3600.0 AS gpu_hours
           FROM usage_ledger GROUP BY team, flavor ORDER BY team, flavor"""
    )
    return [dict(r) for r in rows]


WAITING_FOR: dict[str, list[str]] = {
    "quota": ["queued", "retrying", "preempted"],  # admitted, no quota held for the current attempt
    "node": ["reserved"],  # holds quota, not placed on nodes yet
}
"""Job states (the ``jobs.state`` column) of a job that waits, by what it waits for."""


async def state_counts(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await conn.fetch("SELECT coalesce(team, '-') AS team, state, count(*) AS n FROM jobs GROUP BY 1, 2")
    return [dict(r) for r in rows]


async def queue_quotas(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """One row per live queue and flavor: its cohort, the root of that cohort's tree
    (``cohort_root``; None outside any cohort), nominal and limits (GPUs), the thousandths of a
    GPU its unreleased reservations hold (``used_milli``) and its waiting jobs (``pending_jobs``)."""
    rows = [dict(r) for r in await conn.fetch(
        """SELECT q.name AS queue, q.cohort, fq->>'flavor' AS flavor, (fq->>'nominal')::int AS nominal,
                  (fq->>'borrowing_limit')::int AS borrowing_limit, (fq->>'lending_limit')::int AS lending_limit,
                  coalesce((SELECT sum(coalesce(r.gpu_milli, r.gpus * 1000)) FROM reservations r
                            WHERE r.queue = q.name AND r.flavor = fq->>'flavor' AND r.released_at IS NULL),
                           0)::bigint AS used_milli
           FROM queues q, jsonb_array_elements(q.config->'quotas') fq
           WHERE NOT q.deleted ORDER BY q.name, fq->>'flavor'""")]
    parents = dict(await conn.fetch("SELECT name, parent FROM cohorts"))
    pending = dict(await conn.fetch(
        "SELECT queue, count(*) FROM jobs WHERE state = ANY($1::text[]) GROUP BY queue", WAITING_FOR["quota"]))
    for r in rows:
        r["cohort_root"] = _cohort_root(r["cohort"], parents)
        r["pending_jobs"] = pending.get(r["queue"], 0)
    return rows


async def queue_configs(conn: asyncpg.Connection) -> dict[str, QueueConfigured]:
    """Each live queue's configuration: its last QueueConfigured."""
    configs = [QueueConfigured.model_validate_json(r["config"])
               for r in await conn.fetch("SELECT config FROM queues WHERE NOT deleted")]
    return {c.name: c for c in configs}


async def class_holdings(conn: asyncpg.Connection) -> dict[tuple[str, str, str], int]:
    """Thousandths of a GPU unreleased reservations hold per (queue, flavor, the job's priority class)."""
    rows = await conn.fetch(
        """SELECT r.queue, r.flavor, j.priority_class, sum(coalesce(r.gpu_milli, r.gpus * 1000))::bigint AS milli
           FROM reservations r JOIN jobs j USING (job_id) WHERE r.released_at IS NULL
           GROUP BY r.queue, r.flavor, j.priority_class""")
    return {(r["queue"], r["flavor"], r["priority_class"]): r["milli"] for r in rows}


async def held_gpu_hours(conn: asyncpg.Connection, since: datetime, until: datetime) -> dict[tuple[str, str], float]:
    """GPU-hours per (queue, flavor) that reservations held between ``since`` and ``until``
    (a reservation still held: up to ``until``)."""
    rows = await conn.fetch(
        """SELECT queue, flavor, sum(extract(epoch FROM least(coalesce(released_at, $2), $2)
                                             - greatest(reserved_at, $1))
                                     * coalesce(gpu_milli, gpus * 1000)) / 3600000.0 AS hours
           FROM reservations WHERE reserved_at < $2 AND (released_at IS NULL OR released_at > $1)
           GROUP BY queue, flavor""", since, until)
    return {(r["queue"], r["flavor"]): float(r["hours"]) for r in rows}


def _cohort_root(cohort: str | None, parents: dict[str, str | None]) -> str | None:
    seen = set()
    while cohort is not None and parents.get(cohort) is not None and cohort not in seen:
        seen.add(cohort)
        cohort = parents[cohort]
    return cohort


async def services(conn: asyncpg.Connection, team: str | None = None) -> list[dict[str, Any]]:
    """Each live service (``team``: only that team's) with its replicas counted by state: ``ready``,
    ``starting`` (placed, not ready yet), ``pending`` (asked for, or lost and retrying)."""
    rows = await conn.fetch(
        """SELECT s.name AS service, s.team, s.queue, s.generation, s.desired, s.requested, s.requested_by,
                  count(*) FILTER (WHERE r.state = 'ready') AS ready,
                  count(*) FILTER (WHERE r.state = 'scheduled') AS starting,
                  count(*) FILTER (WHERE r.state IN ('requested', 'lost')) AS pending,
                  s.spec->'replicas' AS replicas, s.load_rps, s.load_at, s.deployed_by, s.updated_at
           FROM services s LEFT JOIN service_replicas r ON r.service = s.name
           WHERE NOT s.deleted AND ($1::text IS NULL OR s.team = $1)
           GROUP BY s.name ORDER BY s.name""", team)
    return [{**dict(r), "replicas": json.loads(r["replicas"])} for r in rows]


async def service_replicas(conn: asyncpg.Connection, service: str) -> list[dict[str, Any]]:
    """The service's replicas that have not been retired or replaced, and the last ones that were."""
    rows = await conn.fetch(
        """SELECT job_id, generation, replica_index, state, attempt, nodes, reason, requested_at, ready_at, changed_at
           FROM service_replicas WHERE service = $1
           ORDER BY state IN ('retired', 'replaced'), generation DESC, replica_index""", service)
    return [dict(r) for r in rows]


async def service_spec(conn: asyncpg.Connection, service: str) -> tuple[str, ServiceSpec, int] | None:
    """(team, spec, generation) of a live service, or None."""
    row = await conn.fetchrow("SELECT team, spec, generation FROM services WHERE name = $1 AND NOT deleted", service)
    if row is None:
        return None
    return row["team"], ServiceSpec.model_validate_json(row["spec"]), row["generation"]
