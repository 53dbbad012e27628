"""Reads of the accounting read models: jobs, usage, queues (for the CLI and the applications), and
roll-ups, statements and metrics (the adapter side of :mod:`services.accounting.chargeback`).
This module is the only place outside the projection that knows the read models' tables: the
applications read through it and hold no SQL of their own."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from runtime import eventtime
from schemas import QueueConfigured, ServiceSpec
from schemas.jobstate import PLACED_STATES, WAITING_FOR_NODES, WAITING_FOR_QUOTA, JobState
from services.accounting import chargeback, sink
from services.accounting.chargeback import Attempt, PriceVersion, QuotaVersion

PRICE_BOOK = "default"


async def attempts(conn: asyncpg.Connection, *, ended_from: datetime | None = None, ended_before: datetime | None = None,
                   overlapping: tuple[datetime, datetime] | None = None,
                   max_sequence: int | None = None, job_id: str | None = None) -> list[Attempt]:
    """Ledger rows ending in [ended_from, ended_before) or overlapping a window (either), logged
    at or before ``max_sequence``, of one job only with ``job_id``."""
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
    if job_id is not None:
        clauses.append(f"job_id = {arg(job_id)}")
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


async def currency_at(conn: asyncpg.Connection, at: datetime) -> str:
    """The price book's currency in force at ``at`` (its first version's before it; USD with no
    price book): what the usage roll-ups' costs are in."""
    return chargeback.PriceBook(await price_versions(conn)).currency(at)


async def price_versions(conn: asyncpg.Connection, name: str = PRICE_BOOK,
                         max_sequence: int | None = None) -> list[PriceVersion]:
    rows = await conn.fetch(
        """SELECT effective_from, sequence, currency, gpu_prices, cpu_core_hour, memory_gib_hour, idle_quota
           FROM price_books WHERE name = $1 AND ($2::bigint IS NULL OR sequence <= $2)""", name, max_sequence)
    return [PriceVersion(**{**dict(r), "gpu_prices": json.loads(r["gpu_prices"], parse_float=Decimal)}) for r in rows]


async def quota_versions(conn: asyncpg.Connection, max_sequence: int | None = None) -> list[QuotaVersion]:
    rows = await conn.fetch(
        "SELECT queue, owner, effective_from, quotas, sequence FROM quota_history "
        "WHERE $1::bigint IS NULL OR sequence <= $1", max_sequence)
    return [QuotaVersion(**{**dict(r), "quotas": json.loads(r["quotas"])}) for r in rows]


async def log_now(conn: asyncpg.Connection, log: JetStreamContext | None = None) -> datetime:
    """The platform's now as the read models know it: the log's time at the position they hold
    (:func:`runtime.eventtime.log_time`, the newest event time up to it). A function of that
    position, never of when a door asks, so every door asked at one position gives one answer
    (a statement "as of now", a budget left, the last day's waits). It runs ahead of the wall
    clock under the dev stack's time scale and stands still while the log is quiet. Without
    ``log`` (the event log), the newest time the read models' rows hold (a job's timestamps, a
    reservation, a cluster's heartbeat, a telemetry window): the same time wherever those rows
    say it, earlier where the newest events left no time in them; the wall clock only before
    the read models hold anything."""
    seq = await position(conn)
    if log is not None and seq > 0:
        at = await eventtime.log_time(log, seq)
        if at is not None:
            return at
    newest = await conn.fetchval(
        """SELECT greatest((SELECT max(greatest(submitted_at, admitted_at, reserved_at, scheduled_at, started_at,
                                                finished_at)) FROM jobs),
                           (SELECT max(greatest(reserved_at, released_at)) FROM reservations),
                           (SELECT max(last_report) FROM clusters),
                           (SELECT max(window_end) FROM gpu_telemetry))""")
    return newest if newest is not None else datetime.now(UTC)


async def position(conn: asyncpg.Connection) -> int:
    """The stream position up to which the read models hold every event (with accounting
    partitioned, the lowest partition's: :func:`services.accounting.sink.complete_position`)."""
    return await sink.complete_position(conn)


