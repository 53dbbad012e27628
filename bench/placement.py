"""Placement quality on the Alibaba 2023 trace, measured the way the FGD paper's simulator measures
it (`gpusched sim --protocol fgd`), beside that simulator's own results.

    python -m bench.placement [--seeds 42-51] [--policy P ...] [--variant gpuspec20] [--json PATH]
                              [--draws go|python] [--peer DIR [--peer-seeds 42]]
    python -m bench.placement --lists DIR [--only cpu250,gpuspec20] [--seeds 42-51] [--policy P ...]

Each (policy, seed) runs the platform's own cores (gpusched.sim.trace: QuotaCore, SchedulerCore,
SimExecutorCore) in a worker process, two at a time; its wall time and peak memory are the
worker's. By default the tasks are the very sequence the peer builds for the seed: its Go
random draws come from bench/gorand (built with the local Go; without Go, Python's RNG, which
gives the same construction but other tasks, and the bench says so). The anchor is the peer's
`experiments/analysis/expected_results/analysis_allo_discrete.csv`
(hkust-adsl/kubernetes-scheduler-simulator, tune 1.3, seeds 42-51), copied below: the share of
GPU capacity allocated, in percent, at 80/90/100/110/120/130 % of arrived demand on the default
pod list, and the 10-seed means at 100 % on the variant lists. With --peer DIR (a checkout of
the peer) the peer itself is built and run on the same lists and seeds (bench/peer.py); one of its
runs takes about 40 minutes on a 2-core machine, so it runs on --peer-seeds only.

--variant KIND+LEVEL (cpu250, gpuspec20, gpushare40, multigpu30, ...) rebuilds one of the peer's
variant pod lists from the default one (bench/podlists.py); --pods PATH reads any pod list.

--lists DIR runs the policies (default: fgd-balance alone) on the peer's own variant lists, the 16 it reports (PEER_VARIANTS:
cpu050-250, gpushare40-100, gpuspec10-33, multigpu20-50), read from DIR as
openb_pod_list_<list>.csv (the node list: DIR's openb_node_list_gpu_node.csv if there, else the
trace's), and prints one table: each list, the peer's committed BestFit and FGD 10-seed means at
100 % arrived, and each policy's mean over --seeds beside them. The lists are not shipped with
gpusched: they are the Alibaba trace repository's (LISTS_SOURCE below).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import resource
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench import podlists
from gpusched.sim import trace as tracesim
from services.scheduler.placement import Policy, parse_policy

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "alibaba-gpu-2023"
POINTS = (80, 90, 100, 110, 120, 130)
PEER: dict[str, dict[int, tuple[float, ...]]] = {
    "BestFit": {
        42: (79.99, 89.98, 92.94, 93.00, 93.07, 93.13), 43: (80.00, 90.01, 92.97, 93.05, 93.14, 93.25),
        44: (80.01, 90.03, 92.89, 92.97, 93.02, 93.09), 45: (80.03, 89.95, 92.93, 93.02, 93.09, 93.14),
        46: (80.04, 90.01, 93.00, 93.05, 93.14, 93.19), 47: (80.03, 90.03, 92.84, 92.88, 92.92, 93.04),
        48: (80.01, 90.04, 92.68, 92.80, 92.86, 92.95), 49: (80.03, 90.01, 93.04, 93.09, 93.14, 93.21),
        50: (80.00, 89.94, 92.64, 92.72, 92.78, 92.87), 51: (80.01, 89.94, 92.69, 92.77, 92.85, 92.89),
    },
    "FGD": {
        42: (79.99, 89.98, 95.14, 95.19, 95.24, 95.29), 43: (80.00, 90.01, 95.06, 95.14, 95.23, 95.32),
        44: (80.01, 90.03, 95.29, 95.37, 95.41, 95.44), 45: (80.03, 89.95, 95.38, 95.43, 95.45, 95.48),
        46: (80.04, 89.88, 95.35, 95.40, 95.46, 95.49), 47: (80.03, 90.03, 95.14, 95.19, 95.22, 95.27),
        48: (80.01, 90.04, 95.18, 95.29, 95.33, 95.37), 49: (80.03, 90.01, 95.30, 95.37, 95.42, 95.47),
        50: (80.00, 89.94, 95.15, 95.23, 95.29, 95.35), 51: (80.01, 89.94, 95.28, 95.35, 95.42, 95.43),
    },
}


# The peer's 10-seed means at 100 % arrived (BestFit, FGD) on its published variant lists, from the same file.
PEER_VARIANTS: dict[str, tuple[float, float]] = {
    "cpu050": (93.56, 95.00), "cpu100": (93.26, 95.21), "cpu200": (92.15, 94.82), "cpu250": (91.21, 93.20),
    "gpushare40": (91.44, 93.96), "gpushare60": (89.06, 91.25), "gpushare80": (86.66, 89.08),
    "gpushare100": (84.62, 86.64), "gpuspec10": (93.10, 94.66), "gpuspec20": (88.46, 94.66),
    "gpuspec25": (85.67, 93.91), "gpuspec33": (80.39, 87.84), "multigpu20": (93.73, 95.53),
    "multigpu30": (94.57, 96.36), "multigpu40": (95.10, 96.91), "multigpu50": (95.62, 97.09),
}


LISTS_SOURCE = ("the Alibaba trace repository, https://github.com/alibaba/clusterdata, "
                "folder cluster-trace-gpu-v2023/csv (the FGD paper's pod lists)")


# SHA-256 of the shipped trace's files (= the peer's data/csv/openb_node_list_gpu_node.csv and
# openb_pod_list_default.csv): the committed figures are compared only with runs on these.
SHIPPED = {"nodes": "2beca64b4d3dfa342036a34b56a495c6cef9225db836c81f541282cb1df320b5",
           "pods": "1ee7ed79c27a3b0861cda8ddba86a004c6aba904caafa329a76ae93ca63834a8"}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_one(nodes: str, pods: str, policy: str, seed: int, ratio: float, draws: str) -> dict:
    """One inflation run in this worker: the curve at POINTS, wall seconds, peak RSS."""
    trace = tracesim.load_trace(nodes=Path(nodes), pods=Path(pods))
    source = None
    if draws == "go":
        from bench.gorand import GoDraws

        per_task = sum(t.milli for t in trace.tasks) / len(trace.tasks)
        wanted = max(0.0, ratio * trace.capacity * 1000 - sum(t.milli for t in trace.tasks)) / max(per_task, 1.0)
        source = GoDraws(seed, len(trace.tasks), int(1.5 * wanted) + 1000)
    start = time.perf_counter()
    r = tracesim.inflation(trace, parse_policy(policy), ratio=ratio, seed=seed, protocol="fgd", draws=source)
    curve = r["allocation_pct_by_arrived_pct"]
    return {"policy": policy, "seed": seed, "curve": [curve.get(p) for p in POINTS], "failed": r["failed"],
            "tasks": r["arrived_tasks"], "wall_s": time.perf_counter() - start,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def seeds_of(text: str) -> list[int]:
    if "-" in text:
        low, high = (int(x) for x in text.split("-", 1))
        return list(range(low, high + 1))
    return [int(x) for x in text.split(",")]


def mean_curve(rows: list[list[float | None]]) -> list[float | None]:
    out = []
    for column in zip(*rows):
        values = [v for v in column if v is not None]
        out.append(round(statistics.mean(values), 2) if values else None)
    return out


def draws_kind(wanted: str) -> tuple[str, str]:
    """(the draws to use, a line saying which)."""
    if wanted == "go":
        from bench.gobuild import GoUnavailable
        from bench.gorand import binary

        try:
            binary()
            return "go", "the peer's own task sequence per seed (Go's draws, bench/gorand)"
        except GoUnavailable as e:
            return "python", f"Python's draws: the peer's construction, other tasks ({e})"
    return "python", "Python's draws: the peer's construction, other tasks than the peer's for a seed"


def main(args) -> dict:
    seeds = seeds_of(args.seeds)
    draws, draws_line = draws_kind(args.draws)
    with tempfile.TemporaryDirectory(prefix="gpusched-podlist-") as tmp:
        shipped = _digest(args.nodes) == SHIPPED["nodes"]
        pods, label = args.pods, "default" if shipped and _digest(args.pods) == SHIPPED["pods"] else str(args.pods)
        if args.variant:
            kind, level = variant_of(args.variant)
            pods = podlists.write(podlists.build(kind, level, args.pods, args.nodes),
                                  Path(tmp) / f"openb_pod_list_{args.variant}.csv")
            label = args.variant if shipped and label == "default" else f"{args.variant} of {label}"
        jobs = [(str(args.nodes), str(pods), policy, seed, args.ratio, draws)
                for policy in args.policy for seed in seeds]
        with ProcessPoolExecutor(max_workers=args.workers, max_tasks_per_child=1) as pool:
            runs = list(pool.map(run_one, *zip(*jobs)))
        peer_runs = []
        if args.peer_src is not None:
            from bench import peer

            peer_runs = [vars(r) | {"curve": [r.curve.get(p) for p in POINTS]}
                         for r in peer.run_all(args.peer_src, args.nodes, pods, seeds_of(args.peer_seeds or str(seeds[0])),
                                               args.ratio, args.workers)]
    by_policy = {p: [r for r in runs if r["policy"] == p] for p in args.policy}
    committed = {}
    if label == "default":
        committed = {name: mean_curve([table[s] for s in seeds if s in table]) for name, table in PEER.items()}
    elif label in PEER_VARIANTS:
        committed = {name: [None, None, v, None, None, None] for name, v in zip(("BestFit", "FGD"), PEER_VARIANTS[label])}
    return {"seeds": seeds, "ratio": args.ratio, "points": POINTS, "pod_list": label, "draws": draws,
            "draws_line": draws_line, "runs": runs, "peer_runs": peer_runs,
            "gpusched": {p: mean_curve([r["curve"] for r in rs]) for p, rs in by_policy.items()},
            "peer": committed}


def real_lists(directory: Path, names: list[str]) -> dict[str, Path]:
    """The pod list file in ``directory`` of each of ``names`` (keys of PEER_VARIANTS)."""
    unknown = [n for n in names if n not in PEER_VARIANTS]
    if unknown:
        raise SystemExit(f"--only {','.join(unknown)}: not a list the peer reports; accepted: {', '.join(PEER_VARIANTS)}")
    if not directory.is_dir():
        raise SystemExit(f"--lists {directory}: not a directory; give the directory that holds the pod lists "
                         f"openb_pod_list_<list>.csv from {LISTS_SOURCE}")
    files = {n: directory / f"openb_pod_list_{n}.csv" for n in names}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise SystemExit(f"--lists {directory}: missing {', '.join(missing)}; the lists come from {LISTS_SOURCE}: "
                         "download them into one directory and give it to --lists")
    return files


def main_lists(directory: Path, names: list[str], nodes: Path, policies: list[str], seeds: list[int],
               ratio: float, draws_wanted: str, workers: int) -> dict:
    """Every (list, policy, seed) run in one pool; per list and policy the mean at 100 % arrived
    beside the peer's committed BestFit and FGD."""
    files = real_lists(directory, names)
    if (directory / tracesim.NODE_FILE).is_file():
        nodes = directory / tracesim.NODE_FILE
    if not nodes.is_file():
        raise SystemExit(f"the node list is missing ({nodes}, and {directory} has no {tracesim.NODE_FILE}); "
                         "give --nodes PATH or put it beside the pod lists")
    draws, draws_line = draws_kind(draws_wanted)
    jobs = [(name, policy, seed) for name in names for policy in policies for seed in seeds]
    with ProcessPoolExecutor(max_workers=workers, max_tasks_per_child=1) as pool:
        runs = list(pool.map(run_one, *zip(*[(str(nodes), str(files[n]), p, s, ratio, draws) for n, p, s in jobs])))
    for (name, _, _), run in zip(jobs, runs):
        run["list"] = name
    return {"seeds": seeds, "ratio": ratio, "draws": draws, "draws_line": draws_line, "lists_dir": str(directory),
            "nodes": str(nodes), "runs": runs, "table": list_table(runs, names, policies)}


