"""What the console's pages say in words: a job's timeline as plain steps, durations, times and
amounts of money. The sentences themselves are :mod:`schemas.wording`'s (the notifier words its
notifications with them); this module only lays them out for a page and registers the
template filters every page uses (:func:`install`)."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from jinja2 import Environment

from schemas import Event
from schemas.wording import describe, duration, ended, when
from services.accounting import chargeback


def timeline(events: list[tuple[int, Event]]) -> list[dict[str, Any]]:
    """A job's events as the steps a person reads, oldest first: when, which attempt, the
    sentence, and the event as it was logged (for the page's "details" disclosure). Pass the
    events as the viewer may read them (gpusched.gateway.history.job_events ``seen_by``): the raw
    event is shown as given."""
    rows = []
    for seq, e in events:
        text = describe(e)
        if text is None:  # not a job's event: nothing a person needs in a job's story
            continue
        rows.append({"seq": seq, "time": e.occurred_at, "attempt": getattr(e, "attempt", None),
                     "text": text[:1].upper() + text[1:], "type": e.type, "raw": e.model_dump_json(indent=2)})
    return rows


def money(amount: float | Decimal | str | None, currency: str) -> str:
    """``1,234.50 EUR``: an amount with its currency, rounded to the currency's minor unit by
    the one rule money is rounded by (services.accounting.chargeback.money); ``–`` for None."""
    if amount is None or amount == "":
        return "–"
    try:
        value = chargeback.money(chargeback.dec(amount), currency)
    except InvalidOperation:
        return f"{amount} {currency}"
    return f"{value:,f} {currency}"


FILTERS = {"duration": duration, "when": when, "money": money, "ended": ended}
"""The template filters: ``{{ seconds|duration }}``, ``{{ at|when }}``, ``{{ cost|money(currency) }}``,
``{{ outcome|ended }}``."""


def install(env: Environment) -> None:
    env.filters.update(FILTERS)
