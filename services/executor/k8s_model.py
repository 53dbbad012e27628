"""The Kubernetes backend's pure parts: Job manifests from a workload, a gang member's status from
its Job and Pods, NodeInfo from a Node. Everything here works on plain JSON dicts (the API's
camelCase wire form), so it is tested table-driven without a cluster.

Gangs run as **one Job per node slice** (``<job>-a<attempt>-m<member>``), each pinned to its
node by a required node affinity on ``kubernetes.io/hostname``. An Indexed Job has one Pod
template for every index, so it cannot pin index *i* to the node the scheduler chose for member
*i*, nor give members different GPU counts; separate Jobs can, at the price of creating N objects
(not atomic: a restart mid-creation adopts the members that exist and creates the rest).

GPUs come from NVIDIA's device plugin and GPU feature discovery (GFD) on each Node
(:func:`gpu_offer`): whole GPUs as ``nvidia.com/gpu``; MIG devices of the ``single`` strategy as
whole GPUs of a MIG flavor; time-sliced GPUs (``sharing.timeSlicing``) as sharable GPUs, which a
fractional job (``JobSpec.gpu_milli``) asks for as one replica. ``mixed``-strategy MIG devices,
MPS sharing and labels that contradict each other are left out of the inventory with a note the
backend logs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from schemas import FailureReason
from schemas.node import NodeInfo
from schemas.service import READINESS_DELAY, READINESS_PATH, READINESS_PORT, replica_service
from services.executor.gang import MemberStatus
from services.executor.lifecycle import Phase, Workload, flavor_of, workload_name

GPU_RESOURCE = "nvidia.com/gpu"
GPU_SHARED_RESOURCE = "nvidia.com/gpu.shared"  # time-slicing with renameByDefault
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"  # mig.strategy mixed: nvidia.com/mig-<profile>
LABEL_PREFIX = "gpusched.io/"
L_MANAGED = "app.kubernetes.io/managed-by"
L_SERVICE = "gpusched.io/service"
MANAGED_BY = "gpusched-executor"
L_JOB, L_ATTEMPT, L_MEMBER = "gpusched.io/job-id", "gpusched.io/attempt", "gpusched.io/member"
L_GANG, L_QUEUE, L_TEAM, L_PCLASS = ("gpusched.io/gang-size", "gpusched.io/queue", "gpusched.io/team",
                                     "gpusched.io/priority-class")
SELECTOR = f"{L_MANAGED}={MANAGED_BY}"

# GPU feature discovery labels (NVIDIA gpu-feature-discovery) and the topology labels kept.
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_MEMORY = "nvidia.com/gpu.memory"  # MiB
GFD_COUNT = "nvidia.com/gpu.count"
GFD_REPLICAS = "nvidia.com/gpu.replicas"  # accesses handed out per GPU (> 1: shared)
GFD_SHARING = "nvidia.com/gpu.sharing-strategy"  # none, time-slicing or mps
GFD_MIG_STRATEGY = "nvidia.com/mig.strategy"  # none, single or mixed
SHARED_SUFFIX = "-SHARED"  # GFD appends it to a shared GPU's product (unless the resource is renamed)
MIG_INVALID_SUFFIX = "-MIG-INVALID"  # GFD's product for a node mig.strategy single cannot describe
FLAVOR_LABEL = "gpusched.io/gpu-flavor"
TOPOLOGY_PREFIXES = ("topology.kubernetes.io/", "topology.gpusched.io/", "nvidia.com/gpu.clique",
                     "kubernetes.io/hostname", "node.kubernetes.io/instance-type")
FEATURE_PREFIX = "feature.gpusched.io/"  # feature.gpusched.io/rdma=true -> feature "rdma"

IMAGE_PULL_WAITING = {"ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
CONFIG_WAITING = {"CreateContainerConfigError", "CreateContainerError"}
_ANNOTATION_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class JobOptions:
    """Cluster-specific choices (from the environment, see services.executor.config)."""

    namespace: str = "gpusched-workloads"  # not the platform's own (its Secrets); may hold "{team}"
    checkpoint_root: str = "/checkpoints"
    ttl_after_finished_s: int = 3600  # finished Jobs (and their logs) are kept this long
    default_grace_s: int = 30
    gpu_tolerations: tuple[dict, ...] = ({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},)
    service_account: str | None = None

    def namespace_for(self, team: str) -> str:
        return self.namespace.replace("{team}", team)


def service_port(job_id: str, spec) -> int | None:
    """The port a service's replica answers its readiness probe on (docs/serving.md), if any."""
    if replica_service(job_id, spec) is None:
        return None
    try:
        return int(spec.annotations[READINESS_PORT])
    except (KeyError, ValueError):
        return None


