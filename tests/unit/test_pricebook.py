"""pricebook.yaml -> PriceBookUpdated: validation errors name the field; unchanged versions are
not published again; a changed version for the same effective time is a correction."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpusched.config import pricebook
from gpusched.userinput import UserError

NOW = datetime(2026, 11, 20, tzinfo=UTC)
GOOD = """
price_books:
  - effective_from: 2026-11-01T00:00:00Z
    gpu_prices: {a100: 2.1, h100-80gb: 4.5}
    cpu_core_hour: 0.04
    idle_quota: charge-owner
"""


def write(tmp_path, text):
    path = tmp_path / "pricebook.yaml"
    path.write_text(text)
    return pricebook.read(path)


def test_plan_publishes_new_and_changed_versions_only(tmp_path):
    (event,) = pricebook.plan(write(tmp_path, GOOD), {}, NOW)
    assert event.name == "default" and event.producer == "config" and event.idle_quota == "charge-owner"
    assert [(p.flavor, p.gpu_hour) for p in event.gpu_prices] == [("a100", 2.1), ("h100-80gb", 4.5)]
    existing = {(event.name, event.effective_from): event}
    assert pricebook.plan(write(tmp_path, GOOD), existing, NOW) == []
    (fix,) = pricebook.plan(write(tmp_path, GOOD.replace("2.1", "2.0")), existing, NOW)
    assert pricebook.describe(fix, existing).startswith("correction (re-prices history) gpu_prices:")
    assert pricebook.describe(event, {}).startswith("new version from 2026-11-01T00:00:00+00:00: a100 2.1")


@pytest.mark.parametrize("text, message", [
    ("price_books:\n  - gpu_prices: {a100: 1}\n", "price_books.0.effective_from: Field required"),
    ("price_books:\n  - effective_from: 2026-11-01T00:00:00Z\n    gpu_prices: {a100: -1}\n",
     "price_books[0] (default): gpu_prices.0.gpu_hour: Input should be greater than or equal to 0"),
    ("price_books:\n  - effective_from: 2026-11-01T00:00:00Z\n    idle_quota: free\n",
     "idle_quota: Input should be 'showback' or 'charge-owner'"),
    ("price_books:\n  - effective_from: 2026-11-01\n", "effective_from: Input should have timezone info"),
    ("price_books:\n  - effective_from: 2026-11-01T00:00:00Z\n    currency: usd\n", "currency: String should match"),
    ("price_books:\n  - effective_from: 2026-11-01T00:00:00Z\n    colour: red\n", "colour: Extra inputs are not permitted"),
])
def test_bad_files_name_the_field(tmp_path, text, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        write(tmp_path, text)
