"""The executor's backend settings (environment variables, documented in docs/executor.md).

A bad value fails at start with the variable's name, the value and what is accepted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from runtime.settings import ConfigError, env_choice, env_number, env_value
from schemas.node import valid_cluster
from services.executor.k8s_model import JobOptions

_NS = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class ClusterConfig:
    """Which cluster this executor runs, when the platform spans several (docs/executor.md,
    "Many clusters"). Read by every backend, the sim's too."""

    name: str | None = None  # GPUSCHED_CLUSTER; None: the platform's only cluster
    heartbeat_s: float = 15.0  # GPUSCHED_CLUSTER_HEARTBEAT_S: ClusterReported every this often
    per_cluster_quota: bool = False  # GPUSCHED_CLUSTER_QUOTA=per-cluster: flavors carry the cluster's name

    @classmethod
    def from_env(cls) -> "ClusterConfig":
        name = env_value("GPUSCHED_CLUSTER")
        if name is not None and not valid_cluster(name):
            raise ConfigError(f"GPUSCHED_CLUSTER={name!r} is not a cluster name; accepted: a DNS label (lower-case "
                              "letters, digits, '-', at most 63) not of the form r<digits> or ending in -r<digits> "
                              "(a reader's consumer name), or empty for a single-cluster platform")
        return cls(
            name=name,
            heartbeat_s=env_number("GPUSCHED_CLUSTER_HEARTBEAT_S", 15.0, minimum=0.1, maximum=3600),
            per_cluster_quota=env_choice("GPUSCHED_CLUSTER_QUOTA", "global", ("global", "per-cluster")) == "per-cluster",
        )

    @property
    def service_name(self) -> str:
        """The executor's durable, lease and credential: ``executor``, or ``executor-<cluster>``."""
        return f"executor-{self.name}" if self.name else "executor"

    def core_options(self) -> dict:
        """BackendCore's cluster keywords."""
        return {"cluster": self.name, "heartbeat_s": self.heartbeat_s, "cluster_flavors": self.per_cluster_quota}


SIM_TELEMETRY_S = 300.0
"""The sim backend's default telemetry window, platform seconds."""


def sim_telemetry_interval() -> float:
    """GPUSCHED_TELEMETRY_INTERVAL_S for the sim backend: 0 (no simulated telemetry), or a window of
    1..3600 platform seconds (default :data:`SIM_TELEMETRY_S`)."""
    name, raw = "GPUSCHED_TELEMETRY_INTERVAL_S", env_value("GPUSCHED_TELEMETRY_INTERVAL_S")
    if raw is None:
        return SIM_TELEMETRY_S
    accepted = "accepted: 0 (no telemetry reports) or a number of platform seconds 1..3600"
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; {accepted}") from None
    if value != 0 and not 1 <= value <= 3600:
        raise ConfigError(f"{name}={raw!r} is out of range; {accepted}")
    return value


@dataclass(frozen=True)
class ExecutorConfig:
    sync_s: float = 1.0
    k8s: JobOptions = JobOptions()
    k8s_resync_s: float = 300.0
    local_dir: Path = Path(".data/local-executor")
    local_node: str | None = None
    local_telemetry_s: float = 10.0
    telemetry_interval_s: float = 60.0  # 0: no NodeTelemetryReported

    @classmethod
    def from_env(cls) -> "ExecutorConfig":
        ns = env_value("GPUSCHED_K8S_NAMESPACE", "gpusched-workloads") or "gpusched-workloads"
        if not _NS.match(ns.replace("{team}", "team")):
            raise ConfigError(f"GPUSCHED_K8S_NAMESPACE={ns!r} is not a namespace name; accepted: a DNS label "
                              "(lower-case letters, digits, '-'), optionally with {team}, e.g. 'gpu-{team}'")
        node = env_value("GPUSCHED_LOCAL_NODE")
        if node is not None and not re.match(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$", node):
            raise ConfigError(f"GPUSCHED_LOCAL_NODE={node!r} is not a node name; accepted: a DNS subdomain "
                              "(lower-case letters, digits, '-', '.')")
        sample_s = env_number("GPUSCHED_LOCAL_TELEMETRY_S", 10.0, minimum=0.1, maximum=3600)
        return cls(
            sync_s=env_number("GPUSCHED_EXECUTOR_SYNC_S", 1.0, minimum=0.05, maximum=60),
            k8s=JobOptions(
                namespace=ns,
                checkpoint_root=env_value("GPUSCHED_K8S_CHECKPOINT_ROOT", "/checkpoints") or "/checkpoints",
                ttl_after_finished_s=int(env_number("GPUSCHED_K8S_TTL_AFTER_FINISHED_S", 3600, minimum=0,
                                                 maximum=30 * 86_400, integer=True)),
                default_grace_s=int(env_number("GPUSCHED_K8S_DEFAULT_GRACE_S", 30, minimum=0, maximum=86_400,
                                            integer=True)),
                service_account=env_value("GPUSCHED_K8S_SERVICE_ACCOUNT"),
            ),
            k8s_resync_s=env_number("GPUSCHED_K8S_RESYNC_S", 300.0, minimum=5, maximum=86_400),
            local_dir=Path(env_value("GPUSCHED_LOCAL_DIR", ".data/local-executor") or ".data/local-executor"),
            local_node=node,
            local_telemetry_s=sample_s,
            telemetry_interval_s=_telemetry_interval(sample_s),
        )


def _telemetry_interval(sample_s: float) -> float:
    """GPUSCHED_TELEMETRY_INTERVAL_S: 0 (no reports), or a window that holds at least one NVML sample."""
    name, raw = "GPUSCHED_TELEMETRY_INTERVAL_S", env_value("GPUSCHED_TELEMETRY_INTERVAL_S")
    if raw is None:
        return max(60.0, sample_s)
    low = max(1.0, sample_s)
    accepted = f"accepted: 0 (no telemetry reports) or a number of seconds {low:g}..3600"
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; {accepted}") from None
    if value == 0:
        return 0.0
    if not 1 <= value <= 3600:
        raise ConfigError(f"{name}={raw!r} is out of range; {accepted}")
    if value < sample_s:
        raise ConfigError(f"{name}={raw!r} is shorter than GPUSCHED_LOCAL_TELEMETRY_S={sample_s:g} (the NVML "
                          f"sampling period), so a window could hold no sample; {accepted}, or sample more often")
    return value
