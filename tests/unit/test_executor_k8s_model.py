"""The kubernetes backend's pure parts, table-driven: Pod/Job status -> classified outcome,
gang aggregation, Job manifests, NodeInfo from Node objects, deterministic names."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas import FailureReason
from schemas.job import NodeAssignment
from services.executor.gang import MemberStatus, attempt_observation
from services.executor.k8s_model import (
    JobOptions, job_manifests, member_status, node_info, pod_status, service_manifest, service_port,
)
from services.executor.lifecycle import Phase, Workload, flavor_of, workload_name
from tests.unit.builders import spec

T = "2026-01-01T00:00:10Z"
NOW = datetime(2026, 1, 1, 0, 1, tzinfo=UTC)


def term(code: int, reason: str = "Error") -> dict:
    return {"state": {"terminated": {"exitCode": code, "reason": reason, "startedAt": "2026-01-01T00:00:01Z",
                                     "finishedAt": T}}}


def pod(phase: str, *, statuses=(), reason: str | None = None, conditions=()) -> dict:
    st = {"phase": phase, "containerStatuses": list(statuses), "conditions": list(conditions),
          "startTime": "2026-01-01T00:00:01Z"}
    if reason:
        st["reason"] = reason
    return {"metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z"}, "status": st}


POD_CASES = [
    ("pending", pod("Pending"), Phase.PENDING, None, None),
    ("running", pod("Running", statuses=[{"state": {"running": {"startedAt": "2026-01-01T00:00:02Z"}}}]),
     Phase.RUNNING, None, None),
    ("succeeded", pod("Succeeded", statuses=[term(0, "Completed")]), Phase.SUCCEEDED, None, 0),
    ("exit code", pod("Failed", statuses=[term(3)]), Phase.FAILED, FailureReason.EXIT_CODE, 3),
    ("oom", pod("Failed", statuses=[term(137, "OOMKilled")]), Phase.FAILED, FailureReason.OOM_KILLED, 137),
    ("evicted", pod("Failed", reason="Evicted"), Phase.FAILED, FailureReason.EVICTED, None),
    ("pod deadline", pod("Failed", reason="DeadlineExceeded"), Phase.FAILED, FailureReason.DEADLINE_EXCEEDED, None),
    ("taint manager", pod("Failed", statuses=[term(137)], conditions=[{
        "type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}]),
     Phase.FAILED, FailureReason.NODE_LOST, 137),
    ("scheduler preemption", pod("Failed", statuses=[term(137)], conditions=[{
        "type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]),
     Phase.FAILED, FailureReason.EVICTED, 137),
    ("image pull backoff", pod("Pending", statuses=[{"state": {"waiting": {"reason": "ImagePullBackOff"}}}]),
     Phase.FAILED, FailureReason.IMAGE_PULL, None),
    ("invalid image", pod("Pending", statuses=[{"state": {"waiting": {"reason": "InvalidImageName"}}}]),
     Phase.FAILED, FailureReason.IMAGE_PULL, None),
    ("transient pull error still pending", pod("Pending", statuses=[{"state": {"waiting": {"reason": "ErrImagePull"}}}]),
     Phase.PENDING, None, None),
    ("bad config", pod("Pending", statuses=[{"state": {"waiting": {"reason": "CreateContainerConfigError"}}}]),
     Phase.FAILED, FailureReason.BACKEND_ERROR, None),
]


@pytest.mark.parametrize("name,p,phase,reason,code", POD_CASES, ids=[c[0] for c in POD_CASES])
def test_pod_status(name, p, phase, reason, code):
    s = pod_status(p)
    assert (s.phase, s.reason, s.exit_code) == (phase, reason, code)


def job(*conds: tuple[str, str]) -> dict:
    return {"metadata": {"name": "j"}, "status": {"conditions": [
        {"type": t, "status": "True", "reason": r, "lastTransitionTime": T} for t, r in conds]}}


JOB_CASES = [
    ("complete", job(("Complete", "")), [], Phase.SUCCEEDED, None),
    ("job deadline, pod gone", job(("Failed", "DeadlineExceeded")), [], Phase.FAILED, FailureReason.DEADLINE_EXCEEDED),
    ("job deadline wins over the killed pod", job(("FailureTarget", "DeadlineExceeded")),
     [pod("Failed", statuses=[term(137)])], Phase.FAILED, FailureReason.DEADLINE_EXCEEDED),
    ("backoff limit: the pod's reason", job(("Failed", "BackoffLimitExceeded")),
     [pod("Failed", statuses=[term(2)])], Phase.FAILED, FailureReason.EXIT_CODE),
    ("backoff limit, pod gone", job(("Failed", "BackoffLimitExceeded")), [], Phase.FAILED, FailureReason.EXIT_CODE),
    ("no condition: the pod decides", job(), [pod("Running")], Phase.RUNNING, None),
]


@pytest.mark.parametrize("name,j,pods,phase,reason", JOB_CASES, ids=[c[0] for c in JOB_CASES])
def test_member_status(name, j, pods, phase, reason):
    s = member_status(j, pods)
    assert (s.phase, s.reason) == (phase, reason)


R = MemberStatus(Phase.RUNNING, NOW, NOW)
P = MemberStatus(Phase.PENDING)
S = MemberStatus(Phase.SUCCEEDED, NOW, NOW, exit_code=0)
F = MemberStatus(Phase.FAILED, NOW, NOW, FailureReason.EXIT_CODE, 1)

GANG_CASES = [
    ("never created", [None, None], [False, False], False, False, None),
    ("created, then all gone", [None, None], [True, True], False, False, Phase.GONE),
    ("gone while we were down", [None], [False], True, False, Phase.GONE),
    ("gone while stopping", [None], [False], False, True, Phase.GONE),
    ("half created (restart mid-creation)", [R, None], [True, False], False, False, Phase.PENDING),
    ("a member deleted by someone", [R, None], [True, True], False, False, Phase.FAILED),
    ("one running, one pending", [R, P], [True, True], False, False, Phase.PENDING),
    ("whole gang runs", [R, R], [True, True], False, False, Phase.RUNNING),
    ("one done, one still running", [S, R], [True, True], False, False, Phase.RUNNING),
    ("all done", [S, S], [True, True], False, False, Phase.SUCCEEDED),
    ("one failed", [S, F], [True, True], False, False, Phase.FAILED),
]


READY = "2026-01-01T00:00:20Z"
RUNNING = [{"state": {"running": {"startedAt": "2026-01-01T00:00:02Z"}}}]


@pytest.mark.parametrize("conditions, ready_at", [
    ([], None),
    ([{"type": "Ready", "status": "False", "lastTransitionTime": READY}], None),  # its probe does not pass yet
    ([{"type": "Ready", "status": "True", "lastTransitionTime": READY}], datetime(2026, 1, 1, 0, 0, 20, tzinfo=UTC)),
    ([{"type": "Ready", "status": "True"}], datetime(2026, 1, 1, 0, 0, 2, tzinfo=UTC)),  # no time: its start
])
def test_a_running_pod_is_ready_from_its_ready_condition(conditions, ready_at):
    s = pod_status(pod("Running", statuses=RUNNING, conditions=conditions))
    assert (s.phase, s.ready_at) == (Phase.RUNNING, ready_at)


def test_a_gang_is_ready_when_every_running_member_is():
    early, late = datetime(2026, 1, 1, 0, 0, 30, tzinfo=UTC), datetime(2026, 1, 1, 0, 0, 40, tzinfo=UTC)
    members = [MemberStatus(Phase.RUNNING, NOW, NOW, ready_at=early), MemberStatus(Phase.RUNNING, NOW, NOW)]
    obs = attempt_observation("j", 1, members, seen=[True, True], started_in_log=True, stopping=False, now=NOW)
    assert (obs.phase, obs.ready_at) == (Phase.RUNNING, None)
    members[1] = MemberStatus(Phase.RUNNING, NOW, NOW, ready_at=late)
    obs = attempt_observation("j", 1, members, seen=[True, True], started_in_log=True, stopping=False, now=NOW)
    assert (obs.phase, obs.ready_at) == (Phase.RUNNING, late)


@pytest.mark.parametrize("name,members,seen,started,stopping,phase", GANG_CASES, ids=[c[0] for c in GANG_CASES])
def test_attempt_observation(name, members, seen, started, stopping, phase):
    obs = attempt_observation("j", 1, members, seen=seen, started_in_log=started, stopping=stopping, now=NOW)
    assert (obs.phase if obs else None) == phase


def test_names_are_deterministic_and_valid():
    assert workload_name("train-1", 2, 0) == "train-1-a2-m0"
    long = "x" * 63
    a, b2 = workload_name(long, 1, 5), workload_name(long[:-1] + "y", 1, 5)
    assert len(a) <= 63 and a != b2 and a == workload_name(long, 1, 5)


def test_manifests_one_job_per_node_slice():
    w = Workload(job_id="j1", attempt=2, spec=spec(gpus=4, gang_size=2, max_runtime_seconds=60,
                                                    annotations={"bad key!": "x", "ok.io/k": "v"}),
                 flavor="a100", priority=700, resume=True,
                 placement=(NodeAssignment(node="n1", gpus=4, gpu_indices=(0, 1, 2, 3)),
                            NodeAssignment(node="n2", gpus=4, gpu_indices=(4, 5, 6, 7))))
    jobs = job_manifests(w, JobOptions(namespace="gpu-{team}"))
    assert [j["metadata"]["name"] for j in jobs] == ["j1-a2-m0", "j1-a2-m1"]
    assert {j["metadata"]["namespace"] for j in jobs} == {"gpu-team-a"}
    j = jobs[1]
    assert j["spec"]["backoffLimit"] == 0 and j["spec"]["activeDeadlineSeconds"] == 60
    pod_spec = j["spec"]["template"]["spec"]
    values = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
    assert values == ["n2"]
    assert pod_spec["automountServiceAccountToken"] is False  # whatever ServiceAccount the Pod runs as
    c = pod_spec["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert (env["GPUSCHED_RESUME"], env["GPUSCHED_GANG_INDEX"], env["GPUSCHED_GANG_SIZE"]) == ("1", "1", "2")
    ann = j["metadata"]["annotations"]
    assert ann["gpusched.io/priority"] == "700" and ann["ok.io/k"] == "v" and "bad key!" not in ann


@pytest.mark.parametrize("annotations, label, probe, port", [
    ({}, None, None, None),  # a job
    ({"gpusched.io/service": "chat"}, "chat", None, None),  # a replica without a port: labelled only
    ({"gpusched.io/service": "chat", "gpusched.io/readiness-port": "8000"}, "chat", None, 8000),
    ({"gpusched.io/service": "chat", "gpusched.io/readiness-port": "8000", "gpusched.io/readiness-path": "/ok",
      "gpusched.io/readiness-delay": "2.5"}, "chat", ("/ok", 8000, 2), 8000),
    ({"gpusched.io/service": "chat", "gpusched.io/readiness-port": "x"}, "chat", None, None),  # malformed: no port
])
def test_a_replica_is_labelled_with_its_service_and_probed(annotations, label, probe, port):
    w = Workload(job_id="replica-chat-1-0", attempt=1, spec=spec(kind="inference", annotations=annotations),
                 flavor="a100", placement=(NodeAssignment(node="n1", gpus=1, gpu_indices=(0,)),))
    (job,) = job_manifests(w, JobOptions())
    template = job["spec"]["template"]
    assert template["metadata"]["labels"].get("gpusched.io/service") == label
    c = template["spec"]["containers"][0]
    got = c.get("readinessProbe")
    assert (None if got is None else (got["httpGet"]["path"], got["httpGet"]["port"], got["initialDelaySeconds"])) == probe
    assert service_port(w.job_id, w.spec) == port
    assert [p["containerPort"] for p in c.get("ports", [])] == ([port] if port else [])


def test_a_jobs_own_service_annotation_makes_it_no_replica():
    """Only the controller's replica jobs (ids admission refuses to submissions) join a Service:
    a team's job naming another team's service would otherwise receive its traffic."""
    ann = {"gpusched.io/service": "chat", "gpusched.io/readiness-port": "8000"}
    for job_id in ("my-job", "replica-other-1-0", "replica-chat-x-0"):
        w = Workload(job_id=job_id, attempt=1, spec=spec(annotations=ann), flavor="a100",
                     placement=(NodeAssignment(node="n1", gpus=1, gpu_indices=(0,)),))
        (job,) = job_manifests(w, JobOptions())
        assert "gpusched.io/service" not in job["spec"]["template"]["metadata"]["labels"], job_id
        assert service_port(w.job_id, w.spec) is None


def test_the_service_manifest_selects_the_replicas_by_label():
    m = service_manifest("chat", "gpu-team-a", 8000)
    assert m["spec"]["selector"] == {"app.kubernetes.io/managed-by": "gpusched-executor", "gpusched.io/service": "chat"}
    assert m["spec"]["ports"] == [{"name": "serve", "port": 8000, "targetPort": 8000}]
    assert m["metadata"]["namespace"] == "gpu-team-a"


def test_node_info_from_gfd_labels():
    n = node_info({
        "metadata": {"name": "g1", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                              "nvidia.com/gpu.memory": "81559", "topology.kubernetes.io/zone": "z1",
                                              "feature.gpusched.io/rdma": "true", "other": "dropped"}},
        "spec": {"unschedulable": True, "taints": [{"key": "nvidia.com/gpu", "value": "present",
                                                    "effect": "NoSchedule"}]},
        "status": {"allocatable": {"nvidia.com/gpu": "8", "cpu": "95500m", "memory": "1000Gi"}},
    })
    assert (n.gpu_count, n.gpu_flavor, n.gpu_memory_mib) == (8, "h100-80gb-hbm3", 81559)
    assert (n.cpu_millis, n.memory_mib) == (95500, 1024000)
    assert n.features == ("rdma",) and n.labels == {"topology.kubernetes.io/zone": "z1"}
    assert n.taints == ("nvidia.com/gpu=present:NoSchedule",) and n.unschedulable


def test_cpu_node_has_no_flavor():
    n = node_info({"metadata": {"name": "c1"}, "status": {"allocatable": {"cpu": "4", "memory": "16Gi"}}})
    assert (n.gpu_count, n.gpu_flavor, n.gpu_product) == (0, None, None)
    assert flavor_of("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
