"""Who may do what on NATS: the permissions of every credential, least privilege first.

Roles (docs/events.md, "Credentials and permissions"):

- **admin**: everything; provisions, deletes and repairs streams (`gpusched init`). Nothing runs as admin.
- **operator** (the CLI): configuration events, commands on behalf of a user of any team (the
  operator intake subject, with ``on_behalf_of``), and reading every stream through its own readers.
- **service** (admission, quota, scheduler, executor, accounting, notifier, serving; and
  ``executor-<cluster>``, one per cluster of a multi-cluster platform): publishes only the
  event types it produces and its own dead letters; creates, reads and deletes only its own durables
  and readers; admission, quota and scheduler also write and read their own snapshot bucket, and
  admission, quota, scheduler, serving and executor their own lease bucket (admission: one of
  each per partition).
- **api** (the HTTP API, gpusched.api): commands of any team's users and the operator's, each
  sent as the API's caller; core subscriptions to admission's answers, the intake's dead letters
  and the teams' event copies; direct gets on the event log and the dead letters. No consumer.
- **tenant** (one credential per team, named after it; or ``<team>.<user>`` for a user of a team):
  its own intake subjects, and its team's tenant stream, where it may create consumers.

Accounts: the platform's credentials share one NATS account, ``GPUSCHED``, which holds the event
log, the intake, the dead letters and the services' buckets. Each team has an account of its own,
``TEAM_<team>``, with its credentials and its tenant stream; the two are joined by three imports
and nothing else (:func:`accounts`): the team's intake subjects into the platform, its tenant
subjects and its JetStream API out to the platform. Whatever a team's credential makes the server
publish for it (a push consumer's deliveries, the reply to any request, a reply subject it
chose) is published in the team's account, where the only way out is its own intake, as itself.
Within one account, subject permissions could not have held this wall: they check the subject a
client publishes on, not a consumer's ``deliver_subject`` nor the reply subject of a request,
which the server answers on with its own rights (docs/events.md, "The tenant wall").

Every credential receives replies only under its own inbox prefix (``_INBOX.<user>``), so none can
read another's JetStream replies or deliveries. Stream create, update, delete and purge, and message
delete, are the admin's alone (and the streams refuse purge and message delete even to it); the one
exception is a service's own snapshot or lease bucket, which it creates (and purges of old
snapshot chunks).
"""

from __future__ import annotations

from runtime import lease, snapshot
from runtime.teams import MAX_READING_PARTITIONS
from runtime.eventlog import (
    DLQ_STREAM,
    EVENTS_STREAM,
    INTAKE_STREAM,
    inbox_prefix,
    reader_names,
    tenant_stream,
    tenant_subjects,
)
from runtime.eventlog import tenant_api as tenant_api_of
from schemas.commands import INTAKE_VERBS, OPERATOR
from schemas.node import valid_cluster
from schemas.registry import SUBJECT_PREFIX, producer_subjects, subject_suffix

P = SUBJECT_PREFIX
API = "$JS.API"

SERVICES = ("admission", "quota", "scheduler", "executor", "accounting", "notifier", "serving")
"""Every service credential; gpusched.dev.stack starts the ones deploy/Procfile lists."""

ADMISSION_PARTITIONS = [""] + [f"-p{k}" for k in range(1, MAX_READING_PARTITIONS)]
"""The suffix of each admission partition's durables, lease and snapshot bucket (partition 0: none;
services/admission/__main__.py durable_names)."""

DURABLES: dict[str, dict[str, list[str]]] = {
    "admission": {EVENTS_STREAM: [f"admission{p}" for p in ADMISSION_PARTITIONS],
                  INTAKE_STREAM: [f"admission-intake{p}" for p in ADMISSION_PARTITIONS]},
    "quota": {EVENTS_STREAM: ["quota"]},
    "scheduler": {EVENTS_STREAM: ["scheduler"]},
    "executor": {EVENTS_STREAM: ["executor"]},
    "accounting": {},
    # per partition (services/notifier/core.py durable_names; partition 0: no suffix): jobs and
    # services on the log, refused commands on the dead letters
    "notifier": {EVENTS_STREAM: [f"{name}{f'-p{k}' if k else ''}" for k in range(16)
                                 for name in ("notifier", "notifier-services")],
                 DLQ_STREAM: [f"notifier-refused{f'-p{k}' if k else ''}" for k in range(16)]},
    "serving": {EVENTS_STREAM: ["serving"]},
}
"""Service -> stream -> the durable consumers it owns there."""

