"""pricebook.yaml -> PriceBookUpdated events (``gpusched prices -f``, or ``gpusched apply -f`` a
file with ``price_books:``). A version identical to the one the log already has for the same
book and ``effective_from`` is not published again; a changed one is a correction that supersedes
it (re-pricing: costs are always computed from the ledger and the price book history).

    price_books:
      - name: default                 # optional; accounting prices with 'default'
        effective_from: 2026-11-01T00:00:00Z
        currency: USD                 # optional, ISO 4217
        gpu_prices: {a100: 2.10, h100-80gb: 4.50}   # per GPU-hour
        cpu_core_hour: 0.04           # optional
        memory_gib_hour: 0.005        # optional
        idle_quota: showback          # or charge-owner
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gpusched.userinput import CHECKED_AT, checked, field_path, read_document, validate
from runtime import eventlog
from schemas import PriceBookUpdated, new_event, parse_event
from schemas.registry import SUBJECT_PREFIX


class PriceBookSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="default", max_length=63)  # NAME_PATTERN's limit, checked first
    effective_from: datetime
    currency: str = "USD"
    gpu_prices: dict[str, float] = Field(default_factory=dict)
    cpu_core_hour: float | None = None
    memory_gib_hour: float | None = None
    idle_quota: str = "showback"


class PriceBooksFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    price_books: list[PriceBookSpec]


def is_price_file(raw: Any) -> bool:
    return isinstance(raw, dict) and "price_books" in raw


def _payload(event: PriceBookUpdated) -> dict[str, Any]:
    return event.model_dump(mode="json", include={"name", "effective_from", "currency", "gpu_prices", "cpu_core_hour",
                                                  "memory_gib_hour", "idle_quota"})


async def current(js) -> dict[tuple[str, datetime], PriceBookUpdated]:
    """The latest logged version per (book, effective_from)."""
    out: dict[tuple[str, datetime], PriceBookUpdated] = {}
    async for msg in eventlog.read(js, subjects=[f"{SUBJECT_PREFIX}.pricebook.>"]):
        event = parse_event(msg.data)
        if isinstance(event, PriceBookUpdated):
            out[(event.name, event.effective_from)] = event
    return out


def parse(document: Any, source: str | Path) -> PriceBooksFile:
    """A price book file's document, checked down to the events it makes; UserError naming the
    file and the field."""
    parsed = validate(PriceBooksFile, document, source)
    for i, book in enumerate(parsed.price_books):
        checked(lambda: _probe(book, CHECKED_AT), f"{source}: price_books[{i}] ({field_path([book.name])})")
    return parsed


def read(path: Path) -> PriceBooksFile:
    return parse(read_document(path), path)


def plan(parsed: PriceBooksFile, existing: dict[tuple[str, datetime], PriceBookUpdated],
         now: datetime) -> list[PriceBookUpdated]:
    """The PriceBookUpdated events for the versions in ``parsed`` that the log does not have as they are."""
    out = []
    for book in parsed.price_books:
        probe = _probe(book, now)
        old = existing.get((probe.name, probe.effective_from))
        if old is not None and _payload(old) == _payload(probe):
            continue
        digest = json.dumps(_payload(probe), sort_keys=True)
        out.append(new_event(PriceBookUpdated, aggregate_id=book.name, producer="config", occurred_at=now,
                             key=f"{digest}@{now.isoformat()}", **_fields(book)))
    return out


def _fields(book: PriceBookSpec) -> dict[str, Any]:
    fields = book.model_dump()
    fields["gpu_prices"] = tuple({"flavor": f, "gpu_hour": p} for f, p in sorted(book.gpu_prices.items()))
    return fields


def _probe(book: PriceBookSpec, now: datetime) -> PriceBookUpdated:
    """The book's PriceBookUpdated without its id (which is derived from this payload)."""
    return PriceBookUpdated(event_id="pending", aggregate_id=book.name, occurred_at=now, producer="config",
                            **_fields(book))


def describe(event: PriceBookUpdated, existing: dict[tuple[str, datetime], PriceBookUpdated]) -> str:
    old = existing.get((event.name, event.effective_from))
    prices = ", ".join(f"{p.flavor} {p.gpu_hour:g}" for p in event.gpu_prices)
    head = f"from {event.effective_from.isoformat()}: {prices} {event.currency}/GPU-hour, idle quota {event.idle_quota}"
    if old is None:
        return "new version " + head
    before, after = _payload(old), _payload(event)
    changes = [f"{k}: {before[k]} → {after[k]}" for k in sorted(after) if before[k] != after[k]]
    return "correction (re-prices history) " + "; ".join(changes)
