"""The idempotent sink: applies a batch of operations and the stream position in one
transaction, skipping what the read models already contain. Killed mid-batch, it commits all of
the batch or none of it; redelivered, it skips what it has.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Container
from dataclasses import dataclass
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

# The columns of a new job row: the spec's (from JobSubmitted), then the state and the columns
# job updates set, so that a job submitted and changed in one batch is written once.
_JOB_SPEC_COLUMNS = ("job_id", "team", "project", "queue", "kind", "priority_class", "submitter", "gpus_per_node",
                     "gang_size", "total_gpus", "submitted_at", "last_sequence", "cpu_millis", "memory_mib")
_JOB_INSERT_COLUMNS = (*_JOB_SPEC_COLUMNS, "state", *(c for c, _ in _JOB_COLUMNS))
_JOB_DEFAULTS = tuple(1 if c == "attempt" else None for c, _ in _JOB_COLUMNS)  # the table's defaults
_JOB_LAST_SEQUENCE = _JOB_SPEC_COLUMNS.index("last_sequence")

_SQL = {
    # A new job row, with the state its later changes in the same batch give it (see _fold).
    "job_submitted": "INSERT INTO jobs (" + ", ".join(_JOB_INSERT_COLUMNS) + ") VALUES ("
                     + ", ".join(f"${i + 1}" for i in range(len(_JOB_INSERT_COLUMNS))) + ") ON CONFLICT (job_id) DO NOTHING",
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
        INSERT INTO reservations (job_id, attempt, queue, flavor, gpus, borrowed, reserved_at, sequence, released_at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (job_id, attempt) DO NOTHING""",
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


def _update_layout(statement: str) -> tuple[int, ...]:
    """For ``set_state:a,b``: where in a job_update row the op's values go (each column is a
    flag, then its value; the flag is at the position returned)."""
    names = [n for n in statement.split(":", 1)[1].split(",") if n]
    if unknown := set(names) - _STATE_COLUMNS:
        raise ValueError(f"set_state: unknown columns {sorted(unknown)}")
    index = {c: i for i, (c, _) in enumerate(_JOB_COLUMNS)}
    return tuple(3 + 2 * index[n] for n in names)


_NO_CHANGE = (False, None) * len(_JOB_COLUMNS)
_WAIT_REASON = _update_layout("set_state:reason,message")
_layouts: dict[str, tuple[int, ...]] = {}  # set_state statement -> its layout (a handful of call sites)


def _normalize(op: Op) -> tuple[str, tuple]:
    """The converter's op (other than a job's change: see plan) as (statement, arguments) of
    the SQL above."""
    statement, args = op
    if statement == "job_submitted":
        return "job_submitted", (*args, "submitted", *_JOB_DEFAULTS)
    if statement == "reservation":
        return "reservation", (*args, None)  # not released
    if statement not in _SQL or statement == "job_update":
        raise ValueError(f"no SQL for operation {statement!r}")
    return statement, args


def plan(ops: list[Op]) -> list[tuple[str, list[tuple]]]:
    """The batch's operations as (statement, rows) groups in the order they are executed.

    A job's changes (``set_state:…`` and ``wait_reason``) fold into one job_update row per job
    as they come, in log order: the later value of each column wins, the latest state and
    sequence. Nothing in a batch reads a job's mutable columns between its updates (phase
    order), so one update per job has the same effect as several. This loop runs for every op
    of a replay, so the fold is written out here rather than called."""
    grouped: dict[tuple[int, str], list[tuple]] = {}
    ordered: list[tuple[str, list[tuple]]] = []
    updates: dict[str, list] = {}
    layouts = _layouts
    for op in ops:
        statement, args = op
        layout = layouts.get(statement)
        if layout is None and statement.startswith("set_state:"):
            layout = layouts[statement] = _update_layout(statement)
        if layout is not None:  # (job, state, seq, *values)
            job_id, state, seq, values = args[0], args[1], args[2], args[3:]
        elif statement == "wait_reason":  # (job, reason, message, seq)
            job_id, state, seq, values, layout = args[0], None, args[3], args[1:3], _WAIT_REASON
        else:
            name, args = _normalize(op)
            if name in _PHASE:
                grouped.setdefault((_PHASE[name], name), []).append(args)
            elif ordered and ordered[-1][0] == name:
                ordered[-1][1].append(args)
            else:
                ordered.append((name, [args]))
            continue
        if len(values) != len(layout):
            raise ValueError(f"{statement}: {len(layout)} values expected, got {len(values)}")
        row = updates.get(job_id)
        if row is None:
            updates[job_id] = row = [job_id, state, seq, *_NO_CHANGE]
        else:
            if state is not None:
                row[1] = state
            row[2] = seq
        for pos, value in zip(layout, values):
            row[pos] = True
            row[pos + 1] = value
    if updates:
        grouped[(_PHASE["job_update"], "job_update")] = [tuple(r) for r in updates.values()]
    return [(name, rows) for (_, name), rows in sorted(grouped.items())] + ordered


