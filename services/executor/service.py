"""The executor service for backends with I/O (kubernetes, local).

The shared decision loop (:class:`runtime.loop.DecisionService`) folds the log into
:class:`~services.executor.lifecycle.BackendCore` and appends what it decides. Beside it, the
side loop reconciles every ``sync_s``: it takes the core's plan, runs one reconcile pass of the
backend over it (in a worker thread: the Kubernetes client and the process table block), and
folds what the backend saw back into the core, whose next decision turns it into events. It only
starts after the rebuild, so orphans are judged against the whole log. Observations are stamped
with wall-clock time: that is when the outside world did what it did.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

from runtime.loop import DecisionService
from services.executor.lifecycle import Backend, BackendCore, SyncResult, reconcile

log = logging.getLogger(__name__)


def reconcile_once(core: BackendCore, backend: Backend) -> SyncResult:
    """One plan -> act/look -> observe pass (synchronous; the tests drive it directly)."""
    result = reconcile(backend, core.plan(), datetime.now(UTC))
    core.apply(result)
    return result


class ExecutorService(DecisionService):
    def __init__(self, name, core: BackendCore, settings, clock=None, *, backend: Backend,
                 sync_s: float = 1.0) -> None:
        super().__init__(name, core, settings, clock)
        self.backend = backend
        self.sync_s = sync_s

    async def side_loop(self, js, appender) -> None:
        await asyncio.to_thread(self.backend.start)
        try:
            while not self._stop.is_set():
                if not await self._lease_current():
                    return  # lost, or stopped: a deposed executor reconciles nothing (runtime.loop)
                try:
                    plan = self.core.plan()
                    result = await asyncio.to_thread(reconcile, self.backend, plan, datetime.now(UTC))
                    self.core.apply(result)
                except Exception as err:
                    # A refused request (bad manifest, RBAC) is reported per attempt by the backend;
                    # anything reaching here is unexpected (the backend, or the core on what it saw):
                    # log it, keep reconciling. The process never exits for one pass.
                    log.exception("reconcile failed", extra={"error": repr(err)})
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=self.sync_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await asyncio.to_thread(self.backend.close)
