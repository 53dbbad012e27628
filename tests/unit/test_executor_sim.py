"""The sim executor (SimExecutorCore: the lifecycle core driving the sim backend in-line):\ninventory, attempts on the platform clock; the sim backend on its own; the cluster spec loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas import (
    FailureReason,
    JobCancelled,
    JobFailed,
    JobReady,
    JobStarted,
    JobSucceeded,
    NodeLost,
    NodeUpdated,
)
from services.executor.cluster import ClusterSpec, ClusterSpecError, load_cluster
from services.executor.lifecycle import BackendCore, Phase, reconcile
from services.executor.sim import (
    ANN_EXIT,
    ANN_FAIL_ATTEMPTS,
    ANN_REASON,
    DEFAULT_RUNTIME_S,
    SimBackend,
    SimExecutorCore,
    planned_outcome,
)
from tests.unit.builders import (
    T0,
    Log,
    at,
    cancel_requested,
    cancelled,
    drive,
    node_info,
    preempted,
    scheduled,
    spec,
    submitted,
    succeeded,
    types,
)

REPO = Path(__file__).resolve().parents[2]
CLUSTER = [node_info("n1", "a100", 8), node_info("n2.rack-1", "h100", 4)]


class Harness:
    def __init__(self, cluster=CLUSTER):
        self.core = SimExecutorCore(cluster)
        self.log = Log()
        self.inventory = self.feed()

    def feed(self, *events, now=T0):
        return drive(self.core, events, now, log=self.log)

    def run(self, job_id, nodes=("n1",), *, attempt=1, when=T0, submit=True, **spec_fields):
        """Submit (once) and schedule an attempt; returns the executor's decisions at ``when``."""
        events = []
        if submit:
            events.append(submitted(job_id, spec(**spec_fields), when=when))
        events.append(scheduled(job_id, {n: (0,) for n in nodes}, attempt=attempt, when=when))
        return self.feed(*events, now=when)


# -- inventory ---------------------------------------------------------------------------------


def test_nodes_registered_once():
    h = Harness()
    assert types(h.inventory) == ["NodeRegistered", "NodeRegistered"]
    assert [e.node for e in h.inventory] == CLUSTER
    assert [e.aggregate_id for e in h.inventory] == ["n1", "n2.rack-1"]
    assert all(e.occurred_at == T0 and e.producer == "executor" for e in h.inventory)
    assert h.core.decide(at(10)) == []
    assert h.feed(now=at(20)) == []


def test_restarted_executor_registers_nothing_new():
    first = Harness()
    again = SimExecutorCore(CLUSTER)
    for e in first.log.events:
        again.evolve(e)
    assert again.decide(at(100)) == []
    # a fresh log is registered with the same ids
    assert [e.event_id for e in SimExecutorCore(CLUSTER).decide(at(5))] == [e.event_id for e in first.inventory]


def test_changed_node_is_updated_and_removed_node_is_lost():
    h = Harness()
    changed = [node_info("n1", "a100", 8, unschedulable=True)]
    core = SimExecutorCore(changed)
    for e in h.log.events:
        core.evolve(e)
    out = core.decide(at(1))
    assert types(out) == ["NodeUpdated", "NodeLost"]
    upd, lost = out
    assert isinstance(upd, NodeUpdated) and upd.node == changed[0]
    assert isinstance(lost, NodeLost)
    assert (lost.aggregate_id, lost.name, lost.reason) == ("n2.rack-1", "n2.rack-1", "not in the cluster spec")


# -- attempts ----------------------------------------------------------------------------------


def test_scheduled_attempt_starts_then_succeeds_after_its_runtime():
    h = Harness()
    out = h.run("j1", ("n1", "n2.rack-1"), when=at(10), expected_runtime_seconds=100)
    (start,) = out
    assert isinstance(start, JobStarted)
    assert (start.attempt, start.nodes, start.occurred_at) == (1, ("n1", "n2.rack-1"), at(10))
    assert start.causation_id == h.log.events[-2].event_id  # the JobScheduled
    assert h.feed(now=at(109.999)) == []
    # noticed late, stamped when it happened
    (done,) = h.feed(now=at(500))
    assert isinstance(done, JobSucceeded)
    assert (done.attempt, done.started_at, done.occurred_at) == (1, at(10), at(110))
    assert done.causation_id == start.event_id
    assert h.feed(now=at(1000)) == []


