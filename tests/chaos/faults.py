"""The chaos run's fault schedule, drawn from ``random.Random(seed)``: every service killed with
SIGKILL at least twice, nats-server and Postgres killed once each, each target restarted after a
short outage. Faults run one after another, spread over the load."""

from __future__ import annotations

import random
from dataclasses import dataclass

from gpusched.dev.stack import SERVICES

BROKERS = ("nats", "postgres")
CLUSTER_BROKERS = ("nats-meta-leader", "nats-events-leader", "nats-follower", "nats-partition", "nats-cluster",
                   "postgres")
"""The brokers' faults on a JetStream cluster (GPUSCHED_CHAOS_NATS_CLUSTER=3): kill -9 of the
server leading the meta group, of the one leading GPUSCHED_EVENTS, of one leading neither (each
found when its fault comes), the GPUSCHED_EVENTS leader cut off from the others for
:data:`PARTITION_S` (its routes refused; its clients stay connected to it), and every server at
once (a whole-cluster restart); Postgres as on one server."""
PARTITION_S = 10.0
"""How long a partitioned server stays cut off: past nats-server's election timeout (4-9 s), so
the other two elect new leaders while the cut-off one still believes it leads."""
NATS_FAULTS = ("nats", *CLUSTER_BROKERS[:-1])
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


def targets(rng: random.Random, kills: tuple[int, int] = (2, 3), brokers: tuple[str, ...] = BROKERS) -> list[str]:
    """Each process ``kills[0]`` to ``kills[1]`` times, each of ``brokers`` once, in a random order."""
    out = [name for name in PROCESSES for _ in range(rng.randint(*kills))] + list(brokers)
    rng.shuffle(out)
    return out


def schedule(rng: random.Random, load_s: float, start: float = 0.08, end: float = 0.85,
             brokers: tuple[str, ...] = BROKERS) -> list[Fault]:
    """One fault per slot of the window ``[start, end] × load_s``, at a random point of its slot
    and down for at most 40 % of it (3 s at most), so that one is back before the next."""
    order = targets(rng, brokers=brokers)
    slot = (end - start) * load_s / len(order)
    faults = []
    for i, target in enumerate(order):
        down = rng.uniform(0.2, min(3.0, 0.4 * slot))
        if target == "nats-partition":
            down = PARTITION_S
        at = (start * load_s) + i * slot + rng.uniform(0, slot - down)
        faults.append(Fault(round(at, 2), target, round(down, 2)))
    return faults
