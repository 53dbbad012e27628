"""A replay's target: a Postgres schema of the read-model database holding the read models'
tables (the migrations applied), with its own ``projection_position``. ``public`` is live;
any other is a shadow."""

from __future__ import annotations

import re

import asyncpg

from services.accounting import sink

PROJECTIONS = ("read-models",)
"""The projections accounting keeps (one today: every table below shares its position)."""

TABLES = ("jobs", "usage_ledger", "reservations", "attempts", "checkpoints", "nodes", "queues", "cohorts",
          "quota_history", "price_books", "teams", "policies", "api_tokens", "statements", "gpu_telemetry", "services",
          "service_replicas", "clusters", "applied_events",
          "projection_position", "schema_migrations")
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class ReplayError(ValueError):
    """A replay request that cannot be carried out; says why and what is accepted."""


def check_schema(name: str) -> str:
    if not _SCHEMA_NAME.match(name) or name in ("public", "pg_catalog", "information_schema"):
        raise ReplayError(f"--into {name!r}: a shadow is a schema name other than public "
                          "(lowercase letters, digits, _; e.g. shadow)")
    return name


def q(schema: str) -> str:
    """A schema name as a quoted identifier (names are checked: no quotes inside), so that a
    reserved word such as ``window`` works too."""
    return '"' + schema.replace('"', '""') + '"'


async def connect(dsn: str, schema: str = "public") -> asyncpg.Connection:
    """A connection whose unqualified table names resolve in ``schema``."""
    return await asyncpg.connect(dsn, server_settings={"search_path": q(schema)}, timeout=10)


async def reset(dsn: str, schema: str) -> None:
    """Drop and re-create a shadow schema with the migrations applied."""
    await drop(dsn, schema)
    conn = await connect(dsn, schema)
    try:
        await conn.execute(f"CREATE SCHEMA {q(schema)}")
        await sink.migrate(conn)
    finally:
        await conn.close()


async def drop(dsn: str, schema: str) -> None:
    """Drop a shadow schema and everything in it (a scratch rebuild's, once it is read)."""
    check_schema(schema)
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {q(schema)} CASCADE")
    finally:
        await conn.close()
