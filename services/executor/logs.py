"""``gpusched logs ID``: a job's output, from wherever the configured backend keeps it.

* local: the log files under ``GPUSCHED_LOCAL_DIR/runs/<job>-a<attempt>-m<member>/log``;
* kubernetes: the Pod logs of the job's Jobs (kept until ``ttlSecondsAfterFinished``);
* sim: runs nothing, so there is nothing to show (a clear error says so).
"""

from __future__ import annotations


class LogsError(RuntimeError):
    pass


def read_logs(backend: str, job_id: str, attempt: int | None = None, *, tail: int | None = None) -> list[tuple[str, str]]:
    """[(source, text)] in attempt and member order."""
    from services.executor.config import ExecutorConfig

    cfg = ExecutorConfig.from_env()
    if backend == "local":
        from services.executor.local import read_log

        out = read_log(cfg.local_dir, job_id, attempt)
    elif backend == "kubernetes":
        out = _pod_logs(cfg, job_id, attempt)
    else:
        raise LogsError("GPUSCHED_EXECUTOR_BACKEND=sim runs no processes, so there are no logs; "
                        "logs exist for the local and kubernetes backends")
    if not out:
        which = f" attempt {attempt}" if attempt is not None else ""
        raise LogsError(f"no logs for job {job_id!r}{which} on the {backend} backend")
    if tail is not None:
        out = [(src, "\n".join(text.splitlines()[-tail:])) for src, text in out]
    return out


def _pod_logs(cfg, job_id: str, attempt: int | None) -> list[tuple[str, str]]:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from services.executor.k8s_model import L_ATTEMPT, L_JOB, L_MEMBER
    from services.executor.kubernetes import load_api_client

    core = client.CoreV1Api(load_api_client())
    selector = f"{L_JOB}={job_id}" + (f",{L_ATTEMPT}={attempt}" if attempt is not None else "")
    ns = cfg.k8s.namespace
    pods = (core.list_pod_for_all_namespaces(label_selector=selector) if "{team}" in ns
            else core.list_namespaced_pod(ns, label_selector=selector)).items
    pods.sort(key=lambda p: (int(p.metadata.labels.get(L_ATTEMPT, 0)), int(p.metadata.labels.get(L_MEMBER, 0))))
    out = []
    for p in pods:
        try:
            text = core.read_namespaced_pod_log(p.metadata.name, p.metadata.namespace)
        except ApiException as err:
            text = f"(no log: {err.status} {err.reason})"
        out.append((f"{p.metadata.namespace}/{p.metadata.name}", text))
    return out
