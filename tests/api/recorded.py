"""One recorded history for the cross-door test: two teams in one cohort, a GPU-hour budget on a
queue with two flavors of different weights, a job that failed and was retried, a job that
borrowed, a job preempted for another and requeued, jobs waiting with their reasons, a cancel, a
rejection and an inference service. The events are the contract's, built the way the services
build them (deterministic ids), and timed relative to ``base`` so that the period they fall in is
the current one."""

from __future__ import annotations

from datetime import datetime, timedelta

from schemas import (
    CohortConfigured,
    Event,
    FailureReason,
    FlavorQuota,
    JobRejected,
    JobRetryScheduled,
    QuotaWaitReason,
    RejectReason,
    new_event,
)
from schemas.queue import GpuHourBudget
from tests.unit import builders as b

TEAMS = ("team-a", "team-b")
QUEUES = {"team-a": "q-a", "team-b": "q-b"}
PRICES = {"a100": 2.0, "h100": 6.0}


def _queue(name: str, team: str, quotas: tuple[FlavorQuota, ...], budget: GpuHourBudget, when: datetime) -> Event:
    from schemas import QueueConfigured

    return new_event(QueueConfigured, aggregate_id=name, producer="config", occurred_at=when, key=f"{name}/1",
                     name=name, cohort="shared", allowed_teams=(team,), quotas=quotas, budget=budget)


def _retry(job_id: str, failed_attempt: int, after: str, when: datetime) -> JobRetryScheduled:
    return new_event(JobRetryScheduled, aggregate_id=job_id, producer="quota", occurred_at=when,
                     key=str(failed_attempt), failed_attempt=failed_attempt, next_attempt=failed_attempt + 1,
                     not_before=when, after=after)


def _borrowing(job_id: str, queue: str, gpus: int, borrowed: int, when: datetime) -> Event:
    from schemas import QuotaReserved

    return new_event(QuotaReserved, aggregate_id=job_id, producer="quota", occurred_at=when, key="1", attempt=1,
                     queue=queue, flavor="a100", gpus=gpus, borrowed=borrowed)


