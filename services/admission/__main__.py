"""Admission adapter: the event loop of :class:`DecisionService` plus the intake consumer."""

from __future__ import annotations

import logging

from nats.aio.msg import Msg

from runtime import eventlog, observability
from runtime.loop import DecisionService, run_service
from schemas import Event, JobSubmitted
from schemas.commands import intake_principal
from services.admission.domain import AdmissionCore, PoisonCommand

log = logging.getLogger("admission")

INTAKE_DURABLE = "admission-intake"
DEAD_LETTER_NAME = "admission.intake"


def _identity(events: list[Event]) -> set[str]:
    """What later commands of the same batch could collide on: job ids and idempotency keys."""
    out = {e.aggregate_id for e in events}
    out |= {f"key:{e.spec.team}:{e.spec.idempotency_key}" for e in events
            if isinstance(e, JobSubmitted) and e.spec.idempotency_key}
    return out


class AdmissionService(DecisionService):
    """Commands are validated against state that includes everything admission wrote so far.
    A batch of commands is handled together and its events appended at once, unless a command
    collides with an earlier one of the same batch (same job id or key) or is a cancel: then
    what came before is appended and folded in first."""

    async def side_loop(self, js, appender: eventlog.EventLog) -> None:
        # It naks a command whose events were refused, to decide it again 0.2 s later: no backoff list.
        sub = await eventlog.durable_consumer(js, stream=eventlog.INTAKE_STREAM, durable=INTAKE_DURABLE,
                                              backoff=False)
        while True:
            msgs = await eventlog.fetch(sub, self.settings.batch_size, 1.0)
            await self.wait_caught_up()
            pending: list[tuple[Msg, list[Event]]] = []
            seen: set[str] = set()
            for msg in msgs:
                if msg.subject.endswith(".cancel") and pending:
                    await self._flush(appender, pending)
                    pending, seen = [], set()
                events = await self._handle(js, msg)
                if events is None:
                    continue
                if _identity(events) & seen:
                    await self._flush(appender, pending)
                    pending, seen = [], set()
                    events = await self._handle(js, msg)
                    if events is None:
                        continue
                pending.append((msg, events))
                seen |= _identity(events)
            await self._flush(appender, pending)

    async def _handle(self, js, msg: Msg) -> list[Event] | None:
        """The events a command leads to; None when it was dead-lettered."""
        core: AdmissionCore = self.core  # type: ignore[assignment]
        seq = msg.metadata.sequence.stream
        verb = msg.subject.rsplit(".", 1)[-1]
        with observability.span_from_headers(f"admission intake {verb}", msg.headers, sequence=seq):
            try:
                try:
                    sender = intake_principal(msg.subject)
                except ValueError as err:
                    raise PoisonCommand(str(err)) from None
                now = self.clock.now()
                if sender.verb == "submit":
                    events = core.handle_submit(msg.data, sender, seq, now)
                elif sender.verb == "checkpoint":
                    events = core.handle_checkpoint(msg.data, sender, seq, now)
                elif sender.verb == "deploy":
                    events = core.handle_deploy(msg.data, sender, seq, now)
                elif sender.verb == "scale":
                    events = core.handle_scale(msg.data, sender, seq, now)
                elif sender.verb == "delete":
                    events = core.handle_delete(msg.data, sender, seq, now)
                elif sender.verb == "load":
                    events = core.handle_load(msg.data, sender, seq, now)
                else:
                    events = core.handle_cancel(msg.data, sender, now)
            except PoisonCommand as err:
                reason = str(err)
            except Exception as err:  # the core is pure: a command that breaks it is poison, not a blip
                log.exception("admission failed on an intake command", extra={"sequence": seq})
                reason = f"internal error on this command ({type(err).__name__}: {err}); reported as a bug"
            else:
                reason = None
            if reason is not None:
                await eventlog.dead_letter(js, DEAD_LETTER_NAME, msg, reason)
                await msg.ack()
                return None
        ctx = observability.trace_headers(msg.headers)
        for event in events:
            if ctx:
                self.trace_ctx[event.aggregate_id] = ctx
        return events

    async def _flush(self, appender: eventlog.EventLog, pending: list[tuple[Msg, list[Event]]]) -> None:
        if not pending:
            return
        refused = await self.append_all(appender, [e for _, events in pending for e in events])
        for msg, events in pending:
            if not any((type(e).aggregate, e.aggregate_id) in refused for e in events):
                await msg.ack()
            elif eventlog.last_delivery(msg):  # a nak now would drop it without a word
                await eventlog.dead_letter(
                    appender.js, DEAD_LETTER_NAME, msg,
                    f"its events were not recorded after {msg.metadata.num_delivered} deliveries (a conflict "
                    "on the job every time, or the broker refusing the appends); publish it again")
                await msg.ack()
            else:
                await msg.nak(delay=0.2)  # decide again on redelivery, with fresher state
        await self.wait_caught_up()


def main() -> None:
    run_service("admission", lambda settings, clock: AdmissionCore(), AdmissionService)


if __name__ == "__main__":
    main()
