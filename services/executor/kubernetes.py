"""The Kubernetes backend: the :class:`~services.executor.lifecycle.Backend` port over the
Kubernetes API, around :mod:`services.executor.k8s_model` (manifests and status classification).

* Three caches (Jobs and Pods with the executor's label, all Nodes), each a list then a watch
  from the list's resourceVersion, in its own thread. A watch that ends is resumed from the last
  resourceVersion it saw; ``410 Gone`` (expired resourceVersion) relists; every ``resync_s`` the
  cache is relisted anyway, so a missed event cannot keep it wrong; API errors back off
  exponentially (0.5 s doubling to 30 s).
* With the core's plan, a reconcile pass creates the member Jobs that are missing
  (``409 AlreadyExists`` means a Job of that deterministic name exists: adopt it), stops what
  must stop (each Pod deleted with ``gracePeriodSeconds`` = the checkpoint window, so the
  container gets SIGTERM and that long to checkpoint; then the Job), deletes orphans (managed
  Jobs still active whose attempt the log does not hold live), and classifies every live attempt
  from the caches into an Observation.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from datetime import datetime

from schemas import FailureReason
from schemas.node import NodeInfo
from services.executor.gang import MemberStatus, attempt_observation
from services.executor.k8s_model import (
    L_ATTEMPT,
    L_JOB,
    L_MEMBER,
    SELECTOR,
    JobOptions,
    gpu_offer,
    job_manifests,
    member_status,
    node_info,
    service_manifest,
    service_port,
)
from schemas.service import service_of
from services.executor.lifecycle import Observation, Phase, Plan, TelemetryReport, workload_name

log = logging.getLogger(__name__)

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0
PROBE_EVERY_S, PROBE_TIMEOUT_S = 5.0, 5.0  # reachable(): how often GET /version is asked, and how long it may take


class Cache:
    """A list+watch mirror of one resource kind, keyed by namespace/name."""

    def __init__(self, kind: str, list_fn: Callable, *, selector: str | None, resync_s: float,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.kind = kind
        self._list_fn = list_fn
        self._selector = selector
        self._resync_s = resync_s
        self._on_change = on_change
        self._items: dict[str, dict] = {}
        self._put_at: dict[str, float] = {}  # our own writes, by when
        self._lock = threading.Lock()
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{kind}", daemon=True)
        self.relists = 0
        self.errors = 0
        self.connected = False  # the last list or watch request was answered (False after a failure)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def items(self) -> list[dict]:
        with self._lock:
            return list(self._items.values())

    def put(self, obj: dict) -> None:
        """Write-through after our own create (the watch confirms it a moment later)."""
        with self._lock:
            self._items[_key(obj)] = obj
            self._put_at[_key(obj)] = time.monotonic()

    def _kwargs(self) -> dict:
        return {"label_selector": self._selector} if self._selector else {}

    def _relist(self) -> str:
        asked = time.monotonic()
        resp = self._list_fn(**self._kwargs(), _preload_content=False)
        body = json.loads(resp.data)
        with self._lock:
            items = {_key(o): o for o in body.get("items") or ()}
            # An object we created while the list was in flight may be missing from it: keep it
            # (the watch from the list's resourceVersion delivers its ADDED, or its DELETED).
            for key, at in self._put_at.items():
                if at >= asked and key not in items and key in self._items:
                    items[key] = self._items[key]
            self._put_at = {k: t for k, t in self._put_at.items() if t >= asked}
            self._items = items
        self.relists += 1
        self.connected = True
        self.synced.set()
        self._on_change()
        return body["metadata"]["resourceVersion"]

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException
        from kubernetes.watch.watch import iter_resp_lines
        from urllib3.exceptions import ProtocolError

        backoff = BACKOFF_MIN_S
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                    listed_at = time.monotonic()
                remaining = self._resync_s - (time.monotonic() - listed_at)
                if remaining <= 1:
                    rv = None  # periodic resync: relist
                    continue
                resp = self._list_fn(**self._kwargs(), watch=True, resource_version=rv, allow_watch_bookmarks=True,
                                     timeout_seconds=max(1, int(min(remaining, 300))), _preload_content=False)
                try:
                    for line in iter_resp_lines(resp):
                        if self._stop.is_set():
                            return
                        if not line:
                            continue
                        ev = json.loads(line)
                        obj, kind = ev.get("object") or {}, ev.get("type")
                        if kind == "ERROR":
                            if obj.get("code") == 410:
                                log.info("watch expired (410 Gone), relisting", extra={"kind": self.kind})
                                rv = None
                                break
                            raise RuntimeError(f"watch error: {obj.get('reason')}: {obj.get('message')}")
                        rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                        if kind == "BOOKMARK":
                            continue
                        with self._lock:
                            if kind == "DELETED":
                                self._items.pop(_key(obj), None)
                            else:
                                self._items[_key(obj)] = obj
                        self._on_change()
                except ProtocolError:
                    pass  # the server ended the watch mid-stream (its timeout, a restart): resume from rv
                finally:
                    resp.close()
                    resp.release_conn()
                backoff = BACKOFF_MIN_S
            except ApiException as err:
                self.errors += 1
                self.connected = False
                if err.status == 410:
                    rv = None
                    continue
                log.warning("API error in watch, backing off", extra={"kind": self.kind, "status": err.status,
                                                                      "backoff_s": backoff})
                rv = None
                self._stop.wait(backoff * (0.5 + random.random()))
                backoff = min(BACKOFF_MAX_S, backoff * 2)
            except Exception as err:  # connection refused, reset, timeouts, bad JSON
                if self._stop.is_set():
                    return
                self.errors += 1
                self.connected = False
                log.warning("watch of %s failed (%r), backing off", self.kind, err, extra={"kind": self.kind, "error": repr(err),
                                                                "backoff_s": backoff})
                rv = None
                self._stop.wait(backoff * (0.5 + random.random()))
                backoff = min(BACKOFF_MAX_S, backoff * 2)


def _key(obj: dict) -> str:
    m = obj.get("metadata") or {}
    return f"{m.get('namespace', '')}/{m.get('name')}"


class KubernetesBackend:
    """Creates, watches and stops the Jobs of the attempts the core plans."""

    def __init__(self, opts: JobOptions, *, api_client=None, resync_s: float = 300.0,
                 all_namespaces: bool | None = None) -> None:
        from kubernetes import client

        self.opts = opts
        self.api_client = api_client or load_api_client()
        self.batch = client.BatchV1Api(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        per_team = "{team}" in opts.namespace
        self.all_namespaces = per_team if all_namespaces is None else all_namespaces
        ns = opts.namespace
        if self.all_namespaces:
            jobs_fn, pods_fn = self.batch.list_job_for_all_namespaces, self.core.list_pod_for_all_namespaces
        else:
            def jobs_fn(**kw):
                return self.batch.list_namespaced_job(ns, **kw)

            def pods_fn(**kw):
                return self.core.list_namespaced_pod(ns, **kw)
        self.jobs = Cache("jobs", jobs_fn, selector=SELECTOR, resync_s=resync_s)
        self.pods = Cache("pods", pods_fn, selector=SELECTOR, resync_s=resync_s)
        self.nodes = Cache("nodes", self.core.list_node, selector=None, resync_s=resync_s)
        self._seen: set[str] = set()  # member Job names this process has seen exist
        self._services: set[tuple[str, str]] | None = None  # (namespace, name) of our Services; None: not listed
        self._service_errors: set[tuple[str, str, int]] = set()  # refused Service requests, logged once
        self._pod_deleted: dict[str, float] = {}  # pod key -> grace it was deleted with
        self._failed_create: dict[tuple[str, int], Observation] = {}
        self._retry_at = 0.0
        self._backoff = BACKOFF_MIN_S
        self._gpu_resources: dict[str, str] = {}  # node -> the resource its GPUs are requested by
        self._notes: dict[str, str] = {}  # node -> what of it the inventory leaves out, as last logged
        self._probed_at = -PROBE_EVERY_S  # monotonic time of the last GET /version
        self._answered = True  # ... and whether it was answered

    def start(self) -> None:
        for c in (self.jobs, self.pods, self.nodes):
            c.start()

    def close(self) -> None:
        for c in (self.jobs, self.pods, self.nodes):
            c.stop()

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(c.synced.wait(max(0.0, deadline - time.monotonic())) for c in (self.jobs, self.pods, self.nodes))

    def synced(self) -> bool:
        return all(c.synced.is_set() for c in (self.jobs, self.pods, self.nodes))

    # -- the Backend port -----------------------------------------------------------------------
    def reachable(self) -> bool:
        """Every watch's last request was answered (a stopped API server fails the next one),
        and the API server answered ``GET /version`` within the last PROBE_EVERY_S (a connection
        that hangs without failing would keep a watch looking connected until it times out)."""
        if not all(c.connected for c in (self.jobs, self.pods, self.nodes)):
            return False
        now = time.monotonic()
        if now - self._probed_at >= PROBE_EVERY_S:
            from kubernetes import client

            try:
                client.VersionApi(self.api_client).get_code(_request_timeout=PROBE_TIMEOUT_S)
                answered = True
            except Exception as err:  # refused, timed out, TLS, 5xx
                answered = False
                if self._answered:
                    log.warning("the API server does not answer", extra={"error": repr(err)})
            if answered and not self._answered:
                log.info("the API server answers again")
            self._probed_at, self._answered = now, answered
        return self._answered

    def inventory(self) -> list[NodeInfo] | None:
        if not self.synced():
            return None
        out, resources, notes = [], {}, {}
        for n in self.nodes.items():
            offer = gpu_offer(n)
            info = node_info(n, offer)
            out.append(info)
            resources[info.name] = offer.resource
            if offer.note:
                notes[info.name] = offer.note
                if self._notes.get(info.name) != offer.note:
                    log.warning("node %s: %s", info.name, offer.note, extra={"node": info.name})
        self._gpu_resources, self._notes = resources, notes
        return out

    def create(self, plan: Plan, now: datetime) -> int:
        if time.monotonic() < self._retry_at:
            return 0
        by_attempt, _ = self._snapshot()
        try:
            return self._create_missing(plan, by_attempt, now)
        except Exception as err:  # 5xx, 429, connection errors (what the API refuses is per attempt)
            self._api_backoff(err)
            return 0

    def stop(self, plan: Plan, now: datetime) -> int:
        if time.monotonic() < self._retry_at:
            return 0  # create failed in this pass, or the backoff since an earlier one runs
        by_attempt, pods_by_job = self._snapshot()
        try:
            deleted = self._stop_all(plan, by_attempt, pods_by_job)
            if plan.complete:
                deleted += self._delete_orphans(plan, by_attempt, pods_by_job)
                deleted += self._delete_services(plan)
        except Exception as err:  # 5xx, 429, a refused delete (RBAC), connection errors
            self._api_backoff(err)
            return 0
        self._backoff = BACKOFF_MIN_S  # the pass got through
        return deleted

    def observe(self, plan: Plan, now: datetime) -> tuple[list[Observation], list[TelemetryReport]]:
        """Every attempt of the plan classified from the caches. No telemetry: GPU utilization on
        Kubernetes is the job of NVIDIA's DCGM exporter on the nodes."""
        by_attempt, pods_by_job = self._snapshot()
        stopping = {(s.workload.job_id, s.workload.attempt) for s in plan.stop}
        observations: list[Observation] = []
        for w in plan.workloads:
            k = (w.job_id, w.attempt)
            if k in self._failed_create:
                observations.append(self._failed_create[k])
                continue
            members_jobs = by_attempt.get(k, {})
            members: list[MemberStatus | None] = []
            seen: list[bool] = []
            for i in range(len(w.placement)):
                name = workload_name(w.job_id, w.attempt, i)
                job = members_jobs.get(i)
                seen.append(name in self._seen)
                members.append(member_status(job, pods_by_job.get(name, [])) if job is not None else None)
            obs = attempt_observation(w.job_id, w.attempt, members, seen=seen, started_in_log=w.started_at is not None,
                                      stopping=k in stopping, now=now)
            if obs is not None:
                observations.append(obs)
        if plan.complete:
            self._prune(plan)
        return observations, []

    def _prune(self, plan: Plan) -> None:
        """Forget what concerns attempts the log no longer holds live (bounded memory)."""
        live = {workload_name(w.job_id, w.attempt, i) for w in plan.workloads for i in range(len(w.placement))}
        self._seen &= live
        self._failed_create = {k: v for k, v in self._failed_create.items() if k in plan.keep}
        pods = {_key(p) for p in self.pods.items()}
        self._pod_deleted = {k: g for k, g in self._pod_deleted.items() if k in pods}

    def _snapshot(self):
        """The cached Jobs by (job id, attempt) -> member, and the cached Pods by Job name."""
        by_attempt: dict[tuple[str, int], dict[int, dict]] = {}
        for job in self.jobs.items():
            labels = (job.get("metadata") or {}).get("labels") or {}
            try:
                k = (labels[L_JOB], int(labels[L_ATTEMPT]))
                by_attempt.setdefault(k, {})[int(labels[L_MEMBER])] = job
            except (KeyError, ValueError):
                continue  # not one of ours after all (label edited by hand): left alone
            self._seen.add(job["metadata"]["name"])
        pods_by_job: dict[str, list[dict]] = {}
        for pod in self.pods.items():
            labels = (pod.get("metadata") or {}).get("labels") or {}
            owner = labels.get("batch.kubernetes.io/job-name") or labels.get("job-name")
            if owner:
                pods_by_job.setdefault(owner, []).append(pod)
        return by_attempt, pods_by_job

    def _api_backoff(self, err: Exception) -> None:
        log.warning("Kubernetes API error (%r), backing off %.1f s", err, self._backoff)
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)

    def _create_missing(self, plan: Plan, by_attempt, now: datetime) -> int:
        from kubernetes.client.exceptions import ApiException

        created = 0
        for w in plan.run:
            k = (w.job_id, w.attempt)
            if k in self._failed_create:
                continue
            have = by_attempt.get(k, {})
            self._ensure_service(w)
            for i, manifest in enumerate(job_manifests(w, self.opts, self._gpu_resources)):
                name = manifest["metadata"]["name"]
                if i in have or name in self._seen:
                    continue  # exists (adopted), or existed and vanished: classification reports it
                ns = manifest["metadata"]["namespace"]
                try:
                    obj = self.batch.create_namespaced_job(ns, manifest, _preload_content=False)
                    body = json.loads(obj.data)
                    self.jobs.put(body)
                    self._seen.add(name)
                    created += 1
                except ApiException as err:
                    if err.status == 409:
                        continue  # AlreadyExists: the watch brings it; adopt, never recreate
                    if err.status in (400, 403, 404, 422):
                        msg = _api_message(err)
                        self._failed_create[k] = Observation(
                            w.job_id, w.attempt, Phase.FAILED, now, reason=FailureReason.BACKEND_ERROR,
                            message=f"creating Job {ns}/{name} was refused ({err.status}): {msg}")
                        log.error("Job refused by the API", extra={"job": w.job_id, "attempt": w.attempt,
                                                                   "status": err.status, "error": msg})
                        break
                    raise
        return created

    def _known_services(self) -> set[tuple[str, str]]:
        """The v1 Services this executor made (by its label), listed once per process, then kept
        up to date by what it creates and deletes. A refused list (an older Role without
        ``list``) is logged and leaves only what this process creates known: the Services are a
        convenience for clients and never hold the Jobs up."""
        from kubernetes.client.exceptions import ApiException

        if self._services is None:
            try:
                if self.all_namespaces:
                    found = self.core.list_service_for_all_namespaces(label_selector=SELECTOR).items
                else:
                    found = self.core.list_namespaced_service(self.opts.namespace, label_selector=SELECTOR).items
            except ApiException as err:
                self._service_trouble("list", "*", err)
                found = []
            self._services = {(s.metadata.namespace, s.metadata.name) for s in found}
        return self._services

    def _service_trouble(self, verb: str, name: str, err) -> None:
        """A refused Service request, logged once per (verb, Service, status)."""
        key = (verb, name, err.status)
        if key not in self._service_errors:
            self._service_errors.add(key)
            log.error(f"Service {verb} refused by the API", extra={"service": name, "status": err.status,
                                                                    "error": _api_message(err)})

    def _delete_services(self, plan: Plan) -> int:
        """The v1 Service of each inference service the log deleted, where one exists. A refused
        delete is logged and tried again on the next pass; it never backs the Jobs off."""
        from kubernetes.client.exceptions import ApiException

        if not plan.deleted_services:
            return 0
        known = self._known_services()
        deleted = 0
        for team, name in plan.deleted_services:
            key = (self.opts.namespace_for(team), name)
            if key not in known:
                continue
            try:
                self.core.delete_namespaced_service(name, key[0])
            except ApiException as err:
                if err.status != 404:
                    self._service_trouble("delete", name, err)
                    continue
            log.info("deleted the Service of a deleted inference service", extra={"service": name})
            known.discard(key)
            deleted += 1
        return deleted

    def _ensure_service(self, w) -> None:
        """For a service's replica with a port: the v1 Service that routes to its ready replicas
        (created once; one that exists is kept; deleted with the service, by
        :meth:`_delete_services`)."""
        from kubernetes.client.exceptions import ApiException

        port = service_port(w.job_id, w.spec)
        if port is None:
            return
        name, ns = service_of(w.job_id), self.opts.namespace_for(w.spec.team)
        known = self._known_services()
        if (ns, name) in known:
            return
        try:
            self.core.create_namespaced_service(ns, service_manifest(name, ns, port))
        except ApiException as err:
            if err.status != 409:
                self._service_trouble("create", name, err)
                return  # the replicas run; clients find them once a later pass creates it
        known.add((ns, name))

    def _stop_all(self, plan: Plan, by_attempt, pods_by_job) -> int:
        deleted = 0
        for s in plan.stop:
            k = (s.workload.job_id, s.workload.attempt)
            members = by_attempt.get(k, {})
            for i, job in members.items():
                name = job["metadata"]["name"]
                ns = job["metadata"]["namespace"]
                pods = [p for p in pods_by_job.get(name, [])
                        if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
                grace = int(math.ceil(s.grace_seconds))
                for p in pods:
                    pkey = _key(p)
                    prev = self._pod_deleted.get(pkey)
                    if prev is not None and prev <= grace:
                        continue  # already terminating with that grace (or a shorter one)
                    self._delete(self.core.delete_namespaced_pod, p["metadata"]["name"], ns, grace)
                    self._pod_deleted[pkey] = grace
                    deleted += 1
                if not pods and not _finished(job) and not job["metadata"].get("deletionTimestamp"):
                    # Nothing runs (its Pod is not created yet, or is gone): stop the Job itself so
                    # that it cannot start one. A finished Job stays, with its logs, until its TTL.
                    self._delete(self.batch.delete_namespaced_job, name, ns, 0)
                    deleted += 1
        return deleted

    def _delete_orphans(self, plan: Plan, by_attempt, pods_by_job) -> int:
        deleted = 0
        for k, members in by_attempt.items():
            if k in plan.keep:
                continue
            for job in members.values():
                pods = pods_by_job.get(job["metadata"]["name"], [])
                ended = bool(pods) and all((p.get("status") or {}).get("phase") in ("Succeeded", "Failed")
                                           for p in pods)
                if _finished(job) or ended or job["metadata"].get("deletionTimestamp"):
                    continue  # kept for its logs until ttlSecondsAfterFinished
                log.info("deleting orphan Job", extra={"job": job["metadata"]["name"]})
                self._delete(self.batch.delete_namespaced_job, job["metadata"]["name"],
                             job["metadata"]["namespace"], self.opts.default_grace_s, propagation="Foreground")
                deleted += 1
        return deleted

    def _delete(self, fn, name: str, ns: str, grace: int, propagation: str = "Background") -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            fn(name, ns, grace_period_seconds=grace, propagation_policy=propagation)
        except ApiException as err:
            if err.status != 404:
                raise


def _finished(job: dict) -> bool:
    return any(c.get("type") in ("Complete", "Failed", "SuccessCriteriaMet", "FailureTarget")
               and c.get("status") == "True"
               for c in (job.get("status") or {}).get("conditions") or ())


def _api_message(err) -> str:
    try:
        return json.loads(err.body).get("message") or str(err.reason)
    except (TypeError, ValueError):
        return str(err.reason)


def load_api_client():
    """In-cluster config when running in a Pod, else KUBECONFIG (or ~/.kube/config)."""
    import os

    from kubernetes import client, config

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    return client.ApiClient()
