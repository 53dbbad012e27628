"""Queue, cohort, team and policy configuration as a file (queues.yaml): what the log has now,
what a file changes, and the events that make the log equal the file (``gpusched apply``).

The policy (schemas.priority.PolicyConfigured) is two optional sections: ``priority_classes``
(the whole list of classes: a class the file omits is retired) and ``preemption_limits`` (the
global preemption rate limit). A file with neither leaves the policy as it is; a file with one
keeps the other as the log has it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext
from pydantic import BaseModel, ConfigDict, Field

from gpusched.userinput import CHECKED_AT, UserError, checked, field_path, read_document, validate
from runtime import eventlog
from schemas import (
    DEFAULT_PRIORITY_CLASSES,
    POLICY_ID,
    CohortConfigured,
    Event,
    PolicyConfigured,
    PreemptionRateLimit,
    PriorityClass,
    QueueConfigured,
    QueueDeleted,
    TeamConfigured,
    new_event,
    parse_event,
)
from schemas.registry import SUBJECT_PREFIX


NAME_MAX = 63
"""Longest queue or cohort name (schemas.envelope.NAME_PATTERN's limit), checked first."""


class QueueSpec(BaseModel):
    """One queue in queues.yaml: the QueueConfigured fields without the envelope."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=NAME_MAX)
    cohort: str | None = None
    allowed_teams: list[str] = Field(default_factory=list)
    allowed_users: list[str] = Field(default_factory=list)
    allowed_priority_classes: list[str] = Field(default_factory=list)
    quotas: list[dict[str, Any]] = Field(default_factory=list)
    strict_fifo: bool = False
    budget: dict[str, Any] | None = None
    weighted_limit: float | None = None
    class_limits: list[dict[str, Any]] = Field(default_factory=list)
    preemption: dict[str, Any] = Field(default_factory=dict)


class CohortSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=NAME_MAX)
    parent: str | None = None
    usage_half_life_seconds: float | None = None
    history_weight: float = 0.5

    def same_as(self, event: CohortConfigured) -> bool:
        return (self.parent, self.usage_half_life_seconds, self.history_weight) == (
            event.parent, event.usage_half_life_seconds, event.history_weight)


class TeamSpec(BaseModel):
    """A team's settings: where its jobs' notifications go (schemas.notify.NotifySpec)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=NAME_MAX)
    notify: dict[str, Any] = Field(default_factory=dict)


class QueuesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    priority_classes: list[PriorityClass] | None = Field(default=None, min_length=1, max_length=64)
    preemption_limits: PreemptionRateLimit | None = None
    cohorts: list[CohortSpec] = Field(default_factory=list)
    queues: list[QueueSpec] = Field(default_factory=list)
    teams: list[TeamSpec] = Field(default_factory=list)


def _config_payload(event: QueueConfigured) -> dict[str, Any]:
    return event.model_dump(mode="json", exclude={"event_id", "occurred_at", "producer", "causation_id",
                                                   "correlation_id", "aggregate_id", "schema_version", "type"})


@dataclass
class QuotaConfig:
    """The queue and cohort configuration as the log has it now."""

    queues: dict[str, QueueConfigured]
    cohorts: dict[str, CohortConfigured]
    teams: dict[str, TeamConfigured] = field(default_factory=dict)
    policy: PolicyConfigured | None = None  # None: none applied yet (the built-in classes hold)

    def classes(self) -> dict[str, PriorityClass]:
        """The priority classes in force."""
        if self.policy is None:
            return dict(DEFAULT_PRIORITY_CLASSES)
        return {pc.name: pc for pc in self.policy.priority_classes}


def fold(events: Iterable[Event]) -> QuotaConfig:
    """The queue, cohort, team and policy configuration that ``events`` (in log order) leave;
    other events change nothing."""
    config = QuotaConfig({}, {})
    for event in events:
        if isinstance(event, PolicyConfigured):
            config.policy = event
        elif isinstance(event, TeamConfigured):
            config.teams[event.name] = event
        elif isinstance(event, QueueConfigured):
            config.queues[event.name] = event
        elif isinstance(event, QueueDeleted):
            config.queues.pop(event.name, None)
        elif isinstance(event, CohortConfigured):
            config.cohorts[event.name] = event
    return config


async def current_queues(js: JetStreamContext) -> QuotaConfig:
    """The configuration the log holds now."""
    subjects = [f"{SUBJECT_PREFIX}.{aggregate}.>" for aggregate in ("queue", "cohort", "team", "policy")]
    return fold([parse_event(msg.data) async for msg in eventlog.read(js, subjects=subjects)])