def history(base: datetime) -> list[Event]:
    """The events in log order."""
    def t(minute: float) -> datetime:
        return base + timedelta(minutes=minute)

    def spec(team: str, gpus: int, flavor: str = "a100", **fields):
        return b.spec(team=team, queue=QUEUES[team], gpus=gpus, gpu_flavors=[flavor], **fields)

    def ran(job_id: str, team: str, gpus: int, flavor: str, node: str, indices: tuple[int, ...], *,
            submit: float, start: float, seq: int, attempt: int = 1) -> list[tuple[float, Event]]:
        """Submitted, admitted, reserved, scheduled and started."""
        queue = QUEUES[team]
        return [(submit, b.submitted(job_id, spec(team, gpus, flavor), seq=seq, when=t(submit),
                                     submitter=f"{team}-user")),
                (submit, b.admitted(job_id, queue, when=t(submit))),
                (submit + 0.5, b.reserved(job_id, queue, flavor, gpus, attempt=attempt, when=t(submit + 0.5))),
                (start - 0.5, b.scheduled(job_id, {node: indices}, flavor=flavor, attempt=attempt,
                                          when=t(start - 0.5))),
                (start, b.started(job_id, (node,), attempt=attempt, when=t(start)))]

    timeline: list[tuple[float, Event]] = [
        (0, _queue("q-a", "team-a", (FlavorQuota(flavor="a100", nominal=8), FlavorQuota(flavor="h100", nominal=4,
                                                                                        weight=3.0)),
                   GpuHourBudget(gpu_hours=40, period="month"), t(0))),
        (0, _queue("q-b", "team-b", (FlavorQuota(flavor="a100", nominal=8),), GpuHourBudget(gpu_hours=30, period="day"),
                   t(0))),
        (0, new_event(CohortConfigured, aggregate_id="shared", producer="config", occurred_at=t(0), key="shared/1",
                      name="shared")),
        (0, b.node("n1", "a100", 8, when=t(0))),
        (0, b.node("n2", "a100", 8, when=t(0))),
        (0, b.node("h1", "h100", 8, when=t(0))),
        (0, b.price_book(PRICES, effective_from=t(-60 * 24 * 40), when=t(0))),
        (0.5, b.service_deployed(b.service_spec(name="chat", team="team-b", queue_="q-b"), when=t(0.5), by="bob")),
    ]
    # team-a: one job done, one on H100 (weight 3) done, one failed and retried (running attempt 2)
    timeline += ran("a-done", "team-a", 2, "a100", "n1", (0, 1), submit=1, start=4, seq=101)
    timeline += [(33, b.succeeded("a-done", started_at=t(4), when=t(33))),
                 (33, b.released("a-done", "q-a", "a100", 2, when=t(33)))]
    timeline += ran("a-h100", "team-a", 1, "h100", "h1", (0,), submit=2, start=4, seq=102)
    timeline += [(24, b.succeeded("a-h100", started_at=t(4), when=t(24))),
                 (24, b.released("a-h100", "q-a", "h100", 1, when=t(24)))]
    timeline += ran("a-retry", "team-a", 1, "a100", "n1", (2,), submit=5, start=7, seq=103)
    timeline += [(17, b.failed("a-retry", FailureReason.NODE_LOST, started_at=t(7), when=t(17), exit_code=None)),
                 (17, b.released("a-retry", "q-a", "a100", 1, reason="JobFailed", when=t(17))),
                 (17.2, _retry("a-retry", 1, "JobFailed", t(17.2))),
                 (18, b.reserved("a-retry", "q-a", "a100", 1, attempt=2, when=t(18))),
                 (18.5, b.scheduled("a-retry", {"n1": (2,)}, attempt=2, when=t(18.5))),
                 (19, b.started("a-retry", ("n1",), attempt=2, when=t(19)))]
    # team-a borrows: 8 GPUs while it holds 1 of its nominal 8
    timeline += [(20, b.submitted("a-borrow", spec("team-a", 8), seq=104, when=t(20), submitter="team-a-user")),
                 (20, b.admitted("a-borrow", "q-a", when=t(20))),
                 (21, _borrowing("a-borrow", "q-a", 8, 1, t(21))),
                 (21.5, b.scheduled("a-borrow", {"n2": tuple(range(8))}, when=t(21.5))),
                 (22, b.started("a-borrow", ("n2",), when=t(22)))]
    # team-b: a job preempted for an urgent one and requeued; one waiting behind it; a cancel; a rejection
    timeline += ran("b-victim", "team-b", 4, "a100", "n1", (3, 4, 5, 6), submit=8, start=10, seq=201)
    timeline += ran("b-urgent", "team-b", 4, "a100", "n1", (3, 4, 5, 6), submit=39, start=42, seq=202)
    timeline += [(40, b.preemption_requested("b-victim", "b-urgent", when=t(40))),
                 (41, b.preempted("b-victim", started_at=t(10), when=t(41), by="b-urgent")),
                 (41, b.released("b-victim", "q-b", "a100", 4, reason="JobPreempted", when=t(41))),
                 (41.2, _retry("b-victim", 1, "JobPreempted", t(41.2))),
                 (42.5, b.pending_reason("b-victim", QuotaWaitReason.NOMINAL_EXHAUSTED,
                                         "queue q-b nominal a100 8, used 4; needs 4; cohort shared has 0 free a100 to "
                                         "lend", attempt=2, position=1, when=t(42.5)))]
    timeline += [(43, b.submitted("b-wait", spec("team-b", 8), seq=203, when=t(43), submitter="team-b-user")),
                 (43, b.admitted("b-wait", "q-b", when=t(43))),
                 (44, b.pending_reason("b-wait", QuotaWaitReason.NOMINAL_EXHAUSTED,
                                       "queue q-b nominal a100 8, used 4; needs 8", position=2, when=t(44))),
                 (45, b.submitted("b-cancel", spec("team-b", 1), seq=204, when=t(45), submitter="team-b-user")),
                 (45, b.admitted("b-cancel", "q-b", when=t(45))),
                 (46, b.cancel_requested("b-cancel", when=t(46), by="team-b-user")),
                 (46.5, b.cancelled("b-cancel", when=t(46.5), reason="not needed")),
                 (47, b.submitted("b-rejected", spec("team-b", 1, "h100"), seq=205, when=t(47),
                                  submitter="team-b-user")),
                 (47, new_event(JobRejected, aggregate_id="b-rejected", producer="admission", occurred_at=t(47),
                                key="decision", reason=RejectReason.FORBIDDEN, field="spec.gpu_flavors",
                                message="queue q-b has no quota for h100; accepted: a100", intake_sequence=205,
                                team="team-b"))]
    timeline.sort(key=lambda item: item[0])  # stable: same-minute events keep their order
    return [event for _, event in timeline]


JOBS = ("a-done", "a-h100", "a-retry", "a-borrow", "b-victim", "b-urgent", "b-wait", "b-cancel", "b-rejected")
