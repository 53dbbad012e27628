"""The idempotent sink: applies a batch of operations and the stream position in one
transaction, skipping what the read models already contain. Killed mid-batch, it commits all of
the batch or none of it; redelivered, it skips what it has.
"""

from __future__ import annotations

import logging
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

_SQL = {
    "job_submitted": """
        INSERT INTO jobs (job_id, team, project, queue, kind, priority_class, submitter, gpus_per_node,
                          gang_size, total_gpus, submitted_at, last_sequence, state)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, 'submitted')
        ON CONFLICT (job_id) DO NOTHING""",
    "job_rejected": """
        INSERT INTO jobs (job_id, state, reason, message, finished_at, last_sequence)
        VALUES ($1, 'rejected', $2, $3, $4, $5)
        ON CONFLICT (job_id) DO UPDATE SET state = 'rejected', reason = $2, message = $3,
            finished_at = $4, last_sequence = $5""",
    "usage": """
        INSERT INTO usage_ledger (job_id, attempt, team, project, queue, flavor, gpus, started_at, ended_at,
                                  gpu_seconds, outcome, sequence)
        SELECT job_id, $2, team, project, queue, flavor, total_gpus, $3, $4, total_gpus * $5::float8, $6, $7
        FROM jobs WHERE job_id = $1 AND flavor IS NOT NULL
        ON CONFLICT (job_id, attempt) DO NOTHING""",
    "node": """
        INSERT INTO nodes (name, gpu_flavor, gpu_product, gpu_count, gpu_memory_mib, labels, unschedulable,
                           last_sequence, lost)
        VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8, false)
        ON CONFLICT (name) DO UPDATE SET gpu_flavor = $2, gpu_product = $3, gpu_count = $4,
            gpu_memory_mib = $5, labels = $6::jsonb, unschedulable = $7, last_sequence = $8, lost = false""",
    "wait_reason": "UPDATE jobs SET reason = $2, message = $3, last_sequence = $4 WHERE job_id = $1",
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
    "queue": """
        INSERT INTO queues (name, cohort, config, last_sequence, deleted) VALUES ($1, $2, $3::jsonb, $4, false)
        ON CONFLICT (name) DO UPDATE SET cohort = $2, config = $3::jsonb, last_sequence = $4, deleted = false""",
    "queue_deleted": "UPDATE queues SET deleted = true, last_sequence = $2 WHERE name = $1",
}


def _sql(statement: str) -> str:
    if statement.startswith("set_state:"):
        names = [n for n in statement.split(":", 1)[1].split(",") if n]
        unknown = set(names) - _STATE_COLUMNS
        if unknown:
            raise ValueError(f"set_state: unknown columns {sorted(unknown)}")
        sets = "".join(f", {n} = ${i}" for i, n in enumerate(names, start=4))
        return f"UPDATE jobs SET state = $2, last_sequence = $3{sets} WHERE job_id = $1"
    return _SQL[statement]


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


async def apply_batch(conn: asyncpg.Connection, batch: list[tuple[int, list[Op]]], projection: str = PROJECTION) -> int:
    """Apply the operations of every event newer than the stored position, then store the new
    position, all in one transaction. Returns how many events were applied."""
    if not batch:
        return 0
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO projection_position (projection, last_sequence) VALUES ($1, 0) ON CONFLICT DO NOTHING",
            projection,
        )
        current = await conn.fetchval(
            "SELECT last_sequence FROM projection_position WHERE projection = $1 FOR UPDATE", projection
        )
        applied = 0
        high = current
        for seq, ops in batch:
            if seq <= current:
                continue
            for op in ops:
                await conn.execute(_sql(op.statement), *op.args)
            applied += 1
            high = max(high, seq)
        if high > current:
            await conn.execute(
                "UPDATE projection_position SET last_sequence = $2, updated_at = now() WHERE projection = $1",
                projection, high,
            )
    return applied
