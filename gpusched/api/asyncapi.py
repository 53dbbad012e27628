"""The publisher contract as an AsyncAPI 3.0 document (schemas/asyncapi.json), generated from the
code. Two sources, one document:

- FastStream's own generator, from the broker the HTTP API runs (gpusched.api.bus): the intake
  subjects it publishes commands on, with their payloads.
- The registry (schemas.registry), for what FastStream cannot see: the intake subjects of a
  team's own credential (admission reads all three forms), every event subject
  ``gpusched.<aggregate>.{id}.<token>`` with its event's schema, the teams' subjects the notifier
  writes, the dead letters, and the headers each message carries.

    python -m gpusched.api.asyncapi          # rewrite schemas/asyncapi.json
    python -m gpusched.api.asyncapi --check  # exit 1 if the committed file differs from the code

tests/unit/test_asyncapi.py validates the document against the official AsyncAPI 3.0.0 schema.
"""

from __future__ import annotations

import json
import re
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from faststream.specification import AsyncAPI
from pydantic import BaseModel

from gpusched.api import bus
from runtime.settings import Settings
from schemas.commands import COMMAND_MODELS, INTAKE_VERBS
from schemas.export import ContractSchema, write_or_check
from schemas.registry import ALL_EVENT_TYPES, PRODUCERS, SUBJECT_PREFIX, subject_suffix
from schemas.tenant import CommandRefused, JobNotification, NotificationDelivery

OUT = Path(__file__).resolve().parents[2] / "schemas" / "asyncapi.json"
P = SUBJECT_PREFIX
COMMANDS: dict[str, type[BaseModel]] = COMMAND_MODELS
PARAMETERS = {
    "team": "A team name (a DNS label); a tenant credential may use only its own",
    "user": "A user of the team (a DNS label): the credential `<team>.<user>`, or the API's authenticated caller",
    "job_id": "A job id (a DNS label), or `rejected-<intake sequence>` for a rejection",
    "name": "A queue, cohort, price book or team name",
    "node": "A node name with `.` written as `_`",
    "cluster": "A cluster name (a DNS label): GPUSCHED_CLUSTER of its executor",
    "statement_id": "`<period>-<dimension>-<last sequence>`",
    "token_id": "An API token id (12 characters)",
    "policy_id": "`cluster`: the one policy (priority classes and preemption rate limit)",
    "kind": "A notification kind (schemas.notify.NotificationKind)",
    "intake_sequence": "The sequence JetStream's ack gave the command on stream GPUSCHED_INTAKE",
    "verb": "submit, cancel or checkpoint",
    "service": "The service that dead-lettered the message",
}
AGGREGATE_PARAMETER = {"job": "job_id", "queue": "name", "cohort": "name", "node": "node", "pricebook": "name",
                       "statement": "statement_id", "team": "name", "token": "token_id", "policy": "policy_id",
                       "service": "name", "cluster": "cluster"}


