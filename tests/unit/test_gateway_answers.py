"""Admission's answer, written once for every door (gpusched.gateway.answers): a keyed resend is a
repeat only of the same spec, both feeds ask the same rule, and the port's Answer carries what the
CLI prints and the API turns into status codes; the message id lets another spec under a key reach
admission (docs/publishing.md, "Resending")."""

from __future__ import annotations

from gpusched.gateway import answers, commands
from schemas import JobRejected, RejectReason, SubmitJob, new_event
from tests.unit.builders import T0, admitted, spec, submitted


def rejected(seq: int) -> JobRejected:
    return new_event(JobRejected, aggregate_id=f"rejected-{seq}", producer="admission", occurred_at=T0, key=str(seq),
                     reason=RejectReason.DUPLICATE_IDEMPOTENCY_KEY, message="another spec", intake_sequence=seq,
                     team="team-a", field="spec.idempotency_key")


def test_a_keyed_resend_is_a_repeat_only_of_the_same_spec():
    first = spec()
    other = first.model_copy(update={"gpus": first.gpus + 1})
    for resent, repeat in ((first, True), (other, False)):
        rule = answers.SubmitAnswers(12, keyed=True, spec=resent)
        assert rule.take(submitted("j1", first, seq=3), 0.0) is None and rule.take(admitted("j1"), 0.0) is None
        found = rule.quiet(answers.REPEAT_SETTLE_S)
        assert (found is not None and found.repeat) is repeat
    rule = answers.SubmitAnswers(12, keyed=True, spec=other)  # admission's rejection answers it
    assert rule.take(rejected(12), 0.0).event.reason == RejectReason.DUPLICATE_IDEMPOTENCY_KEY


def test_the_port_answer_of_each_outcome():
    pending = answers.answer_of(None, 7, job_id="j1")
    assert pending.pending and pending.intake_sequence == 7 and pending.decision is None
    dead = answers.answer_of(answers.Decided(dead_letter="not JSON"), 7, job_id="j1")
    assert dead.dead_letter == "not JSON" and not dead.pending and dead.decision is None
    no = answers.answer_of(answers.Decided(rejected(7)), 7, job_id="j1")
    assert (no.decision, no.rejected, no.reason, no.field, no.filed_under, no.job_id) == (
        "JobRejected", True, "duplicate-idempotency-key", "spec.idempotency_key", "rejected-7", "j1")
    yes = answers.answer_of(answers.Decided(admitted("j1", "research"), repeat=True), 3, job_id="j1")
    assert (yes.decision, yes.queue, yes.repeat) == ("JobAdmitted", "research", True)
    assert answers.answer_of(answers.Decided(admitted("j1")), 3, job_id="j1", repeat=True).repeat  # a JetStream duplicate


async def test_the_subscription_answers_a_repeat_once_nothing_else_came(monkeypatch):
    monkeypatch.setattr(answers, "REPEAT_SETTLE_S", 0.05)
    subscribed = answers.Subscribed()
    first = submitted("j1", seq=3)
    for event in (first, admitted("j1")):
        subscribed.take("j1", event.model_dump_json().encode())
    found = await subscribed.wait(answers.for_submit("j1", 9, keyed=True, spec=first.spec), timeout_s=2)
    assert found is not None and found.repeat and found.event.type == "JobAdmitted"
    other = first.spec.model_copy(update={"gpus": first.spec.gpus + 1})
    assert await subscribed.wait(answers.for_submit("j1", 10, keyed=True, spec=other), timeout_s=0.2) is None
    assert not subscribed.waiters


async def test_a_dead_letter_resolves_a_waiter_of_that_sequence_only():
    waiter = answers.Waiter(answers.for_cancel("j1", 5))
    assert not waiter.dead_letter(6, "other") and waiter.dead_letter(5, "no such job")
    assert (await waiter.result(0.1)).dead_letter == "no such job"
    assert answers.dead_letter_of({"Gpusched-Original-Stream": "GPUSCHED_INTAKE", "Gpusched-Original-Sequence": "5",
                                   "Gpusched-Reason": "x"}) == (5, "x")
    assert answers.dead_letter_of({"Gpusched-Original-Sequence": "5"}) is None


def test_the_message_id_drops_only_a_resend_of_the_same_command():
    keyed = commands.submission(SubmitJob(spec=spec().model_copy(update={"idempotency_key": "k1"})))
    same = commands.submission(SubmitJob(spec=keyed.spec))
    other = commands.submission(SubmitJob(spec=keyed.spec.model_copy(update={"gpus": keyed.spec.gpus + 1})))
    assert keyed.job_id == same.job_id == other.job_id  # the key names the job
    assert commands.submit_message_id(keyed) == commands.submit_message_id(same)
    assert commands.submit_message_id(keyed).startswith(f"submit/{keyed.spec.team}/k1/")
    assert commands.submit_message_id(other) != commands.submit_message_id(keyed)
    unkeyed = commands.submission(SubmitJob(job_id="j1", spec=spec()))
    assert commands.submit_message_id(unkeyed) != commands.submit_message_id(unkeyed)  # always reaches admission


def test_both_adapters_answer_every_question_of_the_port():
    import inspect

    from gpusched.gateway.http import HttpGateway
    from gpusched.gateway.log import LogGateway
    from gpusched.gateway.port import Gateway

    asked = {n for n, f in vars(Gateway).items() if inspect.iscoroutinefunction(f)}
    assert {"submit", "why", "events", "queues", "chargeback", "summary"} <= asked
    for adapter in (LogGateway, HttpGateway):
        for name in asked:
            ours, theirs = inspect.signature(getattr(Gateway, name)), inspect.signature(getattr(adapter, name))
            assert list(theirs.parameters) == list(ours.parameters), (adapter.__name__, name)


async def test_the_http_adapter_reads_through_the_sdk():
    from gpusched.gateway.http import HttpGateway

    class Sdk:
        async def chargeback(self, period, *, group_by="team"):
            return {"period": period, "group_by": group_by}

        async def summary(self):
            return {"jobs": {}}

        async def queues(self):
            return [{"queue": "q"}]

    gateway = HttpGateway(connection=None)
    gateway._client = Sdk()
    assert await gateway.chargeback("2026-11", "queue") == {"period": "2026-11", "group_by": "queue"}
    assert await gateway.summary() == {"jobs": {}} and await gateway.queues() == [{"queue": "q"}]