READS: dict[str, list[str]] = {
    "admission": [EVENTS_STREAM], "quota": [EVENTS_STREAM], "scheduler": [EVENTS_STREAM],
    "executor": [EVENTS_STREAM], "accounting": [EVENTS_STREAM], "notifier": [EVENTS_STREAM],
    "serving": [EVENTS_STREAM],
}
"""Service -> the streams it reads with ephemeral readers (runtime.eventlog.read_batches)."""

SNAPSHOTTED = ("admission", "quota", "scheduler")
"""The services that save snapshots of their state (runtime/snapshot.py), each in its own bucket."""

LEASED = ("admission", "quota", "scheduler", "serving", "executor")
"""The services that may run single-active with a standby (runtime/lease.py), each with its own
lease bucket."""

CLUSTER_EXECUTOR_PREFIX = "executor-"
"""``executor-<cluster>``: the credential of one cluster's executor (GPUSCHED_CLUSTER), with the
executor's rights over its own durable, lease and dead letters of that name."""


def cluster_executor(user: str) -> bool:
    """Whether ``user`` names one cluster's executor (``executor-<cluster>``)."""
    cluster = user.removeprefix(CLUSTER_EXECUTOR_PREFIX)
    return cluster != user and valid_cluster(cluster)


NOTIFIER_TENANT_DURABLE = "notifier"
"""The notifier's durable on each tenant stream (webhook delivery), the one consumer there that is not the team's."""


def consumer_api(stream: str, name: str, *, pull: bool = True, api: str = API) -> list[str]:
    """Create (with or without a filter in the subject), info, delete, ack and (``pull``) fetch
    on one named consumer of one stream; ``*`` as the stream: that name on any stream. ``api``:
    the JetStream API prefix (a team's account's, for the notifier's durable there)."""
    return [
        f"{api}.CONSUMER.*.{stream}.{name}",  # CREATE, INFO, DELETE, PAUSE, UNPIN
        f"{api}.CONSUMER.CREATE.{stream}.{name}.>",
        *([f"{api}.CONSUMER.MSG.NEXT.{stream}.{name}"] if pull else []),
        f"$JS.ACK.{stream}.{name}.>",
    ]


def stream_read_api(stream: str) -> list[str]:
    """Stream info and reading a message by sequence or subject (direct get)."""
    return [f"{API}.STREAM.INFO.{stream}", f"{API}.STREAM.MSG.GET.{stream}", f"{API}.DIRECT.GET.{stream}",
            f"{API}.DIRECT.GET.{stream}.>"]


def snapshot_api(service: str) -> list[str]:
    """Its own Object Store bucket, and nothing else of any other: create the bucket's stream
    (never update or delete it), write objects (chunks and metadata), purge its old chunks, read
    them back (an ordered consumer and its flow control, direct gets of the metadata). And the
    stream names: nats-py's ObjectStore.get looks its stream up by subject."""
    bucket, stream = snapshot.bucket(service), snapshot.stream(service)
    return [f"$O.{bucket}.>", f"{API}.STREAM.CREATE.{stream}", f"{API}.STREAM.PURGE.{stream}", f"{API}.STREAM.NAMES",
            *stream_read_api(stream), f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.CREATE.{stream}.>",
            f"{API}.CONSUMER.DELETE.{stream}.*", f"$JS.FC.{stream}.>"]


def lease_api(service: str) -> list[str]:
    """Its own lease bucket (a KV store), nothing of any other's: create the bucket's stream
    (never update or delete it), write the key (create, renew, release: conditional publishes),
    read it (direct get, stream info)."""
    bucket, stream = lease.bucket(service), lease.stream(service)
    return [f"$KV.{bucket}.>", f"{API}.STREAM.CREATE.{stream}", *stream_read_api(stream)]


def _readers(user: str, streams: list[str]) -> list[str]:
    out: list[str] = []
    for stream in streams:
        out += stream_read_api(stream)
        for name in reader_names(user):
            out += consumer_api(stream, name, pull=False)  # readers are push consumers
    return out


def _perms(user: str, publish: list[str], subscribe: tuple[str, ...] = ()) -> dict:
    return {"publish": {"allow": [f"{API}.INFO", *publish]},
            "subscribe": {"allow": [f"{inbox_prefix(user)}.>", *subscribe]}}


