"""The idempotent sink: applies a batch of operations and the stream position in one
transaction, skipping what the read models already contain. Killed mid-batch, it commits all of
the batch or none of it; redelivered, it skips what it has.
"""

from __future__ import annotations

import logging
import weakref
from importlib import resources

import asyncpg

from services.accounting.projection import Op

log = logging.getLogger(__name__)

PROJECTION = "read-models"
_MIGRATION_LOCK = 0x6770_7573  # advisory lock key for migrations ("gpus")

# Columns _state operations may set (the converter's vocabulary); anything else is a bug.
_STATE_COLUMNS = frozenset(
    {"admitted_at", "reserved_at", "scheduled_at", "started_at", "finished_at", "attempt", "flavor",
     "nodes", "reason", "message", "exit_code"}
)

_TS_COLUMNS = ("admitted_at", "reserved_at", "scheduled_at", "started_at", "finished_at")
_JOB_COLUMNS: tuple[tuple[str, str], ...] = (
    *((c, "timestamptz") for c in _TS_COLUMNS),
    ("attempt", "integer"), ("flavor", "text"), ("nodes", "text[]"), ("reason", "text"), ("message", "text"),
    ("exit_code", "integer"),
)
assert {c for c, _ in _JOB_COLUMNS} == _STATE_COLUMNS

# One statement for every change to a job row (state transitions and wait reasons): a flag and a
# value per column, so that all of a batch's job updates go to Postgres in one pipelined
# executemany, in log order.
_JOB_UPDATE = "UPDATE jobs SET state = coalesce($2, state), last_sequence = $3" + "".join(
    f", {c} = CASE WHEN ${4 + 2 * i}::boolean THEN ${5 + 2 * i}::{t} ELSE {c} END"
    for i, (c, t) in enumerate(_JOB_COLUMNS)
) + " WHERE job_id = $1"

