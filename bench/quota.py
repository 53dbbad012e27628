"""Quota decision core at scale: 100 queues in 10 cohorts, 50,000 pending jobs.

    python -m bench.quota [--pending N] [--queues Q] [--cohorts C]

Measures, on the pure core (no NATS): the first full cycle over everything pending (every job
is decided: reserved or given a reason), then steady-state cycles where one running job ends
and the freed quota is handed out, and the core's memory.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import resource
from datetime import UTC, datetime, timedelta

from schemas import FlavorQuota, JobAdmitted, JobSpec, JobSubmitted, JobSucceeded, QueueConfigured, new_event
from schemas.queue import CohortConfigured
from services.quota.domain import QuotaCore

T0 = datetime(2026, 1, 1, tzinfo=UTC)
FLAVORS = ("h100", "a100", "l4")


def build(n_queues: int, n_cohorts: int, n_pending: int, seed: int = 3) -> tuple[QuotaCore, list]:
    rng = random.Random(seed)
    core = QuotaCore()
    for c in range(n_cohorts):
        core.evolve(new_event(CohortConfigured, aggregate_id=f"c{c}", producer="config", occurred_at=T0, key="1",
                              name=f"c{c}"))
    for q in range(n_queues):
        quotas = tuple(FlavorQuota(flavor=f, nominal=rng.choice([8, 16, 32]), borrowing_limit=rng.choice([None, 16]))
                       for f in FLAVORS)
        core.evolve(new_event(QueueConfigured, aggregate_id=f"q{q}", producer="config", occurred_at=T0, key="1",
                              name=f"q{q}", cohort=f"c{q % n_cohorts}", allowed_teams=("t",), quotas=quotas))
    for j in range(n_pending):
        q = rng.randrange(n_queues)
        spec = JobSpec(kind="training", queue=f"q{q}", team="t", image="i", gpus=rng.choice([1, 2, 4, 8]),
                       gpu_flavors=(rng.choice(FLAVORS),))
        when = T0 + timedelta(milliseconds=j)
        s = new_event(JobSubmitted, aggregate_id=f"j{j}", producer="admission", occurred_at=when, key="1",
                      spec=spec, submitter="u", intake_sequence=j + 1)
        core.evolve(s)
        core.evolve(new_event(JobAdmitted, aggregate_id=f"j{j}", producer="admission", occurred_at=when, key="d",
                              queue=f"q{q}", priority=rng.choice([100, 500, 800]), preemptible=True))
    return core, rng


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pending", type=int, default=50_000)
    p.add_argument("--queues", type=int, default=100)
    p.add_argument("--cohorts", type=int, default=10)
    p.add_argument("--cycles", type=int, default=20)
    args = p.parse_args()
    core, rng = build(args.queues, args.cohorts, args.pending)
    rss_build = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    now = T0 + timedelta(hours=1)
    t = time.perf_counter()
    first = core.decide(now)
    first_s = time.perf_counter() - t
    for e in first:
        core.evolve(e)
    reserved = [e for e in first if e.type == "QuotaReserved"]
    steady = []
    decided = 0
    for i in range(args.cycles):
        victim = reserved[rng.randrange(len(reserved))]
        now += timedelta(seconds=1)
        core.evolve(new_event(JobSucceeded, aggregate_id=victim.aggregate_id, producer="executor", occurred_at=now,
                              key="1", attempt=victim.attempt, started_at=now - timedelta(seconds=1)))
        t = time.perf_counter()
        out = core.decide(now)
        steady.append(time.perf_counter() - t)
        decided += len(out)
        for e in out:
            core.evolve(e)
        reserved = [r for r in reserved if r.aggregate_id != victim.aggregate_id] + [
            e for e in out if e.type == "QuotaReserved"]
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"quota core — {args.queues} queues in {args.cohorts} cohorts, {args.pending} pending jobs "
          f"(pure core, this machine; medians)")
    print(f"  first cycle: {first_s:.2f} s for {len(first)} decisions "
          f"({len(reserved)} reserved, the rest given reasons) = {len(first) / first_s:.0f} decisions/s")
    print(f"  steady cycle after one job ends: p50 {statistics.median(steady) * 1000:.0f} ms, "
          f"max {max(steady) * 1000:.0f} ms ({decided} decisions in {args.cycles} cycles)")
    print(f"  max RSS: {rss_build:.0f} MiB after loading the state, {rss_peak:.0f} MiB at the end")


if __name__ == "__main__":
    main()
