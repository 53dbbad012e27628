"""The dev stack's clusters (gpusched/dev/clusters.py): `--clusters` deals the spec's nodes out,
a `clusters:` file gives each cluster its own spec, bad input names the field and what is
accepted, and one cluster's executor per cluster gets its own credential, spec and name."""

from __future__ import annotations

import pytest

from gpusched.dev import clusters as devclusters
from gpusched.dev import run as devrun
from gpusched.dev import stack as devstack
from gpusched.errors import UserError

EXAMPLE = devrun.example("cluster.yaml")


def nodes(spec) -> list[tuple[str, str | None, int]]:
    return [(n.name, n.gpu_flavor, n.gpu_count) for n in spec.nodes()]


def test_the_example_cluster_dealt_to_two_clusters_keeps_its_gpus_and_each_numbers_its_nodes_from_0():
    plan = devclusters.plan(("east", "west"), None, EXAMPLE)
    assert list(plan) == ["east", "west"]
    for name in plan:
        assert nodes(plan[name]) == [("h100-0", "h100-80gb", 8), ("a100-0", "a100-40gb", 8), ("l4-0", "l4", 4)]
    assert sum(devclusters.gpus(s) for s in plan.values()) == 40
    assert devclusters.describe("east", plan["east"]) == "east: h100-0.east, a100-0.east, l4-0.east (20 GPUs)"


def test_dealing_goes_on_across_groups_one_node_at_a_time():
    plan = devclusters.plan(("a", "b", "c"), None, EXAMPLE)  # 6 nodes: h100 ×2, a100 ×2, l4 ×2
    assert [n[0] for n in nodes(plan["a"])] == ["h100-0", "a100-0"]
    assert [n[0] for n in nodes(plan["b"])] == ["h100-0", "l4-0"]
    assert [n[0] for n in nodes(plan["c"])] == ["a100-0", "l4-0"]


def test_no_clusters_is_one_unnamed_cluster_of_the_example_or_the_file(tmp_path):
    assert devclusters.plan((), None, EXAMPLE) is None
    assert devclusters.single_spec(None, EXAMPLE) == EXAMPLE
    own = tmp_path / "c.yaml"
    own.write_text("groups: [{prefix: x, count: 1, gpu_flavor: l4, gpu_count: 2}]\n")
    assert devclusters.plan((), own, EXAMPLE) is None and devclusters.single_spec(own, EXAMPLE) == own


def test_a_clusters_file_gives_each_cluster_its_spec_and_clusters_must_name_the_same(tmp_path):
    f = tmp_path / "clusters.yaml"
    f.write_text("clusters:\n"
                 "  north: {groups: [{prefix: gpu, count: 2, gpu_flavor: l4, gpu_count: 4}]}\n"
                 "  south: {groups: [{prefix: gpu, count: 1, gpu_flavor: a100-40gb, gpu_count: 8}]}\n")
    plan = devclusters.plan((), f, EXAMPLE)
    assert {k: nodes(v) for k, v in plan.items()} == {
        "north": [("gpu-0", "l4", 4), ("gpu-1", "l4", 4)], "south": [("gpu-0", "a100-40gb", 8)]}
    assert devclusters.plan(("south", "north"), f, EXAMPLE) == plan
    with pytest.raises(UserError, match=r"--clusters east,west and the clusters of .* \(north, south\) differ; "
                                        r"accepted: the same names, or --clusters left out"):
        devclusters.plan(("east", "west"), f, EXAMPLE)


@pytest.mark.parametrize(("text", "message"), [
    ("east,East", r"--clusters: 'East' is not a cluster name; accepted: a comma-separated list of names, each a DNS"),
    ("east,r1", r"--clusters: 'r1' is not a cluster name"),
    ("east,,west", r"--clusters: '' is not a cluster name"),
    ("east,west,east", r"--clusters: east named twice; accepted: distinct names"),
])
def test_bad_cluster_names_are_refused_with_what_is_accepted(text, message):
    with pytest.raises(UserError, match=message):
        devclusters.parse_names(text)
    assert devclusters.parse_names(" east, west ") == ("east", "west")


