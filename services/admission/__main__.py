"""Admission adapter: the event loop of :class:`DecisionService` plus the intake consumer.

Partitioned by team with ``GPUSCHED_ADMISSION_PARTITIONS=N`` (default 1) and
``GPUSCHED_ADMISSION_PARTITION=k``: N admissions, each deciding for the teams
:func:`runtime.teams.partition_of` maps to its k (:class:`runtime.teams.Partition`),
each single-active with its own lease and standbys. Partition k has its own durables
(``admission-p<k>`` on the log, ``admission-intake-p<k>`` on the intake; partition 0 keeps
``admission`` and ``admission-intake``), lease and snapshot bucket (``admission-p<k>``). Each
reads every command and handles those published on its teams' intake subjects; it folds the log
and passes over the events of other partitions' jobs and services unread. A job id or service
name another partition's team took is refused from the log: every partition folds every
JobSubmitted and ServiceDeployed, and a new job's first event is appended only if its subjects
hold nothing yet, so of two teams asking at once one gets the id and the other an answer.
"""

from __future__ import annotations

import logging
import sys

from nats.aio.msg import Msg

from runtime import eventlog, observability
from runtime.loop import DecisionService, run_service
from runtime.settings import ConfigError, env_networks
from runtime.teams import MAX_READING_PARTITIONS, Partition, partition_durables, partition_from_env
from schemas import Event, JobSubmitted
from schemas.commands import intake_principal
from schemas.registry import subject_parts
from services.admission.domain import AdmissionCore, PoisonCommand

log = logging.getLogger("admission")

INTAKE_DURABLE = "admission-intake"
DEAD_LETTER_NAME = "admission.intake"
MAX_PARTITIONS = MAX_READING_PARTITIONS
"""Most admission partitions: each process (a partition's active and its standby) holds one of the
admission credential's reader consumers while it folds the log."""


def partition_from_environment() -> Partition:
    """GPUSCHED_ADMISSION_PARTITIONS (N) and GPUSCHED_ADMISSION_PARTITION (k: partition k mod N, so
    that StatefulSet pods k, k+N, k+2N... , its pod index, are one partition's active and standbys);
    ConfigError naming what is accepted."""
    count, index = partition_from_env("GPUSCHED_ADMISSION_PARTITIONS", "GPUSCHED_ADMISSION_PARTITION")
    if count > MAX_PARTITIONS:
        raise ConfigError(f"GPUSCHED_ADMISSION_PARTITIONS={count} is out of range; accepted: 1..{MAX_PARTITIONS}")
    return Partition(count, index % count)


def durable_names(name: str, partition: int) -> tuple[str, str]:
    """A partition's (durable, lease and snapshot name on the log; intake durable)."""
    if partition == 0:
        return name, INTAKE_DURABLE
    return f"{name}-p{partition}", f"{INTAKE_DURABLE}-p{partition}"


def _aggregate(subject: str) -> tuple[str, str] | None:
    """An event subject's (aggregate kind, subject token); None for another subject."""
    return parts[:2] if (parts := subject_parts(subject)) is not None else None


def _identity(events: list[Event]) -> set[str]:
    """What later commands of the same batch could collide on: job ids and idempotency keys."""
    out = {e.aggregate_id for e in events}
    out |= {f"key:{e.spec.team}:{e.spec.idempotency_key}" for e in events
            if isinstance(e, JobSubmitted) and e.spec.idempotency_key}
    return out


