"""The dev stack's clusters (`gpusched dev up --clusters east,west`, `--cluster-file`): which sim
cluster spec each cluster's executor runs (docs/operations.md, "Many clusters in the dev stack").

* no option: one unnamed cluster, the example cluster (gpusched/examples/cluster.yaml);
* ``--clusters east,west``: the example cluster's nodes dealt out to the named clusters, one
  node at a time in the file's order (two clusters: one h100, one a100 and one l4 node each):
  the same GPUs in all as one cluster, so the demo's quotas mean the same; a cluster numbers its
  own nodes from 0, and the log names them ``<node>.<cluster>`` (``h100-0.east``, ``h100-0.west``);
* ``--cluster-file F`` with ``groups:`` (a sim cluster spec): that spec instead of the example's,
  dealt out the same way (one unnamed cluster without ``--clusters``);
* ``--cluster-file F`` with ``clusters:`` (name -> a sim cluster spec): each named cluster runs
  its own spec; ``--clusters``, when given too, must name the same clusters.

Reads and plans, starts nothing; the dev stack writes each plan to a file for its executor.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from gpusched.errors import UserError
from schemas.node import valid_cluster
from services.executor.cluster import ClusterSpec, ClusterSpecError, load_cluster

ACCEPTED_NAME = ("a DNS label (lower-case letters, digits, '-', at most 63) not of the form r<digits> "
                 "nor ending in -r<digits>")


def parse_names(text: str | None) -> tuple[str, ...]:
    """``east,west`` -> ("east", "west"); empty or None: no names. UserError naming the bad one."""
    if not text or not text.strip():
        return ()
    names = tuple(n.strip() for n in text.split(","))
    for name in names:
        if not valid_cluster(name):
            raise UserError(f"--clusters: {name!r} is not a cluster name; accepted: a comma-separated list of "
                            f"names, each {ACCEPTED_NAME}, e.g. east,west")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"--clusters: {', '.join(twice)} named twice; accepted: distinct names, e.g. east,west")
    return names


def plan(names: tuple[str, ...], cluster_file: Path | None, example: Path) -> dict[str, ClusterSpec] | None:
    """cluster name -> the spec its executor runs; None: one unnamed cluster (:func:`single_spec`)."""
    raw = _read(cluster_file) if cluster_file is not None else None
    if isinstance(raw, dict) and "clusters" in raw:
        specs = _named_specs(cluster_file, raw)
        if names and set(names) != set(specs):
            raise UserError(f"--clusters {','.join(names)} and the clusters of {cluster_file} "
                            f"({', '.join(specs)}) differ; accepted: the same names, or --clusters left out")
        return specs
    if not names:
        return None
    source = cluster_file or example
    return deal(_load(source), names, source)


def single_spec(cluster_file: Path | None, example: Path) -> Path:
    """The spec file of the one unnamed cluster (no --clusters and no ``clusters:`` file)."""
    if cluster_file is None:
        return example
    _load(cluster_file)  # a bad file fails here, with its field, not in the executor
    return cluster_file


def deal(spec: ClusterSpec, names: tuple[str, ...], source: Path) -> dict[str, ClusterSpec]:
    """The spec's nodes dealt out to ``names``, one at a time in the spec's order; each cluster
    keeps a group's settings and numbers its share of the group from 0."""
    counts = {name: [0] * len(spec.groups) for name in names}
    turn = 0
    for g, group in enumerate(spec.groups):
        for _ in range(group.count):
            counts[names[turn % len(names)]][g] += 1
            turn += 1
    if turn < len(names):
        raise UserError(f"--clusters names {len(names)} clusters but {source} has {turn} node(s); accepted: "
                        f"at most {turn} clusters, or a --cluster-file with more nodes or with a spec per cluster")
    return {name: ClusterSpec(groups=tuple(group.model_copy(update={"count": n})
                                           for group, n in zip(spec.groups, counts[name], strict=True) if n))
            for name in names}


def gpus(spec: ClusterSpec) -> int:
    return sum(g.count * g.gpu_count for g in spec.groups)


def describe(name: str, spec: ClusterSpec) -> str:
    """``east: h100-0, a100-0, l4-0 (20 GPUs)``, the nodes as the log names them."""
    nodes = ", ".join(f"{n.name}.{name}" for n in spec.nodes())
    return f"{name}: {nodes} ({gpus(spec)} GPUs)"


def dump(spec: ClusterSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True), sort_keys=False)


def _load(path: Path) -> ClusterSpec:
    try:
        spec = load_cluster(path)
        spec.nodes()  # duplicate node names fail here
    except (ClusterSpecError, ValueError) as err:
        raise UserError(f"--cluster-file {err}") from None
    return spec


def _read(path: Path):
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise UserError(f"--cluster-file {path}: {err}") from None


def _named_specs(path: Path, raw: dict) -> dict[str, ClusterSpec]:
    extra = sorted(set(raw) - {"clusters"})
    if extra:
        raise UserError(f"{path}: unexpected key(s) {', '.join(extra)} beside 'clusters'; accepted: either "
                        "'clusters:' (name -> a sim cluster spec with 'groups:') or 'groups:' (one spec)")
    clusters = raw["clusters"]
    if not isinstance(clusters, dict) or not clusters:
        raise UserError(f"{path}: clusters: expected a mapping of cluster name -> spec (with 'groups:'), "
                        f"got {clusters!r}")
    specs = {}
    for name, body in clusters.items():
        if not isinstance(name, str) or not valid_cluster(name):
            raise UserError(f"{path}: clusters: {name!r} is not a cluster name; accepted: {ACCEPTED_NAME}")
        try:
            specs[name] = ClusterSpec.model_validate(body)
            specs[name].nodes()  # duplicate node names fail here
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise UserError(f"{path}: clusters.{name}.{where}: {first['msg']}") from None
        except ValueError as err:
            raise UserError(f"{path}: clusters.{name}: {err}") from None
    return specs