@pytest.mark.parametrize(("body", "message"), [
    ("clusters: {East: {groups: [{prefix: g, count: 1}]}}", r"clusters: 'East' is not a cluster name; accepted:"),
    ("clusters: {east: {groups: [{prefix: g, count: 0}]}}", r"clusters\.east\.groups\.0\.count: Input should be"),
    ("clusters: {east: {nodes: 3}}", r"clusters\.east\.groups: Field required"),
    ("clusters: []", r"clusters: expected a mapping of cluster name -> spec"),
    ("clusters: {east: {groups: [{prefix: g, count: 1}]}}\ngroups: []", r"unexpected key\(s\) groups beside"),
    ("groups: [{prefix: g, count: 1, gpu_count: 99}]", r"--cluster-file cluster spec .*: groups\.0\.gpu_count"),
])
def test_a_bad_cluster_file_names_the_field(tmp_path, body, message):
    f = tmp_path / "bad.yaml"
    f.write_text(body)
    with pytest.raises(UserError, match=message):
        devclusters.plan(("east",), f, EXAMPLE)


def test_more_clusters_than_nodes_is_refused(tmp_path):
    f = tmp_path / "small.yaml"
    f.write_text("groups: [{prefix: g, count: 2, gpu_flavor: l4, gpu_count: 1}]\n")
    with pytest.raises(UserError, match=r"--clusters names 3 clusters but .* has 2 node\(s\); accepted: at most 2"):
        devclusters.plan(("a", "b", "c"), f, EXAMPLE)


def test_a_data_directory_of_one_unnamed_cluster_refuses_named_clusters(tmp_path):
    run_dir = tmp_path / "run"
    assert devrun._layout(("east", "west"), None, run_dir).named == ("east", "west")  # new data: fine
    run_dir.mkdir()
    (run_dir / "clock.json").write_text("{}")  # it ran before, with no record of clusters: one unnamed
    with pytest.raises(UserError, match=r"--clusters east,west: .* holds a platform that ran one unnamed cluster"):
        devrun._layout(("east", "west"), None, run_dir)
    assert devrun._layout((), None, run_dir).named == ()  # as before: fine
    (run_dir / "clusters.json").write_text('["east", "west"]')
    assert devrun._layout(("east", "west", "north"), None, run_dir).named == ("east", "west", "north")


def test_each_cluster_has_an_executor_of_its_own_in_the_executors_place(tmp_path, monkeypatch):
    for variable in ("GPUSCHED_CLUSTER_LOST_AFTER_S", "GPUSCHED_CLUSTER_HEARTBEAT_S"):
        monkeypatch.delenv(variable, raising=False)
    specs = {"east": tmp_path / "east.yaml", "west": tmp_path / "west.yaml"}
    env = devstack.service_env(lambda name: {"GPUSCHED_NATS_USER": name}, "postgresql://x", cluster=EXAMPLE,
                               time_scale=120, epoch=0.0, clusters=specs, api_port=8080)
    assert list(env) == ["admission", "quota", "scheduler", "executor-east", "executor-west", "accounting",
                         "notifier", "serving", "api"]
    for name in specs:
        e = env[f"executor-{name}"]
        assert (e["GPUSCHED_NATS_USER"], e["GPUSCHED_CLUSTER"], e["GPUSCHED_SIM_CLUSTER"]) == (
            f"executor-{name}", name, str(specs[name]))
        assert devstack.procfile_service(f"executor-{name}") == "executor"
    assert "GPUSCHED_CLUSTER" not in env["scheduler"]
    # on a clock 120 times faster: a heartbeat every 2 s and a cluster lost after 20 s, on the wall clock
    assert (env["scheduler"]["GPUSCHED_CLUSTER_LOST_AFTER_S"], env["executor-east"]["GPUSCHED_CLUSTER_HEARTBEAT_S"]) \
        == ("2400", "240")
    single = devstack.service_env(lambda name: {}, "postgresql://x", cluster=EXAMPLE, time_scale=120, epoch=0.0)
    assert "executor" in single and "GPUSCHED_CLUSTER_LOST_AFTER_S" not in single["scheduler"]


def test_cluster_timing_set_in_the_environment_wins():
    assert devstack.cluster_timing(60, {"GPUSCHED_CLUSTER_LOST_AFTER_S": "30"}) == {
        "GPUSCHED_CLUSTER_HEARTBEAT_S": "120", "GPUSCHED_CLUSTER_LOST_AFTER_S": "30"}
    assert devstack.cluster_timing(100_000, {}) == {  # within what the services accept
        "GPUSCHED_CLUSTER_HEARTBEAT_S": "3600", "GPUSCHED_CLUSTER_LOST_AFTER_S": "86400"}