async def statement(conn: asyncpg.Connection, period: str, group_by: str, *, log: JetStreamContext,
                    as_of: datetime | None = None, last_sequence: int | None = None,
                    whole: bool = False) -> dict[str, Any] | None:
    """The period's chargeback statement as of ``as_of`` (default: the log's now,
    :func:`log_now`), computed from the read models as they are now (position = last_sequence):
    the ledger rows and the running attempts that overlap the period up to ``as_of``. Its log
    range is :func:`period_first_sequence` .. last_sequence, found in ``log`` (the event log).
    Besides the statement body (:func:`services.accounting.chargeback.statement`, checksummed)
    it always carries ``statement_id`` (the id it has once issued: period, dimension, log range),
    ``provisional`` (the period had not ended at ``as_of``) and ``as_of`` (ISO 8601). It carries
    the adjustments of closed periods that belong to it (:func:`_adjustments`). The one
    definition every door uses; a statement of a whole closed period (issuing or verifying one) passes its end as
    ``as_of``. ``whole``: None unless the read models are at one position (every accounting
    partition at the same one): a job's row holds its state at its partition's position, so a
    statement is only what the log says up to one sequence when all of them are there."""
    end = chargeback.parse_period(period)[1]
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        if whole and len({seq for seq, _ in (await sink.partition_rows(conn)).values()}) > 1:
            return None
        if as_of is None:
            as_of = await log_now(conn, log)
        seq = await position(conn) if last_sequence is None else last_sequence
        rows, prices, history = await _statement_inputs(conn, period, min(end, as_of), seq)
        adjusting = await _adjustments(conn, period, group_by, seq)
    first = await period_first_sequence(log, period, seq)
    body = chargeback.statement(rows, prices, history, period=period, group_by=group_by, first_sequence=first,
                                last_sequence=seq, as_of=as_of, adjustments=adjusting)
    body["statement_id"] = chargeback.statement_id(period, group_by, seq)
    body["provisional"] = end > as_of
    body["as_of"] = as_of.isoformat()
    return body


async def _statement_inputs(conn: asyncpg.Connection, period: str, until: datetime,
                           seq: int) -> tuple[list[Attempt], list[PriceVersion], list[QuotaVersion]]:
    """What a period's statement is computed from, up to ``until`` and log sequence ``seq``: the
    ledger rows overlapping it, the attempts still running, the price and quota history."""
    start = chargeback.parse_period(period)[0]
    rows = await attempts(conn, overlapping=(start, until), max_sequence=seq)
    rows += await running_attempts(conn, until)
    return rows, await price_versions(conn, max_sequence=seq), await quota_versions(conn, max_sequence=seq)


async def _adjustments(conn: asyncpg.Connection, period: str, group_by: str, seq: int) -> list[dict[str, Any]]:
    """The adjustment lines a statement of ``period`` carries (chargeback.adjustments): for each
    closed period C before it whose statement was issued, with a statement issued for every
    period between C and this one (so this is the first period after C left open), and whose
    figures rows logged after C's statement may change (ledger rows of attempts that ran in C,
    price or quota versions in force by C's end, logged up to ``seq``): C recomputed from the
    log up to ``seq``, less C's issued items, less what statements of the periods between
    already carried for C. Issued statements are those logged up to ``seq``, so a statement's
    adjustments are a function of the log up to its ``last_sequence``."""
    issued = {r["period"]: (r["last_sequence"], json.loads(r["body"])) for r in await conn.fetch(
        """SELECT DISTINCT ON (period) period, last_sequence, body FROM statements
           WHERE group_by = $1 AND sequence <= $2 AND period < $3 ORDER BY period, last_sequence DESC""",
        group_by, seq, period)}
    chain, c = [], chargeback.previous_period(period)
    while c in issued:  # the closed periods whose next open period this is
        chain.append(c)
        c = chargeback.previous_period(c)
    out: list[dict[str, Any]] = []
    for c in reversed(chain):
        last, body = issued[c]
        start, end = chargeback.parse_period(c)
        if body.get("checksum_alg") != chargeback.CHECKSUM_ALG or not await conn.fetchval(
                """SELECT EXISTS (SELECT FROM usage_ledger WHERE sequence > $3 AND sequence <= $4
                                  AND started_at < $2 AND ended_at >= $1)
                       OR EXISTS (SELECT FROM price_books WHERE sequence > $3 AND sequence <= $4 AND effective_from < $2)
                       OR EXISTS (SELECT FROM quota_history WHERE sequence > $3 AND sequence <= $4
                                  AND effective_from < $2)""", start, end, last, seq):
            continue  # issued before items existed (sha256-json-v1), or nothing logged since touches it
        now = chargeback.statement(*await _statement_inputs(conn, c, end, seq), period=c, group_by=group_by,
                                   first_sequence=0, last_sequence=seq)
        carried = [a for q, (_, b) in issued.items() if q > c for a in b.get("adjustments", ())
                   if a["adjusts_period"] == c]
        out += chargeback.adjustments(c, now["items"], body["items"], carried)
    return out