_SQL = {
    "job_submitted": """
        INSERT INTO jobs (job_id, team, project, queue, kind, priority_class, submitter, gpus_per_node,
                          gang_size, total_gpus, submitted_at, last_sequence, state, cpu_millis, memory_mib)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, 'submitted', $13, $14)
        ON CONFLICT (job_id) DO NOTHING""",
    "job_rejected": """
        INSERT INTO jobs (job_id, state, reason, message, finished_at, last_sequence)
        VALUES ($1, 'rejected', $2, $3, $4, $5)
        ON CONFLICT (job_id) DO UPDATE SET state = 'rejected', reason = $2, message = $3,
            finished_at = $4, last_sequence = $5""",
    "job_update": _JOB_UPDATE,
    # The attempt's quota (flavor, GPUs, borrowed part), when it was queued and its last checkpoint
    # logged before it ended: all keyed by (job, attempt), so the result does not depend on the
    # order a batch's rows were written in.
    "usage": """
        INSERT INTO usage_ledger (job_id, attempt, team, project, queue, flavor, gpus, started_at, ended_at,
                                  gpu_seconds, outcome, sequence, borrowed_gpus, borrowed_gpu_seconds,
                                  lost_gpu_seconds, last_checkpoint_at, queued_at, wait_seconds,
                                  cpu_core_seconds, memory_gib_seconds)
        SELECT j.job_id, $2, j.team, j.project, coalesce(r.queue, j.queue), coalesce(r.flavor, j.flavor),
               coalesce(r.gpus, j.total_gpus), $3::timestamptz, $4::timestamptz,
               coalesce(r.gpus, j.total_gpus) * $5::float8, $6, $7,
               coalesce(r.borrowed, 0), coalesce(r.borrowed, 0) * $5::float8,
               CASE WHEN $6 = 'JobPreempted' THEN coalesce(r.gpus, j.total_gpus)
                    * greatest(0, extract(epoch FROM $4::timestamptz - greatest($3::timestamptz, c.at)))::float8
                    ELSE 0 END,
               c.at, a.queued_at,
               CASE WHEN a.queued_at IS NULL THEN NULL
                    ELSE greatest(0, extract(epoch FROM $3::timestamptz - a.queued_at))::float8 END,
               coalesce(j.cpu_millis, 0) / 1000.0 * $5::float8, coalesce(j.memory_mib, 0) / 1024.0 * $5::float8
        FROM jobs j
        LEFT JOIN reservations r ON r.job_id = j.job_id AND r.attempt = $2
        LEFT JOIN attempts a ON a.job_id = j.job_id AND a.attempt = $2
        LEFT JOIN LATERAL (SELECT max(checkpointed_at) AS at FROM checkpoints k
                           WHERE k.job_id = j.job_id AND k.attempt = $2 AND k.sequence < $7
                             AND k.checkpointed_at <= $4::timestamptz) c ON true
        WHERE j.job_id = $1 AND coalesce(r.flavor, j.flavor) IS NOT NULL
        ON CONFLICT (job_id, attempt) DO NOTHING""",
    "attempt_queued": "INSERT INTO attempts (job_id, attempt, queued_at, sequence) VALUES ($1, $2, $3, $4) "
                      "ON CONFLICT DO NOTHING",
    "checkpoint": "INSERT INTO checkpoints (job_id, attempt, checkpointed_at, sequence) VALUES ($1, $2, $3, $4) "
                  "ON CONFLICT DO NOTHING",
    "node": """
        INSERT INTO nodes (name, gpu_flavor, gpu_product, gpu_count, gpu_memory_mib, labels, unschedulable,
                           last_sequence, lost)
        VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8, false)
        ON CONFLICT (name) DO UPDATE SET gpu_flavor = $2, gpu_product = $3, gpu_count = $4,
            gpu_memory_mib = $5, labels = $6::jsonb, unschedulable = $7, last_sequence = $8, lost = false""",
    "reservation": """
        INSERT INTO reservations (job_id, attempt, queue, flavor, gpus, borrowed, reserved_at, sequence)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (job_id, attempt) DO NOTHING""",
    "reservation_released": """
        UPDATE reservations SET released_at = $3, sequence = $4 WHERE job_id = $1 AND attempt = $2
            AND released_at IS NULL""",
    "cohort": """
        INSERT INTO cohorts (name, parent, last_sequence) VALUES ($1, $2, $3)
        ON CONFLICT (name) DO UPDATE SET parent = $2, last_sequence = $3""",
    "node_lost": "UPDATE nodes SET lost = true, last_sequence = $2 WHERE name = $1",
    # One row per (node, GPU, window); the first report of a window stands.
    "gpu_telemetry": """
        INSERT INTO gpu_telemetry (node, gpu, window_start, window_end, utilization, memory_used_mib,
                                   memory_total_mib, power_w, samples, allocated_samples, allocated_utilization,
                                   sequence)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) ON CONFLICT (node, gpu, window_start) DO NOTHING""",
    "queue": """
        INSERT INTO queues (name, cohort, config, last_sequence, deleted) VALUES ($1, $2, $3::jsonb, $4, false)
        ON CONFLICT (name) DO UPDATE SET cohort = $2, config = $3::jsonb, last_sequence = $4, deleted = false""",
    "queue_deleted": "UPDATE queues SET deleted = true, last_sequence = $2 WHERE name = $1",
    "quota_history": "INSERT INTO quota_history (queue, owner, effective_from, quotas, sequence) "
                     "VALUES ($1, $2, $3, $4::jsonb, $5) ON CONFLICT DO NOTHING",
    "price_book": """
        INSERT INTO price_books (name, effective_from, currency, gpu_prices, cpu_core_hour, memory_gib_hour,
                                 idle_quota, sequence)
        VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8) ON CONFLICT DO NOTHING""",
    "statement": """
        INSERT INTO statements (statement_id, period, group_by, checksum, first_sequence, last_sequence,
                                total_cost, body, sequence)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9) ON CONFLICT (statement_id) DO NOTHING""",
}

# Ops of these statements are applied grouped, in this phase order (log order within each
# statement). That is safe because a job's row is inserted before any update to it, every job
# change is one statement (job_update) kept in log order, and the attempt tables are keyed by
# (job, attempt) and written before the usage row that reads them. Every other statement keeps
# strict log order, consecutive runs of one statement grouped.
_PHASE = {"job_submitted": 0, "job_rejected": 1, "job_update": 2, "attempt_queued": 3, "reservation": 3,
          "checkpoint": 3, "reservation_released": 4, "usage": 5}


