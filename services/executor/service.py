"""The executor service for backends with a real outside world (kubernetes, local).

The shared decision loop (:class:`runtime.loop.DecisionService`) folds the log into
:class:`~services.executor.lifecycle.BackendCore` and appends what it decides. Beside it, the
side loop reconciles every ``sync_s``: it takes the core's plan, lets the backend act on it and
look (in a worker thread: the Kubernetes client blocks), and feeds the backend's observations
back into the core, whose next decision turns them into events. It only starts after the
rebuild, so orphans are judged against the whole log.
"""

from __future__ import annotations

import asyncio
import logging

from runtime.loop import DecisionService
from services.executor.lifecycle import BackendCore

log = logging.getLogger(__name__)


def reconcile_once(core: BackendCore, backend) -> object:
    """One plan -> act/look -> observe pass (synchronous; the tests drive it directly)."""
    result = backend.sync(core.plan())
    apply_result(core, result)
    return result


def apply_result(core: BackendCore, result) -> None:
    if result.inventory is not None:
        core.observe_inventory(result.inventory)
    for obs in result.observations:
        core.observe(obs)
    for report in result.telemetry:
        try:
            core.observe_telemetry(report)
        except ValueError as err:  # a report the contract refuses: drop it, keep running
            log.warning("telemetry report dropped", extra={"node": report.node, "error": str(err)})


class ExecutorService(DecisionService):
    def __init__(self, name, core, settings, clock=None, *, backend, sync_s: float = 1.0) -> None:
        super().__init__(name, core, settings, clock)
        self.backend = backend
        self.sync_s = sync_s

    async def side_loop(self, js, appender) -> None:
        await asyncio.to_thread(self.backend.start)
        try:
            while not self._stop.is_set():
                plan = self.core.plan()
                try:
                    result = await asyncio.to_thread(self.backend.sync, plan)
                except Exception as err:
                    # A refused request (bad manifest, RBAC) is reported per attempt by the backend;
                    # anything reaching here is unexpected: log it, keep reconciling.
                    log.exception("reconcile failed", extra={"error": repr(err)})
                else:
                    apply_result(self.core, result)
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=self.sync_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await asyncio.to_thread(self.backend.close)
