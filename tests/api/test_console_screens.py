"""The console's charts and occupancy map in a real browser (Debian's Chromium through Playwright)
on a stack running the demo workload (gpusched/dev/run.py: its queues, price book, sim cluster and
jobs) for a while: each page's screenshot goes to $GPUSCHED_ARTIFACTS/console (default
.artifacts/console; docs/img/console/ holds copies), each chart has data (a path or bars), axes
(tick labels) and a legend, the occupancy map a cell for every GPU, refreshed live; a member sees
its own team's series only. Then table-driven unit tests of gpusched/api/charts.py."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpusched.api import charts, tokens
from gpusched.config import pricebook
from gpusched.config import queues as queueconfig
from gpusched.dev import run as demo
from gpusched.gateway import commands
from runtime import eventlog
from schemas.auth import Role
from tests.api.stack import TEAMS, ApiStack
from tests.api.test_console import ROOT, browser, login  # noqa: F401 - the browser, as the console's tests have it

DEMO_JOBS = 60
TIME_SCALE = 240.0  # a platform hour in 15 wall seconds: the demo's jobs (10 to 60 min) run and end
CHARTS = ("allocation-team", "allocation-flavor", "utilization", "waits", "outcomes", "cost", "congestion")


@pytest.fixture(scope="module")
def shots() -> Path:
    out = Path(os.environ.get("GPUSCHED_ARTIFACTS", ROOT / ".artifacts")) / "console"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _demo_config() -> list:
    now = datetime.now(UTC)
    return [*queueconfig.plan_queues(demo.example("queues.yaml"), queueconfig.fold([]), now),
            *pricebook.plan(pricebook.read(demo.example("pricebook.yaml")), {}, now)]


@pytest.fixture(scope="module")
def demo_stack(postgres, tmp_path_factory):
    stack = ApiStack(tmp_path_factory.mktemp("demo-stack"), postgres, history=_demo_config(),
                     teams=(*TEAMS, *demo.TEAMS), cluster=demo.example("cluster.yaml").read_text(),
                     time_scale=TIME_SCALE).start()
    try:
        stack.tokens["researcher"] = asyncio.run(_member_token(stack, demo.TEAMS[0]))
        asyncio.run(_submit_demo(stack))
        yield stack
    finally:
        crashed = stack.stop()
    assert not crashed, f"tracebacks in the logs of {crashed}: {[stack.log(n)[-2000:] for n in crashed]}"


async def _member_token(stack: ApiStack, team: str) -> str:
    nc = await stack.admin()
    minted = tokens.mint()
    await eventlog.EventLog(nc.jetstream()).append(
        tokens.issued(minted, name="researcher", role=Role.MEMBER, team=team, issued_by="admin", now=datetime.now(UTC)))
    await nc.close()
    return minted.token


async def _submit_demo(stack: ApiStack) -> None:
    nc = await stack.admin()
    js = nc.jetstream()
    for _, command in demo.demo_workload(DEMO_JOBS):  # the demo's burst, all at once
        await commands.publish_command(js, command.spec.team, "submit", command,
                                       headers={"Nats-Msg-Id": f"demo-submit:{command.job_id}"})
    await nc.close()


CHART_CHECK = """(figure) => ({
  data: [...figure.querySelectorAll('path.series')].filter(p => (p.getAttribute('d').match(/,/g) || []).length >= 2)
        .length + figure.querySelectorAll('rect.series, circle.series').length,
  xTicks: [...figure.querySelectorAll('.x-tick')].map(t => t.textContent).filter(Boolean),
  yTicks: [...figure.querySelectorAll('.y-tick')].map(t => t.textContent).filter(Boolean),
  unit: figure.querySelector('.unit') ? figure.querySelector('.unit').textContent : '',
  legend: [...figure.querySelectorAll('.legend text')].map(t => t.textContent),
})"""


def _charts(page) -> dict[str, dict]:
    return {chart_id: page.locator(f"#chart-{chart_id}").evaluate(CHART_CHECK) for chart_id in CHARTS}


def _until_every_chart_has_data(page, url: str, deadline_s: float = 60) -> dict[str, dict]:
    """The demo runs until every chart has data and GPUs have been held for most of the window
    (the cost chart's bars in 3/4 of its buckets: a screenshot worth looking at); the charts as
    the page last showed them."""
    deadline = time.monotonic() + deadline_s
    while True:
        page.goto(url)
        seen = _charts(page)
        buckets = page.locator("#chart-cost rect.series").evaluate_all("(r) => new Set(r.map(b => b.getAttribute('x'))).size")
        if (all(c["data"] for c in seen.values()) and buckets >= 36) or time.monotonic() > deadline:
            return seen
        time.sleep(1)


def test_charts_have_data_axes_and_legends(demo_stack, browser, shots):
    page = login(browser, demo_stack, "ops")
    seen = _until_every_chart_has_data(page, f"{demo_stack.url}/console/charts?hours=1")
    page.screenshot(path=shots / "charts.png", full_page=True)
    for chart_id, c in seen.items():
        assert c["data"], f"{chart_id}: no data: {seen}"
        assert len(c["xTicks"]) >= 2 and len(c["yTicks"]) >= 2, f"{chart_id}: axes without tick labels: {c}"
        assert c["unit"] and c["legend"], f"{chart_id}: no unit or legend: {c}"
    assert set(seen["allocation-team"]["legend"]) == set(demo.TEAMS)  # an operator: every team
    assert set(seen["allocation-flavor"]["legend"]) == {"h100-80gb", "a100-40gb", "l4"}
    assert seen["cost"]["unit"] == "USD"  # the price book's currency
    assert seen["utilization"]["unit"] == "%"
    assert seen["utilization"]["legend"] == ["utilization (simulated)"]  # the sim executor's model, marked
    assert any(label.startswith("training p") for label in seen["waits"]["legend"])
    for hours in (24, 168):  # the other windows render with axes (their own tick labels)
        page.goto(f"{demo_stack.url}/console/charts?hours={hours}")
        c = page.locator("#chart-allocation-team").evaluate(CHART_CHECK)
        assert c["data"] and c["xTicks"] and c["yTicks"], (hours, c)

    member = login(browser, demo_stack, "researcher")
    member.goto(f"{demo_stack.url}/console/charts?hours=1")
    mine = _charts(member)
    assert mine["allocation-team"]["legend"] == [demo.TEAMS[0]]  # its own team's series only, as the API
    assert mine["cost"]["legend"] == [demo.TEAMS[0]]
    member.screenshot(path=shots / "charts-member.png", full_page=True)
    member.close()
    page.close()


def test_queues_show_guaranteed_borrowed_and_lent_bars(demo_stack, browser, shots):
    page = login(browser, demo_stack, "ops")
    page.goto(f"{demo_stack.url}/console/queues")
    bars = page.locator("#chart-quotas")
    rows = page.locator("#queues tr").count() - 1  # one bar per queue and flavor: the table's rows
    labels = bars.locator(".bar-label").all_text_contents()
    assert len(labels) == rows == 6, labels
    assert bars.locator("rect.series").count() >= rows and bars.locator(".x-tick").count() >= 2
    legend = bars.locator(".legend text").all_text_contents()
    assert {"guaranteed in use", "borrowed", "lent to others", "unused nominal"} <= set(legend)
    page.screenshot(path=shots / "queues.png", full_page=True)
    page.close()


def test_the_occupancy_map_has_a_cell_per_gpu_and_follows_the_cluster(demo_stack, browser, shots):
    with demo_stack.client("ops") as ops:
        nodes = ops.get("/v1/nodes").json()
    page = login(browser, demo_stack, "ops")  # the overview: /console
    cells = page.locator("#occupancy g.gpu")
    assert cells.count() == sum(n["gpu_count"] for n in nodes) == 40
    for n in nodes:
        assert page.locator(f"#occupancy g.gpu[data-node='{n['name']}']").count() == n["gpu_count"]
    assert page.locator("#occupancy figure.flavor").count() == 3  # nodes grouped by flavor
    legend = page.locator("#occupancy .legend-list li").all_inner_texts()
    held = page.locator("#occupancy g.gpu:not([data-free='1'])").count()
    assert held > 0 and "free" in legend and set(legend) & set(demo.TEAMS), legend
    assert page.locator("#chart-allocation-team path.series").count() >= 1  # allocation by team, at a glance
    assert page.locator("#chart-quotas rect.series").count() >= 1  # and the queues' borrowing
    page.screenshot(path=shots / "cluster.png", full_page=True)
    # live: the map is rendered again from /console/occupancy-part without reloading the page
    page.locator("#occupancy").evaluate("(e) => { e.dataset.stale = '1'; }")
    page.wait_for_function("() => !document.querySelector('#occupancy[data-stale]')", timeout=15_000)
    assert page.locator("#occupancy g.gpu").count() == 40
    page.close()

    member = login(browser, demo_stack, "researcher")
    legend = member.locator("#occupancy .legend-list li").all_inner_texts()
    assert not set(legend) & set(demo.TEAMS[1:]), legend  # other teams' GPUs are "other teams"
    assert member.locator("#occupancy g.gpu").count() == 40
    member.screenshot(path=shots / "cluster-member.png", full_page=True)
    member.close()


# -- gpusched/api/charts.py, table-driven -------------------------------------------------------

T0 = datetime(2026, 12, 7, 10, 0, tzinfo=UTC)


def _times(n: int, step_min: int = 30) -> list[datetime]:
    return [T0 + timedelta(minutes=step_min * i) for i in range(n)]


@pytest.mark.parametrize(("name", "values", "kind", "paths", "dots", "bars"), [
    ("empty series", [], "line", 0, 0, 0),
    ("all gaps", [None, None, None], "line", 0, 0, 0),
    ("one point", [3], "line", 0, 1, 0),
    ("gaps split a line", [0, 2, None, 4, 1, None, 3], "line", 1, 1, 0),  # one path: 2 subpaths; [3] a dot
    ("an area", [1, 2, None, 4], "area", 1, 0, 0),
    ("bars skip zeros", [1, 0, None, 4], "bars", 0, 0, 2),
])
def test_time_chart_draws_what_it_has(name, values, kind, paths, dots, bars):
    svg = charts.time_chart(_times(len(values)), [charts.Series("team-a", values)], "GPUs", kind=kind)
    assert svg.startswith("<svg") and svg.endswith("</svg>"), name
    assert svg.count('<path class="series') == paths, name
    assert svg.count('<circle class="series') == dots, name
    assert svg.count('<rect class="series') == bars, name
    assert ">team-a</text>" in svg and ">GPUs</text>" in svg, name  # legend and unit, always
    assert ("no data in this window" in svg) == (not any(values)), name


def test_a_gap_starts_a_new_subpath():
    svg = charts.time_chart(_times(7), [charts.Series("s", [0, 2, None, 4, 1, None, 3])], "x")
    d = svg.split(' d="')[1].split('"')[0]
    assert d.count("M") == 2 and d.count("L") == 2


def test_stacked_areas_sum_and_the_axis_covers_the_sum():
    a, b = [1, 2, 3], [2, None, 5]
    lows, highs = charts._stack([charts.Series("a", a), charts.Series("b", b)], 3)
    assert lows == [[0, 0, 0], [1, 2, 3]] and highs == [[1, 2, 3], [3, 2, 8]]
    svg = charts.time_chart(_times(3), [charts.Series("a", a), charts.Series("b", b)], "GPUs", kind="area")
    y_ticks = [t.split(">")[1].split("<")[0] for t in svg.split('class="tick y-tick"')[1:]]
    assert y_ticks == ["0", "2", "4", "6", "8"]  # the stacked top, 8, not the largest single value, 5


def test_names_are_escaped():
    svg = charts.time_chart(_times(2), [charts.Series('<script>"x"</script>', [1, 2])], "<b>")
    assert "<script>" not in svg and "&lt;script&gt;" in svg and "&lt;b&gt;" in svg
    bars = charts.quota_bars([{"queue": "<q>", "flavor": "f&", "nominal": 1, "used": 1, "borrowed": 0, "lent": 0}])
    assert "<q>" not in bars and "&lt;q&gt;" in bars and "f&amp;" in bars


@pytest.mark.parametrize(("first", "last", "labels"), [
    (T0, T0 + timedelta(hours=1), ["10:00", "10:10", "10:20", "10:30", "10:40", "10:50", "11:00"]),
    (T0 + timedelta(minutes=7), T0 + timedelta(hours=24), ["12:00", "18:00", "00:00", "06:00"]),
])
def test_time_ticks_are_round_times(first, last, labels):
    assert [t.strftime("%H:%M") for t in charts.time_ticks(first, last)][:len(labels)] == labels


@pytest.mark.parametrize(("seconds", "text"), [(45, "45 s"), (90, "1.5 min"), (7199.8, "2 h"), (86_400 * 2, "2 d")])
def test_durations_on_axes(seconds, text):
    assert charts.fmt_duration(seconds) == text


def test_series_and_times_must_agree():
    with pytest.raises(ValueError, match="series 'a': 2 values for 3 times"):
        charts.time_chart(_times(3), [charts.Series("a", [1, 2])], "x")
    with pytest.raises(ValueError, match="kind 'pie': accepted: line, area, bars"):
        charts.time_chart(_times(1), [], "x", kind="pie")


@pytest.mark.parametrize(("count", "holders", "cells"), [
    (4, [], [(), (), (), ()]),
    (4, [{"team": "a", "gpus": 2, "gpu_milli": None}, {"team": "b", "gpus": 1, "gpu_milli": None}],
     [(("a", 1.0),), (("a", 1.0),), (("b", 1.0),), ()]),
    (2, [{"team": "a", "gpus": 1, "gpu_milli": 250}, {"team": "b", "gpus": 1, "gpu_milli": 500},
         {"team": "a", "gpus": 1, "gpu_milli": 500}],  # a shared GPU split by fraction; the third share spills
     [(("a", 0.25), ("b", 0.5)), (("a", 0.5),)]),
    (1, [{"team": "a", "gpus": 3, "gpu_milli": None}], [(("a", 1.0),)]),  # more held than the node has: capped
])
def test_gpu_cells(count, holders, cells):
    assert [c.parts for c in charts.gpu_cells(count, holders)] == cells


def test_the_occupancy_map_names_only_a_members_team():
    nodes = [{"name": "n1", "gpu_flavor": "l4", "gpu_count": 2, "lost": False, "unschedulable": False}]
    holders = [{"node": "n1", "team": "a", "gpus": 1, "gpu_milli": None},
               {"node": "n1", "team": "b", "gpus": 1, "gpu_milli": None}]
    (flavor,) = charts.occupancy_map(nodes, holders, team="a")
    assert [c.parts for c in flavor["nodes"][0]["cells"]] == [(("a", 1.0),), (("other teams", 1.0),)]
    assert ">b " not in flavor["svg"] and flavor["svg"].count('class="gpu"') == 2
    (everyone,) = charts.occupancy_map(nodes, holders)
    assert "n1 GPU 1: b 1" in everyone["svg"]


def test_colours_depend_on_the_name_only():
    assert charts.colour("team-a") == charts.colour("team-a") and charts.colour("team-a") in charts.PALETTE
    assert len({charts.colour(t) for t in demo.TEAMS}) == 3  # the demo's teams are told apart


def test_allocation_buckets_cut_the_rollup_at_each_bucket():
    from decimal import Decimal

    from services.accounting import queries
    from services.accounting.chargeback import Attempt, PriceVersion

    def attempt(team, flavor, gpus, start_min, end_min):
        return Attempt(job_id=f"{team}-{start_min}", attempt=1, team=team, project=None, queue="q", flavor=flavor,
                       gpus=gpus, borrowed_gpus=0, started_at=T0 + timedelta(minutes=start_min),
                       ended_at=T0 + timedelta(minutes=end_min))

    prices = [PriceVersion(effective_from=T0 - timedelta(days=1), sequence=1, currency="EUR",
                           gpu_prices={"h100": Decimal("4"), "l4": Decimal("1")}, cpu_core_hour=None,
                           memory_gib_hour=None, idle_quota="showback")]
    rows = [attempt("a", "h100", 2, 0, 90),  # 2 GPUs for the first hour and a half
            attempt("b", "l4", 1, 30, 120)]  # 1 GPU from 0:30 to now
    now = T0 + timedelta(hours=2)
    out = queries.allocation_buckets(rows, prices, [T0, T0 + timedelta(hours=1)], 3600, now)
    assert out["by_team"] == {"a": [2.0, 1.0], "b": [0.5, 1.0]}  # mean GPUs held in each hour
    assert out["by_flavor"] == {"h100": [2.0, 1.0], "l4": [0.5, 1.0]}
    assert out["cost_by_team"] == {"a": [8.0, 4.0], "b": [0.5, 1.0]}  # GPU-hours × the price
    partial = queries.allocation_buckets(rows, prices, [T0 + timedelta(hours=1)], 3600, T0 + timedelta(minutes=75))
    assert partial["by_team"] == {"a": [2.0], "b": [1.0]}  # the last bucket: a mean over its time so far
    assert queries.allocation_buckets([], prices, [T0], 3600, now) == {"by_team": {}, "by_flavor": {},
                                                                       "cost_by_team": {}}


@pytest.mark.parametrize(("now", "count", "last"), [
    (T0, 4, T0 - timedelta(minutes=15)),  # a bucket that starts at now has no time in it yet
    (T0 + timedelta(seconds=1), 5, T0),
])
def test_buckets_end_with_the_one_holding_now(now, count, last):
    from services.accounting import queries

    got = queries.buckets(now, 1, 900)
    assert len(got) == count and got[-1] == last and got[0] == T0 - timedelta(hours=1)