def service_manifest(service: str, namespace: str, port: int) -> dict:
    """The v1 Service through which clients reach a service's ready replicas: it selects the
    replicas' Pods by their ``gpusched.io/service`` label, and Kubernetes routes only to the ones
    whose readiness probe passes."""
    labels = {L_MANAGED: MANAGED_BY, L_SERVICE: service}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": service, "namespace": namespace, "labels": labels},
            "spec": {"selector": labels, "ports": [{"name": "serve", "port": port, "targetPort": port}]}}


def job_manifests(w: Workload, opts: JobOptions, gpu_resources: Mapping[str, str] | None = None) -> list[dict]:
    """One batch/v1 Job per gang member, in member order. ``gpu_resources``: the extended
    resource each node's GPUs are requested by (:attr:`GpuOffer.resource`); a node not in it:
    ``nvidia.com/gpu``. A fractional member (``gpu_milli``) asks for one GPU of that resource:
    on a time-sliced node, one replica."""
    spec = w.spec
    ns = opts.namespace_for(spec.team)
    labels = {
        L_MANAGED: MANAGED_BY, L_JOB: w.job_id, L_ATTEMPT: str(w.attempt), L_GANG: str(len(w.placement)),
        L_QUEUE: spec.queue, L_TEAM: spec.team, L_PCLASS: spec.priority_class,
    }
    passthrough = {k: v for k, v in spec.annotations.items() if _ANNOTATION_KEY.match(k)}
    if (service := replica_service(w.job_id, spec)) is not None:  # its Service selects it by this label
        labels[L_SERVICE] = service
    port = service_port(w.job_id, spec)
    out = []
    for i, p in enumerate(w.placement):
        name = workload_name(w.job_id, w.attempt, i)
        member_labels = {**labels, L_MEMBER: str(i)}
        annotations = {**passthrough, L_JOB: w.job_id, L_ATTEMPT: str(w.attempt), L_QUEUE: spec.queue,
                       L_TEAM: spec.team, L_PCLASS: spec.priority_class, "gpusched.io/node": p.node,
                       "gpusched.io/flavor": w.flavor,
                       "gpusched.io/gpu-indices": ",".join(map(str, p.gpu_indices))}
        if p.gpu_milli is not None:
            annotations["gpusched.io/gpu-milli"] = str(p.gpu_milli)
        if w.priority is not None:
            annotations["gpusched.io/priority"] = str(w.priority)
        env = [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
        env += [
            {"name": "GPUSCHED_JOB_ID", "value": w.job_id},
            {"name": "GPUSCHED_ATTEMPT", "value": str(w.attempt)},
            {"name": "GPUSCHED_CHECKPOINT_DIR", "value": f"{opts.checkpoint_root}/{spec.team}/{w.job_id}"},
            {"name": "GPUSCHED_RESUME", "value": "1" if w.resume else "0"},
            {"name": "GPUSCHED_GANG_SIZE", "value": str(len(w.placement))},
            {"name": "GPUSCHED_GANG_INDEX", "value": str(i)},
            {"name": "GPUSCHED_GANG_LEADER", "value": workload_name(w.job_id, w.attempt, 0)},
        ]
        resources = {"cpu": f"{spec.cpu_millis}m", "memory": f"{spec.memory_mib}Mi"}
        limits = dict(resources)
        if p.gpus:
            gpu = (gpu_resources or {}).get(p.node, GPU_RESOURCE)
            limits[gpu] = str(p.gpus)
            resources = {**resources, gpu: str(p.gpus)}
        container = {"name": "main", "image": spec.image, "env": env,
                     "resources": {"requests": resources, "limits": limits}}
        if spec.command:
            container["command"] = list(spec.command)
        if spec.args:
            container["args"] = list(spec.args)
        if port is not None:
            container["ports"] = [{"name": "serve", "containerPort": port}]
            if READINESS_PATH in spec.annotations:
                container["readinessProbe"] = {
                    "httpGet": {"path": spec.annotations[READINESS_PATH], "port": port},
                    "initialDelaySeconds": int(float(spec.annotations.get(READINESS_DELAY) or 0)),
                    "periodSeconds": 5}
        pod_spec = {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,  # a team's code gets no Kubernetes API token
            "terminationGracePeriodSeconds": opts.default_grace_s,
            "containers": [container],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [p.node]}]}
            ]}}},
            "tolerations": [dict(t) for t in opts.gpu_tolerations],
        }
        if opts.service_account:
            pod_spec["serviceAccountName"] = opts.service_account
        job_spec: dict = {
            "backoffLimit": 0,  # retries are the platform's decision, never the Job controller's
            "completions": 1,
            "parallelism": 1,
            "ttlSecondsAfterFinished": opts.ttl_after_finished_s,
            "template": {"metadata": {"labels": member_labels, "annotations": annotations}, "spec": pod_spec},
        }
        if spec.max_runtime_seconds is not None:
            job_spec["activeDeadlineSeconds"] = spec.max_runtime_seconds
        out.append({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": ns, "labels": member_labels, "annotations": annotations},
            "spec": job_spec,
        })
    return out