def test_a_replica_runs_until_stopped_and_is_ready_after_its_delay():
    h = Harness()
    job = "replica-chat-1-0"
    ann = {"gpusched.io/service": "chat", "gpusched.io/readiness-delay": "30"}
    (start,) = h.run(job, when=at(10), annotations=ann)
    assert isinstance(start, JobStarted)
    assert h.core.next_wake() == at(40)
    assert h.feed(now=at(39)) == []
    (ready,) = h.feed(now=at(45))
    assert isinstance(ready, JobReady) and ready.occurred_at == at(40)
    assert h.feed(now=at(86_400 * 365)) == []  # a year on, it still runs


def test_default_runtime():
    h = Harness()
    h.run("j1")
    assert h.feed(now=at(DEFAULT_RUNTIME_S - 1)) == []
    (done,) = h.feed(now=at(DEFAULT_RUNTIME_S))
    assert done.occurred_at == at(60)


@pytest.mark.parametrize(
    "annotations, retry, reason, exit_code, retryable, message",
    [
        ({ANN_EXIT: "3"}, {}, FailureReason.EXIT_CODE, 3, False, "exited with code 3"),
        ({ANN_EXIT: "3"}, {"retry_on": ["exit-code"]}, FailureReason.EXIT_CODE, 3, True, "exited with code 3"),
        ({ANN_EXIT: "1", ANN_REASON: "oom-killed"}, {}, FailureReason.OOM_KILLED, 1, False, "oom-killed"),
        ({ANN_EXIT: "1", ANN_REASON: "evicted"}, {}, FailureReason.EVICTED, 1, True, "evicted"),
    ],
)
def test_exit_code_annotation_fails_the_attempt(annotations, retry, reason, exit_code, retryable, message):
    h = Harness()
    h.run("j1", expected_runtime_seconds=20, annotations=annotations, retry=retry)
    (fail,) = h.feed(now=at(20))
    assert isinstance(fail, JobFailed)
    assert (fail.reason, fail.exit_code, fail.retryable, fail.message) == (reason, exit_code, retryable, message)
    assert (fail.attempt, fail.started_at, fail.occurred_at) == (1, T0, at(20))


def test_fail_attempts_only_fails_the_first_n():
    h = Harness()
    ann = {ANN_EXIT: "2", ANN_FAIL_ATTEMPTS: "2"}
    h.run("j1", expected_runtime_seconds=10, annotations=ann, retry={"max_attempts": 5, "retry_on": ["exit-code"]})
    outcomes = []
    t = 0
    for attempt in (1, 2, 3):
        if attempt > 1:
            h.run("j1", attempt=attempt, when=at(t), submit=False)
        t += 10
        (end,) = h.feed(now=at(t))
        outcomes.append((end.type, end.attempt))
    assert outcomes == [("JobFailed", 1), ("JobFailed", 2), ("JobSucceeded", 3)]


def test_runtime_past_max_runtime_is_deadline_exceeded():
    h = Harness()
    h.run("j1", max_runtime_seconds=30)  # no expected runtime: the default 60 s
    assert h.feed(now=at(29)) == []
    (fail,) = h.feed(now=at(45))
    assert (fail.reason, fail.exit_code, fail.occurred_at) == (FailureReason.DEADLINE_EXCEEDED, 137, at(30))
    assert fail.retryable is False
    assert fail.message == "deadline-exceeded"


