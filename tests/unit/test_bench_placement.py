"""bench.placement's inputs: the variant pod lists, the peer's Go draws, the peer's input documents."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from bench import peer, podlists
from gpusched.sim.trace import NODE_FILE, POD_FILE, fgd_tasks, load_trace, write_synthetic_trace


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    return write_synthetic_trace(tmp_path_factory.mktemp("trace"), nodes=24, tasks=600)


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _milli(row: dict) -> int:
    return podlists._milli(row)


def _share(rows: list[dict], which) -> float:
    return sum(_milli(r) for r in rows if which(r)) / sum(_milli(r) for r in rows)


@pytest.mark.parametrize("kind, level", [("cpu", 250), ("cpu", 50), ("multigpu", 80), ("gpuspec", 20),
                                         ("gpushare", 60), ("gpushare", 100)])
def test_variant_pod_lists_reach_their_share_from_the_same_columns(trace_dir, tmp_path, kind, level):
    default = _rows(trace_dir / POD_FILE)
    out = podlists.write(podlists.build(kind, level, trace_dir / POD_FILE, trace_dir / NODE_FILE, seed=1),
                         tmp_path / f"{kind}{level}.csv")
    rows = _rows(out)
    assert list(rows[0]) == list(default[0])  # the same columns
    assert [r["name"] for r in rows] == [f"openb-pod-{i:04d}" for i in range(len(rows))]
    gpu = [r for r in rows if int(r["num_gpu"]) > 0]
    if kind == "cpu":
        assert len(gpu) == sum(1 for r in default if int(r["num_gpu"]) > 0)
        assert abs((len(rows) - len(gpu)) / len(rows) - level / 1000) < 0.01
    elif kind == "multigpu":
        assert len(rows) > len(default) and _share(rows, lambda r: int(r["num_gpu"]) > 1) >= level / 100
    elif kind == "gpuspec":
        assert len(rows) == len(default)
        assert abs(_share(rows, lambda r: bool(r["gpu_spec"])) - level / 100) < 0.05
        nodes = _rows(trace_dir / NODE_FILE)
        for r in rows:  # every constraint can be met by some node
            if r["gpu_spec"]:
                assert any(n["model"] in r["gpu_spec"].split("|") and int(n["gpu"]) >= int(r["num_gpu"])
                           for n in nodes)
    else:
        share = _share(rows, podlists._is_share)
        assert abs(share - level / 100) < 0.08 and len(rows) == len(default)
    assert podlists.build(kind, level, trace_dir / POD_FILE, trace_dir / NODE_FILE, seed=1) == rows  # seeded


def test_variant_errors_name_the_accepted_values(trace_dir):
    with pytest.raises(ValueError, match="accepted: cpu, multigpu, gpuspec, gpushare"):
        podlists.build("cpuheavy", 10, trace_dir / POD_FILE, trace_dir / NODE_FILE)
    with pytest.raises(ValueError, match="cpu 001-900"):
        podlists.build("cpu", 950, trace_dir / POD_FILE, trace_dir / NODE_FILE)


@pytest.mark.skipif(shutil.which("go") is None, reason="go is not on PATH (bench/gorand is built with it)")
def test_go_draws_are_the_peers():
    from bench.gorand import GoDraws

    # The peer's log for seed 42 on its 8,152 pods: first created pods 0255, 1685, 6784; the first
    # appended pod is openb-pod-3888-tuned-0 (checked against a run of the peer).
    d = GoDraws(42, 8152, 2)
    items = list(range(8152))
    d.shuffle(items)
    assert items[:3] == [255, 1685, 6784] and sorted(items) == list(range(8152))
    assert d.randrange(8152) == 3888
    d.randrange(8152)
    with pytest.raises(ValueError, match="all 2 Go draws are used"):
        d.randrange(8152)
    with pytest.raises(ValueError, match="not Intn"):
        GoDraws(42, 8152, 1).randrange(10)


@pytest.mark.skipif(shutil.which("go") is None, reason="go is not on PATH (bench/gorand is built with it)")
def test_the_fgd_protocol_takes_go_draws(trace_dir):
    from bench.gorand import GoDraws

    t = load_trace(trace_dir)
    ratio = 1.5 * sum(x.milli for x in t.tasks) / (t.capacity * 1000)  # every row, then appended draws
    tasks = fgd_tasks(t, ratio=ratio, seed=7, draws=GoDraws(7, len(t.tasks), 5000))
    assert tasks == fgd_tasks(t, ratio=ratio, seed=7, draws=GoDraws(7, len(t.tasks), 5000))
    assert tasks != fgd_tasks(t, ratio=ratio, seed=7)  # Python's draws: the same construction, other tasks
    assert sorted(x.name for x in tasks[:len(t.tasks)]) == sorted(x.name for x in t.tasks)
    assert len(tasks) > len(t.tasks)


def test_peer_input_documents_follow_its_csv_to_yaml(tmp_path):
    node = peer._node({"sn": "openb-node-0001", "cpu_milli": "64000", "memory_mib": "262144", "gpu": "2",
                       "model": "P100"})
    assert node["metadata"]["labels"]["alibabacloud.com/gpu-card-model"] == "P100"
    assert node["status"]["capacity"] == {"alibabacloud.com/gpu-count": "2", "alibabacloud.com/gpu-milli": "2000",
                                          "cpu": "64000m", "memory": "262144Mi", "pods": "1001"}
    shared = peer._pod({"name": "p", "cpu_milli": "6000", "memory_mib": "12288", "num_gpu": "1", "gpu_milli": "460",
                        "gpu_spec": "A10||T4"})
    assert shared["metadata"]["annotations"] == {"alibabacloud.com/gpu-milli": "460", "alibabacloud.com/gpu-count": "1",
                                                 "alibabacloud.com/gpu-card-model": "A10|T4"}
    assert shared["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "6000m", "memory": "12288Mi"}
    cpu_only = peer._pod({"name": "c", "cpu_milli": "8000", "memory_mib": "0", "num_gpu": "0", "gpu_milli": "0",
                          "gpu_spec": ""})
    assert cpu_only["metadata"]["annotations"] == {}
    cc, sc = peer._configs(tmp_path, "FGD", 1.3, 42)
    assert json.loads(cc.read_text())["spec"]["customConfig"]["workloadTuningConfig"] == {"ratio": 1.3, "seed": 42}
    profile = json.loads(sc.read_text())["profiles"][0]
    assert profile["plugins"]["score"]["enabled"] == [{"name": "FGDScore", "weight": 1000}]
    with pytest.raises(peer.PeerUnavailable, match="not a checkout"):
        peer.source(tmp_path)


def test_real_lists_run_each_list_beside_the_peers_committed_figures(trace_dir, tmp_path, capsys):
    from bench import placement

    lists = tmp_path / "lists"
    lists.mkdir()
    for name in ("cpu050", "gpuspec20"):  # two of the peer's lists, both the tiny trace's pods here
        shutil.copy(trace_dir / POD_FILE, lists / f"openb_pod_list_{name}.csv")
    shutil.copy(trace_dir / NODE_FILE, lists / NODE_FILE)
    r = placement.main_lists(lists, ["cpu050", "gpuspec20"], tmp_path / "absent.csv", ["best-fit"], [42, 43],
                             1.3, "python", 2)
    assert r["nodes"] == str(lists / NODE_FILE)  # the directory's node list when it has one
    assert [(row["list"], row["policy"], row["seeds"]) for row in r["table"]] == [
        ("cpu050", "best-fit", [42, 43]), ("gpuspec20", "best-fit", [42, 43])]
    at = placement.POINTS.index(100)
    for row in r["table"]:
        assert (row["peer_best_fit"], row["peer_fgd"]) == placement.PEER_VARIANTS[row["list"]]
        runs = [x for x in r["runs"] if x["list"] == row["list"]]
        assert row["per_seed"] == [x["curve"][at] for x in sorted(runs, key=lambda x: x["seed"])]
        assert row["mean"] == round(sum(row["per_seed"]) / 2, 2)
        assert row["delta_vs_fgd"] == round(row["mean"] - row["peer_fgd"], 2)
    # the same pods under two names: the same figures
    assert r["table"][0]["per_seed"] == r["table"][1]["per_seed"]
    placement.report_lists(r)
    out = capsys.readouterr().out
    assert "cpu050" in out and "gpuspec20" in out and f"{placement.PEER_VARIANTS['gpuspec20'][1]:.2f}" in out
    assert "best-fit: above the peer's FGD on" in out


def test_real_lists_name_the_missing_file_and_where_the_lists_come_from(tmp_path):
    from bench import placement

    (tmp_path / "openb_pod_list_cpu050.csv").write_text("name\n")
    with pytest.raises(SystemExit, match=r"missing .*openb_pod_list_cpu100\.csv.*cluster-trace-gpu-v2023/csv"):
        placement.real_lists(tmp_path, ["cpu050", "cpu100"])
    with pytest.raises(SystemExit, match="not a list the peer reports; accepted: cpu050"):
        placement.real_lists(tmp_path, ["cpu075"])
    with pytest.raises(SystemExit, match="not a directory"):
        placement.real_lists(tmp_path / "nowhere", ["cpu050"])
    assert set(placement.real_lists(tmp_path, ["cpu050"])) == {"cpu050"}
