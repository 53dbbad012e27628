"""Pricing, roll-ups and statements (pure): split at price changes, corrections supersede, idle
quota under both policies, usage prorated over the days and periods an attempt ran in, stable
checksums."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.accounting.chargeback import (
    Attempt, ChargebackError, PriceBook, PriceVersion, QuotaVersion, checksum, parse_period, rollup, slices,
    statement,
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
    assert [(line["key"], line["gpu_seconds"], line["total_cost"]) for line in body["lines"]] == [
        ("team-a", (1 + 2) * 2 * 3600.0, 12.0)]
    assert body["total_cost"] == 12.0 and body["last_sequence"] == 9
    december = statement([crossing, october, into_december], BOOK, [], period="2026-12", group_by="team",
                         first_sequence=1, last_sequence=9)
    assert december["lines"][0]["gpu_seconds"] == 2 * 2 * 3600.0


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
    assert lines["vision"]["borrowed_gpu_seconds"] == 3600.0
    assert lines["vision"]["lost_gpu_seconds"] == 600.0


@pytest.mark.parametrize("policy, team_a_total", [("showback", 2.0), ("charge-owner", 2.0 + 2.0 * (720 * 2 - 1))])
def test_idle_guaranteed_quota_policies(policy, team_a_total):
    # queue q: 2 guaranteed a100 all November (720 h) for team-a, which used 1 GPU-hour of it
    history = [QuotaVersion(queue="q", owner="team-a", effective_from=NOV - H, quotas={"a100": 2}, sequence=1)]
    book = [price(NOV - H, 1, 2.0, idle=policy)]
    body = statement([attempt("j1", gpus=1)], book, history, period="2026-11", group_by="team", first_sequence=1,
                     last_sequence=3)
    (line,) = body["lines"]
    assert line["idle_gpu_seconds"] == pytest.approx((720 * 2 - 1) * 3600.0)
    assert line["idle_cost"] == pytest.approx(2.0 * (720 * 2 - 1))
    assert line["total_cost"] == pytest.approx(team_a_total)
    assert body["idle_quota"] == policy


def test_borrowed_use_does_not_reduce_the_owners_idle_quota():
    history = [QuotaVersion(queue="q", owner="team-a", effective_from=NOV, quotas={"a100": 1}, sequence=1)]
    body = statement([attempt("j1", gpus=2, borrowed=2, hours=720.0 - 1, start=NOV)], BOOK, history,
                     period="2026-11", group_by="queue", first_sequence=1, last_sequence=3)
    assert body["lines"][0]["idle_gpu_seconds"] == pytest.approx(720 * 3600.0)


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
