"""Pricing, roll-ups and statements (pure): split at price changes, corrections supersede, idle
quota under both policies, usage prorated over the days and periods an attempt ran in, stable
checksums."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.accounting.chargeback import (
    CSV_COLUMNS, Attempt, ChargebackError, PriceBook, PriceVersion, QuotaVersion, adjustments, canonical, checksum,
    parse_period, rollup, slices, statement, to_csv,
)

NOV = datetime(2026, 11, 1, tzinfo=UTC)
H = timedelta(hours=1)


def attempt(job: str, *, team="team-a", project=None, queue="q", flavor="a100", gpus=2, borrowed=0,
            start=NOV + H, hours=1.0, lost=0.0, n=1, wait=None) -> Attempt:
    return Attempt(job_id=job, attempt=n, team=team, project=project, queue=queue, flavor=flavor, gpus=gpus,
                   borrowed_gpus=borrowed, started_at=start, ended_at=start + hours * H, lost_gpu_seconds=lost,
                   wait_seconds=wait)


def price(at: datetime, seq: int, a100: float, *, idle="showback", cpu=None) -> PriceVersion:
    return PriceVersion(effective_from=at, sequence=seq, currency="USD", gpu_prices={"a100": a100},
                        cpu_core_hour=cpu, idle_quota=idle)


BOOK = [price(NOV - 30 * 24 * H, 1, 2.0)]


def test_parse_period_and_errors():
    assert parse_period("2026-12") == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    for bad in ("2026-13", "2026-1", "nov", "2026-11-01"):
        with pytest.raises(ChargebackError, match="accepted: YYYY-MM"):
            parse_period(bad)


def test_cost_is_split_at_a_price_change_and_a_correction_supersedes():
    change = NOV + 2 * H  # the attempt runs 1h..3h: one hour at each price
    book = PriceBook([price(NOV, 1, 2.0), price(change, 2, 4.0)])
    a = attempt("j1", hours=2.0)
    assert book.attempt_cost(a) == pytest.approx(2 * 2.0 + 2 * 4.0)
    corrected = PriceBook([price(NOV, 1, 2.0), price(change, 2, 4.0), price(change, 3, 3.0)])
    assert corrected.attempt_cost(a) == pytest.approx(2 * 2.0 + 2 * 3.0)
    assert PriceBook([price(NOV + 10 * H, 1, 2.0)]).attempt_cost(a) == 0.0  # no price in force: free


def test_cpu_price_applies_to_core_seconds():
    a = Attempt(**{**attempt("j1").__dict__, "cpu_core_seconds": 4 * 3600.0})
    assert PriceBook([price(NOV, 1, 0.0, cpu=0.5)]).attempt_cost(a) == pytest.approx(2.0)


def test_statement_counts_the_part_of_each_attempt_inside_the_period():
    crossing = attempt("j1", start=NOV - 2 * H, hours=3.0)  # October into November: its last hour
    october = attempt("j2", start=NOV - 5 * H, hours=1.0)
    into_december = attempt("j3", start=datetime(2026, 12, 1, tzinfo=UTC) - 2 * H, hours=4.0)  # first 2 h
    body = statement([crossing, october, into_december], BOOK, [], period="2026-11", group_by="team",
                     first_sequence=1, last_sequence=9)
    assert [(line["key"], line["gpu_hours"], line["total_cost"]) for line in body["lines"]] == [
        ("team-a", "6.000000", "12.00")]
    assert body["total_cost"] == "12.00" and body["last_sequence"] == 9
    december = statement([crossing, october, into_december], BOOK, [], period="2026-12", group_by="team",
                         first_sequence=1, last_sequence=9)
    assert december["lines"][0]["gpu_hours"] == "4.000000"


def test_lost_work_lands_where_the_attempt_ended_and_the_attempt_where_it_started():
    # 2 GPUs from 23:00 to 02:00; preempted, the last 30 minutes lost
    a = attempt("j1", start=NOV - H, hours=3.0, lost=2 * 1800.0, wait=60.0)
    days = rollup([a], BOOK, ["day"])
    assert [(d["day"], d["attempts"], d["gpu_hours"], d["lost_gpu_hours"], d["wait_p50_s"]) for d in days] == [
        ("2026-10-31", 1, 2.0, 0.0, 60.0), ("2026-11-01", 0, 4.0, 1.0, None)]
    (november,) = rollup([a], BOOK, ["team"], start=NOV, end=datetime(2026, 12, 1, tzinfo=UTC))
    assert november["gpu_hours"] == 4.0 and november["attempts"] == 0 and november["cost"] == pytest.approx(8.0)


def test_a_zero_length_attempt_counts_where_it_started():
    a = attempt("j1", start=NOV + H, hours=0.0)
    assert [(d["day"], d["attempts"], d["gpu_hours"]) for d in rollup([a], BOOK, ["day"])] == [("2026-11-01", 1, 0.0)]
    assert rollup([a], BOOK, ["team"], start=NOV + 2 * H) == []


@settings(max_examples=200, deadline=None)
@given(start_min=st.integers(0, 60 * 24 * 40), minutes=st.integers(0, 60 * 24 * 10), gpus=st.integers(1, 8),
       lost_min=st.integers(0, 60 * 24 * 10), cpu=st.floats(0, 1e6), change_min=st.integers(0, 60 * 24 * 50))
def test_property_the_days_of_an_attempt_add_up_to_the_attempt(start_min, minutes, gpus, lost_min, cpu, change_min):
    """Prorating loses and invents nothing: summed over its days (or over two periods), an
    attempt's GPU, lost, CPU figures and cost are the whole attempt's, whatever the price changes."""
    start = NOV - 10 * 24 * H + timedelta(minutes=start_min)
    a = Attempt(job_id="j", attempt=1, team="t", project=None, queue="q", flavor="a100", gpus=gpus, borrowed_gpus=1,
                started_at=start, ended_at=start + timedelta(minutes=minutes),
                lost_gpu_seconds=gpus * 60.0 * min(lost_min, minutes), cpu_core_seconds=cpu)
    book = [price(NOV - 60 * 24 * H, 1, 2.0, cpu=0.1), price(NOV - 10 * 24 * H + timedelta(minutes=change_min), 2, 3.5, cpu=0.2)]
    (whole,) = rollup([a], book, ["team"])
    days = rollup([a], book, ["day"])
    for key in ("gpu_hours", "borrowed_gpu_hours", "lost_gpu_hours", "cost"):
        assert sum(d[key] for d in days) == pytest.approx(whole[key], rel=1e-9, abs=1e-9), key
    assert sum(d["attempts"] for d in days) == 1
    pieces = [slices(a, *parse_period(p))[0][0] for p in ("2026-10", "2026-11", "2026-12") if slices(a, *parse_period(p))]
    assert sum(p.cpu_core_seconds for p in pieces) == pytest.approx(cpu, rel=1e-9, abs=1e-6)
    assert all(d["gpu_hours"] <= gpus * 24 + 1e-9 for d in days)


def test_borrowed_and_lost_and_grouping():
    rows = [attempt("j1", team="team-a", project="vision", gpus=4, borrowed=1, lost=600.0),
            attempt("j2", team="team-b", gpus=1)]
    body = statement(rows, BOOK, [], period="2026-11", group_by="project", first_sequence=1, last_sequence=2)
    lines = {line["key"]: line for line in body["lines"]}
    assert set(lines) == {"vision", "-"}
    assert lines["vision"]["borrowed_gpu_hours"] == "1.000000"
    assert lines["vision"]["guaranteed_gpu_hours"] == "3.000000"
    assert lines["vision"]["lost_gpu_hours"] == "0.166667"


@pytest.mark.parametrize("policy, team_a_total", [("showback", "2.00"), ("charge-owner", "2880.00")])
def test_idle_guaranteed_quota_policies(policy, team_a_total):
    # queue q: 2 guaranteed a100 all November (720 h) for team-a, which used 1 GPU-hour of it
    history = [QuotaVersion(queue="q", owner="team-a", effective_from=NOV - H, quotas={"a100": 2}, sequence=1)]
    book = [price(NOV - H, 1, 2.0, idle=policy)]
    body = statement([attempt("j1", gpus=1)], book, history, period="2026-11", group_by="team", first_sequence=1,
                     last_sequence=3)
    (line,) = body["lines"]
    assert line["idle_gpu_hours"] == f"{720 * 2 - 1}.000000"
    assert line["idle_cost"] == f"{2 * (720 * 2 - 1)}.00"
    assert line["total_cost"] == team_a_total
    assert body["idle_quota"] == policy


def test_borrowed_use_does_not_reduce_the_owners_idle_quota():
    history = [QuotaVersion(queue="q", owner="team-a", effective_from=NOV, quotas={"a100": 1}, sequence=1)]
    body = statement([attempt("j1", gpus=2, borrowed=2, hours=720.0 - 1, start=NOV)], BOOK, history,
                     period="2026-11", group_by="queue", first_sequence=1, last_sequence=3)
    assert body["lines"][0]["idle_gpu_hours"] == "720.000000"


def test_checksum_is_stable_and_order_independent():
    rows = [attempt(f"j{i}", gpus=i % 3 + 1, hours=0.1 * i) for i in range(1, 50)]
    a = statement(rows, BOOK, [], period="2026-11", group_by="team", first_sequence=1, last_sequence=5)
    b = statement(list(reversed(rows)), BOOK, [], period="2026-11", group_by="team", first_sequence=1,
                  last_sequence=5)
    assert a == b and a["checksum"].startswith("sha256:") and checksum(a) == a["checksum"]
    c = statement(rows, BOOK, [], period="2026-11", group_by="team", first_sequence=1, last_sequence=6)
    assert c["checksum"] != a["checksum"]  # the log range is part of what is signed


def test_statement_rejects_unknown_dimension():
    with pytest.raises(ChargebackError, match="accepted: team, project, queue, flavor"):
        statement([], BOOK, [], period="2026-11", group_by="day", first_sequence=1, last_sequence=1)


def test_rollup_by_dimensions_with_wait_percentiles():
    rows = [attempt("j1", wait=10.0), attempt("j2", wait=30.0, flavor="h100"), attempt("j3", wait=20.0)]
    out = rollup(rows, BOOK, ["team", "flavor"])
    assert [(r["team"], r["flavor"], r["attempts"]) for r in out] == [("team-a", "a100", 2), ("team-a", "h100", 1)]
    assert out[0]["wait_p50_s"] == 15.0 and out[0]["cost"] == pytest.approx(8.0)
    assert rollup(rows, BOOK, ["day"])[0]["day"] == "2026-11-01"
    with pytest.raises(ChargebackError, match="accepted dimensions: team, project, queue, flavor, day"):
        rollup(rows, BOOK, ["colour"])


# -- money as money (docs/accounting.md#money) -------------------------------------------------

def test_amounts_are_rounded_half_to_even_to_the_minor_unit_from_the_rounded_hours():
    # 0.25 GPU for 1234.567 s = 0.085734 GPU-hours (rounded); x 2.1 = 0.1800414 -> "0.18"
    a = Attempt(job_id="j", attempt=1, team="t", project=None, queue="q", flavor="a100", gpus=0.25,
                borrowed_gpus=0.0, started_at=NOV + H, ended_at=NOV + H + timedelta(seconds=1234.567))
    body = statement([a], [price(NOV, 1, 2.1)], [], period="2026-11", group_by="team", first_sequence=1,
                     last_sequence=2)
    (item,) = body["items"]
    assert (item["gpu_hours"], item["unit_price"], item["usage_amount"], item["amount"]) == (
        "0.085734", "2.1", "0.18", "0.18")
    # half to even at the minor unit: 0.5 h x 0.05 = 0.025 -> 0.02; 1.5 h x 0.05 = 0.075 -> 0.08
    halves = [attempt("j1", gpus=1, hours=0.5), attempt("j2", team="u", gpus=1, hours=1.5)]
    body = statement(halves, [price(NOV, 1, 0.05)], [], period="2026-11", group_by="team", first_sequence=1,
                     last_sequence=2)
    assert [i["amount"] for i in body["items"]] == ["0.02", "0.08"] and body["total_cost"] == "0.10"


def test_a_currency_without_cents_rounds_to_whole_units():
    book = [PriceVersion(effective_from=NOV, sequence=1, currency="JPY", gpu_prices={"a100": 333})]
    body = statement([attempt("j1", gpus=1, hours=1.5)], book, [], period="2026-11", group_by="team",
                     first_sequence=1, last_sequence=2)
    assert (body["minor_unit"], body["items"][0]["amount"], body["total_cost"]) == (0, "500", "500")


def test_an_item_per_price_in_force_and_csv_rows_are_the_items():
    a = attempt("j1", gpus=2, start=NOV + H, hours=2.0)  # 1 h at 2.0, then 1 h at 3.5
    book = [price(NOV, 1, 2.0), price(NOV + 2 * H, 2, 3.5)]
    body = statement([a], book, [], period="2026-11", group_by="team", first_sequence=3, last_sequence=7)
    assert [(i["unit_price"], i["gpu_hours"], i["amount"]) for i in body["items"]] == [
        ("2", "2.000000", "4.00"), ("3.5", "2.000000", "7.00")]
    rows = list(csv.reader(io.StringIO(to_csv({**body, "statement_id": "2026-11-team-7", "provisional": True}))))
    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == 3
    assert rows[1] == ["2026-11-team-7", "2026-11", "3", "7", "team-a", "-", "q", "a100", "2.000000", "0.000000",
                       "0.000000", "0.000000", "2", "4.00", "0.00", "0.00", "4.00", "USD", "true", body["checksum"], ""]


def test_the_checksum_is_sha256_of_rfc8785_over_string_figures():
    body = statement([attempt("j1", gpus=1, hours=4.0)], BOOK, [], period="2026-11", group_by="team",
                     first_sequence=1, last_sequence=2)
    text = canonical(body).decode()
    assert "14400" not in text and '"total_cost":"8.00"' in text and text.startswith('{"adjustments":[],"checksum_alg":"jcs-sha256"')
    assert not any(isinstance(v, float) for v in json.loads(text).values())
    with pytest.raises(ChargebackError, match="checksum_alg 'sha256-json-v1'"):
        checksum({**body, "checksum_alg": "sha256-json-v1"})


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["q1", "q2"]),
                               st.sampled_from(["a100", "l4"]), st.integers(1, 8000), st.integers(0, 1000),
                               st.integers(-24 * 3600, 31 * 24 * 3600), st.integers(0, 3 * 24 * 3600 * 1000)),
                     max_size=25),
       prices=st.lists(st.tuples(st.integers(0, 31 * 24), st.decimals(0, 100, places=3)), min_size=1, max_size=4),
       quota=st.integers(0, 4), by=st.sampled_from(["team", "project", "queue", "flavor"]),
       currency=st.sampled_from(["USD", "JPY", "KWD"]), policy=st.sampled_from(["showback", "charge-owner"]))
def test_property_totals_are_the_exact_sum_of_the_lines_and_the_lines_of_the_items(rows, prices, quota, by, currency,
                                                                                  policy):
    attempts = [Attempt(job_id=f"j{i}", attempt=1, team=t, project=None if i % 2 else "p", queue=q, flavor=f,
                        gpus=milli / 1000, borrowed_gpus=min(milli, b) / 1000, started_at=NOV + timedelta(seconds=s),
                        ended_at=NOV + timedelta(seconds=s, milliseconds=ms), cpu_core_seconds=ms / 7,
                        lost_gpu_seconds=milli / 1000 * ms / 3000)
                for i, (t, q, f, milli, b, s, ms) in enumerate(rows)]
    book = [PriceVersion(effective_from=NOV + h * H, sequence=n, currency=currency,
                         gpu_prices={"a100": p, "l4": p / 3}, cpu_core_hour=Decimal("0.04"), idle_quota=policy)
            for n, (h, p) in enumerate(prices)]
    history = [QuotaVersion(queue="q1", owner="a", effective_from=NOV - H, quotas={"a100": quota}, sequence=1)]
    body = statement(attempts, book, history, period="2026-11", group_by=by, first_sequence=1, last_sequence=9)
    D = Decimal
    assert D(body["total_cost"]) == sum((D(line["total_cost"]) for line in body["lines"]), D(0))
    assert D(body["total_gpu_hours"]) == sum((D(line["gpu_hours"]) for line in body["lines"]), D(0))
    for line in body["lines"]:
        mine = [i for i in body["items"] if i[by] == line["key"]]
        assert D(line["total_cost"]) == sum((D(i["amount"]) for i in mine), D(0))
        assert D(line["usage_cost"]) == sum((D(i["usage_amount"]) + D(i["other_amount"]) for i in mine), D(0))
        assert D(line["gpu_hours"]) == sum((D(i["gpu_hours"]) for i in mine), D(0))
    places = {"USD": 2, "JPY": 0, "KWD": 3}[currency]
    for item in body["items"]:
        assert D(item["gpu_hours"]) == D(item["guaranteed_gpu_hours"]) + D(item["borrowed_gpu_hours"])
        assert D(item["usage_amount"]) == (D(item["gpu_hours"]) * D(item["unit_price"])).quantize(D(1).scaleb(-places))
        assert -D(item["amount"]).as_tuple().exponent == places and D(item["amount"]) >= 0
        assert D(item["amount"]) == D(item["usage_amount"]) + D(item["other_amount"]) + (
            D(item["idle_amount"]) if policy == "charge-owner" else 0)
    assert checksum(body) == body["checksum"]


def test_what_the_log_learns_late_about_a_closed_period_is_an_adjustment_in_the_next():
    """November issued with a run counted to its end; the run's end (November 30, 12:00) is
    logged in December and a price is corrected: December's statement carries the difference per
    item (a credit is negative), less what an earlier statement already carried; November's
    statement is what it was."""
    nov30 = datetime(2026, 11, 30, tzinfo=UTC)
    running = attempt("late", gpus=1, start=nov30 + 10 * H, hours=14.0)  # counted up to the month's end
    issued = statement([running], BOOK, [], period="2026-11", group_by="team", first_sequence=1, last_sequence=5)
    ended = attempt("late", gpus=1, start=nov30 + 10 * H, hours=2.0)
    now = statement([ended], BOOK, [], period="2026-11", group_by="team", first_sequence=1, last_sequence=9)
    (adj,) = adjustments("2026-11", now["items"], issued["items"])
    assert (adj["adjusts_period"], adj["team"], adj["gpu_hours"], adj["usage_amount"], adj["amount"]) == (
        "2026-11", "team-a", "-12.000000", "-24.00", "-24.00")
    assert adjustments("2026-11", now["items"], issued["items"], [adj]) == []  # carried already: nothing left
    december = statement([attempt("d", team="team-b", gpus=1, start=datetime(2026, 12, 2, tzinfo=UTC))], BOOK, [],
                         period="2026-12", group_by="team", first_sequence=6, last_sequence=9, adjustments=[adj])
    assert december["adjustments"] == [adj]
    assert {line["key"]: line["total_cost"] for line in december["lines"]} == {"team-a": "-24.00", "team-b": "2.00"}
    assert december["total_cost"] == "-22.00" and checksum(december) == december["checksum"]
    rows = list(csv.DictReader(io.StringIO(to_csv({**december, "statement_id": "s", "provisional": False}))))
    assert [(r["team"], r["amount"], r["adjusts_period"]) for r in rows] == [("team-b", "2.00", ""),
                                                                            ("team-a", "-24.00", "2026-11")]
    # a price correction for November: +50 % on what was issued, per item
    fixed = statement([ended], [price(NOV - 30 * 24 * H, 2, 3.0)], [], period="2026-11", group_by="team",
                      first_sequence=1, last_sequence=9)
    assert [(a["unit_price"], a["gpu_hours"], a["amount"]) for a in
            adjustments("2026-11", fixed["items"], issued["items"])] == [("2", "-14.000000", "-28.00"),
                                                                        ("3", "2.000000", "6.00")]
