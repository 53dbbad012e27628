"""Large groups of rows (``STAGE_MIN`` or more: replays, catch-up; small live batches use
executemany) go by COPY, with the same effect as executing the group's statement
(:data:`services.accounting.sql.SQL`) over its rows in order:

* new rows of the insert-only tables (``INSERT … ON CONFLICT DO NOTHING`` on the primary key)
  go straight into the table: the first row of each key, less the keys the table already has
  (one probe by job id, through the primary key's index). That is safe because every batch
  holds the lock on the position row until it commits, so nothing else writes meanwhile;
* job updates (one per job already) and releases (the first of an attempt applies) go into a
  temporary staging table, then one set-based statement.
"""

from __future__ import annotations

import weakref

import asyncpg

from services.accounting.ledger import USAGE_COLUMNS
from services.accounting.sql import JOB_COLUMNS, JOB_INSERT_COLUMNS, SQL

STAGE_MIN = 200

_JOB_UPDATE_STAGE_COLUMNS = ["job_id", "state", "seq"] + [x for c, _ in JOB_COLUMNS for x in (f"f_{c}", f"v_{c}")]

# statement: (the staging table's columns, their names, the set-based statement over {stage})
_STAGES: dict[str, tuple[str, list[str], str]] = {
    "job_update": (
        "job_id text, state text, seq bigint" + "".join(f", f_{c} boolean, v_{c} {t}" for c, t in JOB_COLUMNS),
        _JOB_UPDATE_STAGE_COLUMNS,
        "UPDATE jobs j SET state = coalesce(s.state, j.state), last_sequence = s.seq" + "".join(
            f", {c} = CASE WHEN s.f_{c} THEN s.v_{c} ELSE j.{c} END" for c, _ in JOB_COLUMNS)
        + " FROM {stage} s WHERE j.job_id = s.job_id"),
    "reservation_released": (
        "job_id text, attempt integer, released_at timestamptz, sequence bigint",
        ["job_id", "attempt", "released_at", "sequence"],
        """UPDATE reservations r SET released_at = s.released_at, sequence = s.sequence
           FROM (SELECT DISTINCT ON (job_id, attempt) * FROM {stage} ORDER BY job_id, attempt, ord) s
           WHERE r.job_id = s.job_id AND r.attempt = s.attempt AND r.released_at IS NULL"""),
}

# statement: (table, columns of a row, positions of the primary key's columns in a row)
_DIRECT: dict[str, tuple[str, tuple[str, ...], tuple[int, ...]]] = {
    "job_submitted": ("jobs", JOB_INSERT_COLUMNS, (0,)),
    "attempt_queued": ("attempts", ("job_id", "attempt", "queued_at", "sequence"), (0, 1)),
    "checkpoint": ("checkpoints", ("job_id", "attempt", "checkpointed_at", "sequence"), (0, 1, 3)),
    "reservation": ("reservations", ("job_id", "attempt", "queue", "flavor", "gpus", "borrowed", "gpu_milli",
                                     "borrowed_milli", "reserved_at", "sequence", "released_at"), (0, 1)),
    "usage": ("usage_ledger", USAGE_COLUMNS, (0, 1)),
}

_staged: "weakref.WeakKeyDictionary[asyncpg.Connection, set[str]]" = weakref.WeakKeyDictionary()


async def execute(conn: asyncpg.Connection, name: str, rows: list[tuple]) -> None:
    """Execute statement ``name`` over ``rows`` (in a transaction), by COPY when the group is large."""
    if len(rows) >= STAGE_MIN and name in _DIRECT:
        await _copy_new(conn, name, rows)
    elif len(rows) >= STAGE_MIN and name in _STAGES:
        await _staged_apply(conn, name, rows)
    else:
        await conn.executemany(SQL[name], rows)


def forget(conn: asyncpg.Connection) -> None:
    """The transaction failed: temporary tables it created are gone with it."""
    _staged.pop(conn, None)


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


async def _staged_apply(conn: asyncpg.Connection, name: str, rows: list[tuple]) -> None:
    columns_sql, columns, apply_sql = _STAGES[name]
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
