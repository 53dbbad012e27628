"""Pricing, roll-ups and chargeback statements: pure functions of ledger rows, price book versions
and quota history (no I/O, no clock). The accounting service, the CLI and anyone verifying a
statement call the same code, so the same rows give the same statement and the same checksum.

Semantics (docs/accounting.md):

* An attempt counts in every day and period it ran in, **prorated**: the part of
  [started_at, ended_at) inside the day or month (UTC) — GPU-, borrowed-, CPU- and memory-seconds
  and cost alike. Its lost work (preemption) is the last ``lost / gpus`` seconds of its run, so it
  lands where the attempt ended. The attempt itself (its count and its queue wait) belongs to the
  day and period in which it started. An attempt still running counts up to the time asked for
  (a closed period's end, ``--as-of``): the caller passes it with ``ended_at`` at that time.
* A period's figures can change after its statement was issued only through events logged late
  (an end that happened inside it, a price correction, a quota change): accounting then issues a
  revised statement (see statements.py).
* Its cost integrates the price in force over its run: the interval is split at every price book
  ``effective_from``; for one ``effective_from`` the version logged last wins (a correction).
* Idle guaranteed quota: per queue and flavor, nominal GPUs over the period (from the quota
  history) minus the guaranteed (not borrowed) GPU-seconds the queue used in it, clipped to the
  period; owned by the queue's first allowed team. ``showback``: reported, not in the total;
  ``charge-owner``: billed to the owner.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from typing import Any

DIMENSIONS = ("team", "project", "queue", "flavor", "day")
STATEMENT_DIMENSIONS = ("team", "project", "queue", "flavor")
NONE_KEY = "-"
_DIGITS = 6  # rounding of every figure in a statement: the checksum must not depend on summation noise


class ChargebackError(ValueError):
    """Bad input to a chargeback computation: says the field, the value and what is accepted."""


@dataclass(frozen=True)
class PriceVersion:
    effective_from: datetime
    sequence: int
    currency: str
    gpu_prices: Mapping[str, float]
    cpu_core_hour: float | None = None
    memory_gib_hour: float | None = None
    idle_quota: str = "showback"


@dataclass(frozen=True)
class QuotaVersion:
    queue: str
    owner: str | None
    effective_from: datetime
    quotas: Mapping[str, int]  # flavor -> nominal GPUs
    sequence: int


@dataclass(frozen=True)
class Attempt:
    """One usage-ledger row (an attempt that held GPUs; ``gpus`` and ``borrowed_gpus`` are GPUs
    charged: a fraction for a job on a shared GPU)."""

    job_id: str
    attempt: int
    team: str
    project: str | None
    queue: str
    flavor: str
    gpus: float
    borrowed_gpus: float
    started_at: datetime
    ended_at: datetime
    lost_gpu_seconds: float = 0.0
    cpu_core_seconds: float = 0.0
    memory_gib_seconds: float = 0.0
    wait_seconds: float | None = None

    @property
    def seconds(self) -> float:
        return max(0.0, (self.ended_at - self.started_at).total_seconds())

    def key(self, dimension: str) -> str:
        if dimension == "day":  # a slice lies within one day (see slices)
            return self.started_at.astimezone(UTC).date().isoformat()
        value = getattr(self, dimension)
        return NONE_KEY if value is None else str(value)

    def clip(self, start: datetime | None, end: datetime | None) -> "Attempt | None":
        """The part of the attempt in [start, end) (None: unbounded), or None if it did not run
        then. Time-based figures in proportion; the lost work is the run's last ``lost / gpus``
        seconds. A zero-length attempt belongs to the window holding its start."""
        s = self.started_at if start is None else max(self.started_at, start)
        e = self.ended_at if end is None else min(self.ended_at, end)
        total = self.seconds
        if total == 0:
            return self if s == self.started_at and (end is None or self.started_at < end) else None
        if e <= s:
            return None
        if s == self.started_at and e == self.ended_at:
            return self
        part = (e - s).total_seconds() / total
        lost = 0.0
        if self.lost_gpu_seconds > 0 and self.gpus > 0:
            lost_from = self.ended_at - timedelta(seconds=self.lost_gpu_seconds / self.gpus)
            if (w := _overlap(lost_from, self.ended_at, s, e)) is not None:
                lost = self.gpus * (w[1] - w[0]).total_seconds()
        return replace(self, started_at=s, ended_at=e, lost_gpu_seconds=lost,
                       cpu_core_seconds=self.cpu_core_seconds * part, memory_gib_seconds=self.memory_gib_seconds * part)


def _day_cuts(start: datetime, end: datetime) -> list[datetime]:
    """Midnights (UTC) strictly inside (start, end)."""
    day = datetime.combine(start.astimezone(UTC).date(), datetime.min.time(), tzinfo=UTC) + timedelta(days=1)
    cuts = []
    while day < end:
        cuts.append(day)
        day += timedelta(days=1)
    return cuts


def slices(a: Attempt, start: datetime | None = None, end: datetime | None = None,
           by_day: bool = False) -> list[tuple[Attempt, bool]]:
    """The attempt's parts in [start, end), split at midnights when ``by_day``; each with
    whether it holds the attempt's start (where the attempt and its wait are counted)."""
    part = a.clip(start, end)
    if part is None:
        return []
    pieces = [part]
    if by_day and part.seconds > 0:
        bounds = [part.started_at, *_day_cuts(part.started_at, part.ended_at), part.ended_at]
        pieces = [p for b0, b1 in zip(bounds, bounds[1:]) if (p := a.clip(b0, b1)) is not None]
    return [(p, p.started_at == a.started_at) for p in pieces]


