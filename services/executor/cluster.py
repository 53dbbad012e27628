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
      - prefix: l4
        count: 2
        gpu_flavor: l4
        gpu_count: 4
        gpu_sharable: true    # fractional jobs (gpu_milli) may share these GPUs
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
    gpu_sharable: bool = False  # fractional requests (JobSpec.gpu_milli) may share the GPUs

    @model_validator(mode="after")
    def _sharable_gpus(self) -> "NodeGroup":
        if self.gpu_sharable and (self.gpu_count == 0 or self.gpu_flavor is None):
            raise ValueError(f"gpu_sharable needs GPUs to share: a gpu_flavor and gpu_count ≥ 1 (got gpu_flavor "
                             f"{self.gpu_flavor}, gpu_count {self.gpu_count})")
        return self


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
