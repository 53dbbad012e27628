"""A process's health, as its orchestrator reads it: ``/livez`` and ``/readyz`` on the metrics
port, beside ``/metrics`` (runtime/observability.py serves all three).

* **live**: the asyncio loop still turns: a heartbeat task stamps it every second, and a stamp
  older than :data:`LIVE_WITHIN_S` means the loop is wedged (a restart helps). A process still
  waiting for NATS at start is live: waiting is not wedged.
* **ready**: connected to NATS now, JetStream answering (a decision service's last fetch from
  its consumer, or its standby's last read of the log, did not fail: a server without its
  JetStream quorum refuses them), and nothing this process registered as pending (a decision
  service's rebuild: its state caught up with the log; accounting's first catch-up with the log;
  Postgres answering, for accounting and the API, :func:`watch`). A standby is ready: it follows
  the log.

Each answer is JSON: ``{"ok": bool, ...}`` with what is missing, status 200 or 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

LIVE_WITHIN_S = 30.0
BEAT_EVERY_S = 1.0


@dataclass
class Health:
    beat: float | None = None  # monotonic time of the loop's last heartbeat; None: not started
    nats: bool = False  # connected to NATS now
    pending: set[str] = field(default_factory=set)  # what must finish before the process is ready
    role: str | None = None  # "active" or "standby" for a single-active service
    jetstream: bool = True  # the last JetStream request of the main loop was answered

    def waiting_for(self, what: str) -> None:
        self.pending.add(what)

    def done(self, what: str) -> None:
        self.pending.discard(what)

    def live(self, now: float | None = None) -> tuple[bool, dict]:
        now = time.monotonic() if now is None else now
        if self.beat is None:
            return True, {"ok": True, "loop": "not started"}
        stale = now - self.beat
        return stale <= LIVE_WITHIN_S, {"ok": stale <= LIVE_WITHIN_S, "last_heartbeat_s_ago": round(stale, 1)}

    def ready(self) -> tuple[bool, dict]:
        missing = ([] if self.nats else ["nats"]) + ([] if self.jetstream else ["jetstream"]) + sorted(self.pending)
        body: dict = {"ok": not missing, "waiting_for": missing}
        if self.role is not None:
            body["role"] = self.role
        return not missing, body


HEALTH = Health()
"""This process's."""

_heartbeat: asyncio.Task | None = None


def start_heartbeat() -> None:
    """Stamp HEALTH.beat every second from the running loop (once per loop)."""
    global _heartbeat
    if _heartbeat is not None and not _heartbeat.done() and _heartbeat.get_loop() is asyncio.get_running_loop():
        return

    async def beat() -> None:
        while True:
            HEALTH.beat = time.monotonic()
            await asyncio.sleep(BEAT_EVERY_S)
    _heartbeat = asyncio.get_running_loop().create_task(beat())


async def watch(what: str, probe: Callable[[], Awaitable[object]], *, every_s: float = 5.0,
                timeout_s: float = 5.0) -> None:
    """Keep ``what`` pending in :data:`HEALTH` while ``probe`` fails or takes over ``timeout_s``
    (e.g. a ``SELECT 1`` on a pool: Postgres down or unreachable), tried every ``every_s``. Runs
    until cancelled."""
    while True:
        try:
            await asyncio.wait_for(probe(), timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            HEALTH.waiting_for(what)
        else:
            HEALTH.done(what)
        await asyncio.sleep(every_s)
