"""A decision is appended on the state it was taken on (runtime.loop ``append_all``'s basis).

Admission decides on intake commands beside its main loop, which goes on folding the log. When
the main loop folds an event of the job between the decision and its append, the append must
still be conditional on the job as the decision saw it: a condition read at append time let a
second JobSubmitted of one job id through, from the partition that lost the race
(tests/integration/test_admission_partitions.py saw it once the main loop read faster)."""

from __future__ import annotations

from conftest import service_settings
from runtime import eventlog
from runtime.loop import DecisionService, subject_scope
from services.quota.domain import QuotaCore
from tests.unit.builders import admitted, cancel_requested, submitted


async def test_a_decision_taken_before_an_event_of_its_job_was_folded_is_refused(nats_server, admin_js):
    log = eventlog.EventLog(admin_js)
    service = DecisionService("quota", QuotaCore(), service_settings(nats_server, "quota", snapshot_every=0))
    scope = subject_scope("gpusched.job.j1.submitted")
    service.last_seq[scope] = await log.append(submitted("j1"), expected_last_seq=0)  # folded

    decision = admitted("j1")
    taken_on = service.basis([decision])
    # another writer's event of the job, folded by the main loop before the decision's append
    service.last_seq[scope] = await log.append(cancel_requested("j1"), expected_last_seq=service.last_seq[scope])

    assert await service.append_all(log, [decision], taken_on) == {("job", "j1")}
    assert [m.subject async for m in eventlog.read(admin_js, subjects=["gpusched.job.j1.>"])] == [
        "gpusched.job.j1.submitted", "gpusched.job.j1.cancel_requested"]
    # decided again on the state that holds it, the same decision goes through
    assert await service.append_all(log, [decision]) == set()
    assert service.last_seq[scope] == await eventlog.last_sequence(admin_js)


async def test_a_decision_carries_its_jobs_trace_on_when_nothing_exports_spans(nats_server, admin_js):
    """Without an exporter no span is made for a decision: its append carries the trace context
    of the job's latest event as it came, so the job's trace still follows it across services."""
    from runtime import observability

    assert not observability.recording()
    log = eventlog.EventLog(admin_js)
    service = DecisionService("quota", QuotaCore(), service_settings(nats_server, "quota", snapshot_every=0))
    service.trace_ctx["j2"] = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                               "tracestate": "vendor=1"}
    assert await service.append_all(log, [submitted("j2")]) == set()
    [msg] = [m async for m in eventlog.read(admin_js, subjects=["gpusched.job.j2.>"])]
    assert (msg.headers["traceparent"], msg.headers["tracestate"]) == (
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "vendor=1")