async def _fold(conn: asyncpg.Connection, groups: list[tuple[str, list[tuple]]]) -> list[tuple[str, list[tuple]]]:
    """Rows the batch inserts and then changes, inserted changed: a job submitted and updated in
    the batch is one insert with its final state (not an insert and an update: a second version
    of the row and of each of its index entries), a reservation reserved and released in it is
    one insert with its release. Only for rows that do not exist yet (one indexed probe): the
    change to a row that exists stays an update. The same effect as the phases, applied in order."""
    groups = [(name, list(rows)) for name, rows in groups]
    by_name = {name: rows for name, rows in groups if name in _PHASE}  # one group per phased statement
    subs, updates = by_name.get("job_submitted"), by_name.get("job_update")
    if subs and updates:
        rejected = {r[0] for r in by_name.get("job_rejected", ())}
        update_of = {r[0]: r for r in updates}  # merged: one per job
        first: dict[str, int] = {}
        for i, r in enumerate(subs):
            if r[0] in update_of and r[0] not in rejected:
                first.setdefault(r[0], i)
        if first:
            exists = {r[0] for r in await conn.fetch("SELECT job_id FROM jobs WHERE job_id = ANY($1::text[])",
                                                     list(first))}
            spec, folded = len(_JOB_SPEC_COLUMNS), set()
            for job_id, i in first.items():
                if job_id in exists:
                    continue
                row, upd = list(subs[i]), update_of[job_id]
                if upd[1] is not None:
                    row[spec] = upd[1]
                row[_JOB_LAST_SEQUENCE] = upd[2]  # the latest change's
                for k in range(len(_JOB_COLUMNS)):
                    if upd[3 + 2 * k]:
                        row[spec + 1 + k] = upd[4 + 2 * k]
                subs[i] = tuple(row)
                folded.add(job_id)
            updates[:] = [r for r in updates if r[0] not in folded]
    reservations, releases = by_name.get("reservation"), by_name.get("reservation_released")
    if reservations and releases:
        release_of: dict[tuple, tuple] = {}
        for r in releases:
            release_of.setdefault((r[0], r[1]), r)  # the first release of an attempt is the one applied
        first = {}
        for i, r in enumerate(reservations):
            if (r[0], r[1]) in release_of:
                first.setdefault((r[0], r[1]), i)
        if first:
            keys = list(first)
            exists = {(r[0], r[1]) for r in await conn.fetch(
                "SELECT job_id, attempt FROM reservations WHERE (job_id, attempt) IN "
                "(SELECT * FROM unnest($1::text[], $2::integer[]))", [k[0] for k in keys], [k[1] for k in keys])}
            folded = set()
            for key, i in first.items():
                if key in exists:
                    continue
                _, _, released_at, seq = release_of[key]
                # (job, attempt, queue, flavor, gpus, borrowed, reserved_at) + the release's sequence and time
                reservations[i] = (*reservations[i][:7], seq, released_at)
                folded.add(key)
            releases[:] = [r for r in releases if (r[0], r[1]) not in folded]
    return [(name, rows) for name, rows in groups if rows]


