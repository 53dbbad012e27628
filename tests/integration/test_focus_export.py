"""The FOCUS export of statements the platform issued (the accounting service on a real nats-server
and Postgres, months closed on the log's clock, one with an end logged late: an adjustment), run
through the FinOps Foundation's own validator (PyPI focus-validator 2.2.1, FOCUS 1.2; `make
focus-validator` installs it into its own venv): no rule may fail, and a broken mandatory column
is a failure it reports (docs/accounting.md#focus-export)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

from conftest import eventually, service_settings
from runtime import eventlog
from schemas import NodeRegistered, new_event
from schemas.node import NodeInfo
from services.accounting import __main__ as accounting
from services.accounting.focus import COLUMNS
from tests.integration.test_accounting_ledger import (  # noqa: F401  (cli_env: a fixture)
    NOV, _caught_up, cli_env, december_event, job, scenario,
)

ROOT = Path(__file__).resolve().parents[2]
CRITERIA = ("SUB_ACCOUNT_SUPPORTED", "TAGGING_SUPPORTED", "BILLING_BASED_ON_PROVISIONED_RESOURCES_SUPPORTED",
            "RESOURCE_TYPE_ASSIGNMENT_SUPPORTED", "USAGE_MEASUREMENT_SUPPORTED", "PUBLIC_PRICE_LIST_SUPPORTED",
            "UNIT_PRICING_SUPPORTED")
"""The FOCUS 1.2 applicability criteria the export claims (docs/accounting.md#focus-export): teams
are sub accounts, queue and flavor are tags, a queue's flavor is the resource, GPU-hours are
measured, the price book is the price list and prices are per unit."""
RESULT = re.compile(r"^(✅|❌|⏭️) (\S+): (PASS|FAIL|SKIPPED)", re.M)


@pytest.fixture(scope="module")
def focus_validator() -> tuple[str, Path, dict]:
    """The validator `make focus-validator` installed (scripts/focus-validator.sh), its package
    folder (it reads its currency list relative to the working directory) and its rule model."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "focus-validator.sh")], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    exe = done.stdout.strip().splitlines()[-1]
    where = subprocess.run([str(Path(exe).parent / "python"), "-c",
                            "import focus_validator, pathlib; print(pathlib.Path(focus_validator.__file__).parent)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    package = Path(where)
    (model,) = (package / "rules").glob("model-1.2*.json")
    return exe, package.parent, json.loads(model.read_text())


def validate(focus_validator, data: Path) -> tuple[dict[str, str], list[str], str]:
    """Run the validator on a FOCUS CSV: every rule's result, the failures that count, its output.
    A failure does not count only where the rule is one alternative of an OR the validator passed
    (InvoiceId-C-003-C: null when there is no invoice, OR not null when there is one)."""
    exe, cwd, model = focus_validator
    done = subprocess.run([exe, "--data-file", str(data), "--validate-version", "1.2", "--block-download",
                           "--applicability-criteria", ",".join(CRITERIA)],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Total:" in out, out[-3000:]
    results = {rule: verdict for _, rule, verdict in RESULT.findall(out)}
    alternatives = set()
    for rule_id, rule in model["ModelRules"].items():
        req = rule["ValidationCriteria"].get("Requirement") or {}
        if req.get("CheckFunction") == "OR" and results.get(rule_id) == "PASS":
            alternatives |= {i["ModelRuleId"] for i in req.get("Items", [])
                             if i.get("CheckFunction") == "CheckModelRule"}
    failures = sorted(r for r, v in results.items() if v == "FAIL" and r not in alternatives)
    return results, failures, out


async def test_issued_statements_export_as_focus_that_the_official_validator_passes(
        nats_server, admin_js, pg_dsn, cli_env, focus_validator, tmp_path):
    nov30 = (datetime(2026, 11, 30, tzinfo=UTC) - NOV).total_seconds()
    late = job("late", "team-a", gpus=1, start=nov30 + 10 * 3600, end=nov30 + 12 * 3600)
    log = eventlog.EventLog(admin_js)
    for e in scenario() + late[:-1]:  # two teams in November; "late" still running as far as the log knows
        await log.append(e)
    await log.append(december_event())  # November closes
    stop = asyncio.Event()
    task = asyncio.create_task(accounting.run(service_settings(nats_server, "accounting", pg_dsn=pg_dsn), stop))

    async def count(n: int):
        got = [m.data async for m in eventlog.read(admin_js, subjects=["gpusched.statement.>"])]
        return got if len(got) >= n and await _caught_up(admin_js, pg_dsn) else None

    try:
        await eventually(lambda: count(1))
        await log.append(late[-1])  # its end, logged in December: an adjustment of November in December
        await log.append(new_event(NodeRegistered, aggregate_id="n10", producer="executor",
                                   occurred_at=datetime(2027, 1, 1, 2, tzinfo=UTC), key="1",
                                   node=NodeInfo(name="n10", gpu_flavor="a100", gpu_count=8)))  # December closes
        issued = [json.loads(raw) for raw in await eventually(lambda: count(2))]
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)

    env = {**os.environ, **nats_server.env("operator"), "GPUSCHED_PG_DSN": pg_dsn,
           "GPUSCHED_CONNECTION_FILE": "/nonexistent"}
    done = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "chargeback", "--issued", "--format", "focus"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    export = tmp_path / "focus.csv"
    export.write_bytes(done.stdout.encode())
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert done.stdout.splitlines()[0].split(",") == list(COLUMNS)
    for statement in issued:  # BilledCost sums to each issued statement's total, to the cent
        mine = [r for r in rows if r["x_Checksum"] == statement["checksum"]]
        assert mine and sum(Decimal(r["BilledCost"]) for r in mine) == Decimal(statement["total_cost"])
    (correction,) = [r for r in rows if r["ChargeClass"] == "Correction" and r["x_CostKind"] == "usage"]
    assert (correction["x_AdjustsPeriod"], correction["ChargePeriodStart"], correction["BillingPeriodStart"],
            correction["BilledCost"], correction["SubAccountId"]) == (
        "2026-11", "2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z", "-24.00", "team-a")

    results, failures, out = validate(focus_validator, export)
    assert failures == [], out[-6000:]
    for column in ("BilledCost", "EffectiveCost", "ListCost", "ContractedCost", "BillingCurrency", "ChargeCategory",
                   "ChargeClass", "ChargePeriodStart", "ChargePeriodEnd", "BillingPeriodStart", "BillingPeriodEnd",
                   "PricingQuantity", "PricingUnit", "ConsumedQuantity", "ConsumedUnit", "ListUnitPrice",
                   "SkuId", "SkuPriceId", "ServiceName", "SubAccountId", "Tags"):
        mine = {v for r, v in results.items() if r.startswith(f"{column}-C-")}
        assert "PASS" in mine and "FAIL" not in mine, (column, out[-6000:])  # checked, and passed

    # a mandatory column broken (BilledCost not a number in one row; BillingCurrency dropped) fails it
    broken = rows[0] | {"BilledCost": "twelve"}
    bad = tmp_path / "broken.csv"
    with bad.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows([broken, *rows[1:]])
    assert "BilledCost-C-000-M" in validate(focus_validator, bad)[1]
    dropped = [c for c in COLUMNS if c != "BillingCurrency"]
    with bad.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=dropped, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    failed = validate(focus_validator, bad)[1]
    assert any(r.startswith(("BillingCurrency-", "CostAndUsage-")) for r in failed), failed
