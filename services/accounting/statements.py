"""Issuing chargeback statements (adapter): once the log's time has passed a period's end plus a
grace period, accounting computes the period's statement from the read models and publishes
ChargebackStatementIssued. A statement for a period and dimension is issued once and never
revised: what events logged after it say about its period (an attempt that ran in it and ended
late, a price book version or a quota change in force in it) is billed as adjustment lines in
the next period still open (queries._adjustments), issued in its turn. A closed period that had
nothing to bill when it closed is issued when something for it is logged.

Settings (environment): ``GPUSCHED_STATEMENT_BY`` (comma-separated dimensions, default
``team``; empty: issue none), ``GPUSCHED_STATEMENT_GRACE_S`` (default 3600).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import asyncpg

from runtime import eventlog
from runtime.settings import ConfigError
from schemas import ChargebackStatementIssued, new_event
from services.accounting import chargeback, queries

log = logging.getLogger("accounting.statements")


@dataclass
class IssuerConfig:
    dimensions: tuple[str, ...] = ("team",)
    grace_s: float = 3600.0

    @classmethod
    def from_env(cls) -> "IssuerConfig":
        raw = os.environ.get("GPUSCHED_STATEMENT_BY", "team")
        dims = tuple(d.strip() for d in raw.split(",") if d.strip())
        if bad := [d for d in dims if d not in chargeback.STATEMENT_DIMENSIONS]:
            raise ConfigError(f"GPUSCHED_STATEMENT_BY={raw!r}: {bad} not accepted; accepted: "
                              f"{', '.join(chargeback.STATEMENT_DIMENSIONS)} (comma-separated)")
        grace_raw = os.environ.get("GPUSCHED_STATEMENT_GRACE_S", "3600")
        try:
            grace = float(grace_raw)
        except ValueError:
            raise ConfigError(f"GPUSCHED_STATEMENT_GRACE_S={grace_raw!r} is not a number; accepted: 0..2678400") from None
        if not 0 <= grace <= 31 * 86_400:
            raise ConfigError(f"GPUSCHED_STATEMENT_GRACE_S={grace_raw!r} is out of range; accepted: 0..2678400")
        return cls(dims, grace)


@dataclass
class Issuer:
    config: IssuerConfig
    watermark: datetime | None = None  # latest event time applied
    _latest: dict[tuple[str, str], dict] = field(default_factory=dict)  # (period, dim) -> last issued body
    _seen: int | None = None  # read-model position at the last full check
    _checked: tuple | None = None  # (position, watermark's closed period) at the last full check
    _earliest: datetime | None = None  # where the first period with usage or quota starts

    def observe(self, t: datetime) -> None:
        if self.watermark is None or t > self.watermark:
            self.watermark = t

    async def _last_issued(self, conn: asyncpg.Connection, period: str, dim: str) -> dict | None:
        """The latest statement issued for the period and dimension: what this process issued,
        or the read models' copy (the log's, projected)."""
        row = await conn.fetchrow(
            "SELECT statement_id, checksum, first_sequence, last_sequence FROM statements "
            "WHERE period = $1 AND group_by = $2 ORDER BY last_sequence DESC LIMIT 1", period, dim)
        mine = self._latest.get((period, dim))
        if row is not None and (mine is None or row["last_sequence"] >= mine["last_sequence"]):
            return dict(row)
        return mine

    async def _affected_from(self, conn: asyncpg.Connection, since: int) -> datetime | None:
        """The earliest time that rows logged after ``since`` change: attempts that ended (their
        start), price book versions and quota changes (when they take effect)."""
        return await conn.fetchval(
            """SELECT least((SELECT min(started_at) FROM usage_ledger WHERE sequence > $1),
                            (SELECT min(effective_from) FROM price_books WHERE sequence > $1),
                            (SELECT min(effective_from) FROM quota_history WHERE sequence > $1))""", since)

    async def issue_due(self, conn: asyncpg.Connection, js) -> list[ChargebackStatementIssued]:
        """Publish the statements (and revisions) that are due; returns them."""
        if not self.config.dimensions or self.watermark is None:
            return []
        grace = timedelta(seconds=self.config.grace_s)
        closed = chargeback.period_of(self.watermark - grace)
        position = await queries.position(conn)
        if (position, closed) == self._checked:
            return []
        if self._seen is None:  # after a start: what changed since the oldest issued statement
            self._seen = await conn.fetchval("SELECT coalesce(min(last_sequence), 0) FROM statements")
        affected = await self._affected_from(conn, self._seen)
        if self._earliest is None:  # the first period anything ran or was guaranteed in (then only earlier if affected)
            self._earliest = await conn.fetchval(
                """SELECT least((SELECT min(started_at) FROM usage_ledger), (SELECT min(effective_from) FROM quota_history),
                                (SELECT min(started_at) FROM jobs WHERE state IN ('running', 'preempting', 'cancelling')))""")
        elif affected is not None:
            self._earliest = min(self._earliest, affected)
        earliest = self._earliest
        issued: list[ChargebackStatementIssued] = []
        period = chargeback.period_of(earliest) if earliest is not None else None
        while period is not None and chargeback.parse_period(period)[1] + grace <= self.watermark:
            end = chargeback.parse_period(period)[1]
            for dim in self.config.dimensions:
                if await self._last_issued(conn, period, dim) is not None:
                    continue  # issued: never revised (late events are the next open period's adjustments)
                body = await queries.statement(conn, period, dim, log=js, as_of=end, whole=True)
                if body is None:  # the partitions are not at one position: again after a later batch
                    return issued
                if not body["lines"]:
                    continue
                event = new_event(
                    ChargebackStatementIssued,
                    aggregate_id=chargeback.statement_id(period, dim, body["last_sequence"]),
                    producer="accounting", occurred_at=self.watermark, key=body["checksum"],
                    **{k: v for k, v in body.items() if k not in queries.STATEMENT_EXTRAS})
                await eventlog.EventLog(js).append(event)
                self._latest[(period, dim)] = {"statement_id": event.aggregate_id, "checksum": event.checksum,
                                               "first_sequence": event.first_sequence,
                                               "last_sequence": event.last_sequence}
                issued.append(event)
                log.info("statement issued", extra={"statement": event.aggregate_id, "checksum": body["checksum"],
                                                    "total_cost": body["total_cost"],
                                                    "adjustments": len(body["adjustments"])})
            period = chargeback.next_period(period)
        self._seen, self._checked = position, (position, closed)
        return issued