def list_table(runs: list[dict], names: list[str], policies: list[str]) -> list[dict]:
    """One row per (list, policy): the peer's committed BestFit and FGD at 100 %, the policy's mean
    over its seeds at 100 %, the difference from FGD, the seeds and their values."""
    at = POINTS.index(100)
    rows = []
    for name in names:
        best_fit, fgd = PEER_VARIANTS[name]
        for policy in policies:
            mine = sorted(((r["seed"], r["curve"][at]) for r in runs if r["list"] == name and r["policy"] == policy))
            values = [v for _, v in mine if v is not None]
            mean = round(statistics.mean(values), 2) if values else None
            rows.append({"list": name, "peer_best_fit": best_fit, "peer_fgd": fgd, "policy": policy, "mean": mean,
                         "delta_vs_fgd": None if mean is None else round(mean - fgd, 2),
                         "seeds": [s for s, _ in mine], "per_seed": [v for _, v in mine],
                         "wall_s": statistics.median(r["wall_s"] for r in runs
                                                     if r["list"] == name and r["policy"] == policy)})
    return rows


def report_lists(r: dict) -> None:
    seeds = r["seeds"]
    print(f"\ngpusched bench — placement on the peer's pod lists ({r['lists_dir']}), the FGD paper's protocol "
          f"(tune {r['ratio']}); allocated share of GPU capacity at 100 % arrived, %")
    span = f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))
    print(f"  tasks: {r['draws_line']}; peer: its committed 10-seed means (seeds 42-51); gpusched: seeds {span}")
    print(f"  {'list':<12}{'peer BestFit':>13}{'peer FGD':>10}  {'gpusched policy':<16}{'mean':>8}{'vs FGD':>9}"
          f"{'s / run':>9}   per seed")
    for row in r["table"]:
        mean = f"{row['mean']:>8.2f}" if row["mean"] is not None else f"{'-':>8}"
        delta = f"{row['delta_vs_fgd']:>+9.2f}" if row["delta_vs_fgd"] is not None else f"{'-':>9}"
        per_seed = " ".join(f"{s}:{v:.2f}" if v is not None else f"{s}:-" for s, v in zip(row["seeds"], row["per_seed"]))
        print(f"  {row['list']:<12}{row['peer_best_fit']:>13.2f}{row['peer_fgd']:>10.2f}  {row['policy']:<16}{mean}{delta}"
              f"{row['wall_s']:>9.0f}   {per_seed}")
    for policy in dict.fromkeys(row["policy"] for row in r["table"]):
        deltas = [row["delta_vs_fgd"] for row in r["table"] if row["policy"] == policy and row["delta_vs_fgd"] is not None]
        if deltas:
            print(f"  {policy}: above the peer's FGD on {sum(d > 0 for d in deltas)} of {len(deltas)} lists "
                  f"(difference min {min(deltas):+.2f}, median {statistics.median(deltas):+.2f}, max {max(deltas):+.2f})")