def service_permissions(service: str) -> dict:
    """The event types it produces, its dead letters, its durables and readers. A cluster's
    executor (``executor-<cluster>``) has the executor's, under its own name."""
    kind = "executor" if cluster_executor(service) else service
    publish = producer_subjects(kind) + [f"{P}.deadletter.{service}", f"{P}.deadletter.{service}.>"]
    if kind != service:  # its own cluster's heartbeat only
        cluster = service.removeprefix(CLUSTER_EXECUTOR_PREFIX)
        publish = [f"{P}.cluster.{cluster}.reported" if p == f"{P}.cluster.*.reported" else p for p in publish]
    for stream, durables in DURABLES[kind].items():
        publish += [f"{API}.STREAM.INFO.{stream}"]
        for durable in durables:
            publish += consumer_api(stream, service if kind != service else durable)
    publish += _readers(service, READS[kind])
    for instance in [f"{service}{p}" for p in ADMISSION_PARTITIONS] if service == "admission" else [service]:
        if kind in SNAPSHOTTED:
            publish += snapshot_api(instance)
        if kind in LEASED:
            publish += lease_api(instance)
    if service == "notifier":  # writes every team's tenant stream; delivers webhooks from each
        tenant_api = tenant_api_of("*")
        # (a team's account holds its tenant stream and nothing else of the platform's)
        publish += [f"{P}.tenant.>", f"{tenant_api}.INFO", f"{tenant_api}.STREAM.INFO.*",
                    *consumer_api("*", NOTIFIER_TENANT_DURABLE, api=tenant_api)]
    return _perms(service, sorted(set(publish)))


API_USER = "api"
"""The HTTP API's credential."""


def api_permissions() -> dict:
    """Commands on the user and operator intake subjects of every team (the API authenticates its
    caller and sends as that caller), reading the log by direct get, and the core subscriptions
    of gpusched.api.bus. It creates no consumer."""
    publish = [f"{P}.intake.*.user.*.{verb}" for verb in INTAKE_VERBS]
    publish += [f"{P}.intake.*.{OPERATOR}.{verb}" for verb in INTAKE_VERBS]
    publish += stream_read_api(EVENTS_STREAM) + stream_read_api(DLQ_STREAM)
    return _perms(API_USER, publish, subscribe=(*api_answer_subjects(), f"{P}.deadletter.admission.intake",
                                                f"{P}.tenant.*.job.>"))


API_ANSWER_TYPES = ("JobSubmitted", "JobAdmitted", "JobRejected", "JobCancelRequested", "JobCancelled", "JobSucceeded",
                    "JobCheckpointed")
"""The events that answer a job command (gpusched.api.bus listens to these)."""
API_SERVICE_ANSWER_TYPES = ("ServiceDeployed", "ServiceUpdated", "ScaleRequested", "ServiceDeleted",
                            "ServiceLoadReported")
"""The events that answer a service command."""


def api_answer_subjects() -> tuple[str, ...]:
    return (*(f"{P}.job.*.{subject_suffix(t)}" for t in API_ANSWER_TYPES),
            *(f"{P}.service.*.{subject_suffix(t)}" for t in API_SERVICE_ANSWER_TYPES))

RESERVED = frozenset({"admin", OPERATOR, API_USER, *SERVICES})
"""Credential names that are not teams: a team may not be called so (it would share the inbox and
the permissions of that credential)."""


def tenant_permissions(team: str, user: str | None = None) -> dict:
    """A team's credential (``user`` None) or one of its users' (``<team>.<user>``): its own
    intake subjects, and consumers of any name on its team's tenant stream (but the notifier's).
    ValueError for a reserved team name."""
    if team in RESERVED or cluster_executor(team):
        raise ValueError(f"{team!r} is not a team name: {', '.join(sorted(RESERVED))} and "
                         f"{CLUSTER_EXECUTOR_PREFIX}<cluster> are the platform's credentials")
    who = f"{team}.{user}" if user else team  # the credential's name: its inbox is _INBOX.<team>_<user>
    intake = (f"{P}.intake.{team}.{{verb}}" if user is None else f"{P}.intake.{team}.user.{user}.{{verb}}")
    stream = tenant_stream(team)
    publish = [intake.format(verb=verb) for verb in INTAKE_VERBS]
    publish += stream_read_api(stream) + [
        f"{API}.CONSUMER.*.{stream}",  # LIST, NAMES, and CREATE without a name (an ephemeral)
        f"{API}.CONSUMER.*.{stream}.*",
        f"{API}.CONSUMER.CREATE.{stream}.*.>",
        f"{API}.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"{API}.CONSUMER.MSG.NEXT.{stream}.*",
        f"$JS.ACK.{stream}.>",
    ]
    perms = _perms(who, publish, subscribe=(tenant_subjects(team),))
    # The notifier's durable on the team's stream is the platform's: the team may not touch it.
    perms["publish"]["deny"] = [*consumer_api(stream, NOTIFIER_TENANT_DURABLE),
                                f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{NOTIFIER_TENANT_DURABLE}"]
    return perms


def operator_permissions() -> dict:
    """Configuration events, commands on behalf of users of any team, reading every stream."""
    publish = producer_subjects("config") + [f"{P}.intake.*.{OPERATOR}.{verb}" for verb in INTAKE_VERBS]
    publish += [f"{API}.STREAM.NAMES", f"{API}.STREAM.LIST", *stream_read_api("*")]
    for name in reader_names(OPERATOR):
        publish += consumer_api("*", name, pull=False)
    return _perms(OPERATOR, publish)


def admin_permissions() -> dict:
    return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}


