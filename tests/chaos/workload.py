"""The chaos run's platform and load, all drawn from one ``random.Random(seed)``.

Queues: ``q-a`` and ``q-b`` share the 64 a100 GPUs of cohort ``shared`` (32 nominal each, no
borrowing limit, reclaim from borrowers of any priority); ``q-c`` has the 24 l4 GPUs alone and
preempts its own lower-priority attempts (``preemption.within_queue: lower-priority``).

Jobs come in waves. In a wave's first half team-a submits (and borrows team-b's idle quota) and
team-c fills q-c with batch-low work; in its second half team-b's jobs arrive (and reclaim) and
team-c's higher classes arrive (and preempt). Shapes mix single GPUs, whole nodes and gangs; some
jobs fail once and retry, some fail for good, some run past their deadline; some are cancelled a
few seconds after their submission.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime

from schemas import CancelJob, CohortConfigured, Event, FlavorQuota, JobSpec, QueueConfigured, SubmitJob, new_event
from schemas.queue import PreemptionPolicy

TEAMS = ("team-a", "team-b", "team-c")
QUEUE_OF = {"team-a": "q-a", "team-b": "q-b", "team-c": "q-c"}
TIME_SCALE = 60.0
"""Platform seconds per wall second: a job of 120 platform seconds runs 2 s."""
CLUSTER = """
groups:
  - {prefix: a100, count: 8, gpu_flavor: a100, gpu_count: 8, gpu_memory_mib: 40960, features: [rdma]}
  - {prefix: l4, count: 6, gpu_flavor: l4, gpu_count: 4, gpu_memory_mib: 23034}
"""
NODES = 14
WAVE = 200
"""Jobs per wave."""
SHAPES = {  # (gpus per node, gang size), drawn with these weights
    "a100": ((1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (8, 2)),
    "l4": ((1, 1), (2, 1), (4, 1), (2, 2)),
}
WEIGHTS = {"a100": (40, 25, 15, 8, 7, 5), "l4": (45, 30, 15, 10)}
FINAL_JOB = "chaos-final"


def queue_events(now: datetime) -> list[Event]:
    """The cohort and the three queues, as configuration events."""
    def queue(name: str, team: str, flavor: str, nominal: int, **fields) -> QueueConfigured:
        return new_event(QueueConfigured, aggregate_id=name, producer="config", occurred_at=now, key="chaos",
                         name=name, allowed_teams=(team,), quotas=(FlavorQuota(flavor=flavor, nominal=nominal),),
                         **fields)

    return [
        new_event(CohortConfigured, aggregate_id="shared", producer="config", occurred_at=now, key="chaos",
                  name="shared"),
        queue("q-a", "team-a", "a100", 32, cohort="shared"),
        queue("q-b", "team-b", "a100", 32, cohort="shared"),
        queue("q-c", "team-c", "l4", 24, preemption=PreemptionPolicy(within_queue="lower-priority")),
    ]


@dataclass(frozen=True)
class Action:
    """One command of the load: published by ``team`` on ``gpusched.intake.<team>.<verb>`` at
    ``at`` seconds after the load starts."""

    at: float
    team: str
    verb: str
    command: SubmitJob | CancelJob


def _team_and_class(rng: random.Random, half: int) -> tuple[str, str]:
    if rng.random() < 0.3:
        return "team-c", "batch-low" if half == 0 else rng.choice(("inference-sla", "deadline-training", "training"))
    if half == 0:
        return "team-a", rng.choice(("batch-low", "batch-low", "experiment", "training"))
    return "team-b", rng.choice(("training", "batch-low", "deadline-training"))


def _failure(rng: random.Random) -> tuple[dict[str, str], int | None]:
    """(sim annotations, max_runtime_seconds) of a job: mostly none."""
    r = rng.random()
    if r < 0.08:  # loses its node once; the retry succeeds
        return {"sim.gpusched.io/exit-code": "1", "sim.gpusched.io/fail-attempts": "1",
                "sim.gpusched.io/failure-reason": "node-lost"}, None
    if r < 0.11:  # fails every attempt: ends failed after its retries
        return {"sim.gpusched.io/exit-code": "3", "sim.gpusched.io/failure-reason": "evicted"}, None
    if r < 0.13:  # exits non-zero, a reason not retried: ends failed at once
        return {"sim.gpusched.io/exit-code": "2"}, None
    if r < 0.14:  # no declared runtime (the sim runs it 60 s): past its 20 s deadline
        return {}, 20
    return {}, None


def _runtime(rng: random.Random, priority_class: str) -> float:
    """Platform seconds (0.5 to 3 s of wall time); batch-low work runs longer: a victim to preempt."""
    return rng.uniform(60, 180) if priority_class == "batch-low" else rng.uniform(30, 150)


def job(rng: random.Random, i: int, half: int) -> SubmitJob:
    team, priority_class = _team_and_class(rng, half)
    flavor = "l4" if team == "team-c" else "a100"
    gpus, gang = rng.choices(SHAPES[flavor], WEIGHTS[flavor])[0]
    annotations, deadline = _failure(rng)
    spec = JobSpec(kind="inference" if priority_class == "inference-sla" else "training", queue=QUEUE_OF[team],
                   team=team, priority_class=priority_class, image="registry.example/chaos:1", gpus=gpus,
                   gang_size=gang, gpu_flavors=(flavor,),
                   expected_runtime_seconds=None if deadline else _runtime(rng, priority_class),
                   max_runtime_seconds=deadline, retry={"max_attempts": 3, "backoff_seconds": 5},
                   annotations=annotations)
    return SubmitJob(job_id=f"cj-{i:05d}", spec=spec)


def plan(rng: random.Random, jobs: int, load_s: float, cancel_share: float = 0.06) -> list[Action]:
    """The load's commands in time order: ``jobs`` submissions over ``load_s`` seconds, in waves,
    and a CancelJob for about ``cancel_share`` of them a few seconds after their submission."""
    waves = max(1, round(jobs / WAVE))
    per_wave = load_s / waves
    out = []
    for i in range(jobs):
        wave, position = divmod(i * waves / jobs, 1)
        half = 0 if position < 0.5 else 1
        at = (wave + position) * per_wave
        command = job(rng, i, half)
        out.append(Action(at, command.spec.team, "submit", command))
        if rng.random() < cancel_share:
            cancel = CancelJob(job_id=command.job_id, reason="chaos: cancelled")
            out.append(Action(at + rng.uniform(0.1, 3.0), command.spec.team, "cancel", cancel))
    return sorted(out, key=lambda a: a.at)


def final_command() -> SubmitJob:
    """The valid command submitted after every fault: it must be admitted and succeed."""
    spec = JobSpec(kind="training", queue="q-a", team="team-a", image="registry.example/chaos:1", gpus=1,
                   gpu_flavors=("a100",), expected_runtime_seconds=30)
    return SubmitJob(job_id=FINAL_JOB, spec=spec)
