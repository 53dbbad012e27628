"""Which team an event belongs to, and which partition of a team-partitioned service reads it.

Services that scale out by team (the notifier, accounting) split the teams over N partitions with
:func:`partition_of`, the same in every process. An event names its team only when it carries a
spec (a submission, a service's deployment or update) or a rejection; every other event of a job
or a service is the team's its first valid first event before it names, which :class:`TeamIndex`
remembers or looks up in the log (direct gets on the first event's subject, from the start).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from nats.js.errors import NotFoundError

from runtime import eventlog
from runtime.settings import ConfigError, env_number, env_value
from schemas import Event, JobRejected, JobSubmitted
from schemas.registry import SUBJECT_PREFIX, parse_event, subject_token
from schemas.service import ServiceDeployed, ServiceUpdated
from schemas.tenant import E, counterpart, unnamed

MAX_PARTITIONS = 16
"""Most partitions of a team-partitioned service (their durables and position rows are named)."""

MAX_READING_PARTITIONS = eventlog.READER_SLOTS // 2
"""Most partitions of a service whose processes each hold one of its credential's reader
consumers (:data:`runtime.eventlog.READER_SLOTS`) while they read the log: accounting's, one
process a partition, leaves half for a process that restarts before the server has reaped its old
reader. Admission's processes (a partition's active and its standby) hold one only while they
fold what the log holds past their state (at start; a standby every third of its lease ttl): at
four partitions with a standby each they may take all eight at once, and a process finding none
free retries."""

_FIRST = {"job": "submitted", "service": "deployed"}  # the subject token of an aggregate's first event


def partition_from_env(count_var: str, index_var: str) -> tuple[int, int]:
    """(partitions, this process's partition) from the environment. With several partitions the
    index must be given: unset or empty (a StatefulSet's pod-index label, which Kubernetes sets
    from 1.28 on, missing) would make every process partition 0."""
    partitions = int(env_number(count_var, 1, minimum=1, maximum=MAX_PARTITIONS, integer=True))
    if partitions > 1 and env_value(index_var) is None:
        raise ConfigError(f"{index_var} is not set; accepted: this process's partition, 0..{partitions - 1} "
                          f"({count_var}={partitions}; in Kubernetes, the pod index label of a StatefulSet's "
                          "pod, apps.kubernetes.io/pod-index, set from Kubernetes 1.28)")
    return partitions, int(env_number(index_var, 0, minimum=0, maximum=MAX_PARTITIONS - 1, integer=True))


async def partition_durables(js, *, stream: str, name: Callable[[int], str], partitions: int, partition: int,
                             most: int = MAX_PARTITIONS, **config) -> None:
    """Make the durables of a team-partitioned service's partitions that one process needs before
    it passes over (acknowledges) another partition's message: partition 0 its own and every
    other partition's, partition k its own (in case it starts first). ``name(k)`` is partition
    k's durable (of at most ``most`` partitions: its credential's); ``config`` goes to
    :func:`runtime.eventlog.ensure_durable`.

    A new durable of partition k > 0 starts after what partition 0's has acknowledged (where
    partition 0's would start when it has none either), so none of partition k's messages that
    partition 0 passed over is missing from it. Each is tagged with the partitioning it was made
    for; one tagged for another partitioning is made again, and partition 0 deletes those of
    partitions past the count: a durable left from an earlier count would hand its partition
    the messages of that time again (2 -> 1 -> 2 partitions). One without a tag (made by a
    release before the tags) is taken as made for this partitioning, so that an upgrade keeps
    each partition's position. The count is changed with the service stopped and every
    partition's durable caught up, so that every durable starts at the same point: a partition
    behind the others would otherwise lose what partition 0 passed over (docs/operations.md)."""
    try:
        start = (await js.consumer_info(stream, name(0))).ack_floor.stream_seq + 1
    except NotFoundError:
        start = None
    if partition == 0:
        for k in range(partitions, most):
            try:
                await js.delete_consumer(stream, name(k))
            except NotFoundError:
                pass
    for k in range(1, partitions) if partition == 0 else [partition]:
        tag = str(Partition(partitions, k))
        try:
            made_for = (await js.consumer_info(stream, name(k))).config.description
            if made_for is not None and made_for != tag:
                await js.delete_consumer(stream, name(k))
        except NotFoundError:
            pass
        await eventlog.ensure_durable(js, stream=stream, durable=name(k), start_seq=start, description=tag, **config)


def partition_of(team: str, partitions: int) -> int:
    """The partition (0 .. partitions-1) that owns ``team``: the same in every process and version."""
    return int.from_bytes(hashlib.sha256(team.encode()).digest()[:8], "big") % partitions


@dataclass(frozen=True)
class Partition:
    """One partition of a team-partitioned service: the teams :func:`partition_of` maps to
    ``index`` of ``count`` (every team with one partition)."""

    count: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"partition {self.index} of {self.count}: accepted 0..{self.count - 1}")

    def owns(self, team: str) -> bool:
        return self.count == 1 or partition_of(team, self.count) == self.index

    def __str__(self) -> str:
        return f"partition {self.index} of {self.count}"


def named_team(event: Event) -> str | None:
    """The team an event itself names (a submission, a rejection of a command, a service's spec);
    None: the job's JobSubmitted (the service's ServiceDeployed) names it."""
    if isinstance(event, (JobSubmitted, ServiceDeployed, ServiceUpdated)):
        return event.spec.team
    if isinstance(event, JobRejected):
        return event.team
    return None


class TeamIndex:
    """Job and service -> team, as the log says it up to a point: the team its first valid first
    event (a JobSubmitted, a ServiceDeployed) names, if that event comes before the point. Teams
    are remembered with the sequence of the event that named them (at most ``size``, least
    recently used out), otherwise looked up in the log. Keyed by the aggregate kind and its
    subject token (:func:`schemas.registry.subject_token`), so that a message's subject is enough
    to ask before its payload is parsed. Two processes asking about the same point get the same
    answer, whatever each has seen or remembered."""

    def __init__(self, js, size: int = 100_000) -> None:
        self.js, self.size = js, size
        self._teams: OrderedDict[tuple[str, str], tuple[str, int]] = OrderedDict()  # -> (team, its sequence)

    def remember(self, kind: str, token: str, team: str, sequence: int) -> None:
        """``team`` as named at ``sequence`` (an earlier naming stays)."""
        key = (kind, token)
        known = self._teams.get(key)
        if known is None or sequence < known[1]:
            self._teams[key] = (team, sequence)
        self._teams.move_to_end(key)
        while len(self._teams) > self.size:
            self._teams.popitem(last=False)

    def cached(self, kind: str, token: str, before: int | None = None) -> str | None:
        """The team remembered for the aggregate as named before sequence ``before`` (None: at
        any point), without asking the log."""
        known = self._teams.get((kind, token))
        return known[0] if known is not None and (before is None or known[1] < before) else None

    async def lookup(self, kind: str, token: str, before: int | None = None) -> str | None:
        """The team of a job or a service as named before sequence ``before`` (None: at any point),
        remembered or looked up in the log: its first event's subject is read from the start, past
        anything that is not a valid first event naming a team. None for another kind, or when
        no such event comes before the point."""
        if kind not in _FIRST:
            return None
        if (team := self.cached(kind, token, before)) is not None:
            return team
        subject, seq = f"{SUBJECT_PREFIX}.{kind}.{token}.{_FIRST[kind]}", 1
        while True:
            try:
                raw = await self.js.get_msg(eventlog.EVENTS_STREAM, seq=seq, subject=subject, next=True, direct=True)
            except NotFoundError:
                return None
            if before is not None and raw.seq >= before:
                return None
            try:
                team = named_team(parse_event(raw.data))
            except ValueError:  # poison on the first event's subject names nobody
                team = None
            if team is not None:
                self.remember(kind, token, team, raw.seq)
                return team
            seq = raw.seq + 1

    async def team_of(self, event: Event, sequence: int | None = None) -> str | None:
        """The team of ``event`` (at ``sequence`` in the log; None: not known) by its job or service;
        None when neither it nor an earlier first event of its aggregate names one (an event of a
        job never submitted, of another aggregate)."""
        kind = type(event).aggregate
        if (team := named_team(event)) is not None:
            if isinstance(event, (JobSubmitted, ServiceDeployed)) and sequence is not None:
                self.remember(kind, subject_token(event.aggregate_id), team, sequence)
            return team
        return await self.lookup(kind, subject_token(event.aggregate_id), sequence)

    async def as_seen_by(self, event: E, team: str) -> E:
        """``event`` as ``team`` may read it: when the other job it names (a preemption's or a
        reclaim's, :func:`schemas.tenant.counterpart`) is not known to be ``team``'s, that job and
        its queue are unnamed (:func:`schemas.tenant.unnamed`)."""
        job = counterpart(event)
        if job is None or await self.lookup("job", subject_token(job)) == team:
            return event
        return unnamed(event)
