"""Executor adapter. ``GPUSCHED_EXECUTOR_BACKEND`` picks the backend:

* ``sim``: virtual nodes, declared runtimes, simulated GPU telemetry;
* ``kubernetes``: batch/v1 Jobs on a cluster (in-cluster config or KUBECONFIG);
* ``local``: processes on this host, GPUs from NVML (CPU-only when there are none).

All three are driven by :class:`services.executor.lifecycle.BackendCore`. The sim backend is
pure, so the core reconciles it in-line on every decision (:class:`~services.executor.sim.SimExecutorCore`
in the shared decision loop); the other two are reconciled beside the loop
(:class:`services.executor.service.ExecutorService`). See docs/executor.md.
"""

from __future__ import annotations

import functools
import sys

from runtime.loop import run_service
from runtime.settings import ConfigError, Settings
from services.executor.cluster import ClusterSpecError, load_cluster
from services.executor.config import ClusterConfig
from services.executor.sim import SimExecutorCore


def build(settings, clock, clusters: ClusterConfig, telemetry_s: float = 0.0):
    if settings.sim_cluster is None:
        sys.exit("GPUSCHED_SIM_CLUSTER must name a cluster spec YAML for the sim backend")
    try:
        cluster = load_cluster(settings.sim_cluster)
    except ClusterSpecError as err:
        sys.exit(str(err))
    return SimExecutorCore(cluster.nodes(), telemetry_s=telemetry_s, **clusters.core_options())


def make_backend(kind: str, cfg):
    if kind == "kubernetes":
        from services.executor.kubernetes import KubernetesBackend

        try:
            return KubernetesBackend(cfg.k8s, resync_s=cfg.k8s_resync_s)
        except Exception as err:  # no kubeconfig, unreadable certificate, ...
            sys.exit(f"GPUSCHED_EXECUTOR_BACKEND=kubernetes: cannot load a Kubernetes config "
                     f"(in-cluster, or KUBECONFIG): {err}")
    if kind == "local":
        from services.executor.local import LocalBackend

        return LocalBackend(cfg.local_dir, node_name=cfg.local_node, telemetry_s=cfg.local_telemetry_s,
                            telemetry_interval_s=cfg.telemetry_interval_s)
    raise ValueError(kind)


def main() -> None:
    try:
        settings = Settings.from_env()
        clusters = ClusterConfig.from_env()
        name = clusters.service_name  # one executor (durable, lease, credential) per cluster
        if settings.executor_backend == "sim":
            from services.executor.config import sim_telemetry_interval

            run_service(name, functools.partial(build, clusters=clusters, telemetry_s=sim_telemetry_interval()))
            return
        from services.executor.config import ExecutorConfig

        cfg = ExecutorConfig.from_env()
    except ConfigError as err:
        sys.exit(str(err))
    from services.executor.lifecycle import BackendCore
    from services.executor.service import ExecutorService

    backend = make_backend(settings.executor_backend, cfg)
    run_service(name, lambda settings, clock: BackendCore(**clusters.core_options()),
                functools.partial(ExecutorService, backend=backend, sync_s=cfg.sync_s))


if __name__ == "__main__":
    main()