STATEMENT_EXTRAS = ("statement_id", "provisional", "as_of")
"""What :func:`statement` adds to the checksummed body (not fields of ChargebackStatementIssued)."""


async def period_first_sequence(log: JetStreamContext, period: str, last_sequence: int) -> int:
    """The first sequence of a statement's log range: the first event of ``1..last_sequence``
    that happened in the period or later (event time; :func:`eventtime.first_at`), or
    ``last_sequence + 1`` (an empty range) when none did. Events before it count too (a job
    submitted, a price or a quota set earlier), but none of them happened in the period."""
    first = await eventtime.first_at(log, chargeback.parse_period(period)[0], hi=last_sequence)
    return first if first is not None else last_sequence + 1


async def rollup(conn: asyncpg.Connection, by: list[str], *, period: str | None = None,
                 as_of: datetime | None = None, now: datetime | None = None,
                 log: JetStreamContext | None = None) -> list[dict[str, Any]]:
    """Usage and cost per group, prorated: the parts of attempts inside ``period`` and before
    ``as_of`` (time travel: usage up to that time, running attempts included), attempts still
    running counted up to ``as_of`` or ``now`` (default: :func:`log_now`, with ``log``). Costs use the
    price book as it is now: a corrected price re-prices history."""
    start, end = chargeback.parse_period(period) if period else (None, None)
    if as_of is not None:
        end = as_of if end is None else min(end, as_of)
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        until = as_of or now or await log_now(conn, log)
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


LIST_COLUMNS = ("job_id", "team", "project", "queue", "kind", "priority_class", "submitter", "state", "attempt",
                "total_gpus", "flavor", "nodes", "reason", "message", "submitted_at", "started_at", "finished_at")
"""The columns of a job in a list (:func:`jobs_page`)."""
CLI_COLUMNS = ("job_id", "team", "queue", "state", "attempt", "total_gpus", "flavor", "submitted_at", "finished_at")
"""The columns :func:`list_jobs` keeps (the CLI's table)."""
CURSOR_PATTERN = r"^(n|[0-9]{1,16})~[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
"""A page's cursor: the last row's submission time (microseconds since the epoch; ``n``: none)
and job id. Readable, and any cursor of this form is a valid place in the order."""


def encode_cursor(row: dict[str, Any]) -> str:
    at = row["submitted_at"]
    return f"{'n' if at is None else int(at.timestamp() * 1_000_000)}~{row['job_id']}"


def decode_cursor(cursor: str) -> tuple[datetime | None, str]:
    at, _, job_id = cursor.partition("~")
    return (None if at == "n" else datetime.fromtimestamp(int(at) / 1_000_000, UTC)), job_id


@dataclass(frozen=True)
class JobsPage:
    """A page of jobs, newest first: each row (:data:`LIST_COLUMNS`, and ``position``: its place
    in its queue's line while it waits for quota, :func:`job_positions`; else None) and the
    cursor of the next page (None: this is the last)."""

    items: list[dict[str, Any]]
    next_cursor: str | None