def _normalize(op: Op) -> tuple[str, tuple]:
    """The converter's op as (statement, arguments) of the SQL above."""
    if op.statement.startswith("set_state:"):
        names = [n for n in op.statement.split(":", 1)[1].split(",") if n]
        unknown = set(names) - _STATE_COLUMNS
        if unknown:
            raise ValueError(f"set_state: unknown columns {sorted(unknown)}")
        job_id, state, seq, *values = op.args
        given = dict(zip(names, values))
        args: list = [job_id, state, seq]
        for c, _ in _JOB_COLUMNS:
            args += [c in given, given.get(c)]
        return "job_update", tuple(args)
    if op.statement == "wait_reason":
        job_id, reason, message, seq = op.args
        given = {"reason": reason, "message": message}
        args = [job_id, None, seq]
        for c, _ in _JOB_COLUMNS:
            args += [c in given, given.get(c)]
        return "job_update", tuple(args)
    if op.statement not in _SQL:
        raise ValueError(f"no SQL for operation {op.statement!r}")
    return op.statement, op.args


def plan(ops: list[Op]) -> list[tuple[str, list[tuple]]]:
    """The batch's operations as (statement, rows) groups in the order they are executed."""
    grouped: dict[tuple[int, str], list[tuple]] = {}
    ordered: list[tuple[str, list[tuple]]] = []
    for op in ops:
        name, args = _normalize(op)
        if name in _PHASE:
            grouped.setdefault((_PHASE[name], name), []).append(args)
        elif ordered and ordered[-1][0] == name:
            ordered[-1][1].append(args)
        else:
            ordered.append((name, [args]))
    if (key := (_PHASE["job_update"], "job_update")) in grouped:
        grouped[key] = _merge_job_updates(grouped[key])
    return [(name, rows) for (_, name), rows in sorted(grouped.items())] + ordered


def _merge_job_updates(rows: list[tuple]) -> list[tuple]:
    """A job's updates in one batch folded into one (log order: the later value of each column
    wins, the latest state and sequence). Nothing in the batch reads a job's mutable columns
    between its updates (phase order), so one update per job has the same effect as several."""
    merged: dict[str, list] = {}
    for row in rows:
        current = merged.get(row[0])
        if current is None:
            merged[row[0]] = list(row)
            continue
        if row[1] is not None:
            current[1] = row[1]
        current[2] = row[2]
        for i in range(3, len(row), 2):
            if row[i]:
                current[i], current[i + 1] = True, row[i + 1]
    return [tuple(r) for r in merged.values()]


# -- large batches: COPY into a temporary staging table, then one set-based statement ------------
#
# The same effect as executemany of the statement above over the rows in order: inserts keep the
# first row per key (ORDER BY ord, ON CONFLICT DO NOTHING), a release applies the first release
# of an attempt, and job updates are already one per job. Used for groups of STAGE_MIN rows or
# more (replays, catch-up); small live batches use executemany.

STAGE_MIN = 200

_JOB_UPDATE_STAGE_COLUMNS = ["job_id", "state", "seq"] + [
    x for c, _ in _JOB_COLUMNS for x in (f"f_{c}", f"v_{c}")]

