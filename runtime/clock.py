"""The platform clock. Decisions take time from here, never from ad-hoc wall-clock reads.

All services of one deployment share ``time_scale``, ``epoch`` and ``start``: platform time is
``start + (wall - epoch) * time_scale``, ``start`` (the platform instant at the wall instant
``epoch``) defaulting to ``epoch``. At scale 1 with no start it is wall time; the demo runs a GPU
hour in seconds by giving every service the same scale, so event times stay comparable across
services, and may start its clock at another instant (e.g. just before a month's end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...

    def real_seconds(self, platform_seconds: float) -> float:
        """Wall seconds it takes for ``platform_seconds`` to pass on this clock."""
        ...


@dataclass(frozen=True)
class ScaledClock:
    time_scale: float = 1.0
    epoch: float = field(default_factory=time.time)
    start: float | None = None  # platform time (Unix seconds) at the wall instant ``epoch``; None: ``epoch``

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.platform(time.time()), UTC)

    def platform(self, wall: float) -> float:
        """Platform time (Unix seconds) at the wall instant ``wall`` (Unix seconds)."""
        return (self.epoch if self.start is None else self.start) + (wall - self.epoch) * self.time_scale

    def real_seconds(self, platform_seconds: float) -> float:
        return platform_seconds / self.time_scale


@dataclass
class ManualClock:
    """For tests: time moves only when told."""

    current: datetime = field(default_factory=lambda: datetime(2026, 1, 1, tzinfo=UTC))

    def now(self) -> datetime:
        return self.current

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)

    def real_seconds(self, platform_seconds: float) -> float:
        return 0.0
