"""Price book and chargeback events (``gpusched.pricebook.<name>.updated``,
``gpusched.statement.<statement id>.issued``).

A price book is configuration, published by ``gpusched prices -f pricebook.yaml`` (or ``gpusched
apply -f`` a file with ``price_books:``). Every version carries the time it takes effect; costs are
always computed from the ledger and the price book history, so a corrected price book re-prices
history by replay (a new PriceBookUpdated with the same ``effective_from`` supersedes the old
one), never by a migration.

A chargeback statement is a fact accounting derived from the log: the totals for one period,
grouped by one dimension, the log range it was computed over, and a checksum that anyone can
re-derive by replaying the log up to ``last_sequence`` (``gpusched chargeback --verify``).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from .envelope import NAME_PATTERN, Contract, Event, Timestamp

IdleQuotaPolicy = Literal["showback", "charge-owner"]
"""Guaranteed quota a queue did not use: ``showback`` reports it (cost 0 in the totals);
``charge-owner`` bills it to the queue's owner (its first allowed team)."""

StatementDimension = Literal["team", "project", "queue", "flavor"]

PERIOD_PATTERN = r"^\d{4}-(0[1-9]|1[0-2])$"
"""A calendar month in UTC, ``YYYY-MM``."""


class FlavorPrice(Contract):
    """Price of one GPU of a flavor for one hour."""

    flavor: str = Field(pattern=NAME_PATTERN)
    gpu_hour: float = Field(ge=0, le=1e6, description="Price per GPU-hour in the book's currency")


class PriceBookUpdated(Event):
    aggregate: ClassVar[str] = "pricebook"
    type: Literal["PriceBookUpdated"] = "PriceBookUpdated"
    name: str = Field(default="default", pattern=NAME_PATTERN, description="Price book; accounting uses 'default'")
    effective_from: Timestamp = Field(description="Prices apply to usage from this instant until the next version")
    currency: str = Field(default="USD", pattern=r"^[A-Z]{3}$", description="ISO 4217 code")
    gpu_prices: tuple[FlavorPrice, ...] = Field(max_length=256, description="Per flavor; an unlisted flavor costs 0")
    cpu_core_hour: float | None = Field(default=None, ge=0, le=1e6, description="Price per CPU core-hour; None: free")
    memory_gib_hour: float | None = Field(default=None, ge=0, le=1e6, description="Price per GiB-hour; None: free")
    idle_quota: IdleQuotaPolicy = Field(default="showback", description="What unused guaranteed quota costs")

    @model_validator(mode="after")
    def _unique_flavors(self) -> "PriceBookUpdated":
        flavors = [p.flavor for p in self.gpu_prices]
        dupes = sorted({f for f in flavors if flavors.count(f) > 1})
        if dupes:
            raise ValueError(f"gpu_prices lists flavor(s) {dupes} more than once")
        return self


DECIMAL_PATTERN = r"^-?[0-9]+(\.[0-9]+)?$"
Figure = Annotated[str, Field(pattern=DECIMAL_PATTERN, max_length=40)]
"""A figure as a decimal string in plain notation (``"12.30"``, ``"1.500000"``): money and hours are
never binary floats, and the checksum's canonical form does not depend on any float formatting.
GPU-hours carry 6 places; money the currency's minor unit (docs/accounting.md#money)."""

CHECKSUM_ALGS = ("jcs-sha256", "sha256-json-v1")
ChecksumAlg = Literal["jcs-sha256", "sha256-json-v1"]
"""``jcs-sha256``: sha256 of the RFC 8785 (JCS) form of the statement's fields. ``sha256-json-v1``:
a statement issued before it (float figures, Python's ``json.dumps`` with sorted keys): its
checksum is told apart by this value and is not re-derivable by this release."""


class StatementItem(Contract):
    """One (team, project, queue, flavor, GPU-hour price) of the period: the billing line a finance
    tool reconciles; ``usage_amount`` = ``gpu_hours`` x ``unit_price`` rounded to the minor unit."""

    team: str = Field(max_length=253, description="The team that used the GPUs, or the idle quota's owner")
    project: str = Field(max_length=253, description="The job's project ('-' for none and for idle quota)")
    queue: str = Field(max_length=253)
    flavor: str = Field(max_length=253)
    unit_price: Figure = Field(description="GPU-hour price in force (the price book's figure)")
    gpu_hours: Figure = Field(description="guaranteed + borrowed")
    guaranteed_gpu_hours: Figure
    borrowed_gpu_hours: Figure = Field(description="On quota borrowed from the cohort")
    lost_gpu_hours: Figure = Field(description="Lost to preemption (since the last checkpoint)")
    idle_gpu_hours: Figure = Field(description="Guaranteed quota the team owns but did not use")
    usage_amount: Figure = Field(description="gpu_hours x unit_price, rounded to the minor unit (half to even)")
    idle_amount: Figure = Field(description="idle_gpu_hours x unit_price, rounded; billed only under charge-owner")
    other_amount: Figure = Field(description="CPU core-hours and memory GiB-hours at their prices, rounded")
    amount: Figure = Field(description="usage + other (+ idle under charge-owner): what the item bills")