def parse_period(period: str) -> tuple[datetime, datetime]:
    """``YYYY-MM`` -> [start, end) in UTC."""
    try:
        year, month = (int(p) for p in period.split("-"))
        start = datetime(year, month, 1, tzinfo=UTC)
    except ValueError:
        raise ChargebackError(f"period {period!r} is not a calendar month; accepted: YYYY-MM, e.g. 2026-11") from None
    if len(period) != 7:
        raise ChargebackError(f"period {period!r} is not a calendar month; accepted: YYYY-MM, e.g. 2026-11")
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def period_of(t: datetime) -> str:
    t = t.astimezone(UTC)
    return f"{t.year:04d}-{t.month:02d}"


def next_period(period: str) -> str:
    return period_of(parse_period(period)[1])


class PriceBook:
    """The price in force at any instant, from all logged versions of one price book."""

    def __init__(self, versions: Iterable[PriceVersion]) -> None:
        latest: dict[datetime, PriceVersion] = {}
        for v in sorted(versions, key=lambda v: v.sequence):
            latest[v.effective_from] = v  # a later version for the same instant is a correction
        self.versions = [latest[t] for t in sorted(latest)]
        self._starts = [v.effective_from for v in self.versions]

    def at(self, t: datetime) -> PriceVersion | None:
        i = bisect.bisect_right(self._starts, t) - 1
        return self.versions[i] if i >= 0 else None

    def segments(self, start: datetime, end: datetime) -> list[tuple[float, PriceVersion | None]]:
        """(seconds, version in force) pieces of [start, end)."""
        if end <= start:
            return []
        cuts = [start] + [t for t in self._starts if start < t < end] + [end]
        return [((b - a).total_seconds(), self.at(a)) for a, b in zip(cuts, cuts[1:])]

    def gpu_cost(self, flavor: str, gpus: float, start: datetime, end: datetime) -> float:
        return sum(seconds / 3600.0 * gpus * v.gpu_prices.get(flavor, 0.0)
                   for seconds, v in self.segments(start, end) if v is not None)

    def attempt_cost(self, a: Attempt) -> float:
        cost = self.gpu_cost(a.flavor, a.gpus, a.started_at, a.ended_at)
        duration = a.seconds
        if duration > 0 and (a.cpu_core_seconds or a.memory_gib_seconds):
            cores, gib = a.cpu_core_seconds / duration, a.memory_gib_seconds / duration
            for seconds, v in self.segments(a.started_at, a.ended_at):
                if v is None:
                    continue
                cost += seconds / 3600.0 * (cores * (v.cpu_core_hour or 0.0) + gib * (v.memory_gib_hour or 0.0))
        return cost

    def currency(self, t: datetime) -> str:
        v = self.at(t) or (self.versions[0] if self.versions else None)
        return v.currency if v else "USD"

    def idle_policy(self, t: datetime) -> str:
        v = self.at(t) or (self.versions[0] if self.versions else None)
        return v.idle_quota if v else "showback"


def _overlap(a0: datetime, a1: datetime, b0: datetime, b1: datetime) -> tuple[datetime, datetime] | None:
    start, end = max(a0, b0), min(a1, b1)
    return (start, end) if end > start else None


