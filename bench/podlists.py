"""The FGD paper's variant pod lists, rebuilt from the default one (the same columns), for
bench.placement and for `gpusched sim --pods`.

    python -m bench.podlists KIND LEVEL OUT.csv [--pods DEFAULT.csv] [--seed N]

The peer publishes them beside the default list (hkust-adsl/kubernetes-scheduler-simulator,
data/csv/openb_pod_list_<kind><level>.csv) without the script that made them; how each is built
here is read from comparing them with the default list (docs/scheduling.md, "Variant pod lists"):

* ``cpu``: the GPU tasks as they are; the CPU-only tasks resampled from the default's CPU-only
  rows to LEVEL % of all tasks (cpu050: 5 %, cpu250: 25 %): a sample without replacement below
  the default's own share, every row once or more plus a sample above it;
* ``multigpu``: the default rows, then multi-GPU rows drawn with replacement from the default's
  until multi-GPU tasks ask LEVEL % of the requested GPU capacity;
* ``gpuspec``: the default rows, with a GPU-model constraint (``gpu_spec``) set on GPU tasks drawn
  at random until constrained tasks ask LEVEL % of the requested GPU capacity; the constraint is
  drawn from the mix in the published gpuspec33 list, among those whose models have a node that
  can hold the task;
* ``gpushare``: the CPU-only rows, and as many GPU tasks as the default has, each drawn from the
  default's sharing (fractional) tasks or from its others with the probability that makes
  sharing tasks ask LEVEL % of the requested GPU capacity. The published lists come from a larger
  trace that is not published, so this one is an approximation.

Every list is shuffled and renamed openb-pod-0000... so that sorting by name does not sort it by
kind.
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

KINDS = ("cpu", "multigpu", "gpuspec", "gpushare")
# gpu_spec values and their counts in the published openb_pod_list_gpuspec33.csv (the six most common)
SPEC_MIX = {"T4": 1291, "G2": 331, "P100": 279, "V100M16|V100M32": 141, "P100|V100M16|V100M32": 103, "G3": 86}


def _milli(row: dict) -> int:
    gpus = int(row["num_gpu"])
    milli = int(float(row.get("gpu_milli") or 0))
    return milli if gpus == 1 and 0 < milli < 1000 else 1000 * gpus


def _is_share(row: dict) -> bool:
    return int(row["num_gpu"]) == 1 and 0 < int(float(row.get("gpu_milli") or 0)) < 1000


def _renamed(rows: list[dict], rng: random.Random) -> list[dict]:
    rows = [dict(r) for r in rows]
    rng.shuffle(rows)
    for i, r in enumerate(rows):
        r["name"] = f"openb-pod-{i:04d}"
    return rows


def cpu(rows: list[dict], level: float, rng: random.Random) -> list[dict]:
    gpu = [r for r in rows if int(r["num_gpu"]) > 0]
    cpu_only = [r for r in rows if int(r["num_gpu"]) == 0]
    want = round(level * len(gpu) / (1 - level))
    whole, part = divmod(want, len(cpu_only))
    return _renamed(gpu + cpu_only * whole + rng.sample(cpu_only, part), rng)


def multigpu(rows: list[dict], level: float, rng: random.Random) -> list[dict]:
    multi = [r for r in rows if int(r["num_gpu"]) > 1]
    total = sum(_milli(r) for r in rows)
    taken = sum(_milli(r) for r in multi)
    out = list(rows)
    while taken < level * total:
        r = rng.choice(multi)
        out.append(r)
        taken += _milli(r)
        total += _milli(r)
    return _renamed(out, rng)


def gpuspec(rows: list[dict], level: float, rng: random.Random, nodes: list[dict]) -> list[dict]:
    def holds(spec: str, r: dict) -> bool:
        models = set(spec.split("|"))
        return any(n["model"] in models and int(n["gpu"]) >= int(r["num_gpu"])
                   and int(n["cpu_milli"]) >= int(r["cpu_milli"]) and int(n["memory_mib"]) >= int(r["memory_mib"])
                   for n in nodes)

    out = [dict(r) for r in rows]
    total = sum(_milli(r) for r in out)
    taken = 0
    order = [r for r in out if int(r["num_gpu"]) > 0]
    rng.shuffle(order)
    for r in order:
        if taken >= level * total:
            break
        specs = [s for s in SPEC_MIX if holds(s, r)]
        if specs:
            r["gpu_spec"] = rng.choices(specs, weights=[SPEC_MIX[s] for s in specs])[0]
            taken += _milli(r)
    return _renamed(out, rng)


def gpushare(rows: list[dict], level: float, rng: random.Random) -> list[dict]:
    share = [r for r in rows if _is_share(r)]
    other = [r for r in rows if int(r["num_gpu"]) > 0 and not _is_share(r)]
    cpu_only = [r for r in rows if int(r["num_gpu"]) == 0]
    ms = sum(_milli(r) for r in share) / len(share)
    mw = sum(_milli(r) for r in other) / len(other)
    # P(sharing) q such that q·ms / (q·ms + (1 − q)·mw) = level
    q = 1.0 if level >= 1 else level * mw / (ms * (1 - level) + level * mw)
    drawn = [rng.choice(share) if rng.random() < q else rng.choice(other) for _ in range(len(share) + len(other))]
    return _renamed(cpu_only + drawn, rng)


def build(kind: str, level: int, pods: Path, nodes: Path, seed: int = 0) -> list[dict]:
    """The variant ``<kind><level>`` (level in the file names' units: cpu in tenths of a
    percent, the others in percent) of the pod list at ``pods``."""
    if kind not in KINDS:
        raise ValueError(f"variant kind {kind!r} is not known; accepted: {', '.join(KINDS)}")
    fraction = level / (1000 if kind == "cpu" else 100)
    if not 0 < fraction <= (0.9 if kind == "cpu" else 1.0):
        raise ValueError(f"{kind}{level:03d} is out of range; accepted: cpu 001-900, the others 1-100")
    with pods.open(newline="") as f:
        rows = list(csv.DictReader(f))
    rng = random.Random(f"{kind}{level}/{seed}")
    if kind == "gpuspec":
        with nodes.open(newline="") as f:
            return gpuspec(rows, fraction, rng, list(csv.DictReader(f)))
    return {"cpu": cpu, "multigpu": multigpu, "gpushare": gpushare}[kind](rows, fraction, rng)


def write(rows: list[dict], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return out


if __name__ == "__main__":
    from bench.placement import TRACE
    from gpusched.sim import trace as tracesim

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("level", type=int, help="as in the peer's file names: cpu050 -> 50, gpuspec20 -> 20")
    parser.add_argument("out", type=Path)
    parser.add_argument("--pods", type=Path, default=TRACE / tracesim.POD_FILE)
    parser.add_argument("--nodes", type=Path, default=TRACE / tracesim.NODE_FILE)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(build(args.kind, args.level, args.pods, args.nodes, args.seed), args.out))