_STAGES: dict[str, tuple[str, list[str], str]] = {
    "job_submitted": (
        "job_id text, team text, project text, queue text, kind text, priority_class text, submitter text, "
        "gpus_per_node integer, gang_size integer, total_gpus integer, submitted_at timestamptz, "
        "last_sequence bigint, cpu_millis integer, memory_mib integer",
        ["job_id", "team", "project", "queue", "kind", "priority_class", "submitter", "gpus_per_node", "gang_size",
         "total_gpus", "submitted_at", "last_sequence", "cpu_millis", "memory_mib"],
        """INSERT INTO jobs (job_id, team, project, queue, kind, priority_class, submitter, gpus_per_node, gang_size,
                             total_gpus, submitted_at, last_sequence, state, cpu_millis, memory_mib)
           SELECT job_id, team, project, queue, kind, priority_class, submitter, gpus_per_node, gang_size,
                  total_gpus, submitted_at, last_sequence, 'submitted', cpu_millis, memory_mib
           FROM {stage} ORDER BY ord ON CONFLICT (job_id) DO NOTHING"""),
    "job_update": (
        "job_id text, state text, seq bigint" + "".join(f", f_{c} boolean, v_{c} {t}" for c, t in _JOB_COLUMNS),
        _JOB_UPDATE_STAGE_COLUMNS,
        "UPDATE jobs j SET state = coalesce(s.state, j.state), last_sequence = s.seq" + "".join(
            f", {c} = CASE WHEN s.f_{c} THEN s.v_{c} ELSE j.{c} END" for c, _ in _JOB_COLUMNS)
        + " FROM {stage} s WHERE j.job_id = s.job_id"),
    "attempt_queued": (
        "job_id text, attempt integer, queued_at timestamptz, sequence bigint",
        ["job_id", "attempt", "queued_at", "sequence"],
        "INSERT INTO attempts (job_id, attempt, queued_at, sequence) SELECT job_id, attempt, queued_at, sequence "
        "FROM {stage} ORDER BY ord ON CONFLICT DO NOTHING"),
    "checkpoint": (
        "job_id text, attempt integer, checkpointed_at timestamptz, sequence bigint",
        ["job_id", "attempt", "checkpointed_at", "sequence"],
        "INSERT INTO checkpoints (job_id, attempt, checkpointed_at, sequence) SELECT job_id, attempt, "
        "checkpointed_at, sequence FROM {stage} ORDER BY ord ON CONFLICT DO NOTHING"),
    "reservation": (
        "job_id text, attempt integer, queue text, flavor text, gpus integer, borrowed integer, "
        "reserved_at timestamptz, sequence bigint",
        ["job_id", "attempt", "queue", "flavor", "gpus", "borrowed", "reserved_at", "sequence"],
        "INSERT INTO reservations (job_id, attempt, queue, flavor, gpus, borrowed, reserved_at, sequence) "
        "SELECT job_id, attempt, queue, flavor, gpus, borrowed, reserved_at, sequence FROM {stage} "
        "ORDER BY ord ON CONFLICT (job_id, attempt) DO NOTHING"),
    "reservation_released": (
        "job_id text, attempt integer, released_at timestamptz, sequence bigint",
        ["job_id", "attempt", "released_at", "sequence"],
        """UPDATE reservations r SET released_at = s.released_at, sequence = s.sequence
           FROM (SELECT DISTINCT ON (job_id, attempt) * FROM {stage} ORDER BY job_id, attempt, ord) s
           WHERE r.job_id = s.job_id AND r.attempt = s.attempt AND r.released_at IS NULL"""),
    "usage": (
        "job_id text, attempt integer, started_at timestamptz, ended_at timestamptz, seconds float8, "
        "outcome text, sequence bigint",
        ["job_id", "attempt", "started_at", "ended_at", "seconds", "outcome", "sequence"],
        """INSERT INTO usage_ledger (job_id, attempt, team, project, queue, flavor, gpus, started_at, ended_at,
                                     gpu_seconds, outcome, sequence, borrowed_gpus, borrowed_gpu_seconds,
                                     lost_gpu_seconds, last_checkpoint_at, queued_at, wait_seconds,
                                     cpu_core_seconds, memory_gib_seconds)
           SELECT j.job_id, s.attempt, j.team, j.project, coalesce(r.queue, j.queue), coalesce(r.flavor, j.flavor),
                  coalesce(r.gpus, j.total_gpus), s.started_at, s.ended_at,
                  coalesce(r.gpus, j.total_gpus) * s.seconds, s.outcome, s.sequence,
                  coalesce(r.borrowed, 0), coalesce(r.borrowed, 0) * s.seconds,
                  CASE WHEN s.outcome = 'JobPreempted' THEN coalesce(r.gpus, j.total_gpus)
                       * greatest(0, extract(epoch FROM s.ended_at - greatest(s.started_at, c.at)))::float8
                       ELSE 0 END,
                  c.at, a.queued_at,
                  CASE WHEN a.queued_at IS NULL THEN NULL
                       ELSE greatest(0, extract(epoch FROM s.started_at - a.queued_at))::float8 END,
                  coalesce(j.cpu_millis, 0) / 1000.0 * s.seconds, coalesce(j.memory_mib, 0) / 1024.0 * s.seconds
           FROM {stage} s
           JOIN jobs j ON j.job_id = s.job_id
           LEFT JOIN reservations r ON r.job_id = s.job_id AND r.attempt = s.attempt
           LEFT JOIN attempts a ON a.job_id = s.job_id AND a.attempt = s.attempt
           LEFT JOIN LATERAL (SELECT max(checkpointed_at) AS at FROM checkpoints k
                              WHERE k.job_id = s.job_id AND k.attempt = s.attempt AND k.sequence < s.sequence
                                AND k.checkpointed_at <= s.ended_at) c ON true
           WHERE coalesce(r.flavor, j.flavor) IS NOT NULL
           ORDER BY s.ord
           ON CONFLICT (job_id, attempt) DO NOTHING"""),
}


