"""Issuing chargeback statements (adapter): once the log's time has passed a period's end plus a
grace period, accounting computes the period's statement from the read models and publishes
ChargebackStatementIssued. The log, not memory, says what was issued: a statement for a period
and dimension is issued once, and again only when a price book version logged after it changes
prices in the period (re-pricing).

Settings (environment): ``GPUSCHED_STATEMENT_BY`` (comma-separated dimensions, default
``team``; empty: issue none), ``GPUSCHED_STATEMENT_GRACE_S`` (default 3600).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import asyncpg

from gpusched import eventlog
from gpusched.settings import ConfigError
from schemas import ChargebackStatementIssued, new_event
from schemas.registry import SUBJECT_PREFIX
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
    _done: dict[tuple[str, str], int] = field(default_factory=dict)  # (period, dim) -> last_sequence issued
    _checked: tuple | None = None  # (newest price book sequence, watermark's period) at the last full check

    def observe(self, t: datetime) -> None:
        if self.watermark is None or t > self.watermark:
            self.watermark = t

    async def _issued_last_sequence(self, js, period: str, dim: str) -> int | None:
        if (period, dim) in self._done:
            return self._done[(period, dim)]
        info = await js.stream_info(eventlog.EVENTS_STREAM,
                                    subjects_filter=f"{SUBJECT_PREFIX}.statement.{period}-{dim}-*.issued")
        seqs = [int(s.split(".")[2].rsplit("-", 1)[1]) for s in (info.state.subjects or {})]
        if seqs:
            self._done[(period, dim)] = max(seqs)
        return max(seqs) if seqs else None

    async def issue_due(self, conn: asyncpg.Connection, js) -> list[ChargebackStatementIssued]:
        """Publish the statements that are due; returns them."""
        if not self.config.dimensions or self.watermark is None:
            return []
        # Nothing can have fallen due unless a period closed or a price book version arrived since.
        closed = chargeback.period_of(self.watermark - timedelta(seconds=self.config.grace_s))
        state = (await conn.fetchval("SELECT max(sequence) FROM price_books"), closed)
        if state == self._checked:
            return []
        earliest = await conn.fetchval(
            "SELECT least((SELECT min(ended_at) FROM usage_ledger), (SELECT min(effective_from) FROM quota_history))")
        if earliest is None:
            return []
        issued = []
        period = chargeback.period_of(earliest)
        grace = timedelta(seconds=self.config.grace_s)
        while chargeback.parse_period(period)[1] + grace <= self.watermark:
            start, end = chargeback.parse_period(period)
            for dim in self.config.dimensions:
                last = await self._issued_last_sequence(js, period, dim)
                if last is not None:
                    repriced = await conn.fetchval(
                        "SELECT count(*) FROM price_books WHERE sequence > $1 AND effective_from < $2", last, end)
                    if not repriced:
                        continue
                body = await queries.statement(conn, period, dim)
                if not body["lines"] or body["last_sequence"] == last:
                    self._done[(period, dim)] = last or body["last_sequence"]
                    continue
                event = new_event(
                    ChargebackStatementIssued,
                    aggregate_id=chargeback.statement_id(period, dim, body["last_sequence"]),
                    producer="accounting", occurred_at=self.watermark, key=body["checksum"],
                    **{k: v for k, v in body.items()})
                await eventlog.EventLog(js).append(event)
                self._done[(period, dim)] = body["last_sequence"]
                issued.append(event)
                log.info("statement issued", extra={"statement": event.aggregate_id, "checksum": body["checksum"],
                                                    "total_cost": body["total_cost"]})
            period = chargeback.next_period(period)
        self._checked = state
        return issued
