"""Urgent scale-up of an SLA service in a cluster full of preemptible training.

    python -m bench.serving [--nodes 8] [--start 2] [--to 32] [--victim-gpus 2] [--hours 24]

The platform's decision cores — admission, quota, scheduler, the sim executor and the serving
controller — on a virtual clock (no service lag: what is measured is the decisions' own delays):
``nodes`` × 8 A100 in one queue whose nominal is the whole cluster (preemption of lower
priorities within the queue allowed); an inference service at ``start`` replicas (inference-sla,
readiness 30 s); the rest of the cluster full of ``training`` jobs of ``victim-gpus`` GPUs each
(protection 600 s, grace 60 s), running for an hour; then one ``gpusched scale`` to ``to``
replicas. Run twice: the training never checkpointed, and each job checkpointed 10 minutes
before the scale-up.

Prints, per run: the scale-up latency per new replica (request → ReplicaReady) p50 / p99 / max
beside its floor (a victim's grace, then the readiness delay: the sim stops a preempted attempt at
its deadline, as a kubernetes Pod gets its grace period, so no replica can be ready sooner), the
victims chosen against the fewest that free enough GPUs, and the GPU-seconds of work they lost
(from their start or last checkpoint to their stop at the deadline). All times are virtual seconds; the
run itself takes under a second.

Then a diurnal load (a day's sine between 10 % and 100 % of a peak of 300 requests/s, ±5 % noise,
measured every 10 s and reported every minute) on a service whose replicas serve 10 requests/s
each, once with a ``requests_per_replica`` autoscaling rule (target 8 per replica: 20 % headroom;
no up window, 5-minute down window) and once at a fixed size for the noisy peak (32 replicas):
the seconds during which the ready replicas could not serve the load (SLA breach) and the
GPU-hours the replicas held.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpusched.cli.services import load_curve
from gpusched.sim.trace import decide_until_quiet
from schemas import Event, JobPreempted, QueueConfigured, new_event
from schemas.node import NodeInfo
from schemas.commands import Principal
from schemas.queue import FlavorQuota, PreemptionPolicy
from schemas.service import ReplicaReady
from services.admission.domain import AdmissionCore
from services.executor.sim import SimExecutorCore
from services.quota.domain import QuotaCore
from services.scheduler.domain import SchedulerCore
from services.serving.domain import ServingCore

T0 = datetime(2026, 12, 1, tzinfo=UTC)
TEAM = Principal(team="team-a", user="alice", verb="submit")
READINESS_S = 30.0
GRACE_S = 60.0
"""The training class's grace: a victim's checkpoint window before its stop (schemas/priority.py)."""
RUN_FOR = timedelta(hours=1)  # the training runs this long before the scale-up
CHECKPOINT_BEFORE = timedelta(minutes=10)


def command(verb: str) -> Principal:
    return Principal(team=TEAM.team, user=TEAM.user, verb=verb)


def service(replicas: int, most: int) -> bytes:
    return json.dumps({"spec": {
        "name": "chat", "team": "team-a", "queue": "prod", "replicas": {"min": 1, "max": most, "desired": replicas},
        "replica": {"kind": "inference", "queue": "prod", "team": "team-a", "image": "srv", "gpus": 1,
                    "priority_class": "inference-sla"},
        "readiness": {"delay_seconds": READINESS_S}}}).encode()


def run(nodes: int, start: int, to: int, victim_gpus: int, checkpoints: bool) -> dict:
    cluster = [NodeInfo(name=f"n{i}", gpu_flavor="a100", gpu_count=8, gpu_memory_mib=81920) for i in range(nodes)]
    admission, quota, scheduler = AdmissionCore(), QuotaCore(), SchedulerCore()
    executor, serving = SimExecutorCore(cluster), ServingCore()
    cores = (admission, quota, scheduler, executor, serving)
    log: list[Event] = []

    def feed(events):
        for e in events:
            log.append(e)
            for core in cores:
                core.evolve(e)

    def settle(now):
        if not decide_until_quiet(cores, feed, now, 1000):
            raise RuntimeError(f"the cores still decide at {now}")

    seq = iter(range(1, 1_000_000))
    feed([new_event(QueueConfigured, aggregate_id="prod", producer="config", occurred_at=T0, key="1", name="prod",
                    allowed_teams=("team-a",), quotas=(FlavorQuota(flavor="a100", nominal=nodes * 8),),
                    preemption=PreemptionPolicy(within_queue="lower-priority"))])
    settle(T0)  # the executor registers the nodes
    feed(admission.handle_deploy(service(start, max(to, start)), command("deploy"), next(seq), T0))
    settle(T0)
    training = (nodes * 8 - start) // victim_gpus
    for i in range(training):
        job = {"job_id": f"train-{i}", "spec": {"kind": "training", "queue": "prod", "team": "team-a", "image": "t",
                                                "gpus": victim_gpus, "priority_class": "training",
                                                "expected_runtime_seconds": 86_400}}
        feed(admission.handle_submit(json.dumps(job).encode(), TEAM, next(seq), T0))
    now = T0
    settle(now)
    if checkpoints:
        now = T0 + RUN_FOR - CHECKPOINT_BEFORE
        for i in range(training):
            report = {"job_id": f"train-{i}", "attempt": 1, "checkpointed_at": now.isoformat(), "step": 1000}
            feed(admission.handle_checkpoint(json.dumps(report).encode(), command("checkpoint"), next(seq), now))
    now = T0 + RUN_FOR
    settle(now)
    scale_at = now
    feed(admission.handle_scale(json.dumps({"service": "chat", "replicas": to}).encode(), command("scale"),
                                next(seq), now))
    step = timedelta(seconds=1)
    ready: dict[str, datetime] = {}
    while len(ready) < to - start and now - scale_at < timedelta(hours=2):
        settle(now)
        ready = {e.job_id: e.occurred_at for e in log if isinstance(e, ReplicaReady)
                 and not e.job_id.endswith(tuple(f"-{k}" for k in range(start))) and e.occurred_at >= scale_at}
        now += step
    latencies = sorted((at - scale_at).total_seconds() for at in ready.values())
    victims = [e for e in log if isinstance(e, JobPreempted)]
    lost = 0.0
    for v in victims:
        since = v.started_at if not checkpoints else max(v.started_at, T0 + RUN_FOR - CHECKPOINT_BEFORE)
        lost += victim_gpus * (v.occurred_at - since).total_seconds()
    free = nodes * 8 - start - training * victim_gpus  # GPUs no training job fits in
    needed = max(0, to - start - free)
    return {
        "checkpoints": checkpoints, "replicas_ready": len(ready), "asked": to - start,
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p99_s": latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)] if latencies else None,
        "latency_max_s": latencies[-1] if latencies else None,
        "latency_floor_s": GRACE_S + READINESS_S,
        "victims": len({v.aggregate_id for v in victims}), "victims_minimum": math.ceil(needed / victim_gpus),
        "work_lost_gpu_s": lost,
    }


def curve_rps(curve: list[tuple[float, float]], offset_s: float) -> float:
    """The load at ``offset_s`` on a curve of (offset, requests/s) points, linear between them."""
    if offset_s <= curve[0][0]:
        return curve[0][1]
    for (t0, r0), (t1, r1) in zip(curve, curve[1:]):
        if offset_s <= t1:
            return r0 if t1 == t0 else r0 + (r1 - r0) * (offset_s - t0) / (t1 - t0)
    return curve[-1][1]


def diurnal(hours: float, autoscale: bool, peak_rps: float = 300.0, capacity: float = 10.0, target: float = 8.0,
            nodes: int = 8, seed: int = 3, curve: list[tuple[float, float]] | None = None) -> dict:
    """``curve``: the load from a file (gpusched/examples/load-diurnal.csv) instead of the sine,
    with the same noise; ``peak_rps`` is then its highest point."""
    cluster = [NodeInfo(name=f"n{i}", gpu_flavor="a100", gpu_count=8, gpu_memory_mib=81920) for i in range(nodes)]
    admission, quota, scheduler = AdmissionCore(), QuotaCore(), SchedulerCore()
    executor, serving = SimExecutorCore(cluster), ServingCore()
    cores = (admission, quota, scheduler, executor, serving)

    def feed(events):
        for e in events:
            for core in cores:
                core.evolve(e)

    rng = random.Random(seed)
    seq = iter(range(1, 1_000_000))
    if curve is not None:
        peak_rps = max(r for _, r in curve)
    peak = math.ceil(peak_rps * 1.05 / capacity)  # the fixed size: enough for the noisy peak
    feed([new_event(QueueConfigured, aggregate_id="prod", producer="config", occurred_at=T0, key="1", name="prod",
                    allowed_teams=("team-a",), quotas=(FlavorQuota(flavor="a100", nominal=nodes * 8),))])
    decide_until_quiet(cores, feed, T0, 1000)
    doc = json.loads(service(2 if autoscale else peak, max(peak + 8, 2)))
    if autoscale:
        doc["spec"]["autoscaling"] = {"metric": "requests_per_replica", "target": target,
                                      "scale_up_stabilization_seconds": 0, "scale_down_stabilization_seconds": 300}
    feed(admission.handle_deploy(json.dumps(doc).encode(), command("deploy"), next(seq), T0))
    step, report_every = timedelta(seconds=10), 6  # a load report every minute
    breach = held = 0.0
    now, i = T0, 0
    while now < T0 + timedelta(hours=hours):
        offset = (now - T0).total_seconds()
        base = (curve_rps(curve, offset) if curve is not None
                else peak_rps * (0.55 + 0.45 * math.sin(2 * math.pi * (offset / 86_400 - 0.25))))
        rps = base * rng.uniform(0.95, 1.05)
        if i % report_every == 0:
            feed(admission.handle_load(json.dumps({"service": "chat", "requests_per_second": rps}).encode(),
                                       command("load"), next(seq), now))
        if not decide_until_quiet(cores, feed, now, 1000):
            raise RuntimeError(f"the cores still decide at {now}")
        replicas = [r for r in serving.services["chat"].replicas.values() if r.live]
        ready = sum(r.ready for r in replicas)
        breach += step.total_seconds() * (ready * capacity < rps)
        held += step.total_seconds() * sum(r.placed is not None for r in replicas)
        now, i = now + step, i + 1
    return {"autoscaled": autoscale, "breach_s": breach, "gpu_hours": held / 3600}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--start", type=int, default=2)
    p.add_argument("--to", type=int, default=32)
    p.add_argument("--victim-gpus", type=int, default=2)
    p.add_argument("--hours", type=float, default=24.0, help="Length of the diurnal run")
    p.add_argument("--load-file", type=Path, default=None,
                   help="The diurnal load from a CSV of seconds,requests_per_second (gpusched report-load's --curve "
                        "format) instead of the sine")
    args = p.parse_args()
    print(f"urgent scale-up {args.start} -> {args.to} replicas of an SLA service on {args.nodes} x 8 A100 full of "
          f"{args.victim_gpus}-GPU training jobs (virtual seconds; pure cores, no service lag)")
    for checkpoints in (False, True):
        r = run(args.nodes, args.start, args.to, args.victim_gpus, checkpoints)
        def ratio(v):
            return f"{v / r['latency_floor_s']:.2f}x floor" if v is not None else "-"
        print(f"  {'checkpointed 10 min before' if checkpoints else 'never checkpointed'}: "
              f"{r['replicas_ready']}/{r['asked']} new replicas ready; latency p50 {r['latency_p50_s']} s "
              f"({ratio(r['latency_p50_s'])}), p99 {r['latency_p99_s']} s ({ratio(r['latency_p99_s'])}), "
              f"max {r['latency_max_s']} s ({ratio(r['latency_max_s'])}); floor {r['latency_floor_s']:.0f} s "
              f"(grace, then readiness); victims {r['victims']} (fewest possible {r['victims_minimum']}); "
              f"work lost {r['work_lost_gpu_s']:.0f} GPU-s")
    curve = load_curve(args.load_file) if args.load_file else None
    fixed, auto = diurnal(args.hours, False, curve=curve), diurnal(args.hours, True, curve=curve)
    source = f"from {args.load_file}" if curve else "peak 300 requests/s"
    print(f"diurnal load over {args.hours:g} h ({source} ±5 %, replicas serve 10 requests/s each):")
    for r in (fixed, auto):
        print(f"  {'autoscaled (target 8 per replica)' if r['autoscaled'] else 'fixed for the peak (32)'}: SLA breach {r['breach_s']:.0f} s; "
              f"{r['gpu_hours']:.1f} GPU-hours ({r['gpu_hours'] / fixed['gpu_hours']:.2f}x the fixed size's)")


if __name__ == "__main__":
    main()