_staged: "weakref.WeakKeyDictionary[asyncpg.Connection, set[str]]" = weakref.WeakKeyDictionary()


async def _execute(conn: asyncpg.Connection, name: str, rows: list[tuple]) -> None:
    stage = _STAGES.get(name)
    if stage is None or len(rows) < STAGE_MIN:
        await conn.executemany(_SQL[name], rows)
        return
    columns_sql, columns, apply_sql = stage
    table = f"stage_{name}"
    created = _staged.setdefault(conn, set())
    if table not in created:  # temporary tables live as long as the session
        await conn.execute(f"CREATE TEMP TABLE IF NOT EXISTS {table} (ord integer, {columns_sql}) "
                           "ON COMMIT DELETE ROWS")
        created.add(table)
    await conn.copy_records_to_table(table, records=[(i, *r) for i, r in enumerate(rows)],
                                     columns=["ord", *columns], schema_name="pg_temp")
    # statistics for the planner: without them it assumes a large stage and scans whole tables
    await conn.execute(f"ANALYZE pg_temp.{table}")
    await conn.execute(apply_sql.format(stage=f"pg_temp.{table}"))  # emptied at commit (or rollback)


async def migrate(conn: asyncpg.Connection) -> list[str]:
    """Apply the numbered SQL files not applied yet; safe when several replicas start at once."""
    applied: list[str] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        files = sorted(
            (f for f in resources.files("services.accounting.migrations").iterdir() if f.name.endswith(".sql")),
            key=lambda f: f.name,
        )
        for f in files:
            version = f.name.removesuffix(".sql")
            if version in done:
                continue
            await conn.execute(f.read_text())
            await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
            applied.append(version)
    if applied:
        log.info("applied migrations", extra={"versions": applied})
    return applied


async def position(conn: asyncpg.Connection, projection: str = PROJECTION) -> int:
    value = await conn.fetchval("SELECT last_sequence FROM projection_position WHERE projection = $1", projection)
    return value or 0


Entry = tuple[int, list[Op]] | tuple[int, str | None, list[Op]]
"""(sequence, ops) or (sequence, event id, ops); an entry without an id is not de-duplicated by id."""


async def apply_batch(conn: asyncpg.Connection, batch: list[Entry], projection: str = PROJECTION) -> int:
    """Apply the operations of every event newer than the stored position and not applied
    before (by event id), then store the new position, all in one transaction. Returns how many
    events were applied."""
    if not batch:
        return 0
    try:
        return await _apply_batch(conn, batch, projection)
    except BaseException:
        _staged.pop(conn, None)  # temporary tables created in the rolled-back transaction are gone
        raise


async def _apply_batch(conn: asyncpg.Connection, batch: list[Entry], projection: str) -> int:
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO projection_position (projection, last_sequence) VALUES ($1, 0) ON CONFLICT DO NOTHING",
            projection,
        )
        current = await conn.fetchval(
            "SELECT last_sequence FROM projection_position WHERE projection = $1 FOR UPDATE", projection
        )
        fresh = [(e[0], e[1] if len(e) == 3 else None, e[-1]) for e in batch if e[0] > current]
        ids = [event_id for _, event_id, _ in fresh if event_id is not None]
        seen = set()
        if ids:
            seen = {r[0] for r in await conn.fetch(
                "SELECT event_id FROM applied_events WHERE event_id = ANY($1::text[])", ids)}
        applied = 0
        high = current
        ops: list[Op] = []
        new_ids: list[tuple[str, int]] = []
        for seq, event_id, event_ops in fresh:
            high = max(high, seq)
            if event_id is not None:
                if event_id in seen:
                    continue  # the same event appended again: no effect
                seen.add(event_id)
                new_ids.append((event_id, seq))
            ops.extend(event_ops)
            applied += 1
        for name, rows in plan(ops):
            await _execute(conn, name, rows)
        if new_ids:
            await conn.copy_records_to_table("applied_events", records=new_ids, columns=["event_id", "sequence"])
        if high > current:
            await conn.execute(
                "UPDATE projection_position SET last_sequence = $2, updated_at = now() WHERE projection = $1",
                projection, high,
            )
    return applied