# -- large batches: COPY ---------------------------------------------------------------------------
#
# Groups of STAGE_MIN rows or more (replays, catch-up; small live batches use executemany) go by
# COPY: the inserts of new rows straight into their table (_DIRECT, below), the rest into a
# temporary staging table, then one set-based statement. The same effect as executemany of the
# statement above over the rows in order: the usage insert keeps the first row per key (ORDER BY
# ord, ON CONFLICT DO NOTHING), a release applies the first release of an attempt, and job
# updates are already one per job.

STAGE_MIN = 200

_JOB_UPDATE_STAGE_COLUMNS = ["job_id", "state", "seq"] + [
    x for c, _ in _JOB_COLUMNS for x in (f"f_{c}", f"v_{c}")]

_STAGES: dict[str, tuple[str, list[str], str]] = {
    "job_update": (
        "job_id text, state text, seq bigint" + "".join(f", f_{c} boolean, v_{c} {t}" for c, t in _JOB_COLUMNS),
        _JOB_UPDATE_STAGE_COLUMNS,
        "UPDATE jobs j SET state = coalesce(s.state, j.state), last_sequence = s.seq" + "".join(
            f", {c} = CASE WHEN s.f_{c} THEN s.v_{c} ELSE j.{c} END" for c, _ in _JOB_COLUMNS)
        + " FROM {stage} s WHERE j.job_id = s.job_id"),
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


# Insert-only statements (ON CONFLICT DO NOTHING on the table's primary key): their large groups
# go straight into the table by COPY, without a staging table's second copy of every row. The
# rows are the first per key, less the keys the table has (one probe by the key's first column,
# job_id, through the primary key's index). The same effect as the INSERT over the rows in
# order: nothing else writes a read model meanwhile, since every batch holds the lock on the
# position row (_apply_batch) until it commits.
_DIRECT: dict[str, tuple[str, tuple[str, ...], tuple[int, ...]]] = {
    # statement: (table, columns of a row, positions of the primary key's columns in a row)
    "job_submitted": ("jobs", _JOB_INSERT_COLUMNS, (0,)),
    "attempt_queued": ("attempts", ("job_id", "attempt", "queued_at", "sequence"), (0, 1)),
    "checkpoint": ("checkpoints", ("job_id", "attempt", "checkpointed_at", "sequence"), (0, 1, 3)),
    "reservation": ("reservations", ("job_id", "attempt", "queue", "flavor", "gpus", "borrowed", "reserved_at",
                                     "sequence", "released_at"), (0, 1)),
}


async def _copy_new(conn: asyncpg.Connection, name: str, rows: list[tuple]) -> None:
    table, columns, key = _DIRECT[name]
    first: dict[tuple, tuple] = {}
    for row in rows:
        first.setdefault(tuple(row[i] for i in key), row)  # the first row per key wins
    existing = await conn.fetch(
        f"SELECT {', '.join(columns[i] for i in key)} FROM {table} WHERE job_id = ANY($1::text[])",
        list({k[0] for k in first}))
    for r in existing:
        first.pop(tuple(r), None)
    if first:
        await conn.copy_records_to_table(table, records=list(first.values()), columns=list(columns))


_staged: "weakref.WeakKeyDictionary[asyncpg.Connection, set[str]]" = weakref.WeakKeyDictionary()


async def _execute(conn: asyncpg.Connection, name: str, rows: list[tuple]) -> None:
    if name in _DIRECT and len(rows) >= STAGE_MIN:
        await _copy_new(conn, name, rows)
        return
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


@dataclass(frozen=True)
class Prepared:
    """What applying a batch takes that needs no database, worked out ahead (a replay's writer
    does it while an earlier batch is being written): the batch's event ids at their first
    sequence in it, and the plan of every event in it but the copies of an id earlier in the
    batch. Valid as long as the target has none of the batch yet (its position is below the
    batch, and no id in it was applied before); :func:`apply_batch` checks, and works it out
    again for what is left when not."""

    entries: list[tuple[int, str | None, list[Op]]]
    first: dict[str, int]  # event id -> its first sequence in the batch
    groups: list[tuple[str, list[tuple]]]
    applied: int  # events planned
    low: int  # the batch's lowest and highest sequence (0 if empty)
    high: int


def prepare(batch: list[Entry], skip: frozenset[str] | set[str] = frozenset()) -> Prepared:
    """The batch's plan, less the events whose id is in ``skip`` (applied by an earlier batch)."""
    entries = [(e[0], e[1] if len(e) == 3 else None, e[-1]) for e in batch]
    first: dict[str, int] = {}
    for seq, event_id, _ in entries:
        if event_id is not None and event_id not in first:
            first[event_id] = seq
    ops: list[Op] = []
    applied = 0
    for seq, event_id, event_ops in entries:
        if event_id is not None and (event_id in skip or first[event_id] != seq):
            continue  # the same event appended again: no effect
        ops += event_ops
        applied += 1
    seqs = [e[0] for e in entries]
    return Prepared(entries, first, plan(ops), applied, min(seqs, default=0), max(seqs, default=0))


async def apply_batch(conn: asyncpg.Connection, batch: list[Entry] | Prepared, projection: str = PROJECTION, *,
                      maybe_applied: Container[str] | None = None) -> int:
    """Apply the operations of every event newer than the stored position and not applied
    before (by event id), then store the new position, all in one transaction. Returns how many
    events were applied. ``batch``: entries, or entries prepared (:func:`prepare`).
    ``maybe_applied``: see :func:`_record_applied`."""
    prepared = batch if isinstance(batch, Prepared) else prepare(batch)
    if not prepared.entries:
        return 0
    try:
        return await _apply_batch(conn, prepared, projection, maybe_applied)
    except BaseException:
        _staged.pop(conn, None)  # temporary tables created in the rolled-back transaction are gone
        raise


async def _record_applied(conn: asyncpg.Connection, prepared: Prepared,
                          maybe_applied: Container[str] | None = None) -> set[str]:
    """Record the batch's event ids (at their first sequence in it) and return those an earlier
    batch applied. ``maybe_applied``: ids that may have been applied to this target before,
    at least every one that was (for a replay into a fresh shadow: what its Bloom filter of the
    ids applied so far lets through); an id not in it needs no lookup. None: every id is
    looked up."""
    if not prepared.first:
        return set()
    if maybe_applied is None:
        maybe = list(prepared.first)
    else:
        maybe = [event_id for event_id in prepared.first if event_id in maybe_applied]
    earlier: set[str] = set()
    if maybe:  # by the key Postgres derives from the id (migration 008): the primary key's index
        earlier = {r[0] for r in await conn.fetch(
            "SELECT event_id FROM applied_events WHERE event_key = ANY(SELECT md5(i)::uuid FROM unnest($1::text[]) i)",
            maybe)}
    records = list(prepared.first.items())  # (id, its first sequence in the batch)
    if earlier:
        records = [r for r in records if r[0] not in earlier]
    await conn.copy_records_to_table("applied_events", records=records, columns=["event_id", "sequence"])
    return earlier


async def _apply_batch(conn: asyncpg.Connection, prepared: Prepared, projection: str,
                       maybe_applied: Container[str] | None) -> int:
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO projection_position (projection, last_sequence) VALUES ($1, 0) ON CONFLICT DO NOTHING",
            projection,
        )
        current = await conn.fetchval(
            "SELECT last_sequence FROM projection_position WHERE projection = $1 FOR UPDATE", projection
        )
        if prepared.low <= current:  # some of it is applied already (a redelivery): plan what is left
            prepared = prepare([e for e in prepared.entries if e[0] > current])
        high = max(prepared.high, current)
        earlier = await _record_applied(conn, prepared, maybe_applied)  # ids applied by an earlier batch
        if earlier:
            prepared = prepare(prepared.entries, skip=earlier)
        for name, rows in await _fold(conn, prepared.groups):
            await _execute(conn, name, rows)
        if high > current:
            await conn.execute(
                "UPDATE projection_position SET last_sequence = $2, updated_at = now() WHERE projection = $1",
                projection, high,
            )
    return prepared.applied
