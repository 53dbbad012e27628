"""The decision loop's pure helpers, and the executor's reconcile side loop going on when one
pass fails (issue 21: a service process never exits because of what it handles)."""

from __future__ import annotations

import asyncio

import pytest

from runtime import eventlog
from runtime.loop import failure, subject_scope
from runtime.settings import Settings
from services.executor.lifecycle import BackendCore
from services.executor.service import ExecutorService


@pytest.mark.parametrize(("failures", "delay"), [(0, 0.5), (1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 5.0), (50, 5.0)])
def test_retry_delay_doubles_up_to_a_cap(failures, delay):
    assert eventlog.retry_delay(failures) == delay


@pytest.mark.parametrize(("subject", "scope"), [
    ("gpusched.job.j1.submitted", "gpusched.job.j1"),
    ("gpusched.node.gpu-1_example_com.registered", "gpusched.node.gpu-1_example_com"),
    ("gpusched.job.j1.garbage", "gpusched.job.j1"),
])
def test_subject_scope_is_the_aggregate_of_any_message(subject, scope):
    assert subject_scope(subject) == scope


def test_failure_names_the_exception_and_where_it_was_raised():
    try:
        {}["x"]
    except KeyError as err:
        text = failure(err)
    assert text.startswith("KeyError: 'x' at ") and "test_runtime_loop.py" in text


class EmptyBackend:
    def start(self) -> None: ...
    def close(self) -> None: ...
    def reachable(self) -> bool:
        return True
    def inventory(self):
        return []
    def create(self, plan, now) -> int:
        return 0
    def stop(self, plan, now) -> int:
        return 0
    def observe(self, plan, now):
        return [], []


class CoreFailingOnce(BackendCore):
    def __init__(self) -> None:
        super().__init__()
        self.applied = 0

    def apply(self, result) -> None:
        self.applied += 1
        if self.applied == 1:
            raise RuntimeError("the core choked on what the backend saw")
        super().apply(result)


async def test_the_reconcile_loop_goes_on_after_a_pass_fails():
    core = CoreFailingOnce()
    service = ExecutorService("executor", core, Settings(), backend=EmptyBackend(), sync_s=0.01)
    task = asyncio.create_task(service.side_loop(None, None))
    for _ in range(200):
        if core.applied >= 3:
            break
        await asyncio.sleep(0.01)
    service.stop()
    await asyncio.wait_for(task, 5)
    assert core.applied >= 3
