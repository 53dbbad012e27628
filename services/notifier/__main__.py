"""The notifier: tells each team about its own jobs (docs/notifications.md).

Two loops:

- **Fan-out** (durable ``notifier`` on ``gpusched.job.>``, one event in flight): in log order, each job event is copied to its team's tenant stream, with the notification it
  makes (:mod:`services.notifier.core`). Both carry a ``Nats-Msg-Id``, so a redelivery after a
  crash stores nothing twice; the event is acked only once both are stored. A job's team comes
  from its JobSubmitted (looked up in the log by direct get, then cached). The same, with the
  durable ``notifier-services`` on ``gpusched.service.>``, for the teams' inference services
  (a service's team from its ServiceDeployed), whose deploys, updates, scalings, lost replicas and
  deletion make notifications too. Two durables, not one
  with two filters: a consumer with several filter subjects delivered about 14 times slower here.
- **Webhooks** (nats-py; one durable ``notifier`` per tenant stream, in the team's own account
  (:func:`runtime.eventlog.tenant_js`), filtered to its notifications, for every team that has a
  signing secret or whose events it has copied, checked every 30 s): each notification is POSTed, signed, to the webhooks of the
  team (its latest TeamConfigured) and of the job (its spec's ``notify``; a service's: its replica
  template's), one at a time per
  team, so a job's notifications arrive in order and one team's dead receiver never delays
  another's. A failed POST is retried with backoff; after the last try it is dead-lettered. Every
  try is logged on the team's delivery subject.

Scale-out: with ``GPUSCHED_NOTIFIER_PARTITIONS=N``, N notifiers share the teams, each team to one
(:func:`runtime.teams.partition_of`), ``GPUSCHED_NOTIFIER_PARTITION`` saying which is
which (a StatefulSet's pod index). Each reads every event through its own fan-out durables
(:func:`~services.notifier.core.durable_names`) but copies and delivers only its teams': a team's
order holds (one consumer per team, in log order), and the copies, notifications and webhook POSTs
(the work) are divided. A partition's durable that does not exist yet starts where partition 0's
has acknowledged, and partition 0 makes every partition's before it passes over another's event
(:func:`runtime.teams.partition_durables`), so adding notifiers neither loses nor repeats
anything.

Both loops are nats-py pull consumers, as in the other services. FastStream 0.7's pull subscriber
was tried for the fan-out and left: it handles the messages of one fetched batch concurrently
(which breaks the log order a team's view and the job-to-team lookup need), and a fetch timeout
escapes its loop as an error (nats-py raises asyncio.TimeoutError where FastStream catches
nats.errors.TimeoutError).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import httpx
import nats
from nats.aio.msg import Msg
from nats.js.errors import NoStreamResponseError, NotFoundError, ServiceUnavailableError
from prometheus_client import Counter, Histogram

from runtime import eventlog, health, observability, teams
from runtime.settings import Settings
from schemas import (Event, JobRejected, JobSubmitted, NotificationKind, NotifySpec, ServiceDeployed, TeamConfigured,
                     parse_event)
from schemas.service import ServiceUpdated
from schemas.registry import SUBJECT_PREFIX, subject_token
from schemas.tenant import JobNotification, NotificationDelivery
from services.notifier import core, egress
from services.notifier.settings import NotifierSettings

NAME = "notifier"
DURABLE = "notifier"  # on each tenant stream (webhook delivery)
log = logging.getLogger(NAME)
logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO

COPIES = Counter("gpusched_notifier_copies_total", "Job events copied to a team's tenant stream", ["team"])
NOTIFICATIONS = Counter("gpusched_notifier_notifications_total", "Notifications written", ["team", "kind"])
UNPROVISIONED = Counter("gpusched_notifier_unprovisioned_total",
                        "Job events of a team that has no tenant stream (gpusched init --team)", ["team"])
DELIVERIES = Counter("gpusched_notifier_webhook_deliveries_total", "Webhook delivery tries by outcome", ["outcome"])
DELIVERY_SECONDS = Histogram("gpusched_notifier_webhook_seconds", "Duration of one webhook POST")


class Notifier:
    def __init__(self, settings: Settings, options: NotifierSettings | None = None) -> None:
        self.settings, self.options = settings, options or NotifierSettings.from_env()
        self._stop = asyncio.Event()
        self._warned: set[str] = set()
        self._workers: dict[str, asyncio.Task] = {}
        self._copied: set[str] = set()  # the teams whose events this process has copied
        self._new_team = asyncio.Event()  # wakes the webhook supervisor

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        self.nc = await eventlog.connect(self.settings, NAME)
        self.js = self.nc.jetstream()
        self.teams = teams.TeamIndex(self.js)
        await eventlog.wait_for_streams(self.js)
        supervisor = asyncio.create_task(self._supervise_webhooks())
        loops = [asyncio.create_task(self._fan_out_loop(0, eventlog.EVENTS_STREAM, f"{SUBJECT_PREFIX}.job.>",
                                                        self.fan_out)),
                 asyncio.create_task(self._fan_out_loop(1, eventlog.EVENTS_STREAM, f"{SUBJECT_PREFIX}.service.>",
                                                        self.fan_out)),
                 asyncio.create_task(self._fan_out_loop(2, eventlog.DLQ_STREAM, core.REFUSED_COMMANDS, self.refuse))]
        try:
            # all end when stopped; one that fails for anything but the broker takes the process
            # down (its supervisor restarts it) rather than dying unnoticed beside the others
            done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            for task in [supervisor, *self._workers.values()]:
                task.cancel()
            await asyncio.gather(supervisor, *self._workers.values(), return_exceptions=True)
            await eventlog.close(self.nc)

    def mine(self, team: str) -> bool:
        """Whether this notifier's partition copies and delivers ``team``'s."""
        return teams.Partition(self.options.partitions, self.options.partition).owns(team)

    async def _fan_out_loop(self, family: int, stream: str, subject: str,
                            handle: Callable[[Msg], Awaitable[None]]) -> None:
        """The fan-out of one family of durables (``family``: 0 jobs, 1 services, 2 refused
        commands; core.durable_names): ``handle`` each message on ``subject`` of ``stream``."""
        failures = 0
        durable = core.durable_names(self.options.partition)[family]
        # One message in flight (max_ack_pending=1): a team's copies stay in log order even when a
        # notifier dies, or stops, with messages delivered and not acknowledged: those come again
        # before anything later (with a batch in flight, the later ones would be copied first and
        # the batch after its ack wait).
        config = {"filter_subjects": [subject], "max_ack_pending": 1}
        while not self._stop.is_set():
            try:
                if stream == eventlog.DLQ_STREAM:
                    await self._refused_from_now(core.durable_names(0)[family], config)
                # a partition's durable starts where partition 0's stopped (runtime.teams.partition_durables)
                await teams.partition_durables(self.js, stream=stream, partitions=self.options.partitions,
                                               partition=self.options.partition,
                                               name=lambda k: core.durable_names(k)[family], **config)
                sub = await eventlog.durable_consumer(self.js, stream=stream, durable=durable, **config)
                while not self._stop.is_set():
                    for msg in await eventlog.fetch(sub, 1, 1.0):
                        await self._handle(msg, handle)
                    failures = 0
                    health.HEALTH.jetstream = True  # /readyz: its consumer answers
            except eventlog.BROKER_ERRORS as err:
                failures += 1
                health.HEALTH.jetstream = False
                log.warning("fan-out lost the broker; resuming", extra={"error": repr(err), "durable": durable})
                await asyncio.sleep(eventlog.retry_delay(failures))

    async def _refused_from_now(self, durable: str, config: dict) -> None:
        """Partition 0's refused-commands durable, when it does not exist yet, starts after the
        dead letters already there: telling teams of commands refused before this notifier
        copied refusals would flood their webhooks with old news (the operator's dead-letter
        list has them). The other partitions' start where it is (runtime.teams.partition_durables)."""
        try:
            await self.js.consumer_info(eventlog.DLQ_STREAM, durable)
        except NotFoundError:
            after = await eventlog.last_sequence(self.js, eventlog.DLQ_STREAM)
            await eventlog.ensure_durable(self.js, stream=eventlog.DLQ_STREAM, durable=durable, start_seq=after + 1,
                                          **config)

    async def _handle(self, msg: Msg, handle: Callable[[Msg], Awaitable[None]]) -> None:
        try:
            await handle(msg)
        except eventlog.BROKER_ERRORS:
            raise  # the broker is away: the consumer redelivers after it is back
        except Exception as err:  # a bug on this event: again later, and never dropped
            log.exception("fan-out failed; redelivered later", extra={"subject": msg.subject})
            if eventlog.last_delivery(msg):
                await eventlog.dead_letter(self.js, NAME, msg, f"not copied after {msg.metadata.num_delivered} "
                                                               f"deliveries: {err!r}"[:2000])
                await msg.ack()
            else:
                await msg.nak(delay=eventlog.retry_delay(msg.metadata.num_delivered))

    # -- fan-out ------------------------------------------------------------------------------
    async def fan_out(self, msg: Msg) -> None:
        """Copy one job event to its team's stream with its notification; ack when both are stored."""
        try:
            event = parse_event(msg.data)
        except Exception as err:  # not an event this notifier can read: poison
            await eventlog.dead_letter(self.js, NAME, msg, f"unreadable event: {err}"[:2000])
            await msg.ack()
            return
        with observability.span_from_headers(f"notifier {event.type}", msg.headers, job=event.aggregate_id):
            team = await self.teams.team_of(event, eventlog.sequence(msg))
            if team is None:
                log.warning("no team for an event; skipped", extra={"aggregate": event.aggregate_id, "type": event.type})
                await msg.ack()
                return
            if not self.mine(team):
                await msg.ack()  # another partition's team
                return
            # The event's own headers (trace context) but JetStream's: an expected-sequence header
            # was for the events stream, and the copy's de-duplication id is the event id.
            headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
            headers["Nats-Msg-Id"] = event.event_id
            seen = await self.teams.as_seen_by(event, team)  # another team's job is never named to this one
            data = msg.data if seen is event else seen.model_dump_json().encode()
            await self._store(team, core.copy_subject(team, event), data, headers, core.notification(seen, team),
                              trace=msg.headers)
        await msg.ack()

    async def refuse(self, msg: Msg) -> None:
        """Tell a team about a command of its that admission dead-lettered: a CommandRefused (the
        reason, and the command's bytes base64-encoded, never as they were) on the team's
        ``refused.<intake sequence>`` subject, and a ``command-refused`` notification (for its
        webhooks); ack when both are stored."""
        refused = core.refused_command(msg.headers, msg.metadata.timestamp)
        if refused is not None and self.mine(refused.team):
            await self._store(refused.team, core.refused_subject(refused), core.refused_copy(refused, msg.data),
                              {"Nats-Msg-Id": f"refused:{refused.intake_sequence}", "Gpusched-Reason": refused.reason},
                              core.refused_notification(refused, msg.data), trace=msg.headers)
        await msg.ack()

    async def _store(self, team: str, subject: str, data: bytes, headers: dict[str, str],
                     note: JobNotification | None, trace: dict[str, str] | None) -> None:
        """Store a copy and its notification (if any) in the team's stream."""
        try:
            await self.js.publish(subject, data, headers=headers, timeout=10)
            COPIES.labels(team=team).inc()
            if team not in self._copied:
                self._copied.add(team)
                self._new_team.set()
            if note is not None:
                await self.js.publish(core.notify_subject(note), note.model_dump_json().encode(), timeout=10,
                                      headers={**observability.trace_headers(trace), "Nats-Msg-Id": note.notification_id})
                NOTIFICATIONS.labels(team=team, kind=note.kind.value).inc()
        except (nats.errors.NoRespondersError, NoStreamResponseError):
            # (nats-py turns the server's "no responders" into NoStreamResponseError.) No stream
            # took the publish: the team has none (counted and skipped), or JetStream does not
            # answer now (raised: the message comes again).
            if await self._has_stream(team):
                raise
            self._unprovisioned(team)

    async def _has_stream(self, team: str) -> bool:
        """Whether the team's account holds its tenant stream (no account: the broker has no
        responder on the team's JetStream API)."""
        try:
            await eventlog.tenant_js(self.js, team).stream_info(eventlog.tenant_stream(team))
        except NotFoundError:
            return False
        except ServiceUnavailableError:  # nats-py's "no responders": no account, or JetStream away
            if await eventlog.team_account_exists(self.nc, team):
                raise
            return False
        return True

    def _unprovisioned(self, team: str) -> None:
        UNPROVISIONED.labels(team=team).inc()
        if team not in self._warned:
            self._warned.add(team)
            log.warning("team has no tenant stream; its jobs' events are not copied (gpusched init --team)",
                        extra={"team": team, "stream": eventlog.tenant_stream(team)})

    async def _last(self, subject: str) -> Event | None:
        """The last event on ``subject`` in the log (direct get), or None."""
        try:
            raw = await self.js.get_last_msg(eventlog.EVENTS_STREAM, subject, direct=True)
        except NotFoundError:
            return None
        return parse_event(raw.data)

    # -- webhooks -----------------------------------------------------------------------------
    async def _supervise_webhooks(self) -> None:
        """A delivery worker per team of this partition that has a tenant stream, checked now and
        every 30 s (and at once when the fan-out copies a new team's first event). The teams: those
        with a signing secret (the only ones whose webhooks are ever POSTed) and those whose events
        it has copied. Tenant streams live in the teams' accounts, which the platform's cannot list."""
        while True:
            for team in sorted((set(self.options.secrets) | self._copied) - set(self._running_workers())):
                try:
                    if self.mine(team) and await self._has_stream(team):
                        self._workers[team] = asyncio.create_task(self._deliver_team(team))
                except eventlog.BROKER_ERRORS as err:
                    log.warning("cannot look up a tenant stream; trying again", extra={"team": team, "error": repr(err)})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._new_team.wait(), 30)
            self._new_team.clear()

    def _running_workers(self) -> list[str]:
        return [team for team, task in self._workers.items() if not task.done()]

    async def _deliver_team(self, team: str) -> None:
        stream = eventlog.tenant_stream(team)
        failures = 0
        while True:
            try:
                sub = await eventlog.durable_consumer(eventlog.tenant_js(self.js, team), stream=stream, durable=DURABLE,
                                                      api=eventlog.tenant_api(team),
                                                      filter_subjects=[f"{SUBJECT_PREFIX}.tenant.{team}.notify.>"],
                                                      ack_wait_s=600, max_ack_pending=1, backoff=False)
                # no proxy from the environment: a request goes to the address egress checked
                async with httpx.AsyncClient(timeout=self.options.timeout_s, trust_env=False) as http:
                    while True:
                        for msg in await eventlog.fetch(sub, 1, 5.0):
                            await self._deliver(team, msg, http)
                            await msg.ack()
                        failures = 0
            except asyncio.CancelledError:
                raise
            except eventlog.BROKER_ERRORS as err:
                failures += 1
                log.warning("webhook worker lost the broker; resuming", extra={"team": team, "error": repr(err)})
                await asyncio.sleep(eventlog.retry_delay(failures))

    async def _deliver(self, team: str, msg: Msg, http: httpx.AsyncClient) -> None:
        try:
            note = JobNotification.model_validate_json(msg.data, strict=True)
        except Exception as err:
            await eventlog.dead_letter(self.js, f"{NAME}.webhook", msg, f"unreadable notification: {err}"[:2000])
            return
        if not await self._the_teams(note, team):
            await eventlog.dead_letter(self.js, f"{NAME}.webhook", msg, f"a notification on team {team}'s stream about "
                                                                         "something not the team's: delivered to no one")
            return
        team_config = await self._last(f"{SUBJECT_PREFIX}.team.{team}.configured")
        urls = core.webhooks_for(note.kind, team_config.notify if isinstance(team_config, TeamConfigured) else None,
                                 await self._own_notify(note))
        if not urls:
            return
        secret = self.options.secrets.get(team)
        if secret is None:
            DELIVERIES.labels(outcome="no-secret").inc()
            log.warning("team has webhooks but no signing secret; not delivered (never unsigned)",
                        extra={"team": team, "notification": note.notification_id})
            return
        body = msg.data
        for url in urls:
            await self._post_until_done(team, note, url, body, secret, http, msg)

    async def _the_teams(self, note: JobNotification, team: str) -> bool:
        """Whether a notification on ``team``'s stream is about the team's own job, service or
        command, as the log says. Only the notifier writes notifications, but a team can make the
        server copy what its stream holds onto its own subjects (docs/events.md, "The tenant
        wall"): whatever lands there, no other team's webhooks are ever asked for."""
        if note.team != team:
            return False
        if note.kind is NotificationKind.COMMAND_REFUSED:
            return True  # the team's webhooks only (:meth:`_own_notify`)
        if note.service is not None:
            return await self.teams.lookup("service", subject_token(note.service)) == team
        owner = await self.teams.lookup("job", subject_token(note.job_id))
        if owner is None:  # a rejection of a command that never made a job: the JobRejected names the team
            rejected = await self._last(f"{SUBJECT_PREFIX}.job.{note.job_id}.rejected")
            owner = rejected.team if isinstance(rejected, JobRejected) else None
        return owner == team

    async def _own_notify(self, note: JobNotification) -> NotifySpec | None:
        """The webhooks of the job (its spec's ``notify``), or for a service's notification of
        the service (its replica template's, as last deployed or updated); none for a refused
        command (its document was refused: nothing in it is taken, its webhooks included)."""
        if note.kind is NotificationKind.COMMAND_REFUSED:
            return None
        if note.service is None:
            submitted = await self._last(f"{SUBJECT_PREFIX}.job.{note.job_id}.submitted")
            return submitted.spec.notify if isinstance(submitted, JobSubmitted) else None
        latest = None  # (stream sequence, spec): the later of the last deploy and the last update
        for token in ("deployed", "updated"):
            try:
                raw = await self.js.get_last_msg(eventlog.EVENTS_STREAM, f"{SUBJECT_PREFIX}.service.{note.service}.{token}",
                                                 direct=True)
            except NotFoundError:
                continue
            event = parse_event(raw.data)
            if isinstance(event, (ServiceDeployed, ServiceUpdated)) and (latest is None or raw.seq > latest[0]):
                latest = (raw.seq, event.spec)
        return latest[1].replica.notify if latest is not None else None

    async def _post_until_done(self, team: str, note: JobNotification, url: str, body: bytes, secret: str,
                               http: httpx.AsyncClient, msg: Msg) -> None:
        for attempt in range(1, self.options.max_attempts + 1):
            start = time.monotonic()
            status, error, refused = None, "", False
            try:
                # only to addresses outside the platform, checked after resolution and on each redirect
                response = await egress.post(http, url, content=body, allow=self.options.webhook_allow, headers={
                    "Content-Type": "application/json", "Gpusched-Notification-Id": note.notification_id,
                    "Gpusched-Kind": note.kind.value, "Gpusched-Signature": core.sign(secret, int(time.time()), body)})
                status = response.status_code
                if not 200 <= status < 300:
                    error = f"HTTP {status}"
            except egress.EgressRefused as err:  # no try would fare better: dead-lettered now
                error, refused = str(err)[:1024], True
            except httpx.HTTPError as err:
                error = f"{type(err).__name__}: {err}"[:1024]
            took = time.monotonic() - start
            DELIVERY_SECONDS.observe(took)
            last = attempt == self.options.max_attempts or refused
            outcome = "delivered" if not error else ("dead-lettered" if last else "failed-attempt")
            DELIVERIES.labels(outcome="refused" if refused else outcome).inc()
            await self._log_delivery(team, NotificationDelivery(
                notification_id=note.notification_id, job_id=note.job_id, service=note.service, kind=note.kind, url=url, outcome=outcome,
                attempt=attempt, status_code=status, error=error, duration_ms=took * 1000, at=datetime.now(UTC)))
            if not error:
                return
            if last:
                await eventlog.dead_letter(self.js, f"{NAME}.webhook", msg,
                                           error if refused else f"{url}: {error} after {attempt} tries")
                return
            await msg.in_progress()  # many slow tries may outlast the ack wait; the message stays ours
            await asyncio.sleep(core.backoff_s(attempt, cap_s=self.options.backoff_cap_s))

    async def _log_delivery(self, team: str, record: NotificationDelivery) -> None:
        msg_id = f"{record.notification_id}:{record.url}:{record.attempt}"
        await self.js.publish(core.delivery_subject(team, record.job_id or record.service),
                              record.model_dump_json().encode(),
                              headers={"Nats-Msg-Id": msg_id[:256]}, timeout=10)


def main() -> None:
    settings = Settings.from_env()
    observability.setup(NAME, level=settings.log_level, fmt=settings.log_format, metrics_port=settings.metrics_port,
                        metrics_addr=settings.metrics_addr, otel_exporter=settings.otel_exporter,
                        trace_dir=settings.trace_dir)

    async def run() -> None:
        notifier = Notifier(settings)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, notifier.stop)
        await notifier.run()

    try:
        asyncio.run(run())
    finally:
        observability.shutdown()


if __name__ == "__main__":
    main()
