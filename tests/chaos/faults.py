"""The chaos run's fault schedule, drawn from ``random.Random(seed)``: every service killed with
SIGKILL at least twice, nats-server and Postgres killed once each, each target restarted after a
short outage. Faults run one after another, spread over the load."""

from __future__ import annotations

import random
from dataclasses import dataclass

from gpusched.dev.stack import SERVICES

BROKERS = ("nats", "postgres")
ADMISSION_PARTITIONS = ("admission", "admission-p1")
"""Admission runs as two partitions by team (GPUSCHED_ADMISSION_PARTITIONS=2): ``admission`` is
partition 0, ``admission-p1`` partition 1; each is killed like a service."""
PROCESSES = (*SERVICES, *ADMISSION_PARTITIONS[1:])
"""Every process of the chaos run's stack but the brokers: the services and admission's second partition."""


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the load starts
    target: str  # a service, "nats" or "postgres"
    down_s: float  # how long it stays down before the harness restarts it


def targets(rng: random.Random, kills: tuple[int, int] = (2, 3)) -> list[str]:
    """Each process ``kills[0]`` to ``kills[1]`` times, each broker once, in a random order."""
    out = [name for name in PROCESSES for _ in range(rng.randint(*kills))] + list(BROKERS)
    rng.shuffle(out)
    return out


def schedule(rng: random.Random, load_s: float, start: float = 0.08, end: float = 0.85) -> list[Fault]:
    """One fault per slot of the window ``[start, end] × load_s``, at a random point of its slot
    and down for at most 40 % of it (3 s at most), so that one is back before the next."""
    order = targets(rng)
    slot = (end - start) * load_s / len(order)
    faults = []
    for i, target in enumerate(order):
        down = rng.uniform(0.2, min(3.0, 0.4 * slot))
        at = (start * load_s) + i * slot + rng.uniform(0, slot - down)
        faults.append(Fault(round(at, 2), target, round(down, 2)))
    return faults