@pytest.mark.parametrize(
    "fields, attempt, expected",
    [
        ({}, 1, (60.0, None, 0)),
        ({"expected_runtime_seconds": 12.5}, 1, (12.5, None, 0)),
        ({"expected_runtime_seconds": 30, "max_runtime_seconds": 30}, 1, (30, None, 0)),
        ({"max_runtime_seconds": 59}, 1, (59.0, FailureReason.DEADLINE_EXCEEDED, 137)),
        ({"annotations": {ANN_EXIT: "0"}}, 1, (60.0, None, 0)),
        ({"annotations": {ANN_EXIT: ""}}, 1, (60.0, None, 0)),
        ({"annotations": {ANN_EXIT: "7"}}, 9, (60.0, FailureReason.EXIT_CODE, 7)),
        ({"annotations": {ANN_EXIT: "7", ANN_FAIL_ATTEMPTS: "1"}}, 1, (60.0, FailureReason.EXIT_CODE, 7)),
        ({"annotations": {ANN_EXIT: "7", ANN_FAIL_ATTEMPTS: "1"}}, 2, (60.0, None, 0)),
        ({"annotations": {ANN_EXIT: "7", ANN_FAIL_ATTEMPTS: "0"}}, 1, (60.0, None, 0)),
        ({"annotations": {ANN_EXIT: "1", ANN_REASON: "image-pull"}}, 1, (60.0, FailureReason.IMAGE_PULL, 1)),
        # a deadline wins over the annotations
        ({"max_runtime_seconds": 5, "annotations": {ANN_EXIT: "3"}}, 1, (5.0, FailureReason.DEADLINE_EXCEEDED, 137)),
        # a service's replica runs until stopped, unless it declares a runtime
        ({"annotations": {"gpusched.io/service": "chat"}}, 1, (10 * 365 * 86_400.0, None, 0)),
        ({"annotations": {"gpusched.io/service": "chat"}, "expected_runtime_seconds": 8}, 1, (8, None, 0)),
    ],
)
def test_planned_outcome(fields, attempt, expected):
    assert planned_outcome(spec(**fields), attempt) == expected


@pytest.mark.parametrize(
    "annotations, expected",
    [
        ({ANN_EXIT: "three"}, (60.0, None, 0)),
        ({ANN_EXIT: "3", ANN_FAIL_ATTEMPTS: "first"}, (60.0, FailureReason.EXIT_CODE, 3)),
        ({ANN_EXIT: "3", ANN_REASON: "gremlins"}, (60.0, FailureReason.EXIT_CODE, 3)),
    ],
)
def test_malformed_annotations_fall_back_to_defaults(annotations, expected):
    # Regression: a malformed annotation raised ValueError inside decide(), which stalled the
    # executor for every job, not only the one that carried it.
    assert planned_outcome(spec(annotations=annotations), 1) == expected


def test_malformed_annotation_does_not_stall_other_jobs():
    h = Harness()
    h.run("bad", expected_runtime_seconds=10, annotations={ANN_EXIT: "x"})
    h.feed(submitted("good", spec(expected_runtime_seconds=10)), scheduled("good", {"n1": (1,)}))
    assert sorted((e.aggregate_id, e.type) for e in h.feed(now=at(10))) == [
        ("bad", "JobSucceeded"), ("good", "JobSucceeded"),
    ]


def test_cancel_running_attempt():
    h = Harness()
    h.run("j1", expected_runtime_seconds=100)
    req = cancel_requested("j1", when=at(5), reason="wrong data")
    (event,) = h.feed(req, now=at(6))
    assert isinstance(event, JobCancelled)
    assert (event.attempt, event.started_at, event.reason, event.occurred_at) == (1, T0, "wrong data", at(6))
    assert event.causation_id == req.event_id
    assert h.feed(now=at(200)) == []  # no success after the cancel


def test_cancel_before_scheduling_and_after_cancel():
    h = Harness()
    h.feed(submitted("j1"))
    (event,) = h.feed(cancel_requested("j1"), now=at(1))
    assert (event.type, event.attempt, event.started_at) == ("JobCancelled", None, None)
    # a late placement of the cancelled job is not started
    assert h.feed(scheduled("j1"), now=at(2)) == []


def test_cancel_arriving_after_success_is_not_answered():
    # Regression: JobSucceeded is terminal, but a JobCancelRequested that admission wrote before
    # it saw the success was answered with JobCancelled: a second terminal event for the job.
    h = Harness()
    h.run("j1", expected_runtime_seconds=10)
    (done,) = h.feed(now=at(10))
    assert done.type == "JobSucceeded"
    assert h.feed(cancel_requested("j1", when=at(11)), now=at(11)) == []