class StatementAdjustment(StatementItem):
    """What the log learned about a closed period after its statement was issued (an end logged
    late, a price correction, a quota change), billed in the next open period: the differences of
    one item's figures (negative: a credit), with the period it corrects. The issued statement
    itself never changes."""

    adjusts_period: str = Field(pattern=PERIOD_PATTERN, description="The closed period it corrects")


class StatementLine(Contract):
    """One group's totals (a team, project, queue or flavor): exact sums of its items and adjustments."""

    key: str = Field(max_length=253, description="The group's value, e.g. the team name ('-' for none)")
    gpu_hours: Figure = Field(description="GPU-hours used in the period (guaranteed + borrowed)")
    guaranteed_gpu_hours: Figure
    borrowed_gpu_hours: Figure = Field(description="Part of gpu_hours on borrowed quota")
    lost_gpu_hours: Figure = Field(description="GPU-hours lost to preemption (since last checkpoint)")
    idle_gpu_hours: Figure = Field(description="Guaranteed quota the group owns but did not use")
    usage_cost: Figure = Field(description="Sum of its items' usage_amount + other_amount")
    idle_cost: Figure = Field(description="Billed under charge-owner; shown (not in total) under showback")
    total_cost: Figure = Field(description="Sum of its items' amount")


def statement_v1_to_v2(data: dict) -> dict:
    """Upcaster (schemas.registry.UPCASTERS): a version-1 statement, issued before ``jcs-sha256``
    (float figures in GPU-seconds), as version 2: the same figures as decimal strings in hours,
    its checksum kept and marked ``sha256-json-v1`` (not re-derivable by this release)."""
    def hrs(x) -> str:
        return format((Decimal(repr(float(x))) / 3600).quantize(Decimal("0.000001")), "f")

    def amt(x) -> str:
        return format(Decimal(repr(float(x))), "f")

    lines = []
    for line in data.get("lines", ()):
        line = dict(line)
        if "gpu_seconds" in line:
            g, b = line.pop("gpu_seconds"), line.pop("borrowed_gpu_seconds")
            line = {"key": line["key"], "gpu_hours": hrs(g), "guaranteed_gpu_hours": hrs(g - b),
                    "borrowed_gpu_hours": hrs(b), "lost_gpu_hours": hrs(line["lost_gpu_seconds"]),
                    "idle_gpu_hours": hrs(line["idle_gpu_seconds"]), "usage_cost": amt(line["usage_cost"]),
                    "idle_cost": amt(line["idle_cost"]), "total_cost": amt(line["total_cost"])}
        lines.append(line)
    out = {**data, "lines": lines, "checksum_alg": "sha256-json-v1", "schema_version": 2}
    if "total_gpu_seconds" in out:
        out["total_gpu_hours"] = hrs(out.pop("total_gpu_seconds"))
    if not isinstance(out.get("total_cost"), str):
        out["total_cost"] = amt(out["total_cost"])
    return out


class ChargebackStatementIssued(Event):
    aggregate: ClassVar[str] = "statement"
    type: Literal["ChargebackStatementIssued"] = "ChargebackStatementIssued"
    schema_version: int = Field(default=2, ge=2, description="2: decimal-string figures, items, checksum_alg "
                                                             "(version 1 is upcast: statement_v1_to_v2)")
    period: str = Field(pattern=PERIOD_PATTERN, description="Calendar month (UTC), YYYY-MM")
    group_by: StatementDimension
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    minor_unit: int = Field(default=2, ge=0, le=4, description="Decimal places of the currency's minor unit (ISO 4217)")
    idle_quota: IdleQuotaPolicy
    items: tuple[StatementItem, ...] = Field(default=(), max_length=100_000,
                                             description="Per team, project, queue, flavor and price: the lines' parts")
    adjustments: tuple[StatementAdjustment, ...] = Field(
        default=(), max_length=100_000, description="Corrections of closed periods' issued statements, billed here")
    lines: tuple[StatementLine, ...] = Field(max_length=10_000, description="Per group: its items and adjustments")
    total_gpu_hours: Figure = Field(description="Sum of the lines' gpu_hours")
    total_cost: Figure = Field(description="Sum of the lines' total_cost")
    first_sequence: int = Field(ge=0, description="First stream sequence of the log range: the first event that happened in the "
                                                 "period or later (last_sequence + 1 when none did); earlier events count too "
                                                 "(a job submitted, a price set before the period)")
    last_sequence: int = Field(ge=0, description="Read models were at this sequence when it was computed")
    checksum_alg: ChecksumAlg = Field(description="How checksum was computed: jcs-sha256 (RFC 8785 over the body); "
                                                  "sha256-json-v1: issued by an earlier release")
    checksum: str = Field(pattern=r"^sha256:[0-9a-f]{64}$", description="Of the canonical statement body")
    supersedes: str | None = Field(default=None, max_length=200,
                                   description="The statement id this one revises (late events or a price "
                                               "correction changed the period); None for the first")