def _header(description: str, example: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string", "description": description}
    if example:
        out["examples"] = [example]
    return out


TRACE = {
    "traceparent": _header("W3C trace context: continues the sender's trace (OpenTelemetry)",
                           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    "tracestate": _header("W3C trace state, with traceparent"),
}
COMMAND_HEADERS = {"type": "object", "properties": {
    "Nats-Msg-Id": _header("Optional: JetStream drops a second command with the same id within the duplicate "
                           "window (120 s); with an idempotency key the job id is derived from it as well",
                           "submit/team-a/nightly-42"),
    **TRACE}}
EVENT_HEADERS = {"type": "object", "required": ["Nats-Msg-Id", "Gpusched-Type"], "properties": {
    "Nats-Msg-Id": _header("The event_id (deterministic: a re-derived decision has the same one)"),
    "Gpusched-Type": _header("The event type, as in the payload's `type`", "JobAdmitted"),
    "Nats-Expected-Last-Subject-Sequence": _header(
        "Optimistic concurrency: the newest sequence of the aggregate's events the writer had seen (0: a new "
        "aggregate); JetStream refuses the append otherwise"),
    "Nats-Expected-Last-Subject-Sequence-Subject": _header("The scope of that check: `gpusched.<aggregate>.<id>.>`"),
    **TRACE}}
DEAD_LETTER_HEADERS = {"type": "object", "required": ["Gpusched-Reason", "Gpusched-Original-Subject"], "properties": {
    "Nats-Msg-Id": _header("`dlq:<service>:<original stream>:<original sequence>`: one record per message"),
    "Gpusched-Reason": _header("Why it was refused: at most 2,000 characters, on one line"),
    "Gpusched-Original-Subject": _header("The message's subject"),
    "Gpusched-Original-Stream": _header("GPUSCHED_EVENTS or GPUSCHED_INTAKE"),
    "Gpusched-Original-Sequence": _header("Its sequence in that stream (for a command: the intake sequence)")}}


def _schemas() -> dict[str, Any]:
    """components.schemas: every command, event and tenant message, with their shared definitions."""
    out: dict[str, Any] = {}
    for model in (*COMMANDS.values(), *ALL_EVENT_TYPES, JobNotification, NotificationDelivery, CommandRefused):
        schema = model.model_json_schema(schema_generator=ContractSchema, ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _message(name: str, title: str, payload: dict[str, Any], headers: dict[str, Any], summary: str) -> dict[str, Any]:
    return {"name": name, "title": title, "summary": summary, "contentType": "application/json",
            "payload": payload, "headers": headers}


def _channel(doc: dict[str, Any], key: str, address: str, description: str, messages: dict[str, Any]) -> None:
    params = {p: {"description": PARAMETERS[p]} for p in re.findall(r"\{(\w+)\}", address)}
    channel: dict[str, Any] = {"address": address, "description": description,
                               "messages": {name: {"$ref": f"#/components/messages/{mid}"}
                                            for name, mid in messages.items()}}
    if params:
        channel["parameters"] = params
    doc["channels"][key] = channel


def _operation(doc: dict[str, Any], key: str, action: str, channel: str, summary: str, tag: str) -> None:
    messages = [{"$ref": f"#/channels/{channel}/messages/{name}"} for name in doc["channels"][channel]["messages"]]
    doc["operations"][key] = {"action": action, "channel": {"$ref": f"#/channels/{channel}"}, "summary": summary,
                              "messages": messages, "tags": [{"name": tag}]}


def _from_faststream() -> dict[str, Any]:
    broker = bus.new_broker(Settings(nats_user=bus.API_USER, nats_password=""))  # declared, never connected
    bus.declare_publishers(broker)
    return AsyncAPI(broker, title="gpusched", version="1",
                    schema_version="3.0.0").to_specification().to_jsonable()


def document() -> dict[str, Any]:
    doc = _from_faststream()
    doc["info"]["description"] = (
        "The subjects, messages and headers of gpusched on NATS JetStream: the commands a team (or the HTTP API for "
        "its caller) publishes on the intake subjects, the events the services publish, what each team reads on its "
        "own subjects, and the dead letters. docs/publishing.md and docs/events.md explain them.")
    doc["servers"] = {"development": {"host": "127.0.0.1:4222", "protocol": "nats",
                                      "description": "make run's nats-server; each credential uses the inbox "
                                                     "prefix _INBOX.<user> (docs/events.md)"}}
    components = doc.setdefault("components", {})
    components["schemas"] = {**components.get("schemas", {}), **_schemas()}
    messages = components.setdefault("messages", {})
    for op in doc["operations"].values():  # FastStream's part is the HTTP API's own
        op.setdefault("tags", [{"name": "api"}])
    for channel in doc["channels"].values():  # its addresses name parameters it does not declare
        params = {p: {"description": PARAMETERS[p]} for p in re.findall(r"\{(\w+)\}", channel["address"])}
        if params:
            channel["parameters"] = params
    # The API's publications: the headers FastStream does not know.
    for channel in doc["channels"].values():
        messages[_message_id(channel)].update(headers=COMMAND_HEADERS, contentType="application/json")
    # A team's own credential: the intake subjects admission reads.
    for verb in INTAKE_VERBS:
        model = COMMANDS[verb].__name__
        mid = f"intake.{verb}"
        messages[mid] = _message(mid, model, _ref(model), COMMAND_HEADERS,
                                 f"A {model}; the subject authenticates the sender (docs/publishing.md)")
        for form, address in ((f"team-{verb}", f"{P}.intake.{{team}}.{verb}"),
                              (f"user-{verb}", f"{P}.intake.{{team}}.user.{{user}}.{verb}"),
                              (f"operator-{verb}", f"{P}.intake.{{team}}.operator.{verb}")):
            key = f"intake-{form}"
            _channel(doc, key, address, f"{model} commands on stream GPUSCHED_INTAKE; JetStream answers with the "
                                        "intake sequence", {model: mid})
            _operation(doc, f"admission-receives-{form}", "receive", key,
                       f"Admission reads {model} from {address} and answers with events (or a dead letter)",
                       "platform")
    # Every event type, on its subject.
    for cls in ALL_EVENT_TYPES:
        name = cls.model_fields["type"].default
        param = AGGREGATE_PARAMETER[cls.aggregate]
        address = f"{P}.{cls.aggregate}.{{{param}}}.{subject_suffix(name)}"
        mid = f"event.{name}"
        messages[mid] = _message(mid, name, _ref(name), EVENT_HEADERS,
                                 (cls.__doc__ or name).strip().splitlines()[0])
        key = f"event-{name}"
        _channel(doc, key, address, f"{name} events on stream GPUSCHED_EVENTS, published by {PRODUCERS[name]}",
                 {name: mid})
        _operation(doc, f"{PRODUCERS[name]}-sends-{name}", "send", key, f"{PRODUCERS[name]} publishes {name}",
                   "platform")
    # What a team reads on its own subjects (stream GPUSCHED_TENANT_<team>).
    for key, address, model, summary in (
            ("tenant-notify", f"{P}.tenant.{{team}}.notify.{{job_id}}.{{kind}}", JobNotification,
             "What happened to one of the team's jobs, as a notification (webhooks get the same body)"),
            ("tenant-delivery", f"{P}.tenant.{{team}}.delivery.{{job_id}}", NotificationDelivery,
             "The outcome of each webhook delivery of a notification")):
        mid = f"tenant.{model.__name__}"
        messages[mid] = _message(mid, model.__name__, _ref(model.__name__), {"type": "object", "properties": TRACE},
                                 summary)
        _channel(doc, key, address, f"{summary}; stream GPUSCHED_TENANT_<team>", {model.__name__: mid})
        _operation(doc, f"notifier-sends-{key}", "send", key, summary, "platform")
    mid = "tenant.job-event"
    messages[mid] = _message(mid, "Job event copy", {"oneOf": [_ref(c.__name__) for c in ALL_EVENT_TYPES
                                                               if c.aggregate == "job"]},
                             EVENT_HEADERS, "A copy of one of the team's job events: the same bytes and headers")
    _channel(doc, "tenant-job", f"{P}.tenant.{{team}}.job.{{job_id}}.{{verb}}",
             "Copies of every event of the team's jobs (the last token is the event's subject token); stream "
             "GPUSCHED_TENANT_<team>", {"JobEvent": mid})
    doc["channels"]["tenant-job"]["parameters"]["verb"] = {"description": "The event's subject token, e.g. admitted"}
    _operation(doc, "notifier-sends-tenant-job", "send", "tenant-job", "The notifier copies each job event to its team",
               "platform")
    mid = "deadletter"
    messages[mid] = _message(mid, "Dead letter", {"description": "The refused message's bytes, unchanged"},
                             DEAD_LETTER_HEADERS, "A message a service could not take, with the reason")
    _channel(doc, "deadletter", f"{P}.deadletter.{{service}}", "Poison messages on stream GPUSCHED_DLQ",
             {"DeadLetter": mid})
    _operation(doc, "services-send-deadletters", "send", "deadletter", "A service dead-letters a message", "platform")
    mid = "tenant.CommandRefused"
    messages[mid] = _message(mid, "CommandRefused", _ref("CommandRefused"), {"type": "object", "properties": TRACE},
                             "A command of the team that admission could not read or take, with the reason")
    _channel(doc, "tenant-refused", f"{P}.tenant.{{team}}.refused.{{intake_sequence}}",
             "The team's commands admission refused unread, under the intake sequence their JetStream ack gave; "
             "stream GPUSCHED_TENANT_<team>", {"CommandRefused": mid})
    _operation(doc, "notifier-sends-tenant-refused", "send", "tenant-refused",
               "The notifier copies each dead-lettered command of a team to the team", "platform")
    return doc


def _message_id(channel: dict[str, Any]) -> str:
    (ref,) = channel["messages"].values()
    return urllib.parse.unquote(ref["$ref"].rsplit("/", 1)[1])  # FastStream's refs are URL-encoded


def rendered() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    return write_or_check({OUT: rendered()}, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
