"""Executor adapter. The ``sim`` backend is a pure core run by the shared decision loop; the
Kubernetes and local backends are the executor issue's work."""

from __future__ import annotations

import sys

from gpusched.service import run_service
from services.executor.cluster import ClusterSpecError, load_cluster
from services.executor.sim import SimExecutorCore


def build(settings, clock):
    if settings.executor_backend != "sim":
        sys.exit(f"GPUSCHED_EXECUTOR_BACKEND={settings.executor_backend!r} is not available in this version; "
                 "available: sim")
    if settings.sim_cluster is None:
        sys.exit("GPUSCHED_SIM_CLUSTER must name a cluster spec YAML for the sim backend")
    try:
        cluster = load_cluster(settings.sim_cluster)
    except ClusterSpecError as err:
        sys.exit(str(err))
    return SimExecutorCore(cluster.nodes())


def main() -> None:
    run_service("executor", build)


if __name__ == "__main__":
    main()