async def jobs_page(conn: asyncpg.Connection, *, team: str | None = None, state: str | None = None,
                    queue: str | None = None, kind: str | None = None, submitter: str | None = None,
                    limit: int = 50, cursor: str | None = None) -> JobsPage:
    """Jobs newest first (by submission, then job id), ``limit`` at a time from ``cursor``."""
    after_at, after_id = decode_cursor(cursor) if cursor else (None, None)
    async with conn.transaction(isolation="repeatable_read", readonly=True):
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
        positions = await job_positions(conn, [r["job_id"] for r in page if r["state"] in WAITING_FOR_QUOTA])
    for r in page:
        r["position"] = positions.get(r["job_id"])
    return JobsPage(page, encode_cursor(page[-1]) if len(rows) > limit else None)


async def list_jobs(conn: asyncpg.Connection, team: str | None = None, state: str | None = None,
                    limit: int = 50) -> list[dict[str, Any]]:
    """The first page of :func:`jobs_page`, each row's :data:`CLI_COLUMNS` (``gpusched jobs``)."""
    page = await jobs_page(conn, team=team, state=state, limit=limit)
    return [{k: r[k] for k in CLI_COLUMNS} for r in page.items]


async def job_positions(conn: asyncpg.Connection, job_ids: list[str]) -> dict[str, int]:
    """Each given job that waits for quota (:data:`schemas.jobstate.WAITING_FOR_QUOTA`): its
    position among its queue's waiting jobs (1: next), by submission then job id. The one
    definition of a job's queue position (the job list, ``why``, the console)."""
    if not job_ids:
        return {}
    rows = await conn.fetch(
        """SELECT job_id, position FROM (
               SELECT job_id, row_number() OVER (PARTITION BY queue ORDER BY submitted_at, job_id) AS position
               FROM jobs WHERE state = ANY($2::text[]) AND queue IN (SELECT queue FROM jobs WHERE job_id = ANY($1)))
           w WHERE job_id = ANY($1)""", job_ids, list(WAITING_FOR_QUOTA))
    return {r["job_id"]: r["position"] for r in rows}


async def job_position(conn: asyncpg.Connection, job_id: str) -> int | None:
    """:func:`job_positions` of one job (None: it does not wait for quota)."""
    return (await job_positions(conn, [job_id])).get(job_id)


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


async def job_costs(conn: asyncpg.Connection, job_id: str) -> dict[int, float]:
    """The usage cost of each ended attempt of a job (attempt -> amount in :func:`currency_at`'s
    currency), priced as :func:`rollup` prices it: the price book as it is now."""
    book = chargeback.PriceBook(await price_versions(conn))
    return {a.attempt: book.attempt_cost(a) for a in await attempts(conn, job_id=job_id)}


async def usage_by_team(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        """SELECT team, flavor, count(*) AS attempts, sum(gpu_seconds) / 3600.0 AS gpu_hours
           FROM usage_ledger GROUP BY team, flavor ORDER BY team, flavor"""
    )
    return [dict(r) for r in rows]


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
        "SELECT queue, count(*) FROM jobs WHERE state = ANY($1::text[]) GROUP BY queue", list(WAITING_FOR_QUOTA)))
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


# -- queues, cluster, usage and summaries, for the applications -------------------------------------


async def queue_teams(conn: asyncpg.Connection) -> dict[str, tuple[str, ...]]:
    """Each live queue -> the teams that may submit to it."""
    rows = await conn.fetch("SELECT name, config->'allowed_teams' AS teams FROM queues WHERE NOT deleted")
    return {r["name"]: tuple(json.loads(r["teams"] or "[]")) for r in rows}


@dataclass(frozen=True)
class Cohort:
    name: str
    parent: str | None


async def cohorts(conn: asyncpg.Connection) -> list[Cohort]:
    return [Cohort(r["name"], r["parent"]) for r in await conn.fetch("SELECT name, parent FROM cohorts ORDER BY name")]


