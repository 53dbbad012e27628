"""The sim backend's cluster spec: a YAML file of node groups.

Example::

    groups:
      - prefix: a100          # nodes a100-0 .. a100-3
        count: 4
        gpu_flavor: a100-80gb
        gpu_product: NVIDIA-A100-SXM4-80GB
        gpu_count: 8
        gpu_memory_mib: 81920
        cpu_millis: 96000
        memory_mib: 1048576
        features: [rdma]
        labels: {topology.gpusched.io/rack: rack-1}
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.envelope import NAME_PATTERN
from schemas.node import NodeInfo


class NodeGroup(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: str = Field(pattern=NAME_PATTERN)
    count: int = Field(ge=1, le=100_000)
    gpu_flavor: str | None = Field(default=None, pattern=NAME_PATTERN)
    gpu_product: str | None = None
    gpu_count: int = Field(default=0, ge=0, le=64)
    gpu_memory_mib: int | None = Field(default=None, ge=1)
    cpu_millis: int = Field(default=0, ge=0)
    memory_mib: int = Field(default=0, ge=0)
    features: tuple[str, ...] = ()
    labels: dict[str, str] = Field(default_factory=dict)


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    groups: tuple[NodeGroup, ...] = Field(min_length=1)

    def nodes(self) -> list[NodeInfo]:
        out = []
        for g in self.groups:
            fields = g.model_dump(exclude={"prefix", "count"})
            out.extend(NodeInfo(name=f"{g.prefix}-{i}", **fields) for i in range(g.count))
        names = [n.name for n in out]
        if len(set(names)) != len(names):
            raise ValueError("cluster spec: node group prefixes produce duplicate node names")
        return out


class ClusterSpecError(ValueError):
    pass


def load_cluster(path: Path) -> ClusterSpec:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ClusterSpecError(f"cluster spec {path}: {err}") from None
    try:
        return ClusterSpec.model_validate(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ClusterSpecError(f"cluster spec {path}: {where}: {first['msg']}") from None
