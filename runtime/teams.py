"""Which team an event belongs to, and which partition of a team-partitioned service reads it.

Services that scale out by team (the notifier, accounting) split the teams over N partitions with
:func:`partition_of`, the same in every process. An event names its team only when it carries a
spec (a submission, a service's deployment or update) or a rejection; every other event of a job
or a service is the team's of its first event, which :class:`TeamIndex` looks up in the log (a
direct get of the last message on the first event's subject) and remembers.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from nats.js.errors import NotFoundError

from runtime import eventlog
from schemas import Event, JobRejected, JobSubmitted
from schemas.registry import SUBJECT_PREFIX, parse_event, subject_token
from schemas.service import ServiceDeployed, ServiceUpdated

MAX_PARTITIONS = 16
"""Most partitions of a team-partitioned service (their durables and position rows are named)."""

_FIRST = {"job": "submitted", "service": "deployed"}  # the subject token of an aggregate's first event


def partition_of(team: str, partitions: int) -> int:
    """The partition (0 .. partitions-1) that owns ``team``: the same in every process and version."""
    return int.from_bytes(hashlib.sha256(team.encode()).digest()[:8], "big") % partitions


def named_team(event: Event) -> str | None:
    """The team an event itself names (a submission, a rejection of a command, a service's spec);
    None: the job's JobSubmitted (the service's ServiceDeployed) names it."""
    if isinstance(event, (JobSubmitted, ServiceDeployed, ServiceUpdated)):
        return event.spec.team
    if isinstance(event, JobRejected):
        return event.team
    return None


class TeamIndex:
    """Job and service -> team: remembered from the first events seen (at most ``size``, least
    recently used out), otherwise looked up in the log once. Keyed by the aggregate kind and its
    subject token (:func:`schemas.registry.subject_token`), so that a message's subject is
    enough to ask before its payload is parsed."""

    def __init__(self, js, size: int = 100_000) -> None:
        self.js, self.size = js, size
        self._teams: OrderedDict[tuple[str, str], str] = OrderedDict()

    def remember(self, kind: str, token: str, team: str) -> None:
        key = (kind, token)
        self._teams[key] = team
        self._teams.move_to_end(key)
        while len(self._teams) > self.size:
            self._teams.popitem(last=False)

    def cached(self, kind: str, token: str) -> str | None:
        """The team remembered for the aggregate, without asking the log."""
        return self._teams.get((kind, token))

    async def lookup(self, kind: str, token: str) -> str | None:
        """The team of a job or a service (its first event's), remembered or looked up in the
        log; None for another kind, or when the log has no first event naming one."""
        if kind not in _FIRST:
            return None
        if (team := self._teams.get((kind, token))) is not None:
            return team
        try:
            raw = await self.js.get_last_msg(eventlog.EVENTS_STREAM, f"{SUBJECT_PREFIX}.{kind}.{token}.{_FIRST[kind]}",
                                             direct=True)
        except NotFoundError:
            return None
        try:
            team = named_team(parse_event(raw.data))
        except ValueError:  # a poison message on the first event's subject names nobody
            return None
        if team is not None:
            self.remember(kind, token, team)
        return team

    async def team_of(self, event: Event) -> str | None:
        """The team of ``event``'s job or service; None when neither it nor the log's first event
        of its aggregate names one (an event of a job never submitted, of another aggregate)."""
        kind = type(event).aggregate
        if (team := named_team(event)) is not None:
            if isinstance(event, (JobSubmitted, ServiceDeployed)):
                self.remember(kind, subject_token(event.aggregate_id), team)
            return team
        return await self.lookup(kind, subject_token(event.aggregate_id))