async def nodes(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """Each node with its GPUs: capacity, used (held by placed attempts,
    :data:`schemas.jobstate.PLACED_STATES`), free (none on a lost or unschedulable node)."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        held = await conn.fetch(
            """SELECT node, sum(gpus_per_node)::int AS used FROM jobs, unnest(nodes) AS node
               WHERE state = ANY($1::text[]) GROUP BY node""", list(PLACED_STATES))
        rows = await conn.fetch("SELECT name, gpu_flavor, gpu_product, gpu_count, gpu_memory_mib, unschedulable, lost "
                                "FROM nodes ORDER BY name")
    used = {r["node"]: r["used"] for r in held}
    out = []
    for r in rows:
        n = dict(r)
        n["used"] = min(used.get(n["name"], 0), n["gpu_count"])
        n["free"] = 0 if (n["lost"] or n["unschedulable"]) else n["gpu_count"] - n["used"]
        out.append(n)
    return out


def gpus_by_flavor(node_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per flavor, from :func:`nodes`: capacity, used, free, and fragmented: the free GPUs on
    nodes that are partly used (they cannot take a job that wants a whole node), with the
    largest free block. Lost nodes count nowhere."""
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


async def team_usage(conn: asyncpg.Connection, team: str | None, by: list[str],
                     period: str | None, log: JetStreamContext | None = None) -> list[dict[str, Any]]:
    """:func:`rollup` as a team may see it: ``team`` None: every group; else only that team's
    rows (grouped by team too, so they are told apart)."""
    groups = sorted({*by, "team"}) if team is not None else by
    rows = await rollup(conn, groups, period=period, log=log)
    return rows if team is None else [r for r in rows if r.get("team") == team]


WAIT_WINDOW_S = 86_400.0
"""Wait percentiles are over the attempts that started in the last day (log time: up to the
ledger's newest start)."""


@dataclass(frozen=True)
class WaitPercentiles:
    """Wait from queued to started (the usage ledger's ``wait_seconds``) of the attempts that
    started in the window: how many, p50, p95 and the sum (seconds). ``queue`` None: all queues."""

    queue: str | None
    n: int
    p50: float | None
    p95: float | None
    total: float | None


async def wait_percentiles(conn: asyncpg.Connection, *, by_queue: bool = False, team: str | None = None,
                           window_s: float = WAIT_WINDOW_S) -> list[WaitPercentiles]:
    """The one definition of wait p50/p95: the ledger's ``wait_seconds`` of the attempts that
    started within ``window_s`` of the ledger's newest start, per queue (``by_queue``) or over
    all of them (one row, n 0 when none), a team's only when ``team`` is given."""
    rows = await conn.fetch(
        """SELECT CASE WHEN $3 THEN queue END AS queue, count(*)::int AS n,
                  percentile_cont(0.5) WITHIN GROUP (ORDER BY wait_seconds) AS p50,
                  percentile_cont(0.95) WITHIN GROUP (ORDER BY wait_seconds) AS p95,
                  sum(wait_seconds)::float8 AS total
           FROM usage_ledger WHERE wait_seconds IS NOT NULL
             AND started_at > (SELECT max(started_at) FROM usage_ledger) - make_interval(secs => $1)
             AND ($2::text IS NULL OR team = $2)
           GROUP BY 1 ORDER BY 1""", window_s, team, by_queue)
    out = [WaitPercentiles(r["queue"], r["n"], r["p50"], r["p95"], r["total"]) for r in rows]
    return out if out or by_queue else [WaitPercentiles(None, 0, None, None, None)]


async def summary(conn: asyncpg.Connection, team: str | None, log: JetStreamContext | None = None) -> dict[str, Any]:
    """Jobs by state, wait p50/p95 (:func:`wait_percentiles`) and failures over the last day, GPU
    utilization from telemetry over the last hour; the day and the hour end at the log's now
    (:func:`log_now`). ``team``: that team's jobs only."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        now = await log_now(conn, log)
        states = await conn.fetch("SELECT state, count(*)::int AS n FROM jobs WHERE ($1::text IS NULL OR team = $1) "
                                  "GROUP BY state ORDER BY state", team)
        (waits,) = await wait_percentiles(conn, team=team)
        failures = await conn.fetch(
            """SELECT coalesce(reason, '-') AS reason, count(*)::int AS n FROM jobs
               WHERE state = 'failed' AND finished_at > $2::timestamptz - interval '1 day'
                 AND ($1::text IS NULL OR team = $1)
               GROUP BY 1 ORDER BY 2 DESC""", team, now)
        util = await conn.fetchrow(
            """SELECT avg(utilization) AS mean, avg(allocated_utilization) AS allocated, count(*)::int AS windows
               FROM gpu_telemetry WHERE window_end > $1::timestamptz - interval '1 hour'""", now)
    return {
        "jobs_by_state": {r["state"]: r["n"] for r in states},
        "wait_s": {"started_last_day": waits.n, "p50": waits.p50, "p95": waits.p95},
        "failures_last_day": {r["reason"]: r["n"] for r in failures},
        "gpu_utilization_last_hour": {"mean": util["mean"], "allocated_mean": util["allocated"],
                                      "windows": util["windows"]},
    }


async def series(conn: asyncpg.Connection, team: str | None, hours: int = 24,
                 bucket_s: int = 3600, log: JetStreamContext | None = None) -> list[dict[str, Any]]:
    """Over time, per bucket: jobs submitted, started, waiting at the bucket's end (congestion),
    median wait (the ledger's ``wait_seconds``, as :func:`wait_percentiles`) of the attempts
    started in it, and mean GPU utilization. Time is the platform's (:func:`log_now`)."""
    now = await log_now(conn, log)
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
                  (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY u.wait_seconds)
                     FROM usage_ledger u WHERE u.wait_seconds IS NOT NULL
                     AND u.started_at >= b.t0 AND u.started_at < b.t0 + make_interval(secs => $2)
                     AND ($3::text IS NULL OR u.team = $3)) AS wait_p50_s,
                  (SELECT avg(g.utilization) FROM gpu_telemetry g WHERE g.window_end >= b.t0
                     AND g.window_end < b.t0 + make_interval(secs => $2)) AS utilization
           FROM b ORDER BY b.t0""", hours, bucket_s, team, now)
    return [dict(r) for r in rows]


async def pending_by_queue(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """Per queue and what its jobs wait for (``quota``: :data:`schemas.jobstate.WAITING_FOR_QUOTA`;
    ``node``: :data:`schemas.jobstate.WAITING_FOR_NODES`): how many, and when the longest-waiting
    of them was queued (``oldest``)."""
    waiting = [(state, "quota") for state in WAITING_FOR_QUOTA] + [(state, "node") for state in WAITING_FOR_NODES]
    return [dict(r) for r in await conn.fetch(
        """SELECT queue, w.waiting_for, count(*) AS n, min(coalesce(a.queued_at, j.admitted_at)) AS oldest
           FROM jobs j JOIN unnest($1::text[], $2::text[]) AS w(state, waiting_for) ON w.state = j.state
           LEFT JOIN attempts a ON a.job_id = j.job_id AND a.attempt = j.attempt
           GROUP BY queue, w.waiting_for""", [s for s, _ in waiting], [w for _, w in waiting])]


TOKEN_COLUMNS = "token_id, name, role, team, issued_by, issued_at, expires_at, revoked_at, revoked_by"
"""What a token's row shows (never its hash)."""


async def api_tokens(conn: asyncpg.Connection | asyncpg.Pool) -> list[dict[str, Any]]:
    """Every API token, oldest first, without its hash: `gpusched token list` and GET /v1/tokens."""
    return [dict(r) for r in await conn.fetch(f"SELECT {TOKEN_COLUMNS} FROM api_tokens ORDER BY issued_at")]


async def api_token(conn: asyncpg.Connection | asyncpg.Pool, token_id: str) -> asyncpg.Record | None:
    """One token's row with its hash, for the API's authentication (None: no such token)."""
    return await conn.fetchrow(f"SELECT {TOKEN_COLUMNS}, token_hash FROM api_tokens WHERE token_id = $1", token_id)


async def clusters(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """Each cluster of a platform of several (docs/executor.md, "Many clusters"): its latest
    heartbeat, the nodes its executor saw then, and ``lost_at`` / ``lost_reason`` while it is lost."""
    return [dict(r) for r in await conn.fetch(
        "SELECT name, last_report, nodes, lost_at, lost_reason FROM clusters ORDER BY name")]


async def running_gpus(conn: asyncpg.Connection) -> int:
    """GPUs held by the jobs that run now."""
    return await conn.fetchval("SELECT coalesce(sum(total_gpus), 0) FROM jobs WHERE state = $1",
                               JobState.RUNNING.value)


# -- the console's charts and occupancy map ---------------------------------------------------------


def buckets(now: datetime, hours: int, bucket_s: int) -> list[datetime]:
    """The starts of the buckets :func:`series` reports (bins of ``bucket_s`` from the epoch, from
    the one holding ``now - hours`` to the one holding ``now``), less a last one that starts at
    ``now`` (no time in it yet: the log's time is often a round telemetry window's end)."""
    first = math.floor((now.timestamp() - hours * 3600) / bucket_s) * bucket_s
    last = math.ceil(now.timestamp() / bucket_s) * bucket_s - bucket_s
    return [datetime.fromtimestamp(t, UTC) for t in range(first, max(first, last) + 1, bucket_s)]


async def allocation_series(conn: asyncpg.Connection, team: str | None, hours: int = 24, bucket_s: int = 3600,
                            log: JetStreamContext | None = None) -> dict[str, Any]:
    """Per bucket of :func:`buckets`: the GPUs attempts held, as a mean over the bucket (GPU-seconds
    / the bucket's seconds up to now), per team and per flavor, and their cost per team in the
    price book's currency: :func:`rollup`'s figures (ledger rows and running attempts, prorated,
    priced by :func:`services.accounting.chargeback.rollup`) cut at each bucket's edges.
    ``team``: only that team's attempts. Keys: ``t0``, ``by_team``, ``by_flavor``, ``cost_by_team``
    (name -> one value per bucket) and ``currency``."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        now = await log_now(conn, log)
        t0s = buckets(now, hours, bucket_s)
        rows = await attempts(conn, overlapping=(t0s[0], now)) + await running_attempts(conn, now)
        prices = await price_versions(conn)
        currency = await currency_at(conn, now)
    rows = [a for a in rows if team is None or a.team == team]
    return {"t0": t0s, "currency": currency, **allocation_buckets(rows, prices, t0s, bucket_s, now)}


def allocation_buckets(rows: list[Attempt], prices: list[PriceVersion], t0s: list[datetime], bucket_s: int,
                       now: datetime) -> dict[str, dict[str, list[float]]]:
    """:func:`allocation_series`' figures from its attempts: per bucket starting at each of
    ``t0s`` (up to ``now``), mean GPUs held per team and per flavor, and cost per team."""
    teams, flavors = sorted({a.team for a in rows}), sorted({a.flavor for a in rows})
    out: dict[str, dict[str, list[float]]] = {"by_team": {t: [] for t in teams}, "by_flavor": {f: [] for f in flavors},
                                              "cost_by_team": {t: [] for t in teams}}
    for t0 in t0s:
        t1 = min(t0 + timedelta(seconds=bucket_s), now)
        seconds = max(1.0, (t1 - t0).total_seconds())
        inside = [a for a in rows if a.started_at < t1 and a.ended_at >= t0]
        groups = chargeback.rollup(inside, prices, ["team", "flavor"], start=t0, end=t1) if inside else []
        for name, key, figure, scale in (("by_team", "team", "gpu_hours", 3600 / seconds),
                                         ("by_flavor", "flavor", "gpu_hours", 3600 / seconds),
                                         ("cost_by_team", "team", "cost", 1)):
            sums: dict[str, float] = {}
            for g in groups:
                sums[g[key]] = sums.get(g[key], 0.0) + float(g[figure]) * scale
            for k, values in out[name].items():
                values.append(round(sums.get(k, 0.0), 4))
    return out


async def wait_series(conn: asyncpg.Connection, team: str | None, hours: int = 24, bucket_s: int = 3600,
                      log: JetStreamContext | None = None) -> dict[str, Any]:
    """Per priority class and bucket of :func:`buckets`: p50 and p90 of the waits (the ledger's
    ``wait_seconds``, as :func:`wait_percentiles`) of the attempts that started in the bucket
    (None: none started). Keys: ``t0`` and ``classes`` (class -> {"p50": [...], "p90": [...]})."""
    now = await log_now(conn, log)
    t0s = buckets(now, hours, bucket_s)
    rows = await conn.fetch(
        """SELECT date_bin(make_interval(secs => $1), u.started_at, 'epoch'::timestamptz) AS t0,
                  coalesce(j.priority_class, '-') AS priority_class,
                  percentile_cont(0.5) WITHIN GROUP (ORDER BY u.wait_seconds) AS p50,
                  percentile_cont(0.9) WITHIN GROUP (ORDER BY u.wait_seconds) AS p90
           FROM usage_ledger u LEFT JOIN jobs j USING (job_id)
           WHERE u.wait_seconds IS NOT NULL AND u.started_at >= $2 AND u.started_at <= $3
             AND ($4::text IS NULL OR u.team = $4)
           GROUP BY 1, 2""", bucket_s, t0s[0], now, team)
    index = {t: i for i, t in enumerate(t0s)}
    classes: dict[str, dict[str, list[float | None]]] = {}
    for r in rows:
        c = classes.setdefault(r["priority_class"], {"p50": [None] * len(t0s), "p90": [None] * len(t0s)})
        if (i := index.get(r["t0"])) is not None:
            c["p50"][i], c["p90"][i] = r["p50"], r["p90"]
    return {"t0": t0s, "classes": {k: classes[k] for k in sorted(classes)}}


async def outcome_series(conn: asyncpg.Connection, team: str | None, hours: int = 24, bucket_s: int = 3600,
                         log: JetStreamContext | None = None) -> dict[str, Any]:
    """Per bucket of :func:`buckets`: the attempts that ended preempted (JobPreempted) and failed
    (JobFailed, a retried attempt's too), by when they ended (the usage ledger's outcome).
    Keys: ``t0``, ``preempted`` and ``failed`` (one count per bucket)."""
    now = await log_now(conn, log)
    t0s = buckets(now, hours, bucket_s)
    rows = await conn.fetch(
        """SELECT date_bin(make_interval(secs => $1), ended_at, 'epoch'::timestamptz) AS t0,
                  count(*) FILTER (WHERE outcome = 'JobPreempted')::int AS preempted,
                  count(*) FILTER (WHERE outcome = 'JobFailed')::int AS failed
           FROM usage_ledger WHERE ended_at >= $2 AND ended_at <= $3 AND ($4::text IS NULL OR team = $4)
           GROUP BY 1""", bucket_s, t0s[0], now, team)
    by_t0 = {r["t0"]: r for r in rows}
    return {"t0": t0s, **{k: [by_t0[t][k] if t in by_t0 else 0 for t in t0s] for k in ("preempted", "failed")}}


async def gpu_holders(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """Who holds GPUs on which node now: per placed attempt (:data:`schemas.jobstate.PLACED_STATES`,
    as :func:`nodes` counts them) and node, its ``team``, ``job_id``, ``gpus`` on that node and
    ``gpu_milli`` (thousandths of one shared GPU; None: whole GPUs)."""
    rows = await conn.fetch(
        """SELECT node, team, job_id, gpus_per_node AS gpus, gpu_milli FROM jobs, unnest(nodes) AS node
           WHERE state = ANY($1::text[]) ORDER BY node, gpu_milli NULLS FIRST, job_id""", list(PLACED_STATES))
    return [dict(r) for r in rows]


async def telemetry_sources(conn: asyncpg.Connection, since: datetime) -> list[str]:
    """Where the GPU telemetry of the windows ending after ``since`` comes from (``nvml``,
    ``simulated``: the sim executor's model), so a chart of it can say which it shows."""
    return [r["source"] for r in await conn.fetch(
        "SELECT DISTINCT source FROM gpu_telemetry WHERE window_end >= $1 ORDER BY 1", since)]
