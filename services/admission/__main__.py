"""Admission adapter: the event loop of :class:`DecisionService` plus the intake consumer."""

from __future__ import annotations

import logging

from gpusched import eventlog, observability
from gpusched.service import DecisionService, run_service
from services.admission.domain import AdmissionCore, PoisonCommand

log = logging.getLogger("admission")

INTAKE_DURABLE = "admission-intake"
DEAD_LETTER_NAME = "admission.intake"


class AdmissionService(DecisionService):
    async def side_loop(self, js, appender: eventlog.EventLog) -> None:
        sub = await eventlog.durable_consumer(js, stream=eventlog.INTAKE_STREAM, durable=INTAKE_DURABLE)
        core: AdmissionCore = self.core  # type: ignore[assignment]
        while True:
            msgs = await eventlog.fetch(sub, self.settings.batch_size, 1.0)
            for msg in msgs:
                # Commands are validated against state that includes everything admission wrote
                # so far, so a second submission with the same key sees the first.
                await self.wait_caught_up()
                parts = msg.subject.split(".")  # gpusched.intake.<team>.<verb>
                seq = msg.metadata.sequence.stream
                with observability.span_from_headers(f"admission intake {parts[-1]}", msg.headers, sequence=seq):
                    try:
                        if len(parts) != 4 or parts[3] not in ("submit", "cancel"):
                            raise PoisonCommand(
                                f"unknown intake subject {msg.subject!r}; accepted: "
                                "gpusched.intake.<team>.submit, gpusched.intake.<team>.cancel"
                            )
                        team, verb = parts[2], parts[3]
                        now = self.clock.now()
                        if verb == "submit":
                            events = core.handle_submit(msg.data, team, seq, now)
                        else:
                            events = core.handle_cancel(msg.data, team, now)
                    except PoisonCommand as err:
                        await eventlog.dead_letter(js, DEAD_LETTER_NAME, msg, str(err))
                        await msg.ack()
                        continue
                    for event in events:
                        ctx = observability.trace_headers(msg.headers)
                        if ctx:
                            self.trace_ctx[event.aggregate_id] = ctx
                    if await self.append_all(appender, events):
                        # Refused or failed: decide again on redelivery, with fresher state.
                        await msg.nak(delay=0.2)
                        continue
                await msg.ack()


def main() -> None:
    run_service("admission", lambda settings, clock: AdmissionCore(), AdmissionService)


if __name__ == "__main__":
    main()
