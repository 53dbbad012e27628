"""Trace replay through the quota, scheduler and sim-executor cores (gpusched sim)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusched.cli.main import app
from gpusched.sim.trace import (TraceError, fgd_curve, fgd_tasks, inflation, load_trace, replay, workload_of,
                               write_synthetic_trace)
from services.scheduler.placement import Policy

REAL = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "alibaba-gpu-2023"


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    return write_synthetic_trace(tmp_path_factory.mktemp("trace"), nodes=24, tasks=240)


def test_load_trace(trace_dir):
    t = load_trace(trace_dir)
    assert len(t.nodes) == 24 and t.capacity == sum(n.gpu_count for n in t.nodes)
    assert all(n.gpu_sharable and n.gpu_flavor == "gpu" for n in t.nodes)
    assert t.cpu_only > 0 and t.timed and len(t.gpu_tasks) + t.cpu_only == len(t.tasks)
    assert any(task.gpu_milli for task in t.tasks)
    assert abs(sum(workload_of(t.tasks).values()) - 1) < 1e-9


def test_malformed_trace_errors_name_the_file_and_row(tmp_path):
    with pytest.raises(TraceError, match="No such file"):
        load_trace(tmp_path)
    (tmp_path / "openb_node_list_gpu_node.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,1,1,eight,T4\n")
    with pytest.raises(TraceError, match=r"openb_node_list_gpu_node.csv:2: column 'gpu' is 'eight'"):
        load_trace(tmp_path)


def test_any_node_list_and_pod_list_by_path_with_model_lists_and_no_time_columns(tmp_path):
    nodes, pods = tmp_path / "my-nodes.csv", tmp_path / "my-pods.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn-t4,32000,65536,2,T4\nn-a10,32000,65536,2,A10\n"
                     "n-v100,32000,65536,8,V100M16\n")
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
                    "p1,4000,1024,1,1000,A10|T4\np2,4000,1024,1,1000,A10|T4\np3,4000,1024,1,1000,A10|T4\n"
                    "p4,4000,1024,1,1000,A10|T4\np5,4000,1024,1,1000,A10|T4\ncpu,8000,1024,0,0,\n")
    t = load_trace(nodes=nodes, pods=pods)
    assert not t.timed and t.cpu_only == 1 and t.tasks[0].models == ("A10", "T4")
    r = inflation(t, Policy.BEST_FIT, ratio=1.0, seed=1, protocol="fgd")
    # four GPUs are T4 or A10: a fifth such task fails although the V100 node is empty; CPU-only tasks run
    assert r["allocation_rate"] == round(4 / 12, 4) and r["failed"] > 0
    assert r["placed"] == 4 + sum(1 for task in fgd_tasks(t, ratio=1.0, seed=1) if task.gpus == 0)
    with pytest.raises(TraceError, match="replay needs the pod list's time columns"):
        replay(t, Policy.BEST_FIT)
    refused = CliRunner().invoke(app, ["sim", "--nodes", str(nodes), "--pods", str(pods)])
    assert refused.exit_code == 2 and "replay needs the pod list's time columns" in refused.output


@pytest.mark.parametrize("policy", list(Policy))
def test_replay_places_everything_and_is_deterministic(trace_dir, policy):
    t = load_trace(trace_dir)
    a = replay(t, policy)
    assert a["placed"] == a["finished"] == a["tasks"]
    assert 0 < a["allocation_rate"] <= 1
    assert a["wait_s"]["p50"] is not None and a["jct_s"]["p50"] >= a["wait_s"]["p50"]
    assert replay(t, policy) == a


def test_inflation_reaches_the_target_and_never_over_allocates(trace_dir):
    t = load_trace(trace_dir)
    r = inflation(t, Policy.FGD, ratio=1.3, seed=1)
    assert r["arrived_demand"] >= 1.3
    assert 0.5 < r["allocation_rate"] <= 1.0
    assert [c["arrived_demand"] for c in r["curve"]] == sorted(c["arrived_demand"] for c in r["curve"])
    assert r == inflation(t, Policy.FGD, ratio=1.3, seed=1)
    assert r != inflation(t, Policy.FGD, ratio=1.3, seed=2)
    with pytest.raises(ValueError, match="accepted: 0 < RATIO <= 10"):
        inflation(t, Policy.FGD, ratio=0, seed=1)


def test_cli_sim_side_by_side(trace_dir):
    runner = CliRunner()
    result = runner.invoke(app, ["sim", "--trace", str(trace_dir), "-p", "best-fit", "-p", "fgd", "-o", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [r["policy"] for r in data] == ["best-fit", "fgd"]
    result = runner.invoke(app, ["sim", "--trace", str(trace_dir), "--inflation", "1.3", "--seed", "4"])
    assert result.exit_code == 0 and "unallocated share" in result.stdout
    bad = runner.invoke(app, ["sim", "--trace", str(trace_dir), "-p", "worst-fit"])
    assert bad.exit_code == 2 and "accepted: first-fit, best-fit, fgd" in bad.output


def test_the_fgd_protocol_builds_the_peers_workload(trace_dir):
    t = load_trace(trace_dir)
    assert sum(x.milli for x in t.tasks) < 2.0 * t.capacity * 1000
    tasks = fgd_tasks(t, ratio=2.0, seed=42)
    originals, tuned = tasks[:len(t.tasks)], tasks[len(t.tasks):]
    assert sorted(x.name for x in originals) == sorted(x.name for x in t.tasks)  # every row, CPU-only included
    assert [x.name for x in originals] != sorted(x.name for x in t.tasks)  # shuffled
    assert all(x.name.endswith(f"-tuned-{i}") for i, x in enumerate(tuned))
    milli = sum(x.milli for x in tasks)
    assert milli <= 2.0 * t.capacity * 1000 < milli + 8000  # stopped at the first draw past the target
    assert fgd_tasks(t, ratio=2.0, seed=42) == tasks and fgd_tasks(t, ratio=2.0, seed=43) != tasks
    fewer = fgd_tasks(t, ratio=0.5, seed=42)
    assert sum(x.milli for x in fewer) <= 0.5 * t.capacity * 1000


@pytest.mark.parametrize("rows, expected", [
    # (arrived, used) in thousandths of a 10-GPU cluster: 1 % = 100
    # 0 % and 3 % have no row: the mean of the rows within ±1
    ([(100, 100), (140, 100), (200, 200)], {0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0}),
    ([(250, 100), (350, 300)], {1: 1.0, 2: 1.0, 3: 2.0, 4: 3.0, 5: 3.0}),  # 2.5 -> 2, 3.5 -> 4: half to even
])
def test_the_fgd_curve_is_read_as_the_peer_reads_it(rows, expected):
    assert fgd_curve(rows, capacity=10, top=5) == expected


def test_fgd_protocol_run(trace_dir):
    t = load_trace(trace_dir)
    r = inflation(t, Policy.FGD, ratio=1.3, seed=42, protocol="fgd")
    curve = r["allocation_pct_by_arrived_pct"]
    assert r["protocol"] == "fgd" and r["arrived_demand"] <= 1.3 and 0 < max(curve.values()) <= 100
    assert all(curve[p] <= p + 1.5 for p in curve)  # nothing is allocated before it arrives (± the rounding)
    assert r == inflation(t, Policy.FGD, ratio=1.3, seed=42, protocol="fgd")
    with pytest.raises(ValueError, match="accepted: gpusched, fgd"):
        inflation(t, Policy.FGD, ratio=1.3, seed=42, protocol="paper")


@pytest.mark.skipif(not REAL.exists(), reason="the real trace is not at ../shared/traces/")
def test_real_trace_loads():
    t = load_trace(REAL)
    assert len(t.nodes) == 1213 and t.capacity == 6212
