"""bench.scale at a small size: the cores on a virtual clock keep every gang inside one cluster,
re-place a lost cluster's work in the others, and the report prints a number for every figure."""

from __future__ import annotations

import gc
import math
import re

import pytest

from bench import scale
from tests.unit.builders import at, scheduled


@pytest.fixture(scope="module")
def result() -> dict:
    # 8,000 GPUs in 4 clusters: losing one of two would leave too few GPUs to re-place its work
    try:
        return scale.run(gpus=8000, clusters=4, quota=0.85, backlog=1.2, load=0.5, runtime=300, steady=60, seed=7)
    finally:
        gc.unfreeze()  # run() freezes the folded state as the scheduler service does; not for the next tests


def test_the_burst_fills_the_quota_and_gangs_stay_in_one_cluster(result):
    assert result["gpus"] == 8000 and result["nodes"] == 1000
    assert result["first_cycle_placed"] > 0 and result["gangs_placed"] > 0  # run() asserts each is in one cluster
    assert 0.8 * result["quota"] * result["gpus"] <= result["allocated_first"] <= result["quota"] * result["gpus"]


def test_a_placement_across_two_clusters_fails_the_run():
    p = scale.Platform(["c0", "c1"], nodes_per_cluster=4)
    with pytest.raises(AssertionError, match="across clusters"):
        p.feed([scheduled("g", {"node-00000.c0": (0,), "node-00000.c1": (0,)}, when=at(1))])


def test_the_lost_clusters_work_is_placed_again_in_the_others(result):
    assert result["lost_cluster"] == "c0" and result["lost_attempts"] > 0
    assert result["not_replaced"] == 0  # and run() asserts that nothing was placed on c0 once lost
    assert result["lost_after_report_s"] == scale.LOST_AFTER_S
    assert result["replaced_p50_after_lost_s"] >= result["replace_floor_s"]  # the retry backoff comes first
    assert result["replace_scheduler_cycles"] >= result["replacing_cycles"] >= 1


def test_every_figure_printed_is_a_number(result, capsys):
    scale.report({**result, "runs": 1})
    out = capsys.readouterr().out
    assert not re.search(r"\b(None|nan|inf)\b", out)
    for label in ("events/s", "placements/s", "first cycle", "p99", "peak RSS", "GPUs allocated", "re-placed"):
        assert label in out
    for name in ("admission", "quota", "scheduler", "executor"):
        assert math.isfinite(result[f"{name}_s"]) and result[f"{name}_folded"] > 0
