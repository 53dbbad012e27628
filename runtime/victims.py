"""Victim selection: which attempts may be stopped to make room for another, and which go first.
One policy for quota's reclaim and within-queue preemption and for the scheduler's priority
preemption; the priority classes (``schemas.priority``) are given to it, never looked up here.

Contract, for an attempt that holds GPUs (or quota for them) at ``now``:

* **Eligible** unless (checked in this order, the first that applies is the refusal):
  ``below`` is given and its priority is not lower (``equal or higher priority``); it, or its
  class, is not preemptible (``non-preemptible class``); it is already being stopped or has
  ended (``already stopping``); ``started_only`` is set and it has not started (``not
  started``); it has started and runs inside its class's ``protection_seconds``
  (``protection window``, ending at :meth:`VictimPolicy.protected_until`); it carries a count of
  preemptions and its class's ``max_preemptions`` is used up (``preemption budget used``). An
  attempt that carries no count (``preemptions`` None) has no such budget: quota's reclaim of
  lent quota is not limited by it.
* **Lost work**: its GPUs × seconds since its latest checkpoint of this attempt, or since it
  started; 0 when it has not started.
* **Order** (best victim first): least lost work, then lowest priority, then newest hold, then
  job id.

Pure: no I/O, and ``now`` is always passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, Protocol, TypeVar

from schemas.priority import PriorityClass

DEFAULT_GRACE_SECONDS = 30.0
"""Checkpoint window of an attempt whose class is not configured."""


class Attempt(Protocol):
    """What the policy reads of a candidate victim."""

    @property
    def job_id(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def priority_class(self) -> str: ...

    @property
    def preemptible(self) -> bool: ...  # as admitted (JobAdmitted.preemptible)

    @property
    def stopping(self) -> bool: ...  # asked to stop (preemption, reclaim, cancel), or ended

    @property
    def started_at(self) -> datetime | None: ...

    @property
    def checkpoint_at(self) -> datetime | None: ...  # latest checkpoint of this attempt

    @property
    def held_gpus(self) -> float: ...  # GPUs it holds, fractions as their share

    @property
    def held_since(self) -> datetime: ...  # when it got them

    @property
    def preemptions(self) -> int | None: ...  # preemptions counted against the job; None: no count


class SubmittedJob:
    """For a core's record of a job that keeps its ``submitted`` event (JobSubmitted) and
    ``spec`` (JobSpec): the job id and priority class an :class:`Attempt` has."""

    submitted: Any
    spec: Any

    @property
    def job_id(self) -> str:
        return self.submitted.aggregate_id

    @property
    def priority_class(self) -> str:
        return self.spec.priority_class


A = TypeVar("A", bound=Attempt)


@dataclass(frozen=True)
class Ranking(Generic[A]):
    victims: list[A]  # the eligible attempts, best victim first
    lost: dict[str, float]  # job id -> lost work in GPU-seconds, for each of them
    wake_at: datetime | None  # earliest end of a protection window that kept an attempt out


class VictimPolicy:
    def __init__(self, classes: Mapping[str, PriorityClass]) -> None:
        self.classes = classes

    def protected_until(self, a: Attempt) -> datetime | None:
        """The end of the attempt's protection window; None when it has not started or its class
        has none."""
        pc = self.classes.get(a.priority_class)
        if pc is None or a.started_at is None:
            return None
        return a.started_at + timedelta(seconds=pc.protection_seconds)

    def refusal(self, a: Attempt, now: datetime, *, below: int | None = None,
                started_only: bool = False) -> str | None:
        """Why ``a`` may not be a victim now; None when it may (module docstring)."""
        if below is not None and a.priority >= below:
            return "equal or higher priority"
        pc = self.classes.get(a.priority_class)
        if not a.preemptible or (pc is not None and not pc.preemptible):
            return "non-preemptible class"
        if a.stopping:
            return "already stopping"
        if a.started_at is None:
            return "not started" if started_only else None
        if pc is not None:
            if now < a.started_at + timedelta(seconds=pc.protection_seconds):
                return "protection window"
            if pc.max_preemptions is not None and a.preemptions is not None and a.preemptions >= pc.max_preemptions:
                return "preemption budget used"
        return None

    def lost_work(self, a: Attempt, now: datetime) -> float:
        """GPU-seconds the attempt loses if stopped now (module docstring)."""
        if a.started_at is None:
            return 0.0
        since = a.started_at if a.checkpoint_at is None else max(a.started_at, a.checkpoint_at)
        return a.held_gpus * max(0.0, (now - since).total_seconds())

    def grace_seconds(self, a: Attempt) -> float:
        """The checkpoint window its class gives a stopped attempt."""
        pc = self.classes.get(a.priority_class)
        return pc.preemption_grace_seconds if pc is not None else DEFAULT_GRACE_SECONDS

    def rank(self, attempts: Iterable[A], now: datetime, *, below: int | None = None,
             started_only: bool = False) -> Ranking[A]:
        """The eligible ``attempts`` in victim order, their lost work, and when the first
        protection window that kept one out ends."""
        keyed = []
        lost: dict[str, float] = {}
        wake_at: datetime | None = None
        for a in attempts:
            why = self.refusal(a, now, below=below, started_only=started_only)
            if why is None:
                w = lost[a.job_id] = self.lost_work(a, now)
                keyed.append((w, a.priority, -a.held_since.timestamp(), a.job_id, a))
            elif why == "protection window":
                until = self.protected_until(a)
                wake_at = until if wake_at is None else min(wake_at, until)
        keyed.sort(key=lambda k: k[:4])
        return Ranking([k[-1] for k in keyed], lost, wake_at)
