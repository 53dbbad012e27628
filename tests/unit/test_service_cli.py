"""The service CLI's pure parts: a load curve from a file (what `gpusched report-load --curve`
plays and `python -m bench.serving --load-file` reads), refused with the file and line."""

from __future__ import annotations

import pytest

from gpusched.dev.run import example
from gpusched.cli.services import load_curve
from gpusched.userinput import UserError


def test_the_example_curve_is_a_day_of_hourly_points():
    curve = load_curve(example("load-diurnal.csv"))
    assert len(curve) == 25 and curve[0] == (0.0, 30.0) and curve[-1][0] == 86_400
    assert max(r for _, r in curve) == 300.0


@pytest.mark.parametrize("text, message", [
    ("", "no rows"),
    ("seconds,requests_per_second\n", "no rows"),
    ("0,10\n60\n", ":2: expected seconds,requests_per_second (numbers), got '60'"),
    ("0,10\n60,x\n", ":2: expected seconds,requests_per_second"),
    ("0,10\n60,-1\n", ":2: offsets and loads are finite, at least 0, and offsets never go back"),
    ("60,10\n0,10\n", ":2: offsets and loads are finite, at least 0, and offsets never go back"),
    ("0,10\n60,inf\n", ":2: offsets and loads are finite"),
])
def test_a_bad_curve_is_refused_with_the_line(tmp_path, text, message):
    f = tmp_path / "load.csv"
    f.write_text(text)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_curve(f)


@pytest.mark.parametrize("text, points", [
    ("0,1\n\n30,2.5\n", [(0.0, 1.0), (30.0, 2.5)]),  # blank lines skipped
    ("t,rps\n0,1\n", [(0.0, 1.0)]),  # a header
])
def test_a_curve_with_or_without_a_header(tmp_path, text, points):
    f = tmp_path / "load.csv"
    f.write_text(text)
    assert load_curve(f) == points