def idle_quota(attempts: Sequence[Attempt], history: Iterable[QuotaVersion], start: datetime,
               end: datetime) -> list[dict[str, Any]]:
    """Per (queue, flavor, owner, interval): nominal GPU-seconds in [start, end) and the idle part.
    The guaranteed use of a queue's attempts is clipped to the same window."""
    by_queue: dict[str, list[QuotaVersion]] = {}
    for v in sorted(history, key=lambda v: (v.queue, v.effective_from, v.sequence)):
        by_queue.setdefault(v.queue, []).append(v)
    used: dict[tuple[str, str], float] = {}
    for a in attempts:
        if (w := _overlap(a.started_at, a.ended_at, start, end)) is not None:
            k = (a.queue, a.flavor)
            used[k] = used.get(k, 0.0) + (a.gpus - a.borrowed_gpus) * (w[1] - w[0]).total_seconds()
    out: list[dict[str, Any]] = []
    for queue, versions in sorted(by_queue.items()):
        nominal: dict[tuple[str, str | None], float] = {}
        pieces: dict[str, list[tuple[datetime, datetime, int, str | None]]] = {}
        for v, nxt in zip(versions, versions[1:] + [None]):
            v_end = nxt.effective_from if nxt is not None else end
            if (w := _overlap(v.effective_from, v_end, start, end)) is None:
                continue
            for flavor, gpus in v.quotas.items():
                if gpus > 0:
                    nominal[(flavor, v.owner)] = nominal.get((flavor, v.owner), 0.0) + gpus * (w[1] - w[0]).total_seconds()
                    pieces.setdefault(flavor, []).append((w[0], w[1], gpus, v.owner))
        for flavor in sorted(pieces):
            total = sum(s for (f, _), s in nominal.items() if f == flavor)
            idle_total = max(0.0, total - used.get((queue, flavor), 0.0))
            for w0, w1, gpus, owner in pieces[flavor]:
                share = gpus * (w1 - w0).total_seconds() / total if total else 0.0
                out.append({"queue": queue, "flavor": flavor, "owner": owner, "start": w0, "end": w1,
                            "nominal_gpu_seconds": gpus * (w1 - w0).total_seconds(),
                            "idle_gpu_seconds": idle_total * share})
    return out


def _r(x: float) -> float:
    value = round(x, _DIGITS)
    return 0.0 if value == 0 else value  # no -0.0 in a canonical body


@dataclass
class _Totals:
    gpu_seconds: float = 0.0
    borrowed: float = 0.0
    lost: float = 0.0
    idle: float = 0.0
    usage_cost: float = 0.0
    idle_cost: float = 0.0
    attempts: int = 0
    waits: list[float] = field(default_factory=list)


def _ordered(attempts: Iterable[Attempt]) -> list[Attempt]:
    return sorted(attempts, key=lambda a: (a.job_id, a.attempt))


def statement(attempts: Iterable[Attempt], prices: Iterable[PriceVersion], history: Iterable[QuotaVersion], *,
              period: str, group_by: str, first_sequence: int, last_sequence: int,
              as_of: datetime | None = None) -> dict[str, Any]:
    """The chargeback statement body for one period, grouped by one dimension, with its checksum.
    ``attempts`` may hold any rows (running ones with ``ended_at`` at the period's end or
    ``as_of``); the part of each inside the period counts. ``as_of`` clips an open period
    (default: the period's end)."""
    if group_by not in STATEMENT_DIMENSIONS:
        raise ChargebackError(f"--by {group_by!r} is not a statement dimension; accepted: "
                              f"{', '.join(STATEMENT_DIMENSIONS)}")
    start, end = parse_period(period)
    clip = min(end, as_of) if as_of is not None else end
    book = PriceBook(prices)
    policy = book.idle_policy(clip - timedelta(microseconds=1))
    attempts = _ordered(attempts)
    groups: dict[str, _Totals] = {}
    for a in (part for whole in attempts for part, _ in slices(whole, start, clip)):
        t = groups.setdefault(a.key(group_by), _Totals())
        t.gpu_seconds += a.gpus * a.seconds
        t.borrowed += a.borrowed_gpus * a.seconds
        t.lost += a.lost_gpu_seconds
        t.usage_cost += book.attempt_cost(a)
    # idle quota: clipped by time, so it looks at every attempt that overlaps the window
    for piece in idle_quota(attempts, history, start, clip):
        if piece["idle_gpu_seconds"] <= 0:
            continue
        key = {"team": piece["owner"], "queue": piece["queue"], "flavor": piece["flavor"], "project": None}[group_by]
        t = groups.setdefault(NONE_KEY if key is None else key, _Totals())
        t.idle += piece["idle_gpu_seconds"]
        nominal = piece["nominal_gpu_seconds"]
        if nominal > 0:
            full = book.gpu_cost(piece["flavor"], nominal / (piece["end"] - piece["start"]).total_seconds(),
                                 piece["start"], piece["end"])
            t.idle_cost += full * piece["idle_gpu_seconds"] / nominal
    lines = []
    for key in sorted(groups):
        t = groups[key]
        total = t.usage_cost + (t.idle_cost if policy == "charge-owner" else 0.0)
        lines.append({"key": key, "gpu_seconds": _r(t.gpu_seconds), "borrowed_gpu_seconds": _r(t.borrowed),
                      "lost_gpu_seconds": _r(t.lost), "idle_gpu_seconds": _r(t.idle),
                      "usage_cost": _r(t.usage_cost), "idle_cost": _r(t.idle_cost), "total_cost": _r(total)})
    body = {
        "period": period, "group_by": group_by, "currency": book.currency(clip - timedelta(microseconds=1)),
        "idle_quota": policy, "lines": lines,
        "total_gpu_seconds": _r(sum(line["gpu_seconds"] for line in lines)),
        "total_cost": _r(sum(line["total_cost"] for line in lines)),
        "first_sequence": first_sequence, "last_sequence": last_sequence,
    }
    body["checksum"] = checksum(body)
    return body