class AdmissionService(DecisionService):
    """Commands are validated against state that includes everything admission wrote so far.
    A batch of commands is handled together and its events appended at once, unless a command's
    answer may depend on an earlier one of the same batch (refused, nothing to do, or the same
    job id, key or service): then what came before is appended and folded in first."""

    def __init__(self, name: str, core: AdmissionCore, settings, clock=None) -> None:
        super().__init__(name, core, settings, clock)
        self.partition = core.state.partition
        self.instance, self.intake_durable = durable_names(name, self.partition.index)

    def passes_over(self, subject: str) -> bool:
        """Events of another partition's job or service are not parsed."""
        return (agg := _aggregate(subject)) is not None and self.core.foreign(*agg)  # type: ignore[attr-defined]

    def dead_letters(self, subject: str) -> bool:
        """Poison on a job's or service's subject: by its team's partition (the others pass it
        over unread); before any first event named a team, and anything else: by partition 0."""
        if self.partition.count == 1:
            return True
        core: AdmissionCore = self.core  # type: ignore[assignment]
        if (agg := _aggregate(subject)) is not None:
            if core.foreign(*agg):
                return False
            if agg[0] == "job" and agg[1] in core.state.jobs or agg[0] == "service" and agg[1] in core.state.services:
                return True
        return self.partition.index == 0

    def mine(self, msg: Msg) -> bool:
        """Whether this partition handles an intake command: one published on a subject of its
        teams, or (partition 0) on a subject that names no team (dead-lettered)."""
        if self.partition.count == 1:
            return True
        try:
            return self.partition.owns(intake_principal(msg.subject).team)
        except ValueError:
            return self.partition.index == 0

    async def side_loop(self, js, appender: eventlog.EventLog) -> None:
        # A partition's intake durable starts where partition 0's stopped (runtime.teams). It naks a
        # command whose events were refused, to decide it again: no backoff list.
        await partition_durables(js, stream=eventlog.INTAKE_STREAM, partitions=self.partition.count,
                                 partition=self.partition.index, most=MAX_PARTITIONS, backoff=False,
                                 name=lambda k: durable_names(self.name, k)[1])
        sub = await eventlog.durable_consumer(js, stream=eventlog.INTAKE_STREAM, durable=self.intake_durable,
                                              backoff=False)
        while not self._stop.is_set():
            if not await self._lease_current():
                return  # lost: the process ends (runtime.loop)
            msgs = await eventlog.fetch(sub, self.settings.batch_size, 1.0)
            await self.wait_caught_up()
            pending: list[tuple[Msg, list[Event], dict[str, int]]] = []
            seen: set[str] = set()
            for msg in msgs:
                if not self.mine(msg):
                    await msg.ack()  # another partition's team
                    continue
                outcome = self._handle(msg)
                if pending and (isinstance(outcome, str) or not outcome or _identity(outcome) & seen):
                    # Its answer may depend on what came before it in the batch (refused: a scale
                    # of a service deployed just before; nothing to do: a redeploy of a service
                    # deleted just before; the same job, key or service): that is recorded and
                    # folded in first, and the command handled again.
                    refused = await self._flush(appender, pending)
                    pending, seen = [], set()
                    outcome = self._handle(msg)
                    if isinstance(outcome, str) and refused and not eventlog.last_delivery(msg):
                        await msg.nak(delay=0.2)  # it may need one of those, decided again on redelivery
                        continue
                if isinstance(outcome, str):
                    await eventlog.dead_letter(js, DEAD_LETTER_NAME, msg, outcome)
                    await msg.ack()
                    continue
                # what the decision was taken on, read with no await since _handle: the main loop
                # may fold events of the job before the append (runtime.loop append_all's basis)
                pending.append((msg, outcome, self.basis(outcome)))
                seen |= _identity(outcome)
            await self._flush(appender, pending)

    def _handle(self, msg: Msg) -> list[Event] | str:
        """The events a command leads to, or why it is poison (for the dead-letter subject)."""
        core: AdmissionCore = self.core  # type: ignore[assignment]
        seq = msg.metadata.sequence.stream
        verb = msg.subject.rsplit(".", 1)[-1]
        with observability.span_if_recording(f"admission intake {verb}", msg.headers, sequence=seq):
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
                return reason
        ctx = observability.trace_headers(msg.headers)
        for event in events:
            if ctx:
                self.trace_ctx[event.aggregate_id] = ctx
        return events

    async def _flush(self, appender: eventlog.EventLog, pending: list[tuple[Msg, list[Event], dict[str, int]]]) -> bool:
        """Append the events of the commands so far and ack them; nak those whose events were
        refused (decided again on redelivery). True when any was."""
        if not pending:
            return False
        basis = {scope: seq for _, _, taken_on in pending for scope, seq in taken_on.items()}
        refused = await self.append_all(appender, [e for _, events, _ in pending for e in events], basis)
        if refused:
            # What refused them (another partition's job of that id, a decision already taken) is
            # in the log: they are decided again once the state holds it.
            try:
                await self.wait_applied(await eventlog.last_sequence(appender.js), timeout_s=10.0)
            except eventlog.BROKER_ERRORS:
                pass
        for msg, events, _ in pending:
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
        return bool(refused)


def main() -> None:
    try:
        partition = partition_from_environment()
        webhook_allow = env_networks("GPUSCHED_WEBHOOK_ALLOW")  # beside public addresses (docs/notifications.md)
    except ConfigError as err:
        sys.exit(str(err))
    run_service("admission", lambda settings, clock: AdmissionCore(partition=partition, webhook_allow=webhook_allow),
                AdmissionService)


if __name__ == "__main__":
    main()