def test_cancel_arriving_after_a_failure_is_answered():
    # whether a failure ends the job is quota's decision: the cancel stops any retry
    h = Harness()
    h.run("j1", expected_runtime_seconds=10, annotations={ANN_EXIT: "1"})
    (fail,) = h.feed(now=at(10))
    assert fail.type == "JobFailed"
    (event,) = h.feed(cancel_requested("j1", when=at(11)), now=at(11))
    assert (event.type, event.attempt) == ("JobCancelled", None)


def test_cancel_of_scheduled_not_started_attempt():
    h = Harness()
    core = h.core
    for e in (submitted("j1"), scheduled("j1"), cancel_requested("j1")):
        core.evolve(e)
    (event,) = core.decide(at(1))
    assert (event.type, event.attempt, event.started_at) == ("JobCancelled", 1, None)


def test_preempted_attempt_stops():
    h = Harness()
    h.run("j1")
    assert h.feed(preempted("j1", when=at(10)), now=at(10)) == []
    assert h.feed(now=at(1000)) == []


def test_removed_node_fails_the_running_job_with_node_lost():
    h = Harness()
    h.run("j1", ("n2.rack-1",), expected_runtime_seconds=100)
    h.run("other", ("n1",), expected_runtime_seconds=100)
    core = SimExecutorCore([CLUSTER[0]])  # n2.rack-1 removed from the spec; restarted
    log = Log()
    for e in h.log.events:
        log.append(e)
        core.evolve(e)
    out = drive(core, (), at(50), log=log)
    assert types(out) == ["NodeLost", "JobFailed"]
    fail = out[1]
    assert (fail.aggregate_id, fail.reason, fail.retryable, fail.attempt) == ("j1", FailureReason.NODE_LOST, True, 1)
    assert fail.started_at == T0
    assert fail.occurred_at == at(50)
    assert fail.message == "node n2.rack-1 lost"
    # the job on the remaining node runs on
    (done,) = drive(core, (), at(100), log=log)
    assert (done.aggregate_id, done.type) == ("other", "JobSucceeded")


def test_fresh_core_rederives_the_same_outcomes():
    h = Harness()
    h.run("ok", expected_runtime_seconds=30, when=at(1))
    h.run("bad", ("n2.rack-1",), expected_runtime_seconds=40, annotations={ANN_EXIT: "4"}, when=at(2))
    prefix = list(h.log.events)
    outcomes = h.feed(now=at(100))
    assert types(outcomes) == ["JobSucceeded", "JobFailed"]
    # an executor that was down replays the log up to the starts and decides later
    fresh = SimExecutorCore(CLUSTER)
    for e in prefix:
        fresh.evolve(e)
    again = fresh.decide(at(5000))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in outcomes]
    # and replaying the whole log decides nothing
    replay = SimExecutorCore(CLUSTER)
    for e in h.log.events:
        replay.evolve(e)
    assert replay.decide(at(9999)) == []


def test_events_for_unknown_jobs_are_ignored():
    h = Harness()
    assert h.feed(scheduled("ghost"), cancel_requested("ghost")) == []


# -- cluster spec ------------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text(text)
    return p


def test_load_cluster_expands_groups(tmp_path):
    spec_ = load_cluster(write(tmp_path, """
groups:
  - prefix: a100
    count: 3
    gpu_flavor: a100-80gb
    gpu_count: 8
    gpu_memory_mib: 81920
    features: [rdma]
    labels: {rack: r1}
  - prefix: cpu
    count: 1
    cpu_millis: 64000
"""))
    nodes = spec_.nodes()
    assert [n.name for n in nodes] == ["a100-0", "a100-1", "a100-2", "cpu-0"]
    assert nodes[0] == node_info("a100-0", "a100-80gb", 8, features=("rdma",), labels={"rack": "r1"})
    assert (nodes[3].gpu_flavor, nodes[3].gpu_count, nodes[3].cpu_millis) == (None, 0, 64000)


