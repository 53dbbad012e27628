"""The executor contract: every backend (sim, local, kubernetes) must pass these.

The kubernetes cases run against the real control plane of ``make test-k8s``; ``make test``
runs the sim and local ones.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from schemas import (
    FailureReason,
    JobCancelled,
    JobFailed,
    JobPreempted,
    JobStarted,
    JobSucceeded,
    NodeLost,
    NodeRegistered,
)
from tests.executor.harness import Driver, work
from tests.unit import builders as b


@pytest.fixture
def driver(backend):
    d = Driver(backend)
    d.until(lambda: any(isinstance(e, NodeRegistered) and e.aggregate_id == backend.node for e in d.log))
    yield d
    d.stop()


def job_id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def test_inventory_registers_the_backend_nodes(driver, backend):
    reg = [e for e in driver.log if isinstance(e, NodeRegistered) and e.aggregate_id == backend.node][0]
    assert reg.node.name == backend.node
    assert reg.node.gpu_count >= backend.gpus


def test_a_job_runs_to_success_once(driver, backend):
    j = job_id("ok")
    driver.submit_and_schedule(j, work(1, gpus=backend.gpus))
    done = driver.until(lambda: driver.first(j, JobSucceeded))
    started = driver.first(j, JobStarted)
    assert started is not None and started.nodes == (backend.node,)
    assert done.attempt == 1 and done.started_at <= done.occurred_at
    assert backend.count_runs(driver, j) == 1
    assert not driver.events(j, JobFailed)


def test_a_failure_carries_its_exit_code(driver, backend):
    j = job_id("fail")
    driver.submit_and_schedule(j, work(1, exit_code=3, gpus=backend.gpus))
    failed = driver.until(lambda: driver.first(j, JobFailed))
    assert (failed.reason, failed.exit_code) == (FailureReason.EXIT_CODE, 3)
    assert failed.retryable is False  # exit-code is not in the default retry_on
    assert not driver.events(j, JobSucceeded)


def test_a_failure_the_policy_retries_is_retryable(driver, backend):
    j = job_id("retry")
    spec = work(1, exit_code=3, gpus=backend.gpus, retry={"max_attempts": 3, "retry_on": ["exit-code"]})
    driver.submit_and_schedule(j, spec)
    assert driver.until(lambda: driver.first(j, JobFailed)).retryable is True
    driver.feed(b.retry_scheduled(j, 1, when=datetime.now(UTC)))
    driver.submit_and_schedule(j, spec, attempt=2)  # the platform's retry: attempt 2, a new workload
    second = driver.until(lambda: [e for e in driver.events(j, JobFailed) if e.attempt == 2])
    assert second[0].exit_code == 3
    assert backend.count_runs(driver, j) == 2


def test_cancel_stops_a_running_job(driver, backend):
    j = job_id("cancel")
    driver.submit_and_schedule(j, work(None, gpus=backend.gpus))
    driver.until(lambda: driver.first(j, JobStarted))
    driver.feed(b.cancel_requested(j, when=datetime.now(UTC), reason="not needed"))
    cancelled = driver.until(lambda: driver.first(j, JobCancelled), timeout=60)
    assert cancelled.attempt == 1 and cancelled.reason == "not needed"
    assert not driver.events(j, JobSucceeded) and not driver.events(j, JobFailed)


def test_cancel_before_start(driver, backend):
    j = job_id("early")
    driver.feed(b.submitted(j, work(1, gpus=backend.gpus)), b.cancel_requested(j, when=datetime.now(UTC)))
    cancelled = driver.until(lambda: driver.first(j, JobCancelled))
    assert cancelled.attempt is None
    assert backend.count_runs(driver, j) == 0


def test_preemption_honours_the_grace_period(driver, backend):
    j = job_id("preempt")
    grace = 4.0
    driver.submit_and_schedule(j, work(None, gpus=backend.gpus, ignore_sigterm=True))
    driver.until(lambda: driver.first(j, JobStarted))
    asked = datetime.now(UTC)
    driver.feed(b.preemption_requested(j, "urgent", grace_seconds=grace, when=asked))
    preempted = driver.until(lambda: driver.first(j, JobPreempted), timeout=60)
    assert preempted.preempted_by == "urgent" and preempted.attempt == 1
    if backend.honours_grace:
        # SIGTERM first; the attempt is gone only once the checkpoint window is over (Kubernetes
        # timestamps have whole seconds, hence the one-second slack).
        assert preempted.occurred_at >= asked + timedelta(seconds=grace - 1)
    assert not driver.events(j, JobFailed)


def test_a_stop_asked_before_the_attempt_is_placed_ends_it_without_running(driver, backend):
    # Quota reclaims a reservation the scheduler has not placed yet; the scheduler places it all
    # the same (it is the log's next step): the attempt is stopped, never run, and requeued.
    j = job_id("reclaimed")
    now = datetime.now(UTC)
    driver.feed(b.submitted(j, work(None, gpus=backend.gpus), when=now), b.admitted(j, when=now),
                b.reclaim_requested(j, when=now).model_copy(update={"grace_seconds": 30.0}),
                b.scheduled(j, {backend.node: tuple(range(backend.gpus))}, when=now))
    preempted = driver.until(lambda: driver.first(j, JobPreempted), timeout=60)
    assert preempted.attempt == 1 and preempted.started_at is None
    assert not driver.events(j, JobStarted)
    assert backend.count_runs(driver, j) == 0


def test_restart_reports_what_finished_meanwhile_without_running_twice(driver, backend):
    j = job_id("restart")
    driver.submit_and_schedule(j, work(2, gpus=backend.gpus))
    driver.until(lambda: driver.first(j, JobStarted))
    driver.stop()  # the executor is down ...
    time.sleep(3.5)  # ... while the job finishes
    driver.restart()
    done = driver.until(lambda: driver.first(j, JobSucceeded))
    assert done.attempt == 1
    assert len(driver.events(j, JobStarted)) == 1
    assert backend.count_runs(driver, j) == 1


def test_restart_adopts_a_running_job(driver, backend):
    j = job_id("adopt")
    driver.submit_and_schedule(j, work(None, gpus=backend.gpus))
    driver.until(lambda: driver.first(j, JobStarted))
    driver.restart()
    for _ in range(10):
        driver.step()
        time.sleep(0.1)
    assert backend.count_runs(driver, j) == 1
    assert len(driver.events(j, JobStarted)) == 1
    assert not driver.events(j, JobFailed)
    driver.feed(b.cancel_requested(j, when=datetime.now(UTC)))
    driver.until(lambda: driver.first(j, JobCancelled), timeout=60)


def test_decisions_are_not_taken_twice(driver, backend):
    j = job_id("once")
    driver.submit_and_schedule(j, work(1, gpus=backend.gpus))
    driver.until(lambda: driver.first(j, JobSucceeded))
    before = len(driver.log)
    driver.restart()  # a fresh core over the same log decides the same ids: all already there
    for _ in range(5):
        driver.step()
    assert [e for e in driver.log[before:] if e.aggregate_id == j] == []


def test_node_lost_fails_its_attempt_retryably(driver, backend):
    if backend.lose_node is None:
        pytest.skip(f"the {backend.name} backend has one host, which it cannot lose")
    j = job_id("lost")
    driver.submit_and_schedule(j, work(None, gpus=backend.gpus), node=backend.spare_node)
    driver.until(lambda: driver.first(j, JobStarted))
    backend.lose_node(backend.spare_node)
    lost = driver.until(lambda: [e for e in driver.log if isinstance(e, NodeLost)
                                 and e.aggregate_id == backend.spare_node], timeout=60)
    assert lost
    failed = driver.until(lambda: driver.first(j, JobFailed), timeout=60)
    assert failed.reason == FailureReason.NODE_LOST and failed.retryable is True