# -- status ------------------------------------------------------------------------------------

def parse_time(value) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def _cond(obj: dict, kind: str) -> dict | None:
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c.get("type") == kind and c.get("status") == "True":
            return c
    return None


def _terminated(pod: dict) -> dict | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or ():
        term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if term:
            return term
    return None


def _pod_started(pod: dict) -> datetime | None:
    st = pod.get("status") or {}
    for cs in st.get("containerStatuses") or ():
        state = cs.get("state") or {}
        if "running" in state and state["running"].get("startedAt"):
            return parse_time(state["running"]["startedAt"])
        if "terminated" in state and state["terminated"].get("startedAt"):
            return parse_time(state["terminated"]["startedAt"])
    return parse_time(st.get("startTime"))


def pod_status(pod: dict) -> MemberStatus:
    """Classify one Pod of a member Job."""
    st = pod.get("status") or {}
    phase = st.get("phase")
    started = _pod_started(pod)
    term = _terminated(pod)
    disruption = _cond(pod, "DisruptionTarget")
    if phase == "Succeeded":
        return MemberStatus(Phase.SUCCEEDED, parse_time((term or {}).get("finishedAt")) or started, started, exit_code=0)
    if phase == "Failed":
        at = parse_time((term or {}).get("finishedAt")) or parse_time((disruption or {}).get("lastTransitionTime"))
        pod_reason = st.get("reason") or ""
        code = term.get("exitCode") if term else None
        if pod_reason == "Evicted":
            return MemberStatus(Phase.FAILED, at, started, FailureReason.EVICTED, code, st.get("message") or "evicted")
        if pod_reason == "DeadlineExceeded":
            return MemberStatus(Phase.FAILED, at, started, FailureReason.DEADLINE_EXCEEDED, code,
                                "ran past its max runtime")
        if disruption is not None:
            reason = (FailureReason.NODE_LOST if disruption.get("reason") == "DeletionByTaintManager"
                      else FailureReason.EVICTED)
            return MemberStatus(Phase.FAILED, at, started, reason, code,
                                f"{disruption.get('reason')}: {disruption.get('message', '')}".strip(": "))
        if term and term.get("reason") == "OOMKilled":
            return MemberStatus(Phase.FAILED, at, started, FailureReason.OOM_KILLED, code, "out of memory (OOMKilled)")
        if code is not None:
            return MemberStatus(Phase.FAILED, at, started, FailureReason.EXIT_CODE, code, f"exited with code {code}")
        return MemberStatus(Phase.FAILED, at, started, FailureReason.BACKEND_ERROR, None,
                            st.get("message") or pod_reason or "pod failed")
    for cs in st.get("containerStatuses") or ():
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PULL_WAITING:
            return MemberStatus(Phase.FAILED, None, None, FailureReason.IMAGE_PULL, None,
                                f"{waiting['reason']}: {waiting.get('message', '')}".strip(": "))
        if waiting.get("reason") in CONFIG_WAITING:
            return MemberStatus(Phase.FAILED, None, None, FailureReason.BACKEND_ERROR, None,
                                f"{waiting['reason']}: {waiting.get('message', '')}".strip(": "))
    if phase == "Running":
        ready = _cond(pod, "Ready")  # its readiness probe passes (or it has none and runs)
        return MemberStatus(Phase.RUNNING, started, started,
                            ready_at=(parse_time(ready.get("lastTransitionTime")) or started) if ready else None)
    return MemberStatus(Phase.PENDING)


