"""Notice, then grace, then stop, on `make run`'s own stack (issue 44, item 2): `gpusched dev up`
with the demo workload at 30 platform seconds a wall second, so that the demo's 60 s grace is two
wall seconds (`make run` runs 120: there it is half a wall second, which an overloaded 2-core
machine's notifier path has taken; at 60 `make test` here saw one notice 35 wall ms late while the
e2e tier ran at less than half its usual speed; `python -m bench.notice` reports the margins at
120, and at 60 on an idle machine 948 of the 1,000 wall ms), every demo team's webhook a real HTTP
receiver here. Each preemption notice reaches the team before its
deadline (on the platform clock); each running attempt it names stops at the deadline, not before,
and the team hears of the stop after the notice. The measurement is `bench.notice`'s, run until two
running attempts have been preempted, or 300 s (the demo's first reclaims come about 60 s after the start)."""

from __future__ import annotations

import pytest

from bench.notice import measure, report

pytestmark = pytest.mark.e2e


def test_the_notice_reaches_the_team_before_its_deadline_and_the_stop_comes_after(tmp_path):
    # Two running attempts stopped ends the run early; on a loaded
    # one the demo's reclaims often take a not-yet-started reservation instead, so one is enough.
    run = measure(tmp_path, 300, enough=2, time_scale=30.0)
    figures = report(run)
    assert len(run.stopped()) >= 1, f"the demo preempted no running attempt: {figures}"
    assert run.problems() == [], figures
    for n in run.stopped():
        assert n.arrived < n.deadline <= n.end_at and n.end_arrived > n.arrived
    logs = tmp_path / "logs"
    for log in logs.glob("*.log"):
        assert "Traceback" not in log.read_text(), f"{log.name} crashed"
