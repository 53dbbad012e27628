"""The FOCUS 1.2 export of a statement (pure): one row per cost kind of each item, the statement's
decimal strings as they are, BilledCost summing to the total, idle kept apart (billed only under
charge-owner), adjustments as corrections of their closed period."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from services.accounting.chargeback import Attempt, PriceVersion, QuotaVersion, statement, statement_id
from services.accounting.focus import COLUMNS, to_focus

NOV = datetime(2026, 11, 1, tzinfo=UTC)
H = timedelta(hours=1)
MANDATORY = ("BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodEnd",
             "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription", "ChargePeriodEnd",
             "ChargePeriodStart", "ContractedCost", "EffectiveCost", "InvoiceIssuerName", "ListCost", "PricingCategory",
             "PricingQuantity", "PricingUnit", "ProviderName", "PublisherName", "ServiceCategory", "ServiceName")
ADJ = {"adjusts_period": "2026-10", "team": "team-a", "project": "-", "queue": "q", "flavor": "a100",
       "unit_price": "2.1", "gpu_hours": "-12.000000", "guaranteed_gpu_hours": "-12.000000",
       "borrowed_gpu_hours": "0.000000", "lost_gpu_hours": "0.000000", "idle_gpu_hours": "12.000000",
       "usage_amount": "-25.20", "idle_amount": "25.20", "other_amount": "0.00", "amount": "-25.20"}


def body(idle: str, *, as_of: datetime | None = None) -> dict:
    adj = ADJ if idle == "showback" else {**ADJ, "amount": "0.00"}  # charge-owner: the idle part billed too
    book = [PriceVersion(NOV - 30 * 24 * H, 1, "USD", {"a100": 2.1}, cpu_core_hour=0.05, idle_quota=idle)]
    history = [QuotaVersion("q", "team-a", NOV - 24 * H, {"a100": 4}, 1)]
    attempts = [Attempt("j1", 1, "team-a", "llm", "q", "a100", 2, 0, NOV + H, NOV + 4.3333 * H, 0.0,
                        cpu_core_seconds=8 * 3600.0),
                Attempt("j2", 1, "team-b", None, "r", "a100", 1, 1, NOV + 2 * H, NOV + 3 * H, 1800.0)]
    b = statement(attempts, book, history, period="2026-11", group_by="team", first_sequence=1, last_sequence=40,
                  adjustments=[adj], as_of=as_of)
    b.update(statement_id=statement_id("2026-11", "team", 40), provisional=as_of is not None)
    if as_of is not None:
        b["as_of"] = as_of.isoformat()
    return b


def rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_every_mandatory_focus_column_and_the_platform_figures():
    out = to_focus(body("showback"))
    assert out.startswith(",".join(COLUMNS) + "\r\n") and set(MANDATORY) <= set(COLUMNS)
    got = rows(out)
    assert all(r[c] for r in got for c in MANDATORY if c != "ChargeClass")
    usage = next(r for r in got if r["x_CostKind"] == "usage" and r["SubAccountId"] == "team-a")
    assert (usage["ChargeCategory"], usage["ChargeClass"], usage["ConsumedUnit"], usage["PricingUnit"]) == (
        "Usage", "", "GPU-Hours", "GPU-Hours")
    assert usage["ConsumedQuantity"] == usage["PricingQuantity"] == usage["x_GpuHours"] == "6.666600"
    assert usage["ListUnitPrice"] == "2.10" and usage["BilledCost"] == usage["ListCost"] == "14.00"
    assert json.loads(usage["Tags"]) == {"gpusched/queue": "q", "gpusched/flavor": "a100", "gpusched/project": "llm"}
    assert (usage["ChargePeriodStart"], usage["ChargePeriodEnd"]) == ("2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z")
    assert (usage["x_StatementId"], usage["x_LogRange"], usage["x_Provisional"]) == ("2026-11-team-40", "1..40",
                                                                                     "false")
    assert usage["x_Checksum"].startswith("sha256:")
    b = next(r for r in got if r["SubAccountId"] == "team-b")
    assert (b["x_BorrowedGpuHours"], b["x_LostGpuHours"], b["x_GuaranteedGpuHours"]) == ("1.000000", "0.500000",
                                                                                          "0.000000")


def test_billed_cost_sums_to_the_statement_total_and_idle_is_billed_only_under_charge_owner():
    for policy in ("showback", "charge-owner"):
        b = body(policy)
        got = rows(to_focus(b))
        assert sum(Decimal(r["BilledCost"]) for r in got) == Decimal(b["total_cost"]), policy
        idle = [r for r in got if r["x_CostKind"] == "idle" and not r["ChargeClass"]]
        assert idle and all(Decimal(r["ListCost"]) > 0 for r in idle)
        if policy == "showback":
            assert {r["BilledCost"] for r in idle} == {r["EffectiveCost"] for r in idle} == {"0.00"}
        else:
            assert all(r["BilledCost"] == r["ListCost"] for r in idle)


def test_an_adjustment_is_a_correction_of_its_closed_period():
    got = [r for r in rows(to_focus(body("showback"))) if r["ChargeClass"]]
    assert {r["ChargeClass"] for r in got} == {"Correction"} and {r["ChargeCategory"] for r in got} == {"Usage"}
    usage = next(r for r in got if r["x_CostKind"] == "usage")
    assert (usage["ChargePeriodStart"], usage["ChargePeriodEnd"]) == ("2026-10-01T00:00:00Z", "2026-11-01T00:00:00Z")
    assert (usage["BillingPeriodStart"], usage["BillingPeriodEnd"]) == ("2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z")
    assert (usage["BilledCost"], usage["PricingQuantity"], usage["x_AdjustsPeriod"]) == ("-25.20", "-12.000000",
                                                                                         "2026-10")


def test_an_open_period_is_charged_up_to_as_of_and_marked_provisional():
    got = rows(to_focus(body("showback", as_of=NOV + 10 * 24 * H + timedelta(microseconds=5))))
    items = [r for r in got if not r["ChargeClass"]]
    assert {(r["ChargePeriodEnd"], r["x_Provisional"]) for r in items} == {("2026-11-11T00:00:01Z", "true")}  # as_of, up to the second
