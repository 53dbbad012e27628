"""Drives an executor backend the way the service does, without NATS: an in-memory log that
drops repeated event ids (as JetStream's duplicate window does), the core folding every event
in, the backend reconciling the core's plan. Real time throughout, for all three backends.

``Backend`` describes one backend under test: how to build a fresh core (a restart is a fresh
core rebuilt from the log) and its reconciler, which node to place jobs on, and whether it
honours the checkpoint window (the sim stops at once by design).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from schemas import Event, JobSpec
from tests.unit import builders as b


@dataclass
class Backend:
    name: str
    make_core: Callable[[], object]
    make_backend: Callable[[], object | None]  # None: the core reconciles its own backend in-line (sim)
    node: str
    gpus: int  # GPUs each test job asks for
    honours_grace: bool
    count_runs: Callable[["Driver", str], int]  # how many times a job's workload was started
    close: Callable[[object], None] = lambda backend: None
    lose_node: Callable[[str], None] | None = None  # makes the backend lose spare_node
    spare_node: str | None = None


@dataclass
class Driver:
    spec: Backend
    log: list[Event] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    core: object = None
    backend: object = None

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """A new executor process: a fresh core rebuilt from the whole log, a fresh backend."""
        if self.backend is not None:
            self.spec.close(self.backend)
        self.core = self.spec.make_core()
        for e in self.log:
            self.core.evolve(e)
        self.backend = self.spec.make_backend()
        if self.backend is not None:
            self.backend.start()
            deadline = time.monotonic() + 30
            while self.backend.inventory() is None and time.monotonic() < deadline:
                time.sleep(0.05)

    def stop(self) -> None:
        if self.backend is not None:
            self.spec.close(self.backend)
            self.backend = None

    def feed(self, *events: Event) -> None:
        for e in events:
            if e.event_id not in self.ids:
                self.ids.add(e.event_id)
                self.log.append(e)
                self.core.evolve(e)

    def step(self) -> list[Event]:
        from services.executor.service import reconcile_once

        if self.backend is not None:
            reconcile_once(self.core, self.backend)
        new = [e for e in self.core.decide(datetime.now(UTC)) if e.event_id not in self.ids]
        self.feed(*new)
        return new

    def until(self, predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.1):
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            result = predicate()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.spec.name}: condition not met within {timeout}s; log: "
                                     f"{[(e.type, e.aggregate_id, getattr(e, 'message', '')) for e in self.log[-15:]]}")
            time.sleep(interval)

    def events(self, job_id: str, kind: type | None = None) -> list[Event]:
        return [e for e in self.log if e.aggregate_id == job_id and (kind is None or isinstance(e, kind))]

    def first(self, job_id: str, kind: type):
        found = self.events(job_id, kind)
        return found[0] if found else None

    # -- a job's life, as the other services would write it --------------------------------------
    def submit_and_schedule(self, job_id: str, spec: JobSpec, *, attempt: int = 1, node: str | None = None) -> None:
        now = datetime.now(UTC)
        if attempt == 1:
            self.feed(b.submitted(job_id, spec, when=now), b.admitted(job_id, when=now))
        gpus = tuple(range(self.spec.gpus))
        self.feed(b.scheduled(job_id, {node or self.spec.node: gpus}, attempt=attempt, when=now))


def work(run_s: float | None, exit_code: int = 0, *, gpus: int = 1, ignore_sigterm: bool = False,
         **fields) -> JobSpec:
    """One job spec that every backend runs the same way: ``run_s`` seconds, then ``exit_code``
    (None: until stopped). The local backend runs the command, the sim reads its declared runtime
    and exit-code annotation, kwok reads its run-for and exit-code annotations."""
    trap = "trap '' TERM; " if ignore_sigterm else ""
    script = f"{trap}sleep {run_s if run_s is not None else 3600}; exit {exit_code}"
    ann = {"sim.gpusched.io/exit-code": str(exit_code)}
    if run_s is not None:
        ann |= {"kwok.gpusched.io/run-for": f"{run_s}s", "kwok.gpusched.io/exit-code": str(exit_code)}
    runtime = run_s if run_s is not None else (None if fields.get("max_runtime_seconds") else 3600.0)
    return b.spec(gpus=gpus, command=("sh", "-c", script), expected_runtime_seconds=runtime,
                  annotations=ann, cpu_millis=100, memory_mib=64, **fields)