def member_status(job: dict, pods: list[dict]) -> MemberStatus:
    """One member Job with the Pods it owns (at most one: backoffLimit is 0)."""
    pod = max(pods, key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or "") if pods else None
    ps = pod_status(pod) if pod is not None else MemberStatus(Phase.PENDING)
    if pod is not None and (pod.get("metadata") or {}).get("deletionTimestamp") and ps.phase in (
            Phase.PENDING, Phase.RUNNING):
        # Terminating: SIGTERM was sent, the checkpoint window runs. The Job controller may call
        # the Job failed already, but the attempt still holds its node until the Pod is gone.
        return ps
    complete = _cond(job, "Complete") or _cond(job, "SuccessCriteriaMet")
    failed = _cond(job, "Failed") or _cond(job, "FailureTarget")
    started = ps.started_at or parse_time((job.get("status") or {}).get("startTime"))
    if complete is not None:
        at = parse_time((job.get("status") or {}).get("completionTime")) or parse_time(complete.get("lastTransitionTime"))
        return MemberStatus(Phase.SUCCEEDED, ps.at or at, started, exit_code=0)
    if failed is not None:
        at = ps.at or parse_time(failed.get("lastTransitionTime"))
        if failed.get("reason") == "DeadlineExceeded":
            return MemberStatus(Phase.FAILED, at, started, FailureReason.DEADLINE_EXCEEDED, ps.exit_code,
                                "ran past its max runtime (activeDeadlineSeconds)")
        if ps.phase == Phase.FAILED:
            return ps
        return MemberStatus(Phase.FAILED, at, started, FailureReason.EXIT_CODE, ps.exit_code,
                            f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}".strip(": "))
    return ps


# -- nodes -------------------------------------------------------------------------------------

def _quantity_mib(q: str | None) -> int:
    if not q:
        return 0
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 ** 2, "K": 1000 / 2 ** 20, "M": 10 ** 6 / 2 ** 20,
             "G": 10 ** 9 / 2 ** 20}
    for u, f in units.items():
        if q.endswith(u):
            return int(float(q[: -len(u)]) * f)
    return int(float(q) / 2 ** 20)


def _quantity_millis(q: str | None) -> int:
    if not q:
        return 0
    return int(q[:-1]) if q.endswith("m") else int(float(q) * 1000)


@dataclass(frozen=True)
class GpuOffer:
    """The GPUs a Node offers gpusched, read from the device plugin's allocatable resources and
    the GFD labels."""

    count: int  # GPUs to place on: physical GPUs, or MIG devices (mig.strategy single)
    resource: str  # the extended resource a Pod requests them by
    sharable: bool  # time-sliced: fractional requests share a GPU, each Pod holding one replica
    product: str | None  # GFD's product, without the -SHARED suffix
    note: str = ""  # what the node advertises that gpusched leaves out, and why ("" if nothing)


def _whole(value) -> int | None:
    """A label or quantity that must be a whole number ≥ 0; None when it is not one."""
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


