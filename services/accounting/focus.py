"""A chargeback statement as FOCUS: the FinOps Open Cost and Usage Specification, version 1.2,
CostAndUsage dataset, one CSV (docs/accounting.md#focus-export). A pure function of the statement's body,
like :func:`services.accounting.chargeback.to_csv`: ``gpusched chargeback --format focus`` and
``GET /v1/chargeback?format=focus`` both send what :func:`to_focus` returns, byte for byte.

Rows, per statement item (and the same per adjustment line, as corrections):

* **usage**: the item's GPU-hours at its unit price (``usage_amount``), ChargeCategory ``Usage``;
* **idle**: the item's idle guaranteed quota, kept apart (OpenCost's idle allocation): its GPU-hours
  at the unit price are the ListCost; BilledCost and EffectiveCost are what the item's ``amount``
  bills of it (``amount - usage_amount - other_amount``): the idle amount under the price book's
  ``idle_quota: charge-owner``, 0 under ``showback`` (reported, not billed);
* **other**: CPU and memory (``other_amount``), when not 0.

An adjustment line (what the log learnt late about a closed, issued period) is a correction of
that period's usage: ChargeClass ``Correction``, ChargePeriod the closed period, BillingPeriod the
statement's. Every figure is the statement's own decimal string; the sum of BilledCost is the
statement's ``total_cost``.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from services.accounting.chargeback import NONE_KEY, minor_unit, parse_period, text

FOCUS_VERSION = "1.2"
PLATFORM = "gpusched"
"""BillingAccountId/Name, InvoiceIssuerName, ProviderName and PublisherName: the platform bills itself."""
SERVICE_CATEGORY = "Compute"
SERVICE_SUBCATEGORY = "Other (Compute)"
GPU_UNIT = "GPU-Hours"
OTHER_UNIT = "Charges"
ONE = "1.000000"
"""The quantity of a CPU-and-memory charge (one charge; GPU-hours' 6 places)."""
TAG_PREFIX = "gpusched/"
"""Provider-defined tag keys (queue, flavor, project) carry this prefix (FOCUS Tags: KeyValueFormat)."""

COLUMNS = (
    # FOCUS 1.2 mandatory columns
    "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodEnd",
    "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription", "ChargePeriodEnd",
    "ChargePeriodStart", "ContractedCost", "EffectiveCost", "InvoiceIssuerName", "ListCost", "PricingCategory",
    "PricingQuantity", "PricingUnit", "ProviderName", "PublisherName", "ServiceCategory", "ServiceName",
    # conditional and optional columns that apply
    "ChargeFrequency", "CommitmentDiscountStatus", "ConsumedQuantity", "ConsumedUnit", "ContractedUnitPrice",
    "InvoiceId", "ListUnitPrice", "PricingCurrency", "PricingCurrencyContractedUnitPrice",
    "PricingCurrencyEffectiveCost", "PricingCurrencyListUnitPrice", "ResourceId", "ResourceName", "ResourceType",
    "ServiceSubcategory", "SkuId", "SkuMeter", "SkuPriceDetails", "SkuPriceId", "SubAccountId", "SubAccountName",
    "Tags",
    # the platform's own figures
    "x_StatementId", "x_Period", "x_LogRange", "x_Checksum", "x_ChecksumAlg", "x_Provisional", "x_AsOf",
    "x_GroupBy", "x_CostKind", "x_IdlePolicy", "x_Project", "x_Queue", "x_Flavor", "x_GpuHours",
    "x_GuaranteedGpuHours", "x_BorrowedGpuHours", "x_LostGpuHours", "x_IdleGpuHours", "x_AdjustsPeriod",
)
"""The export's columns, in order (docs/accounting.md#focus-export says where each comes from)."""

ZERO_HOURS = "0.000000"


def _when(t: datetime) -> str:
    """FOCUS DateTimeFormat: ISO 8601 in UTC, to the second, with ``Z``."""
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _as_of(body: Mapping[str, Any]) -> datetime | None:
    raw = body.get("as_of")
    if not raw:
        return None
    return datetime.fromisoformat(raw) if isinstance(raw, str) else raw


def _charge_period(period: str, as_of: datetime | None) -> tuple[str, str]:
    """The month, or of an open month the part up to ``as_of`` (its exclusive end: ``as_of``
    rounded up to the second, the resolution of FOCUS's DateTimeFormat)."""
    start, end = parse_period(period)
    if as_of is not None and start < as_of < end:
        up = as_of.replace(microsecond=0) + (timedelta(seconds=1) if as_of.microsecond else timedelta(0))
        end = min(end, up)
    return _when(start), _when(end)


def _unit_price(price: str, currency: str) -> str:
    """A unit price as the statement writes it (``"2.1"``, ``"2"``), written to at least the
    currency's minor unit (``"2.10"``, ``"2.00"``; ``"2.125"`` stays): the same decimal, never an
    integer, so a reader that infers a column's type (the validator does) sees a decimal column."""
    d = Decimal(price)
    places = max(1, minor_unit(currency))
    return text(d.quantize(Decimal(1).scaleb(-places)) if d.as_tuple().exponent > -places else d)


def _consumed(quantity: str, unit: str, correction: bool) -> dict[str, str]:
    """ConsumedQuantity/Unit: null on a correction (FOCUS 1.2: it MAY be null there; the quantity
    corrected is in PricingQuantity and the x_ columns)."""
    return {"ConsumedQuantity": "", "ConsumedUnit": ""} if correction else {"ConsumedQuantity": quantity,
                                                                           "ConsumedUnit": unit}


def _rows(body: Mapping[str, Any], line: Mapping[str, Any], correction: bool) -> list[dict[str, str]]:
    """The FOCUS rows of one statement item or adjustment line."""
    currency, policy = body["currency"], body["idle_quota"]
    bill_start, bill_end = (_when(t) for t in parse_period(body["period"]))
    as_of = None if correction else _as_of(body)
    charge_start, charge_end = _charge_period(line["adjusts_period"] if correction else body["period"], as_of)
    team, project, queue, flavor = line["team"], line["project"], line["queue"], line["flavor"]
    price = _unit_price(line["unit_price"], currency)
    tags = {f"{TAG_PREFIX}queue": queue, f"{TAG_PREFIX}flavor": flavor}
    if project != NONE_KEY:
        tags[f"{TAG_PREFIX}project"] = project
    common = {
        "BillingAccountId": PLATFORM, "BillingAccountName": PLATFORM, "BillingCurrency": currency,
        "BillingPeriodStart": bill_start, "BillingPeriodEnd": bill_end,
        "ChargeClass": "Correction" if correction else "",
        "ChargePeriodStart": charge_start, "ChargePeriodEnd": charge_end,
        "InvoiceIssuerName": PLATFORM, "ProviderName": PLATFORM, "PublisherName": PLATFORM,
        "PricingCategory": "Standard", "ServiceCategory": SERVICE_CATEGORY, "ChargeFrequency": "Usage-Based",
        "ServiceSubcategory": SERVICE_SUBCATEGORY, "ChargeCategory": "Usage",
        "InvoiceId": "",  # a statement is not an invoice (its id: x_StatementId)
        "CommitmentDiscountStatus": "",  # no commitment discounts (ConsumedQuantity's rules read it)
        "ResourceId": f"{PLATFORM}/queue/{queue}/{flavor}", "ResourceName": f"{queue} ({flavor})",
        "ResourceType": "GPU queue",
        "SubAccountId": "" if team == NONE_KEY else team, "SubAccountName": "" if team == NONE_KEY else team,
        "Tags": json.dumps(tags, sort_keys=True, separators=(",", ":")),
        "x_StatementId": body["statement_id"], "x_Period": body["period"],
        "x_LogRange": f"{body['first_sequence']}..{body['last_sequence']}", "x_Checksum": body["checksum"],
        "x_ChecksumAlg": body["checksum_alg"], "x_Provisional": "true" if body.get("provisional") else "false",
        "x_AsOf": body.get("as_of") or "", "x_GroupBy": body["group_by"], "x_IdlePolicy": policy,
        "x_Project": project, "x_Queue": queue, "x_Flavor": flavor,
        "x_AdjustsPeriod": line["adjusts_period"] if correction else "",
        "x_GpuHours": ZERO_HOURS, "x_GuaranteedGpuHours": ZERO_HOURS, "x_BorrowedGpuHours": ZERO_HOURS,
        "x_LostGpuHours": ZERO_HOURS, "x_IdleGpuHours": ZERO_HOURS,
    }
    what = f"Correction for {line['adjusts_period']}: " if correction else ""
    who = f"team {team}" + (f", project {project}" if project != NONE_KEY else "")
    rows = []
    if Decimal(line["gpu_hours"]) or Decimal(line["usage_amount"]) or Decimal(line["lost_gpu_hours"]):
        usage = line["usage_amount"]
        rows.append({**common, "x_CostKind": "usage", "ServiceName": "GPU time",
                     "ChargeDescription": f"{what}GPU-hours of {who} on queue {queue}, flavor {flavor}, "
                                          f"at {price} {currency} per GPU-hour",
                     **_consumed(line["gpu_hours"], GPU_UNIT, correction), "PricingQuantity": line["gpu_hours"],
                     "PricingUnit": GPU_UNIT, "ListUnitPrice": price,
                     "ListCost": usage, "ContractedCost": usage, "EffectiveCost": usage, "BilledCost": usage,
                     "x_GpuHours": line["gpu_hours"], "x_GuaranteedGpuHours": line["guaranteed_gpu_hours"],
                     "x_BorrowedGpuHours": line["borrowed_gpu_hours"], "x_LostGpuHours": line["lost_gpu_hours"]})
    if Decimal(line["idle_gpu_hours"]) or Decimal(line["idle_amount"]):
        idle = line["idle_amount"]
        # what of the idle amount the line bills: its amount less usage and other (the idle amount under
        # charge-owner, 0 under showback; an adjustment's as its closed period billed it)
        billed = text(Decimal(line["amount"]) - Decimal(line["usage_amount"]) - Decimal(line["other_amount"]))
        rows.append({**common, "x_CostKind": "idle", "ServiceName": "Idle guaranteed GPU quota",
                     "ChargeDescription": f"{what}Idle guaranteed quota of queue {queue}, flavor {flavor}, owned by "
                                          f"{who}, at {price} {currency} per GPU-hour "
                                          f"(idle_quota {policy}: {'billed' if Decimal(billed) else 'not billed'})",
                     **_consumed(line["idle_gpu_hours"], GPU_UNIT, correction),
                     "PricingQuantity": line["idle_gpu_hours"], "PricingUnit": GPU_UNIT, "ListUnitPrice": price,
                     "ListCost": idle, "ContractedCost": idle, "EffectiveCost": billed, "BilledCost": billed,
                     "x_IdleGpuHours": line["idle_gpu_hours"]})
    if Decimal(line["other_amount"]):
        other = line["other_amount"]
        rows.append({**common, "x_CostKind": "other", "ServiceName": "CPU and memory",
                     "ChargeDescription": f"{what}CPU and memory of {who} on queue {queue}, flavor {flavor}",
                     **_consumed(ONE, OTHER_UNIT, correction), "PricingQuantity": ONE,
                     "PricingUnit": OTHER_UNIT, "ListUnitPrice": "" if correction else other,
                     "ListCost": other, "ContractedCost": other, "EffectiveCost": other, "BilledCost": other})
    return [_priced(r) for r in rows]


def _priced(row: dict[str, str]) -> dict[str, str]:
    """The SKU and price columns of a row: one SKU per GPU flavor (CPU and memory: one), one SKU
    price per unit price; no negotiated prices (contracted = list) and prices in the billing
    currency (the PricingCurrency columns repeat the billing ones)."""
    sku = "cpu-memory" if row["x_CostKind"] == "other" else f"gpu-{row['x_Flavor']}"
    price = row["ListUnitPrice"]
    return {**row, "SkuId": sku, "SkuPriceId": f"{sku}@{price}" if price else "", "SkuMeter": row["PricingUnit"],
            "SkuPriceDetails": json.dumps({"x_Flavor": row["x_Flavor"]}, separators=(",", ":"))
            if sku != "cpu-memory" else "{}",
            "ContractedUnitPrice": price, "PricingCurrency": row["BillingCurrency"],
            "PricingCurrencyListUnitPrice": price, "PricingCurrencyContractedUnitPrice": price,
            "PricingCurrencyEffectiveCost": row["EffectiveCost"]}


def focus_rows(*bodies: Mapping[str, Any]) -> list[dict[str, str]]:
    """The FOCUS rows of statements (bodies as every door answers them: with ``statement_id``,
    ``provisional`` and, for an open period, ``as_of``): items first, then adjustments."""
    out: list[dict[str, str]] = []
    for body in bodies:
        for item in body["items"]:
            out.extend(_rows(body, item, correction=False))
        for adj in body["adjustments"]:
            out.extend(_rows(body, adj, correction=True))
    return out


def to_focus(*bodies: Mapping[str, Any]) -> str:
    """Statements as a FOCUS 1.2 CostAndUsage CSV (RFC 4180: CRLF, one header row; a null is an
    empty field): what ``gpusched chargeback --format focus`` and ``GET /v1/chargeback?format=focus``
    both send."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\r\n")
    writer.writeheader()
    writer.writerows(focus_rows(*bodies))
    return out.getvalue()
