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

from typing import ClassVar, Literal

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


class StatementLine(Contract):
    """One group's totals (a team, project, queue or flavor)."""

    key: str = Field(max_length=253, description="The group's value, e.g. the team name ('-' for none)")
    gpu_seconds: float = Field(ge=0, description="GPU-seconds used in the period (guaranteed + borrowed)")
    borrowed_gpu_seconds: float = Field(ge=0, description="Part of gpu_seconds on borrowed quota")
    lost_gpu_seconds: float = Field(ge=0, description="GPU-seconds lost to preemption (since last checkpoint)")
    idle_gpu_seconds: float = Field(ge=0, description="Guaranteed quota the group owns but did not use")
    usage_cost: float = Field(ge=0)
    idle_cost: float = Field(ge=0, description="Billed under charge-owner; shown (not in total) under showback")
    total_cost: float = Field(ge=0)


class ChargebackStatementIssued(Event):
    aggregate: ClassVar[str] = "statement"
    type: Literal["ChargebackStatementIssued"] = "ChargebackStatementIssued"
    period: str = Field(pattern=PERIOD_PATTERN, description="Calendar month (UTC), YYYY-MM")
    group_by: StatementDimension
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    idle_quota: IdleQuotaPolicy
    lines: tuple[StatementLine, ...] = Field(max_length=10_000)
    total_gpu_seconds: float = Field(ge=0)
    total_cost: float = Field(ge=0)
    first_sequence: int = Field(ge=0, description="First stream sequence of the log range: the first event that happened in the "
                                                 "period or later (last_sequence + 1 when none did); earlier events count too "
                                                 "(a job submitted, a price set before the period)")
    last_sequence: int = Field(ge=0, description="Read models were at this sequence when it was computed")
    checksum: str = Field(pattern=r"^sha256:[0-9a-f]{64}$", description="Of the canonical statement body")
    supersedes: str | None = Field(default=None, max_length=200,
                                   description="The statement id this one revises (late events or a price "
                                               "correction changed the period); None for the first")