def describe_change(event: Event, config: QuotaConfig) -> str:
    """What an apply event changes, field by field (quotas matched by flavor)."""
    if isinstance(event, QueueDeleted):
        return "deleted"
    if isinstance(event, PolicyConfigured):
        return _describe_policy(event, config)
    if isinstance(event, TeamConfigured):
        old = config.teams.get(event.name)
        return "new" if old is None else f"notify: {old.notify.model_dump(mode='json')} → {event.notify.model_dump(mode='json')}"
    if isinstance(event, CohortConfigured):
        old = config.cohorts.get(event.name)
        if old is None:
            return "new"
        return "; ".join(f"{f}: {getattr(old, f)} → {getattr(event, f)}"
                         for f in ("parent", "usage_half_life_seconds", "history_weight")
                         if getattr(old, f) != getattr(event, f))
    old = config.queues.get(event.aggregate_id)
    if old is None:
        return "new"
    before, after = _config_payload(old), _config_payload(event)
    changes = []
    for field_name in sorted(set(before) | set(after)):
        if field_name == "quotas":
            b = {q["flavor"]: q for q in before.get("quotas", [])}
            a = {q["flavor"]: q for q in after.get("quotas", [])}
            for flavor in sorted(set(b) | set(a)):
                if flavor not in a:
                    changes.append(f"quotas[{flavor}]: removed")
                elif flavor not in b:
                    changes.append(f"quotas[{flavor}]: added {a[flavor]}")
                else:
                    changes += [f"quotas[{flavor}].{k}: {b[flavor].get(k)} → {a[flavor].get(k)}"
                                for k in sorted(a[flavor]) if a[flavor].get(k) != b[flavor].get(k)]
        elif before.get(field_name) != after.get(field_name):
            changes.append(f"{field_name}: {before.get(field_name)} → {after.get(field_name)}")
    return "; ".join(changes)


def _describe_policy(event: PolicyConfigured, config: QuotaConfig) -> str:
    before = {name: pc.model_dump(mode="json") for name, pc in config.classes().items()}
    after = {pc.name: pc.model_dump(mode="json") for pc in event.priority_classes}
    changes = []
    for name in sorted(set(before) | set(after)):
        if name not in after:
            changes.append(f"priority_classes[{name}]: retired")
        elif name not in before:
            changes.append(f"priority_classes[{name}]: added {after[name]}")
        else:
            changes += [f"priority_classes[{name}].{k}: {before[name][k]} → {after[name][k]}"
                        for k in after[name] if before[name].get(k) != after[name][k]]
    old_limits = (config.policy.preemption if config.policy is not None else None)
    if old_limits is None:
        changes.append(f"preemption_limits: {event.preemption.model_dump(mode='json')}")
    else:
        changes += [f"preemption_limits.{k}: {getattr(old_limits, k)} → {getattr(event.preemption, k)}"
                    for k in PreemptionRateLimit.model_fields if getattr(old_limits, k) != getattr(event.preemption, k)]
    return "; ".join(changes) or "unchanged"


def parse_queues(document: Any, source: str | Path) -> QueuesFile:
    """A queues file's document, checked down to the events it makes; UserError naming the file
    and the field."""
    parsed = validate(QueuesFile, document, source)
    names = [q.name for q in parsed.queues]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise UserError(f"{source}: queues: name(s) {dupes} appear more than once; each queue once")
    for i, c in enumerate(parsed.cohorts):
        checked(lambda: _cohort_event(c, CHECKED_AT), f"{source}: cohorts[{i}] ({field_path([c.name])})")
    if parsed.priority_classes is not None:
        checked(lambda: _policy_event(parsed.priority_classes, PreemptionRateLimit(), CHECKED_AT),
                f"{source}: priority_classes")
    for i, q in enumerate(parsed.queues):
        checked(lambda: _queue_probe(q, CHECKED_AT), f"{source}: queues[{i}] ({field_path([q.name])})")
    if parsed.priority_classes is not None:
        _check_allowed_classes(parsed.queues, {pc.name for pc in parsed.priority_classes}, f"{source}: queues")
    teams = [t.name for t in parsed.teams]
    if dupes := sorted({n for n in teams if teams.count(n) > 1}):
        raise UserError(f"{source}: teams: name(s) {dupes} appear more than once; each team once")
    for i, t in enumerate(parsed.teams):
        checked(lambda: _team_event(t, CHECKED_AT), f"{source}: teams[{i}] ({field_path([t.name])})")
    return parsed


def read_queues(path: Path) -> QueuesFile:
    return parse_queues(read_document(path), path)