def variant_of(text: str) -> tuple[str, int]:
    m = re.fullmatch(rf"({'|'.join(podlists.KINDS)})(\d+)", text)
    if m is None:
        raise SystemExit(f"--variant {text!r}: accepted: KIND+LEVEL with KIND one of {', '.join(podlists.KINDS)}, "
                         "e.g. cpu250, gpuspec20, gpushare40, multigpu30")
    return m.group(1), int(m.group(2))


def report(r: dict) -> None:
    seeds = r["seeds"]
    at = r["points"].index(100)
    print(f"\ngpusched bench — placement, the FGD paper's protocol, pod list {r['pod_list']} "
          f"(tune {r['ratio']}, seeds {seeds[0]}-{seeds[-1]}; allocated share of GPU capacity, %, mean over seeds)")
    print(f"  tasks: {r['draws_line']}")
    print(f"  {'policy':<22}" + "".join(f"{p:>8} %" for p in r["points"]) + "   wall s / run   peak MiB")

    def row(name: str, curve, tail: str) -> None:
        print(f"  {name:<22}" + "".join(f"{v:>10.2f}" if v is not None else f"{'-':>10}" for v in curve) + tail)

    for name, curve in r["peer"].items():
        row("peer " + name, curve, f"   (committed, openb_pod_list_{r['pod_list']})")
    for name in dict.fromkeys(x["policy"] for x in r["peer_runs"]):
        runs = [x for x in r["peer_runs"] if x["policy"] == name]
        row(f"peer {name} (run here)", mean_curve([x["curve"] for x in runs]),
            f"   {statistics.median(x['wall_s'] for x in runs):>12.0f}   {max(x['peak_rss_mib'] for x in runs):>8.0f}"
            f"   seeds {[x['seed'] for x in runs]}")
    for policy, curve in r["gpusched"].items():
        runs = [x for x in r["runs"] if x["policy"] == policy]
        row("gpusched " + policy, curve, f"   {statistics.median(x['wall_s'] for x in runs):>12.0f}"
                                         f"   {max(x['peak_rss_mib'] for x in runs):>8.0f}")
    fgd = r["peer"].get("FGD", [None] * len(r["points"]))[at]
    for policy, curve in r["gpusched"].items():
        if curve[at] is None:  # a small trace jumps over 100 %
            print(f"  at 100 %: gpusched {policy}: no task arrived within 99-101 %")
            continue
        per_seed = {x["seed"]: x["curve"][at] for x in r["runs"] if x["policy"] == policy}
        line = f"  at 100 %: gpusched {policy} {curve[at]:.2f}"
        if fgd is not None:
            line += f" vs peer FGD {fgd:.2f} ({curve[at] - fgd:+.2f} points; unallocated {100 - curve[at]:.2f} % vs {100 - fgd:.2f} %)"
        print(line + f"; per seed {list(per_seed.values())}")
        if r["pod_list"] == "default" and r["draws"] == "go":
            diffs = [v - PEER["FGD"][s][at] for s, v in per_seed.items() if s in PEER["FGD"] and v is not None]
            if diffs:
                print(f"      same tasks as the peer, seed by seed: {sum(d > 0 for d in diffs)} of {len(diffs)} above FGD, "
                      f"difference median {statistics.median(diffs):+.2f}, min {min(diffs):+.2f}, max {max(diffs):+.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42-51", help="a range A-B or a list A,B,C")
    parser.add_argument("--policy", action="append", default=None, choices=[p.value for p in Policy])
    parser.add_argument("--ratio", type=float, default=1.3)
    parser.add_argument("--trace", type=Path, default=TRACE, help="the directory of the default node and pod lists")
    parser.add_argument("--nodes", type=Path, default=None, help="a node list (default: the trace's)")
    parser.add_argument("--pods", type=Path, default=None, help="a pod list (default: the trace's)")
    parser.add_argument("--variant", default=None, help="rebuild a variant of the pod list: cpu250, gpuspec20, ...")
    parser.add_argument("--lists", type=Path, default=None,
                        help="a directory with the peer's pod lists (openb_pod_list_<list>.csv, from the Alibaba "
                             "trace repository's cluster-trace-gpu-v2023/csv): run every list it reports")
    parser.add_argument("--only", default=None, help="with --lists: these lists only, comma-separated (cpu250,gpuspec20)")
    parser.add_argument("--draws", choices=("go", "python"), default="go")
    parser.add_argument("--peer", dest="peer_src", type=Path, default=None,
                        help="a checkout or a bare clone of hkust-adsl/kubernetes-scheduler-simulator "
                             "(or GPUSCHED_PEER_SRC)")
    parser.add_argument("--peer-seeds", default=None, help="the seeds the peer runs (default: the first of --seeds)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    # --lists: 16 lists x 10 seeds of one policy already take about 80 minutes on two cores
    args.policy = args.policy or (["fgd-balance"] if args.lists else ["best-fit", "fgd", "fgd-spread", "fgd-balance"])
    args.nodes = args.nodes or args.trace / tracesim.NODE_FILE
    if args.lists is not None:
        if args.variant or args.pods or args.peer_src:
            raise SystemExit("--lists runs the peer's own lists: give it without --variant, --pods and --peer")
        names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(PEER_VARIANTS)
        result = main_lists(args.lists, names, args.nodes, args.policy, seeds_of(args.seeds), args.ratio, args.draws,
                            args.workers)
        report_lists(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        raise SystemExit(0)
    if args.only:
        raise SystemExit("--only selects among --lists: give --lists DIR too")
    args.pods = args.pods or args.trace / tracesim.POD_FILE
    if not args.nodes.exists() or not args.pods.exists():
        raise SystemExit(f"the node or pod list is missing ({args.nodes}, {args.pods}); "
                         "give --trace DIR (the Alibaba 2023 openb files) or --nodes/--pods")
    from bench import peer as peer_module

    try:
        args.peer_src = peer_module.source(args.peer_src)
    except peer_module.PeerUnavailable as e:
        raise SystemExit(str(e)) from None
    if args.peer_src is None:
        print("[peer] not run: give --peer DIR or GPUSCHED_PEER_SRC (a checkout or a bare clone of "
              "hkust-adsl/kubernetes-scheduler-simulator); its committed results are the anchor")
    result = main(args)
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