def permissions(user: str) -> dict:
    """The permissions of a credential by its name: ``admin``, ``operator``, a service, or a
    tenant (``<team>`` or ``<team>.<user>``)."""
    if user == "admin":
        return admin_permissions()
    if user == OPERATOR:
        return operator_permissions()
    if user in SERVICES or cluster_executor(user):
        return service_permissions(user)
    if user == API_USER:
        return api_permissions()
    team, _, member = user.partition(".")
    return tenant_permissions(team, member or None)


# -- accounts ---------------------------------------------------------------------------------

PLATFORM_ACCOUNT = "GPUSCHED"
"""The account of every platform credential (admin, operator, api, the services)."""


def team_account(team: str) -> str:
    """The NATS account of one team's credentials and its tenant stream."""
    return f"TEAM_{team}"


def team_of(user: str) -> str | None:
    """The team a credential belongs to (``<team>`` or ``<team>.<user>``), None for the platform's."""
    if user in RESERVED or cluster_executor(user):
        return None
    return user.partition(".")[0]


def account_of(user: str) -> str:
    team = team_of(user)
    return PLATFORM_ACCOUNT if team is None else team_account(team)


def team_intake_subjects(team: str) -> list[str]:
    """The intake subjects a team's account reaches: the team's and its users'
    (``gpusched.intake.<team>.<verb>``, ``….user.<user>.<verb>``), never the operator's
    (``….operator.<verb>``, which only the platform's credentials publish)."""
    return [f"{P}.intake.{team}.*", f"{P}.intake.{team}.user.*.*"]


def accounts(users: list[str]) -> dict[str, dict]:
    """Account name -> its users, exports and imports (nats-server's ``accounts`` block, less the
    users' passwords and permissions). The only paths between the platform and a team:

    - the team's intake (:func:`team_intake_subjects`, the operator's subjects excluded): a
      service the platform exports to that team alone; a publish there in the team's account is
      stored in GPUSCHED_INTAKE and JetStream's ack comes back as the service's response;
    - the team's tenant subjects ``gpusched.tenant.<team>.>``: a service the team exports to the
      platform, so the notifier's copies are stored in the team's own stream (and the platform's
      core subscribers, the API's answers, still see them);
    - the team's JetStream API (``$JS.API.>``, and the acks of its tenant stream's consumers):
      exported to the platform, imported as :func:`runtime.eventlog.tenant_api`, so that the
      admin provisions the team's stream and the notifier reads it for webhooks.

    Nothing flows from a team's account into the platform's but the first, and that only on the
    team's own intake subjects."""
    teams = sorted({t for u in users if (t := team_of(u)) is not None})
    out: dict[str, dict] = {PLATFORM_ACCOUNT: {"users": [], "exports": [], "imports": []}}
    for team in teams:
        account, stream = team_account(team), tenant_stream(team)
        intake = team_intake_subjects(team)
        out[PLATFORM_ACCOUNT]["exports"] += [{"service": subject, "accounts": [account]} for subject in intake]
        out[PLATFORM_ACCOUNT]["imports"] += [
            {"service": {"account": account, "subject": tenant_subjects(team)}},
            {"service": {"account": account, "subject": f"{API}.>"}, "to": f"{tenant_api_of(team)}.>"},
            {"service": {"account": account, "subject": f"$JS.ACK.{stream}.>"}},
        ]
        out[account] = {"users": [], "imports": [{"service": {"account": PLATFORM_ACCOUNT, "subject": subject}}
                                                 for subject in intake],
                        "exports": [
                            {"service": tenant_subjects(team), "accounts": [PLATFORM_ACCOUNT]},
                            # a fetch answers with many messages
                            {"service": f"{API}.>", "accounts": [PLATFORM_ACCOUNT], "response_type": "stream"},
                            {"service": f"$JS.ACK.{stream}.>", "accounts": [PLATFORM_ACCOUNT]},
                        ]}
    for user in users:
        out[account_of(user)]["users"].append(user)
    return out
