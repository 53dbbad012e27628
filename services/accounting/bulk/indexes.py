"""Indexes after the load: a fresh shadow's secondary indexes (and ``applied_events``' key) are
dropped before a rebuild loads it and built once at the end, sorted, instead of being updated
row by row; autovacuum is off for the shadow meanwhile, and its tables are analyzed after."""

from __future__ import annotations

import asyncio

from services.accounting.target import TABLES, connect, q


async def defer_indexes(dsn: str, schema: str) -> list[str]:
    """Bulk-load practice for a fresh shadow: drop its secondary indexes (not primary keys or
    unique ones: the sink's conflict checks and joins use those) and remember their definitions
    in the shadow, so that :func:`build_indexes` builds each once, sorted, instead of the
    load inserting into it row by row. Returns the indexes deferred."""
    conn = await connect(dsn, schema)
    try:
        async with conn.transaction():
            rows = await conn.fetch(
                "SELECT c.relname, pg_get_indexdef(i.indexrelid) AS ddl FROM pg_index i "
                "JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = $1 AND NOT i.indisprimary AND NOT i.indisunique ORDER BY c.relname", schema)
            await conn.execute("CREATE TABLE IF NOT EXISTS deferred_indexes (name text PRIMARY KEY, ddl text NOT NULL)")
            for table in TABLES:  # nothing to vacuum in a table being loaded; build_indexes analyzes it
                await conn.execute(f"ALTER TABLE {q(schema)}.{table} SET (autovacuum_enabled = off)")
            for r in rows:
                await conn.execute("INSERT INTO deferred_indexes VALUES ($1, $2) ON CONFLICT DO NOTHING", r["relname"],
                                   r["ddl"])
                await conn.execute(f"DROP INDEX {q(schema)}.{q(r['relname'])}")
            # applied_events' key: random (a digest), one entry per event, used by no conflict
            # check or join, only by lookups of ids the writer's filter cannot rule out.
            key = await conn.fetchrow(
                "SELECT conname, pg_get_constraintdef(oid) AS ddl FROM pg_constraint "
                "WHERE conrelid = $1::regclass AND contype = 'p'", f"{q(schema)}.applied_events")
            await conn.execute("INSERT INTO deferred_indexes VALUES ($1, $2)", key["conname"],
                               f"ALTER TABLE {q(schema)}.applied_events ADD CONSTRAINT {q(key['conname'])} {key['ddl']}")
            await conn.execute(f"ALTER TABLE {q(schema)}.applied_events DROP CONSTRAINT {q(key['conname'])}")
    finally:
        await conn.close()
    return [r["relname"] for r in rows] + [key["conname"]]


INDEX_BUILDERS = 2
"""Sessions that build a shadow's deferred indexes and analyze its tables at once: each build
and each ANALYZE keeps one core busy, and a rebuild's last seconds are spent there."""


async def build_indexes(dsn: str, schema: str, *, sessions: int = INDEX_BUILDERS) -> list[str]:
    """Build the indexes :func:`defer_indexes` dropped (none if there are none), then analyze
    the tables, on ``sessions`` connections at once; a shadow is swapped in only with all its
    indexes. Each index is built in a transaction that also strikes it off ``deferred_indexes``,
    so a build that fails part way resumes with what is left; the last one drops the list and
    turns autovacuum back on."""
    conn = await connect(dsn, schema)
    try:
        if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{q(schema)}.deferred_indexes"):
            return []
        rows = await conn.fetch("SELECT name, ddl FROM deferred_indexes ORDER BY name")
        # applied_events' key (one entry per event) is the longest build: it goes first.
        rows = sorted(rows, key=lambda r: not r["ddl"].startswith("ALTER TABLE"))
        # One iterator for all sessions: each statement is taken by one. The ANALYZEs (statistics
        # for the load) come after the builds: one waits for a build on its table anyway.
        work = iter([(r["name"], r["ddl"]) for r in rows] + [(None, f"ANALYZE {q(schema)}.{t}") for t in TABLES])

        async def builder() -> None:
            session = await connect(dsn, schema)
            try:
                await session.execute("SET maintenance_work_mem = '256MB'")
                for name, sql in work:
                    async with session.transaction():
                        await session.execute(sql)
                        if name is not None:
                            await session.execute("DELETE FROM deferred_indexes WHERE name = $1", name)
            finally:
                await session.close()

        builders = [asyncio.create_task(builder()) for _ in range(max(1, sessions))]
        try:
            await asyncio.gather(*builders)
        except BaseException:  # a failed build stops the others; the list keeps what is left
            for task in builders:
                task.cancel()
            await asyncio.gather(*builders, return_exceptions=True)
            raise
        async with conn.transaction():
            await conn.execute("DROP TABLE deferred_indexes")
            for table in TABLES:
                await conn.execute(f"ALTER TABLE {q(schema)}.{table} RESET (autovacuum_enabled)")
    finally:
        await conn.close()
    return [r["name"] for r in rows]
