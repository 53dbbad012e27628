"""A recorded history to run ``gpusched whatif`` on: a multi-team workload submitted through
admission's intake (SubmitJob and CancelJob commands, as a team publishes them) and decided by the
platform's cores — admission, quota, scheduler, the sim executor — on a virtual clock, with no
service lag, then stored in a real JetStream stream as the services would have appended it.

The workload: the example queues and policy (gpusched/examples/queues.yaml: three teams in one
cohort, guaranteed quota, borrowing and lending), the example cluster repeated ``scale`` times,
jobs arriving as a Poisson process sized to keep the cluster busy, of every priority class, 1 to
8 GPUs and some gangs, runtimes spread over minutes to hours, a few per cent that fail (and are
retried) and a few that are cancelled.

``python -m bench.history --jobs 2000`` prints what one recording holds.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from gpusched.config import pricebook
from gpusched.config import queues as queueconfig
from gpusched.dev.run import example
from gpusched.sim.trace import decide_until_quiet
from schemas import Event, dumps
from schemas.commands import Principal
from schemas.registry import event_subject
from services.admission.domain import AdmissionCore, PoisonCommand
from services.executor.cluster import load_cluster
from services.executor.sim import SimExecutorCore
from services.quota.domain import QuotaCore
from services.scheduler.domain import SchedulerCore

T0 = datetime(2026, 11, 2, tzinfo=UTC)
TEAMS = {"team-research": "research", "team-product": "product", "team-platform": "platform"}
CLASSES = [("training", 0.45), ("experiment", 0.25), ("batch-low", 0.15), ("deadline-training", 0.05),
           ("inference-sla", 0.10)]
SHAPES = [(1, 1, 0.35), (2, 1, 0.25), (4, 1, 0.2), (8, 1, 0.12), (8, 2, 0.05), (4, 2, 0.03)]  # gpus, gang, weight


@dataclass
class Cores:
    admission: AdmissionCore
    quota: QuotaCore
    scheduler: SchedulerCore
    executor: SimExecutorCore

    def all(self):
        return (self.admission, self.quota, self.scheduler, self.executor)


def _pick(rng: random.Random, weighted):
    return rng.choices([w[:-1] if len(w) > 2 else w[0] for w in weighted], weights=[w[-1] for w in weighted])[0]


def workload(jobs: int, seed: int, mean_gap_s: float) -> list[tuple[float, str, dict, float | None]]:
    """(arrival s, team, SubmitJob payload, cancel after s or None) for each job."""
    rng = random.Random(seed)
    flavors = {"research": ["h100-80gb", "a100-40gb"], "product": ["h100-80gb", "l4"], "platform": ["a100-40gb", "l4"]}
    out, t = [], 0.0
    for i in range(jobs):
        t += rng.expovariate(1 / mean_gap_s)
        team = rng.choices(list(TEAMS), weights=[0.4, 0.4, 0.2])[0]  # as their guaranteed quota
        queue = TEAMS[team]
        klass = _pick(rng, CLASSES)
        if queue == "product" and klass not in ("inference-sla", "training", "experiment"):
            klass = "training"
        gpus, gang = _pick(rng, SHAPES)
        flavor = rng.choice(flavors[queue])
        if flavor == "l4":
            gpus = min(gpus, 4)
        runtime = round(min(8 * 3600, rng.lognormvariate(7.0, 1.0)), 1)  # median ~18 min
        spec = {"kind": "training", "queue": queue, "team": team, "image": "registry.example/job:1",
                "priority_class": klass, "gpus": gpus, "gang_size": gang, "gpu_flavors": [flavor],
                "expected_runtime_seconds": runtime}
        if rng.random() < 0.05:  # fails once, then succeeds on retry
            spec["annotations"] = {"sim.gpusched.io/exit-code": "3", "sim.gpusched.io/fail-attempts": "1"}
            spec["retry"] = {"max_attempts": 3, "backoff_seconds": 30}
        cancel = rng.uniform(60, 3600) if rng.random() < 0.03 else None
        out.append((round(t, 3), team, {"job_id": f"h-{i:06d}", "spec": spec}, cancel))
    return out


def record(jobs: int = 2000, seed: int = 11, scale: int = 4, mean_gap_s: float | None = None) -> list[Event]:
    """The log a platform with no service lag would have appended for the workload, in order."""
    cluster = load_cluster(example("cluster.yaml"))
    nodes = []
    for k in range(scale):
        for n in cluster.nodes():
            nodes.append(n.model_copy(update={"name": f"{n.name}-{k}"}))
    capacity = sum(n.gpu_count for n in nodes)
    # GPU-seconds arriving per second ≈ 0.6 × capacity (a job asks 3.65 GPUs for 1,808 s on average)
    gap = mean_gap_s or (3.65 * 1808 / (0.6 * capacity))
    cores = Cores(AdmissionCore(), QuotaCore(), SchedulerCore(), SimExecutorCore(nodes))
    log: list[Event] = []

    def feed(events):
        for e in events:
            log.append(e)
            for core in cores.all():
                core.evolve(e)

    def settle(now):
        if not decide_until_quiet(cores.all(), feed, now, 1000):
            raise RuntimeError(f"still deciding at {now}")

    parsed = queueconfig.read_queues(example("queues.yaml"))
    for q in parsed.queues:  # the example's quotas, for a cluster ``scale`` times the example's
        q.quotas = [{k: (v * scale if k in ("nominal", "borrowing_limit", "lending_limit") and v is not None else v)
                     for k, v in quota.items()} for quota in q.quotas]
    feed(queueconfig.plan(parsed, queueconfig.QuotaConfig({}, {}), T0))
    feed(pricebook.plan(pricebook.read(example("pricebook.yaml")), {}, T0))
    settle(T0)
    heap: list[tuple[float, int, str, object]] = []
    for i, (t, team, payload, cancel) in enumerate(workload(jobs, seed, gap)):
        heapq.heappush(heap, (t, 2 * i, "submit", (team, payload)))
        if cancel is not None:
            heapq.heappush(heap, (t + cancel, 2 * i + 1, "cancel", (team, payload["job_id"])))
    intake = 0
    now = T0
    while heap or any(x is not None for x in _wakes(cores, now)):
        times = [T0 + timedelta(seconds=heap[0][0])] if heap else []
        times += [w for w in _wakes(cores, now) if w is not None]
        now = max(now, min(times))
        while heap and T0 + timedelta(seconds=heap[0][0]) <= now:
            _, _, kind, what = heapq.heappop(heap)
            intake += 1
            if kind == "submit":
                team, payload = what
                feed(cores.admission.handle_submit(json.dumps(payload).encode(),
                                                   Principal(team=team, user=team, verb="submit"), intake, now))
            else:
                team, job_id = what
                try:
                    feed(cores.admission.handle_cancel(json.dumps({"job_id": job_id, "reason": "no longer needed"}).encode(),
                                                       Principal(team=team, user=team, verb="cancel"), now))
                except PoisonCommand:  # the job had already ended: a team would not have sent it
                    pass
        settle(now)
    return log


def _wakes(cores: Cores, now: datetime) -> list[datetime | None]:
    return [t for t in (cores.executor.next_end(), cores.quota.next_wake(), cores.scheduler.next_wake())
            if t is not None and t > now] or [None]


async def store(js, events: list[Event], in_flight: int = 2000) -> None:
    """Append ``events`` to the log in order, pipelined (``in_flight`` acks outstanding), each
    with its ``Nats-Msg-Id`` as the services append them."""
    pending = []
    for e in events:
        pending.append(js.publish(event_subject(e), dumps(e),
                                  headers={"Nats-Msg-Id": e.event_id, "Gpusched-Type": e.type}))
        if len(pending) >= in_flight:
            await asyncio.gather(*pending)
            pending = []
    await asyncio.gather(*pending)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--scale", type=int, default=4, help="The example cluster and quotas, this many times")
    args = ap.parse_args()
    began = time.perf_counter()
    log = record(args.jobs, args.seed, args.scale)
    span = (log[-1].occurred_at - log[0].occurred_at).total_seconds()
    types: dict[str, int] = {}
    for e in log:
        types[e.type] = types.get(e.type, 0) + 1
    print(f"{len(log)} events, {span / 3600:.1f} h of event time, recorded in {time.perf_counter() - began:.1f} s")
    print(json.dumps(types, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