def test_example_cluster_loads():
    nodes = load_cluster(REPO / "gpusched" / "examples" / "cluster.yaml").nodes()
    assert [n.name for n in nodes] == ["h100-0", "h100-1", "a100-0", "a100-1", "l4-0", "l4-1"]
    assert sum(n.gpu_count for n in nodes) == 40


@pytest.mark.parametrize(
    "text, where",
    [
        ("groups:\n  - {prefix: a, count: 1, gpu_count: 65}\n",
         "groups.0.gpu_count: Input should be less than or equal to 64"),
        ("groups:\n  - {prefix: a, count: 1}\n  - {prefix: b, count: 0}\n", "groups.1.count:"),
        ("groups:\n  - {prefix: A_B, count: 1}\n", "groups.0.prefix: String should match pattern"),
        ("groups:\n  - {prefix: a, count: 1, gpus: 8}\n", "groups.0.gpus: Extra inputs are not permitted"),
        ("groups: []\n", "groups: Tuple should have at least 1 item"),
        ("nodes: []\n", "groups: Field required"),
    ],
)
def test_load_cluster_errors_name_the_field(tmp_path, text, where):
    path = write(tmp_path, text)
    with pytest.raises(ClusterSpecError) as err:
        load_cluster(path)
    assert str(err.value).startswith(f"cluster spec {path}: ")
    assert where in str(err.value)


def test_load_cluster_unreadable(tmp_path):
    with pytest.raises(ClusterSpecError, match="cluster spec .*missing.yaml"):
        load_cluster(tmp_path / "missing.yaml")
    with pytest.raises(ClusterSpecError, match="cluster spec"):
        load_cluster(write(tmp_path, "groups: [\n"))


def test_duplicate_node_names_are_refused():
    cs = ClusterSpec.model_validate({"groups": [{"prefix": "a", "count": 2}, {"prefix": "a", "count": 1}]})
    with pytest.raises(ValueError, match="duplicate node names"):
        cs.nodes()


def test_the_sim_backend_takes_a_complete_plan_too():
    core, backend = BackendCore(), SimBackend(CLUSTER)
    for e in (submitted("j1", spec(expected_runtime_seconds=10)), scheduled("j1", {"n1": (0,)}),
              submitted("j2", spec(expected_runtime_seconds=30)), scheduled("j2", {"n1": (1,)})):
        core.evolve(e)
    result = reconcile(backend, core.plan(), at(0))
    assert (result.created, result.inventory) == (2, backend.nodes)
    assert [(o.job_id, o.phase) for o in result.observations] == [("j1", Phase.RUNNING), ("j2", Phase.RUNNING)]
    assert backend.next_end() == at(10)
    assert reconcile(backend, core.plan(), at(5)).observations == []  # adopted: nothing new
    [done] = reconcile(backend, core.plan(), at(12)).observations
    assert (done.job_id, done.phase, done.at) == ("j1", Phase.SUCCEEDED, at(10))
    core.evolve(succeeded("j1", when=at(10)))
    core.evolve(cancelled("j2", attempt=1, when=at(12)))  # the log holds neither live any more
    assert reconcile(backend, core.plan(), at(13)).deleted == 1  # j2, an orphan
    assert backend.next_end() is None


def test_the_sim_executor_service_builds_its_core_single_or_per_cluster(monkeypatch):
    """services.executor's build(): the example cluster spec, unnamed or as one cluster's."""
    from pathlib import Path

    from runtime.settings import Settings
    from services.executor.__main__ import build
    from services.executor.config import ClusterConfig

    spec = Path(__file__).resolve().parents[2] / "gpusched" / "examples" / "cluster.yaml"
    settings = Settings(sim_cluster=spec)
    single = build(settings, None, ClusterConfig())
    named = build(settings, None, ClusterConfig(name="east", heartbeat_s=5))
    assert single.core.cluster is None and (named.core.cluster, named.core.heartbeat_s) == ("east", 5)
    assert single.backend.nodes == named.backend.nodes
