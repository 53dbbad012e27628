"""Compare two targets (live and a shadow) table by table: row counts and a checksum (md5 over
the sorted md5 of every row, leaving out the columns that record when a row was written); the
positions as the range of the sequences they hold (one row, or one per accounting partition)."""

from __future__ import annotations

import asyncpg

from services.accounting import sink
from services.accounting.target import TABLES, q

# Columns that record when a row was written, not what the log says: left out of checksums.
_VOLATILE = {"schema_migrations": ("applied_at",)}


async def table_checksums(conn: asyncpg.Connection, schema: str) -> dict[str, tuple[int, str]]:
    """table -> (rows, md5 over the sorted md5 of each row's text)."""
    out = {}
    for table in TABLES:
        exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{q(schema)}.{table}")
        if not exists:
            out[table] = (0, "missing")
            continue
        if table == "projection_position":
            # what the read models hold: every event up to the lowest position and none past the
            # highest (one row, or one per accounting partition: services/accounting/partition.py)
            low, high = await conn.fetchrow(
                f"SELECT min(last_sequence), max(last_sequence) FROM {q(schema)}.projection_position "
                f"WHERE {sink.PARTITION_ROWS}")
            out[table] = (1, f"read-models {low}..{high}")
            continue
        cols = [r["attname"] for r in await conn.fetch(
            "SELECT attname FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped "
            "ORDER BY attname", f"{q(schema)}.{table}")]
        cols = [c for c in cols if c not in _VOLATILE.get(table, ())]
        row = ", ".join(f't."{c}"' for c in cols)
        n, digest = await conn.fetchrow(
            f"SELECT count(*), coalesce(md5(string_agg(h, '' ORDER BY h)), '') FROM "
            f"(SELECT md5(ROW({row})::text) AS h FROM {q(schema)}.{table} t) s")
        out[table] = (n, digest)
    return out


async def compare(dsn: str, shadow: str, live: str = "public") -> list[dict]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            a = await table_checksums(conn, live)
            b = await table_checksums(conn, shadow)
    finally:
        await conn.close()
    return [{"table": t, "live_rows": a[t][0], "shadow_rows": b[t][0], "live_checksum": a[t][1][:12],
             "shadow_checksum": b[t][1][:12], "equal": a[t] == b[t]} for t in TABLES]