def plan(parsed: QueuesFile, config: QuotaConfig, now: datetime, prune: bool = False) -> list[Event]:
    """The events that make the log's queue and cohort configuration equal ``parsed``: changed
    or new cohorts first, then queues; with ``prune``, QueueDeleted for queues the file lacks."""
    out: list[Event] = []
    if (policy := _planned_policy(parsed, config, now)) is not None:
        out.append(policy)  # first: the queues below may name the classes it adds
    classes = ({pc.name for pc in policy.priority_classes} if policy is not None else set(config.classes()))
    _check_allowed_classes(parsed.queues, classes, "queues")
    kept = [QueueSpec(name=q.name, allowed_priority_classes=list(q.allowed_priority_classes),
                      class_limits=[limit.model_dump() for limit in q.class_limits])
            for name, q in sorted(config.queues.items()) if name not in {p.name for p in parsed.queues} and not prune]
    _check_allowed_classes(kept, classes, "queues in the log that the file does not list")
    out += [_cohort_event(c, now) for c in parsed.cohorts
            if (old := config.cohorts.get(c.name)) is None or not c.same_as(old)]
    for q in parsed.queues:
        probe = _queue_probe(q, now)
        existing = config.queues.get(q.name)
        if existing is not None and _config_payload(existing) == _config_payload(probe):
            continue
        digest = json.dumps(_config_payload(probe), sort_keys=True)
        out.append(new_event(QueueConfigured, aggregate_id=q.name, producer="config", occurred_at=now,
                             key=f"{digest}@{now.isoformat()}", **q.model_dump()))
    for t in parsed.teams:
        event = _team_event(t, now)
        if (old := config.teams.get(t.name)) is None or old.notify != event.notify:
            out.append(event)
    if prune:
        for name in sorted(config.queues.keys() - {q.name for q in parsed.queues}):
            out.append(new_event(QueueDeleted, aggregate_id=name, producer="config", occurred_at=now,
                                 key=now.isoformat(), name=name))
    return out


def plan_queues(path: Path, config: QuotaConfig, now: datetime, prune: bool = False) -> list[Event]:
    """:func:`plan` for the queues file at ``path``."""
    return plan(read_queues(path), config, now, prune)


def _policy_event(classes: list[PriorityClass], limits: PreemptionRateLimit, now: datetime) -> PolicyConfigured:
    payload = {"priority_classes": [pc.model_dump(mode="json") for pc in classes],
               "preemption": limits.model_dump(mode="json")}
    return new_event(PolicyConfigured, aggregate_id=POLICY_ID, producer="config", occurred_at=now,
                     key=f"{json.dumps(payload, sort_keys=True)}@{now.isoformat()}",
                     priority_classes=tuple(classes), preemption=limits)


def _planned_policy(parsed: QueuesFile, config: QuotaConfig, now: datetime) -> PolicyConfigured | None:
    """The PolicyConfigured the file asks for, or None when it changes nothing: the file's
    sections, and for a section it omits, what the log has (or the built-in default)."""
    if parsed.priority_classes is None and parsed.preemption_limits is None:
        return None
    current = config.policy
    classes = parsed.priority_classes or list(config.classes().values())
    limits = parsed.preemption_limits or (current.preemption if current is not None else PreemptionRateLimit())
    if current is not None and list(current.priority_classes) == classes and current.preemption == limits:
        return None
    return _policy_event(classes, limits, now)


def _check_allowed_classes(queues: list[QueueSpec], classes: set[str], where: str) -> None:
    """Every class a queue admits or limits must be in force: a queue cannot name a retired class."""
    for q in queues:
        named = {"allowed_priority_classes": set(q.allowed_priority_classes),
                 "class_limits": {str(limit.get("priority_class")) for limit in q.class_limits}}
        for field_name, names in named.items():
            if missing := sorted(names - classes):
                raise UserError(f"{where}: queue {q.name!r} {field_name} names {missing}, which the priority "
                                f"classes in force do not define; accepted: {', '.join(sorted(classes))} "
                                "(or add the class to priority_classes)")


def _cohort_event(c: CohortSpec, now: datetime) -> CohortConfigured:
    return new_event(CohortConfigured, aggregate_id=c.name, producer="config", occurred_at=now,
                     key=f"{c.model_dump_json()}@{now.isoformat()}", **c.model_dump())


def _team_event(t: TeamSpec, now: datetime) -> TeamConfigured:
    return new_event(TeamConfigured, aggregate_id=t.name, producer="config", occurred_at=now,
                     key=f"{t.model_dump_json()}@{now.isoformat()}", name=t.name, notify=t.notify)


def _queue_probe(q: QueueSpec, now: datetime) -> QueueConfigured:
    """The queue's QueueConfigured without its id (which is derived from this payload)."""
    return QueueConfigured(event_id="pending", aggregate_id=q.name, occurred_at=now, producer="config",
                           **q.model_dump())

