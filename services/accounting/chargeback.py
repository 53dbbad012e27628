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
  (an end that happened inside it, a price correction, a quota change): the issued statement
  stands, and the differences are adjustment lines of the next open period (:func:`adjustments`).
* Money and quantities are Decimals, rounded once per item by one rule (:func:`hours`,
  :func:`money`, :func:`_rounded`); lines and totals are exact sums; the checksum is SHA-256 of
  the RFC 8785 form (:func:`canonical`) with every figure a string (docs/accounting.md#money).
* Its cost integrates the price in force over its run: the interval is split at every price book
  ``effective_from``; for one ``effective_from`` the version logged last wins (a correction).
* Idle guaranteed quota: per queue and flavor, nominal GPUs over the period (from the quota
  history) minus the guaranteed (not borrowed) GPU-seconds the queue used in it, clipped to the
  period; owned by the queue's first allowed team. ``showback``: reported, not in the total;
  ``charge-owner``: billed to the owner.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from typing import Any

import rfc8785

DIMENSIONS = ("team", "project", "queue", "flavor", "day")
STATEMENT_DIMENSIONS = ("team", "project", "queue", "flavor")
NONE_KEY = "-"

# -- money and quantities: the one rounding rule (docs/accounting.md#money) ----------------------
HOUR_PLACES = 6
"""GPU-hours in a statement: 6 decimal places (3.6 ms of one GPU), ROUND_HALF_EVEN, per item."""
MINOR_UNITS = {**dict.fromkeys(("BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF", "UGX", "UYI",
                                "VND", "VUV", "XAF", "XOF", "XPF"), 0),
               **dict.fromkeys(("BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"), 3),
               **dict.fromkeys(("CLF", "UYW"), 4)}
"""ISO 4217 minor units that are not 2 (every other currency: 2 decimal places)."""
CHECKSUM_ALG = "jcs-sha256"
"""sha256 of the RFC 8785 (JCS) form of the statement's CHECKSUM_FIELDS. Statements issued before it
carry ``sha256-json-v1`` (float figures; not re-derivable by this release)."""


def minor_unit(currency: str) -> int:
    """Decimal places of the currency's minor unit (ISO 4217): 2 unless listed in MINOR_UNITS."""
    return MINOR_UNITS.get(currency, 2)


def dec(x: float | int | Decimal | str | None) -> Decimal:
    """A figure as an exact Decimal: a float by its shortest repr (the value it was written as:
    a price ``2.1``, a fraction ``0.25`` of a GPU), never its binary expansion."""
    if x is None:
        return Decimal(0)
    if isinstance(x, Decimal):
        return x
    return Decimal(repr(x)) if isinstance(x, float) else Decimal(x)


def hours(seconds: Decimal) -> Decimal:
    """GPU-seconds (exact) -> GPU-hours rounded to HOUR_PLACES, half to even."""
    return (seconds / 3600).quantize(Decimal(1).scaleb(-HOUR_PLACES), rounding=ROUND_HALF_EVEN)


def money(amount: Decimal, currency: str) -> Decimal:
    """An amount rounded to the currency's minor unit, half to even: the one place money is rounded."""
    return amount.quantize(Decimal(1).scaleb(-minor_unit(currency)), rounding=ROUND_HALF_EVEN)


def text(d: Decimal) -> str:
    """A Decimal as a JSON string in plain notation, its places kept (``"0.000000"``, ``"12.30"``)."""
    out = format(d, "f")
    return out[1:] if out.startswith("-") and not d else out  # never "-0.00"


def price_text(d: Decimal) -> str:
    """A unit price as written in the price book, without trailing zeros (``"2.1"``, ``"4"``)."""
    return text(d.normalize()) if d else "0"


class ChargebackError(ValueError):
    """Bad input to a chargeback computation: says the field, the value and what is accepted."""


@dataclass(frozen=True)
class PriceVersion:
    effective_from: datetime
    sequence: int
    currency: str
    gpu_prices: Mapping[str, Decimal | float]  # as the book gives them (Decimal from the read models)
    cpu_core_hour: Decimal | float | None = None
    memory_gib_hour: Decimal | float | None = None
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


def previous_period(period: str) -> str:
    return period_of(parse_period(period)[0] - timedelta(microseconds=1))


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

    def windows(self, start: datetime, end: datetime) -> list[tuple[datetime, datetime, PriceVersion | None]]:
        """[start, end) cut at every ``effective_from`` inside it, each piece with the version in
        force; a zero-length interval is one piece."""
        if end <= start:
            return [(start, start, self.at(start))]
        cuts = [start] + [t for t in self._starts if start < t < end] + [end]
        return [(a, b, self.at(a)) for a, b in zip(cuts, cuts[1:])]

    def gpu_cost(self, flavor: str, gpus: float, start: datetime, end: datetime) -> float:
        return sum(seconds / 3600.0 * gpus * float(v.gpu_prices.get(flavor, 0.0))
                   for seconds, v in self.segments(start, end) if v is not None)

    def attempt_cost(self, a: Attempt) -> float:
        cost = self.gpu_cost(a.flavor, a.gpus, a.started_at, a.ended_at)
        duration = a.seconds
        if duration > 0 and (a.cpu_core_seconds or a.memory_gib_seconds):
            cores, gib = a.cpu_core_seconds / duration, a.memory_gib_seconds / duration
            for seconds, v in self.segments(a.started_at, a.ended_at):
                if v is None:
                    continue
                cost += seconds / 3600.0 * (cores * float(v.cpu_core_hour or 0.0) + gib * float(v.memory_gib_hour or 0.0))
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
    """Per (queue, flavor, owner, interval): nominal GPU-seconds in [start, end) and the idle part
    (exact Decimals). The guaranteed use of a queue's attempts is clipped to the same window."""
    by_queue: dict[str, list[QuotaVersion]] = {}
    for v in sorted(history, key=lambda v: (v.queue, v.effective_from, v.sequence)):
        by_queue.setdefault(v.queue, []).append(v)
    used: dict[tuple[str, str], Decimal] = {}
    for a in attempts:
        if (w := _overlap(a.started_at, a.ended_at, start, end)) is not None:
            k = (a.queue, a.flavor)
            used[k] = used.get(k, Decimal(0)) + (dec(a.gpus) - dec(a.borrowed_gpus)) * _seconds(*w)
    out: list[dict[str, Any]] = []
    for queue, versions in sorted(by_queue.items()):
        pieces: dict[str, list[tuple[datetime, datetime, int, str | None]]] = {}
        for v, nxt in zip(versions, versions[1:] + [None]):
            v_end = nxt.effective_from if nxt is not None else end
            if (w := _overlap(v.effective_from, v_end, start, end)) is None:
                continue
            for flavor, gpus in v.quotas.items():
                if gpus > 0:
                    pieces.setdefault(flavor, []).append((w[0], w[1], gpus, v.owner))
        for flavor in sorted(pieces):
            total = sum((gpus * _seconds(w0, w1) for w0, w1, gpus, _ in pieces[flavor]), Decimal(0))
            idle_total = max(Decimal(0), total - used.get((queue, flavor), Decimal(0)))
            for w0, w1, gpus, owner in pieces[flavor]:
                nominal = gpus * _seconds(w0, w1)
                out.append({"queue": queue, "flavor": flavor, "owner": owner, "start": w0, "end": w1,
                            "nominal_gpu_seconds": nominal,
                            "idle_gpu_seconds": idle_total * nominal / total if total else Decimal(0)})
    return out


@dataclass
class _Totals:
    gpu_seconds: float = 0.0
    borrowed: float = 0.0
    lost: float = 0.0
    usage_cost: float = 0.0
    attempts: int = 0
    waits: list[float] = field(default_factory=list)


def _ordered(attempts: Iterable[Attempt]) -> list[Attempt]:
    return sorted(attempts, key=lambda a: (a.job_id, a.attempt))


def _seconds(a: datetime, b: datetime) -> Decimal:
    """The exact length of [a, b) in seconds (microseconds kept)."""
    d = b - a
    return Decimal((d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds).scaleb(-6)


ITEM_KEY = ("team", "project", "queue", "flavor", "unit_price")
"""A statement item is one (team, project, queue, flavor, GPU-hour price in force) of the period."""


@dataclass
class _Item:
    """An item's exact figures before rounding (Decimal GPU-seconds, CPU and memory cost)."""

    gpu_s: Decimal = Decimal(0)
    borrowed_s: Decimal = Decimal(0)
    lost_s: Decimal = Decimal(0)
    idle_s: Decimal = Decimal(0)
    other: Decimal = Decimal(0)


def _usage(items: dict[tuple, _Item], attempts: Sequence[Attempt], book: PriceBook, start: datetime,
           end: datetime) -> None:
    """The parts of the attempts inside [start, end), split where the price changes, into items."""
    for whole in attempts:
        part = whole.clip(start, end)
        if part is None:
            continue
        for w0, w1, v in book.windows(part.started_at, part.ended_at):
            p = whole.clip(w0, w1) if w1 > w0 else part
            if p is None:
                continue
            price = dec(v.gpu_prices.get(p.flavor, 0)) if v is not None else Decimal(0)
            it = items.setdefault((p.team, whole.key("project"), p.queue, p.flavor, price), _Item())
            secs = _seconds(p.started_at, p.ended_at)
            it.gpu_s += dec(p.gpus) * secs
            it.borrowed_s += dec(p.borrowed_gpus) * secs
            it.lost_s += dec(p.lost_gpu_seconds)
            if v is not None:
                it.other += (dec(p.cpu_core_seconds) * dec(v.cpu_core_hour)
                             + dec(p.memory_gib_seconds) * dec(v.memory_gib_hour)) / 3600


def _idle(items: dict[tuple, _Item], attempts: Sequence[Attempt], history: Iterable[QuotaVersion], book: PriceBook,
          start: datetime, end: datetime) -> None:
    """Idle guaranteed quota into its owners' items, split where the price changes."""
    for piece in idle_quota(attempts, history, start, end):
        if piece["idle_gpu_seconds"] <= 0:
            continue
        length = _seconds(piece["start"], piece["end"])
        for w0, w1, v in book.windows(piece["start"], piece["end"]):
            price = dec(v.gpu_prices.get(piece["flavor"], 0)) if v is not None else Decimal(0)
            owner = NONE_KEY if piece["owner"] is None else piece["owner"]
            it = items.setdefault((owner, NONE_KEY, piece["queue"], piece["flavor"], price), _Item())
            it.idle_s += piece["idle_gpu_seconds"] * _seconds(w0, w1) / length


ITEM_FIGURES = ("gpu_hours", "guaranteed_gpu_hours", "borrowed_gpu_hours", "lost_gpu_hours", "idle_gpu_hours",
                "usage_amount", "idle_amount", "other_amount", "amount")
LINE_FIGURES = ("gpu_hours", "guaranteed_gpu_hours", "borrowed_gpu_hours", "lost_gpu_hours", "idle_gpu_hours",
                "usage_cost", "idle_cost", "total_cost")


def _rounded(key: tuple, it: _Item, currency: str, charge_idle: bool) -> dict[str, Any]:
    """An item's figures by the one rule (docs/accounting.md#money): GPU-hours rounded to
    HOUR_PLACES; each amount = its rounded hours x the unit price, rounded to the minor unit;
    ``amount`` = usage + other (CPU, memory) [+ idle under charge-owner], the sum of rounded parts."""
    price = key[4]
    gpu_h, borrowed_h = hours(it.gpu_s), hours(it.borrowed_s)
    idle_h = hours(it.idle_s)
    usage, idle, other = money(gpu_h * price, currency), money(idle_h * price, currency), money(it.other, currency)
    return {**dict(zip(ITEM_KEY[:4], key[:4])), "unit_price": price,
            "gpu_hours": gpu_h, "guaranteed_gpu_hours": max(Decimal(0), gpu_h - borrowed_h).quantize(gpu_h),
            "borrowed_gpu_hours": borrowed_h, "lost_gpu_hours": hours(it.lost_s), "idle_gpu_hours": idle_h,
            "usage_amount": usage, "idle_amount": idle, "other_amount": other,
            "amount": usage + other + (idle if charge_idle else 0)}


def _lines(items: Sequence[dict[str, Any]], group_by: str) -> list[dict[str, Any]]:
    """Per group: the exact sums of its items' rounded figures."""
    sums: dict[str, dict[str, Decimal]] = {}
    for item in items:
        s = sums.setdefault(item[group_by], {})
        for line_f, item_f in zip(LINE_FIGURES, ITEM_FIGURES[:5] + ("usage_amount", "idle_amount", "amount")):
            s[line_f] = s.get(line_f, Decimal(0)) + item[item_f]
        s["usage_cost"] += item["other_amount"]
    return [{"key": key, **sums[key]} for key in sorted(sums)]


def statement(attempts: Iterable[Attempt], prices: Iterable[PriceVersion], history: Iterable[QuotaVersion], *,
              period: str, group_by: str, first_sequence: int, last_sequence: int,
              as_of: datetime | None = None, adjustments: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The chargeback statement body for one period, grouped by one dimension, with its checksum.
    ``attempts`` may hold any rows (running ones with ``ended_at`` at the period's end or
    ``as_of``); the part of each inside the period counts. ``as_of`` clips an open period
    (default: the period's end).

    ``items``: one per (team, project, queue, flavor, GPU-hour price in force), rounded by the
    one rule (:func:`_rounded`); ``adjustments``: what the log now says differently about closed
    periods whose statements were issued (:func:`adjustments`), billed here; ``lines``: per group,
    the exact sums of its items and adjustments; the totals: the exact sums of the lines. Every
    figure is a decimal string (:func:`text`)."""
    if group_by not in STATEMENT_DIMENSIONS:
        raise ChargebackError(f"--by {group_by!r} is not a statement dimension; accepted: "
                              f"{', '.join(STATEMENT_DIMENSIONS)}")
    start, end = parse_period(period)
    clip = min(end, as_of) if as_of is not None else end
    book = PriceBook(prices)
    policy = book.idle_policy(clip - timedelta(microseconds=1))
    currency = book.currency(clip - timedelta(microseconds=1))
    attempts = _ordered(attempts)
    with localcontext() as ctx:
        ctx.prec = 50  # exact enough that only hours() and money() round
        raw: dict[tuple, _Item] = {}
        _usage(raw, attempts, book, start, clip)
        _idle(raw, attempts, history, book, start, clip)  # clipped by time: every attempt overlapping the window
        items = [_rounded(key, raw[key], currency, policy == "charge-owner") for key in sorted(raw)]
        adjusting = sorted(({**a, **{f: Decimal(a[f]) for f in ITEM_FIGURES}} for a in adjustments), key=_adjustment_key)
        lines = _lines(items + adjusting, group_by)
        total_hours = sum((line["gpu_hours"] for line in lines), Decimal(0))
        total_cost = sum((line["total_cost"] for line in lines), money(Decimal(0), currency))
    body = {
        "period": period, "group_by": group_by, "currency": currency, "minor_unit": minor_unit(currency),
        "idle_quota": policy,
        "items": [{k: price_text(v) if k == "unit_price" else text(v) if isinstance(v, Decimal) else v
                   for k, v in item.items()} for item in items],
        "adjustments": [{k: text(v) if isinstance(v, Decimal) else v for k, v in a.items()} for a in adjusting],
        "lines": [{k: text(v) if isinstance(v, Decimal) else v for k, v in line.items()} for line in lines],
        "total_gpu_hours": text(total_hours), "total_cost": text(total_cost),
        "first_sequence": first_sequence, "last_sequence": last_sequence, "checksum_alg": CHECKSUM_ALG,
    }
    body["checksum"] = checksum(body)
    return body


def _adjustment_key(a: Mapping[str, Any]) -> tuple:
    return (a["adjusts_period"], a["team"], a["project"], a["queue"], a["flavor"], Decimal(a["unit_price"]))


def adjustments(period: str, recomputed: Sequence[Mapping[str, Any]], issued: Sequence[Mapping[str, Any]],
                carried: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """A closed period's adjustment lines: its items as the log says them now (``recomputed``),
    less the items of its issued statement, less the adjustments for it already carried into
    issued statements of later periods (``carried``); one per (team, project, queue, flavor,
    unit price) whose figures differ, each figure the exact difference of rounded figures (so
    sums stay exact; a credit is negative). An issued statement is never changed: what the log
    learns late about its period is billed in the next open one."""
    sums: dict[tuple, dict[str, Decimal]] = {}
    for sign, rows in ((1, recomputed), (-1, issued), (-1, carried)):
        for row in rows:
            key = (row["team"], row["project"], row["queue"], row["flavor"], Decimal(row["unit_price"]))
            acc = sums.setdefault(key, {f: Decimal(0) for f in ITEM_FIGURES})
            for f in ITEM_FIGURES:
                acc[f] += sign * Decimal(row[f])
    return [{"adjusts_period": period, **dict(zip(ITEM_KEY[:4], key[:4])), "unit_price": price_text(key[4]),
             **{f: text(v) for f, v in acc.items()}}
            for key, acc in sorted(sums.items()) if any(acc.values())]


CHECKSUM_FIELDS = ("period", "group_by", "currency", "minor_unit", "idle_quota", "items", "adjustments", "lines",
                   "total_gpu_hours", "total_cost", "first_sequence", "last_sequence", "checksum_alg")
"""What a statement's checksum covers: every field of its body but ``checksum`` (and not the
answer's ``statement_id``, ``provisional``, ``as_of``)."""


def canonical(body: Mapping[str, Any]) -> bytes:
    """RFC 8785 (JCS) of the statement's CHECKSUM_FIELDS: keys sorted by UTF-16 code units, no
    whitespace; every figure is a string and every number an integer, so the form does not
    depend on any language's float formatting."""
    return rfc8785.dumps({k: body[k] for k in CHECKSUM_FIELDS})


def checksum(body: Mapping[str, Any]) -> str:
    """``sha256:`` + hex SHA-256 of :func:`canonical`: what a verifier recomputes, in any language."""
    if body.get("checksum_alg") != CHECKSUM_ALG:
        raise ChargebackError(f"checksum_alg {body.get('checksum_alg')!r} cannot be re-derived by this release; "
                              f"accepted: {CHECKSUM_ALG!r} (statements issued before it say 'sha256-json-v1')")
    return "sha256:" + hashlib.sha256(canonical(body)).hexdigest()


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


CSV_COLUMNS = ("statement_id", "period", "log_first_sequence", "log_last_sequence", "team", "project", "queue",
               "flavor", "guaranteed_gpu_hours", "borrowed_gpu_hours", "lost_gpu_hours", "idle_gpu_hours",
               "unit_price", "usage_amount", "idle_amount", "other_amount", "amount", "currency", "provisional",
               "checksum", "adjusts_period")
"""The statement's CSV (every door's): one row per item, then one per adjustment (``adjusts_period``
set: the closed period it corrects), figures as the statement writes them."""


def to_csv(*bodies: Mapping[str, Any]) -> str:
    """Statements as CSV (RFC 4180: CRLF line ends, one header row), one row per item and per
    adjustment: what ``gpusched chargeback --format csv`` and ``GET /v1/chargeback?format=csv``
    both send (and ``--issued --format csv``, every issued statement in one file)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for body in bodies:
        head = (body["statement_id"], body["period"], body["first_sequence"], body["last_sequence"])
        tail = (body["currency"], "true" if body["provisional"] else "false", body["checksum"])
        for item in body["items"]:
            writer.writerow(head + tuple(item[c] for c in CSV_COLUMNS[4:17]) + tail + ("",))
        for adj in body["adjustments"]:
            writer.writerow(head + tuple(adj[c] for c in CSV_COLUMNS[4:17]) + tail + (adj["adjusts_period"],))
    return out.getvalue()


def day_of(t: datetime) -> date:
    return t.astimezone(UTC).date()
