"""The platform clock's start (issue 43): ``start + (wall - epoch) * scale``, start defaulting to the
epoch; GPUSCHED_CLOCK_START; `gpusched dev up --clock-start` (month-end, now, an ISO time) and the
data directory's run/clock.json; every service of the dev stack gets the same clock."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpusched.dev import stack as devstack
from gpusched.dev.run import MONTH_END_LEAD_S, parse_clock_start, plan_clock
from gpusched.errors import UserError
from runtime.clock import ScaledClock
from runtime.settings import ConfigError, Settings

EXAMPLE = Path(__file__).resolve().parents[2] / "gpusched" / "examples" / "cluster.yaml"


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("GPUSCHED_"):
            monkeypatch.delenv(name)


def test_a_clock_with_a_start_is_at_it_at_the_epoch_and_runs_at_its_scale():
    epoch, start = 1_800_000_000.0, ts("2026-12-31T18:00:00+00:00")
    clock = ScaledClock(time_scale=120.0, epoch=epoch, start=start)
    assert clock.platform(epoch) == start
    assert clock.platform(epoch + 180) == start + 6 * 3600  # 3 wall minutes: 6 platform hours
    assert clock.real_seconds(6 * 3600) == 180
    old = ScaledClock(time_scale=120.0, epoch=epoch)  # no start: the epoch, as before
    assert old.platform(epoch + 10) == epoch + 1200 and old.start is None


def test_settings_read_the_clock_start(monkeypatch):
    assert Settings.from_env().clock_start is None
    monkeypatch.setenv("GPUSCHED_CLOCK_START", "1798740000")
    assert Settings.from_env().clock_start == 1798740000.0
    monkeypatch.setenv("GPUSCHED_CLOCK_START", "soon")
    with pytest.raises(ConfigError, match=r"GPUSCHED_CLOCK_START='soon' is not a number; accepted: 0"):
        Settings.from_env()


@pytest.mark.parametrize("wall, start", [
    ("2026-12-07T15:45:00+00:00", "2026-12-31T18:00:00+00:00"),
    ("2026-02-01T00:00:00+00:00", "2026-02-28T18:00:00+00:00"),
    ("2026-11-30T17:59:59+00:00", "2026-11-30T18:00:00+00:00"),  # one second before the lead
    ("2026-12-31T20:00:00+00:00", "2027-01-31T18:00:00+00:00"),  # inside the lead: the next month's end
])
def test_month_end_starts_the_clock_six_hours_before_a_months_end_never_behind_the_wall(wall, start):
    assert MONTH_END_LEAD_S == 6 * 3600
    assert parse_clock_start("month-end", ts(wall)) == ts(start) >= ts(wall)


def test_now_and_iso_times():
    wall = ts("2026-12-07T15:45:00+00:00")
    assert parse_clock_start("now", wall) == wall
    assert parse_clock_start("2026-12-31T23:00:00Z", wall) == ts("2026-12-31T23:00:00+00:00")
    assert parse_clock_start("2026-12-31T23:00:00", wall) == ts("2026-12-31T23:00:00+00:00")  # no offset: UTC
    assert parse_clock_start("2027-01-01T01:00:00+02:00", wall) == ts("2026-12-31T23:00:00+00:00")


@pytest.mark.parametrize("text, message", [
    ("end-of-month", r"--clock-start 'end-of-month' is not accepted; accepted: month-end .*now .*ISO 8601"),
    ("2026-11-30T18:00:00Z", r"--clock-start '2026-11-30T18:00:00Z' is before the wall clock \(2026-12-07T15:45:00Z\)"),
    ("2100-01-01T00:00:00Z", r"--clock-start '2100-01-01T00:00:00Z' is out of range"),
])
def test_a_wrong_clock_start_is_refused_naming_the_option_and_what_is_accepted(text, message):
    with pytest.raises(UserError, match=message):
        parse_clock_start(text, ts("2026-12-07T15:45:00+00:00"))


def test_a_fresh_data_directory_starts_at_month_end_and_an_existing_one_keeps_its_clock(tmp_path):
    wall = ts("2026-12-07T15:45:00+00:00")
    clock_file = tmp_path / "clock.json"
    fresh = plan_clock(clock_file, 120.0, None, wall)
    assert fresh == {"epoch": wall, "time_scale": 120.0, "start": ts("2026-12-31T18:00:00+00:00")}
    assert plan_clock(clock_file, 120.0, "now", wall)["start"] == wall
    clock_file.write_text(json.dumps(fresh))
    assert plan_clock(clock_file, 60.0, "now", wall + 100) == fresh  # kept, with a warning
    with pytest.raises(UserError, match="--clock-start 'yesterday'"):
        plan_clock(clock_file, 120.0, "yesterday", wall)
    before = {"epoch": wall, "time_scale": 120.0}  # a data directory from before clock starts: at its epoch
    clock_file.write_text(json.dumps(before))
    kept = plan_clock(clock_file, 120.0, None, wall + 100)
    assert kept == before and ScaledClock(kept["time_scale"], kept["epoch"], kept.get("start")).platform(wall) == wall


def test_every_service_gets_the_same_clock(monkeypatch):
    env = devstack.service_env(lambda name: {}, "postgresql://x", cluster=EXAMPLE, time_scale=120, epoch=1.5,
                               start=1798740000.0, api_port=8080, clusters={"east": EXAMPLE, "west": EXAMPLE})
    clocks = {(e["GPUSCHED_TIME_SCALE"], e["GPUSCHED_CLOCK_EPOCH"], e["GPUSCHED_CLOCK_START"]) for e in env.values()}
    assert clocks == {("120", "1.5", "1798740000.0")} and len(env) >= 9
    for name in ("GPUSCHED_TIME_SCALE", "GPUSCHED_CLOCK_EPOCH", "GPUSCHED_CLOCK_START"):
        monkeypatch.setenv(name, env["scheduler"][name])
    settings = Settings.from_env()
    assert ScaledClock(settings.time_scale, settings.clock_epoch, settings.clock_start).platform(1.5) == 1798740000.0
    without = devstack.service_env(lambda name: {}, "postgresql://x", cluster=EXAMPLE, time_scale=120, epoch=1.5)
    assert all("GPUSCHED_CLOCK_START" not in e for e in without.values())