CHECKSUM_FIELDS = ("period", "group_by", "currency", "idle_quota", "lines", "total_gpu_seconds", "total_cost",
                   "first_sequence", "last_sequence")


def checksum(body: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a statement's fields (sorted keys, no spaces, figures
    rounded to 6 decimals): what a verifier recomputes after a replay."""
    canonical = {k: body[k] for k in CHECKSUM_FIELDS}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def statement_id(period: str, group_by: str, last_sequence: int) -> str:
    """Deterministic: the same period, dimension and log range always give the same id."""
    return f"{period}-{group_by}-{last_sequence}"


def percentile(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def rollup(attempts: Iterable[Attempt], prices: Iterable[PriceVersion], by: Sequence[str], *,
           start: datetime | None = None, end: datetime | None = None) -> list[dict[str, Any]]:
    """Usage and cost per group of the given dimensions (team, project, queue, flavor, day), of
    the attempts' parts in [start, end) (None: unbounded), split by day when grouped by day.
    ``attempts`` counts the attempts that started in the group (with their queue waits)."""
    bad = [d for d in by if d not in DIMENSIONS]
    if bad or not by:
        raise ChargebackError(f"--by {','.join(by) or '(empty)'}: accepted dimensions: {', '.join(DIMENSIONS)} "
                              "(comma-separated, e.g. team,flavor)")
    book = PriceBook(prices)
    groups: dict[tuple[str, ...], _Totals] = {}
    for whole in _ordered(attempts):
        for a, first in slices(whole, start, end, by_day="day" in by):
            t = groups.setdefault(tuple(a.key(d) for d in by), _Totals())
            t.gpu_seconds += a.gpus * a.seconds
            t.borrowed += a.borrowed_gpus * a.seconds
            t.lost += a.lost_gpu_seconds
            t.usage_cost += book.attempt_cost(a)
            if first:
                t.attempts += 1
                if a.wait_seconds is not None:
                    t.waits.append(a.wait_seconds)
    out = []
    for key in sorted(groups):
        t = groups[key]
        out.append({**dict(zip(by, key)), "attempts": t.attempts, "gpu_hours": t.gpu_seconds / 3600.0,
                    "guaranteed_gpu_hours": (t.gpu_seconds - t.borrowed) / 3600.0,
                    "borrowed_gpu_hours": t.borrowed / 3600.0, "lost_gpu_hours": t.lost / 3600.0,
                    "wait_p50_s": percentile(t.waits, 50), "wait_p95_s": percentile(t.waits, 95),
                    "cost": t.usage_cost})
    return out


def to_csv_rows(body: Mapping[str, Any]) -> list[list[Any]]:
    header = [body["group_by"], "gpu_hours", "borrowed_gpu_hours", "lost_gpu_hours", "idle_gpu_hours",
              "usage_cost", "idle_cost", "total_cost", "currency"]
    rows = [header]
    for line in body["lines"]:
        rows.append([line["key"], line["gpu_seconds"] / 3600, line["borrowed_gpu_seconds"] / 3600,
                     line["lost_gpu_seconds"] / 3600, line["idle_gpu_seconds"] / 3600, line["usage_cost"],
                     line["idle_cost"], line["total_cost"], body["currency"]])
    return rows


def day_of(t: datetime) -> date:
    return t.astimezone(UTC).date()
