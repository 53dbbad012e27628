"""The executor's backend settings: defaults, and a bad value names the variable and what is accepted."""

from __future__ import annotations

import pytest

from runtime.settings import ConfigError
from services.executor.config import ExecutorConfig


def test_defaults(monkeypatch):
    for k in ("GPUSCHED_K8S_NAMESPACE", "GPUSCHED_EXECUTOR_SYNC_S", "GPUSCHED_LOCAL_NODE"):
        monkeypatch.delenv(k, raising=False)
    c = ExecutorConfig.from_env()
    assert (c.sync_s, c.k8s.namespace, c.k8s.ttl_after_finished_s, c.k8s_resync_s) == (1.0, "gpusched-workloads", 3600, 300.0)


def test_namespace_per_team(monkeypatch):
    monkeypatch.setenv("GPUSCHED_K8S_NAMESPACE", "gpu-{team}")
    assert ExecutorConfig.from_env().k8s.namespace_for("team-a") == "gpu-team-a"


@pytest.mark.parametrize("var,value,needle", [
    ("GPUSCHED_K8S_NAMESPACE", "Bad_NS", "accepted: a DNS label"),
    ("GPUSCHED_EXECUTOR_SYNC_S", "0", "accepted: 0.05..60"),
    ("GPUSCHED_K8S_TTL_AFTER_FINISHED_S", "soon", "is not an integer"),
    ("GPUSCHED_LOCAL_NODE", "My Host", "accepted: a DNS subdomain"),
])
def test_bad_values_are_explained(monkeypatch, var, value, needle):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as err:
        ExecutorConfig.from_env()
    assert var in str(err.value) and needle in str(err.value)