def gpu_offer(node: dict) -> GpuOffer:
    """What the node's GPUs are to gpusched:

    * no sharing (``nvidia.com/gpu.replicas`` absent or 1): ``count`` = allocatable
      ``nvidia.com/gpu`` (with ``mig.strategy`` single these are MIG devices, and the product
      names the profile, e.g. ``NVIDIA-A100-SXM4-40GB-MIG-1g.5gb``);
    * time-slicing (replicas R > 1, ``sharing-strategy`` time-slicing or, from GFD versions
      before that label, absent): sharable, ``count`` = allocatable ``nvidia.com/gpu`` (or
      ``nvidia.com/gpu.shared`` with renameByDefault) // R, the physical GPUs;
    * MPS sharing, an unknown strategy, a replicas label that is not a whole number, a renamed
      resource without replicas, GFD's ``…-MIG-INVALID`` product: no GPUs, and a note;
    * ``nvidia.com/mig-<profile>`` resources (mig.strategy mixed) are never offered: one node has
      one GPU flavor, so the node is offered for its ``nvidia.com/gpu`` only, with a note.
    """
    labels = (node.get("metadata") or {}).get("labels") or {}
    alloc = (node.get("status") or {}).get("allocatable") or (node.get("status") or {}).get("capacity") or {}
    notes = []
    mig = sorted(f"{k}: {v}" for k, v in alloc.items() if k.startswith(MIG_RESOURCE_PREFIX) and _whole(v))
    if mig:
        notes.append(f"MIG devices ({', '.join(mig)}; mig.strategy {labels.get(GFD_MIG_STRATEGY) or 'unset'}) are "
                     f"not offered: gpusched places whole GPUs, MIG devices of mig.strategy single and time-sliced "
                     f"GPUs, one flavor per node")
    renamed = GPU_SHARED_RESOURCE in alloc and GPU_RESOURCE not in alloc
    resource = GPU_SHARED_RESOURCE if renamed else GPU_RESOURCE
    advertised = _whole(alloc.get(resource)) or 0
    product = labels.get(GFD_PRODUCT)

    def none(why: str) -> GpuOffer:
        return GpuOffer(0, resource, False, product, "; ".join([*notes, f"{why}: registered without GPUs"]))

    raw = labels.get(GFD_REPLICAS)
    replicas = _whole(raw) if raw is not None else 1
    strategy = labels.get(GFD_SHARING) or ""
    if advertised and replicas is None:
        return none(f"label {GFD_REPLICAS}={raw!r} is not a whole number")
    if product and product.endswith(MIG_INVALID_SUFFIX):
        return none(f"GPU feature discovery reports an invalid MIG configuration ({GFD_PRODUCT}={product})")
    if advertised and replicas > 1:
        if strategy not in ("", "time-slicing"):
            return none(f"GPUs shared by {strategy!r} ({GFD_REPLICAS}={replicas}): gpusched shares time-sliced "
                        "GPUs only")
        shared = product.removesuffix(SHARED_SUFFIX) if product else None
        return GpuOffer(advertised // replicas, resource, True, shared, "; ".join(notes))
    if advertised and renamed:
        return none(f"{GPU_SHARED_RESOURCE} is advertised without a {GFD_REPLICAS} label above 1: the physical GPU "
                    "count is unknown")
    return GpuOffer(advertised, resource, False, product, "; ".join(notes))


def node_info(node: dict, offer: GpuOffer | None = None) -> NodeInfo:
    """NodeInfo from a Node: GPUs from :func:`gpu_offer` (``offer``, when the caller has it),
    memory from the GFD label, the flavor from ``gpusched.io/gpu-flavor`` or the product (a
    time-sliced node's with ``-shared``: its GPUs are not exclusive), topology labels,
    features, taints and cordon."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    labels = meta.get("labels") or {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    offer = offer or gpu_offer(node)
    gpus = offer.count
    mem = labels.get(GFD_MEMORY)
    derived = flavor_of(offer.product)
    if derived and offer.sharable:
        derived = f"{derived[:56].rstrip('-')}-shared"
    flavor = labels.get(FLAVOR_LABEL) or derived
    features = tuple(sorted(k[len(FEATURE_PREFIX):] for k, v in labels.items()
                            if k.startswith(FEATURE_PREFIX) and v.lower() in ("true", "1", "yes")))
    kept = {k: v for k, v in labels.items() if k.startswith(TOPOLOGY_PREFIXES)}
    taints = tuple(f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in spec.get("taints") or ())
    return NodeInfo(
        name=meta["name"], gpu_flavor=flavor if gpus else None, gpu_product=offer.product if gpus else None,
        gpu_count=min(gpus, 64), gpu_memory_mib=int(mem) if gpus and mem and mem.isdigit() and int(mem) > 0 else None,
        cpu_millis=_quantity_millis(alloc.get("cpu")), memory_mib=_quantity_mib(alloc.get("memory")),
        features=features, labels=kept, taints=taints, unschedulable=bool(spec.get("unschedulable")),
        gpu_sharable=offer.sharable and gpus > 0,
    )


def node_ready(node: dict) -> bool:
    return _cond(node, "Ready") is not None
