"""Accounting partitioned by team: which events a partition projects, and its position row.

With ``GPUSCHED_ACCOUNTING_PARTITIONS=N`` (default 1), N accounting processes share the
projection. Each reads the whole log in order and applies:

* partition ``k``: the events of the jobs whose team :func:`runtime.teams.partition_of` maps to
  ``k`` (every job event; a job's team is the one its first valid JobSubmitted before the event
  names: :class:`runtime.teams.TeamIndex`);
* partition 0 besides: everything that is not a job's (nodes, clusters, queues, cohorts, policy,
  teams, tokens, price books, statements, services and their replicas), and the events of a job
  no submission before them names a team for (a cancel of a job never submitted).

The rows a job's events write (``jobs``, ``attempts``, ``reservations``, ``checkpoints``,
``usage_ledger``, ``applied_events``) are keyed by the job, and its ledger row reads only its
own job's rows, so partitions do not write or read each other's rows and need no coordination
but their positions (but for the events of a job logged before its submission, which partition
0 writes: docs/accounting.md, "Limits").

Positions: partition ``k`` stores its position in ``projection_position`` under
:func:`projection_name` (partition 0 keeps ``read-models``, so one accounting going to several
goes on from where it was), each row tagged with N. The read models are complete up to the
lowest of those rows (:func:`services.accounting.sink.complete_position`), which is the position
readers see (queries, statements, metrics). When N changes, partition 0 moves every row to that
lowest position (:func:`services.accounting.sink.claim`; another partition waits for it): each
partition reads again from there, and what was applied already is passed over by event id.
Every batch checks that the rows still say N, so a process left running with another N stops
applying and claims its partition again instead of applying a team twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from runtime import eventlog
from runtime.settings import ConfigError
from runtime.teams import MAX_READING_PARTITIONS, TeamIndex, partition_from_env, partition_of
from schemas import Event, JobSubmitted
from schemas.registry import subject_parts, subject_token

if TYPE_CHECKING:
    from services.accounting.pipeline import Converted

MAX_PARTITIONS = MAX_READING_PARTITIONS
"""Most accounting partitions: each holds one of the accounting credential's reader consumers
while it follows the log."""

FAMILY = "read-models"
"""Partition 0's position row (the unpartitioned one's); partition k's is ``read-models/p<k>``."""


def projection_name(partition: int) -> str:
    return FAMILY if partition == 0 else f"{FAMILY}/p{partition}"


@dataclass(frozen=True)
class Partitioning:
    partitions: int = 1  # GPUSCHED_ACCOUNTING_PARTITIONS
    partition: int = 0  # GPUSCHED_ACCOUNTING_PARTITION: this process's share

    def __post_init__(self) -> None:
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ConfigError(f"GPUSCHED_ACCOUNTING_PARTITIONS={self.partitions} is out of range; "
                              f"accepted: 1..{MAX_PARTITIONS}")
        if not 0 <= self.partition < self.partitions:
            raise ConfigError(f"GPUSCHED_ACCOUNTING_PARTITION={self.partition} is out of range; accepted: 0.."
                              f"{self.partitions - 1} (GPUSCHED_ACCOUNTING_PARTITIONS={self.partitions})")

    @classmethod
    def from_env(cls) -> "Partitioning":
        return cls(*partition_from_env("GPUSCHED_ACCOUNTING_PARTITIONS", "GPUSCHED_ACCOUNTING_PARTITION"))

    @property
    def projection(self) -> str:
        return projection_name(self.partition)

    @property
    def first(self) -> bool:
        """Partition 0: it also projects what is not a job's, dead-letters poison, issues
        statements and exports the read models' metrics."""
        return self.partition == 0

    def owns(self, team: str | None) -> bool:
        """Whether this partition applies a job's events of ``team`` (None: no team named: partition 0)."""
        if team is None:
            return self.first
        return self.partitions == 1 or partition_of(team, self.partitions) == self.partition


class Share:
    """One partition's share of the log, worked out per message: :meth:`skip` before parsing
    (from the subject and the teams remembered), :meth:`owned` after it (looking a job's team up
    in the log when it is not remembered), :meth:`dead_letters` for the poison."""

    def __init__(self, partitioning: Partitioning, teams: TeamIndex) -> None:
        self.partitioning, self.teams = partitioning, teams

    def skip(self, subject: str, sequence: int) -> bool:
        """Whether the message (``subject``, at ``sequence``) is surely another partition's, so
        that it need not be parsed: not a job's and this is not partition 0, or a job's whose team
        is remembered, as named before it, and another partition's. A JobSubmitted is always
        parsed: every partition learns its job's team from it (:meth:`seen`)."""
        p = self.partitioning
        if p.partitions == 1 or (parts := subject_parts(subject)) is None:
            return False  # unpartitioned, or not an event's subject (parsed, and poison)
        kind, token, suffix = parts
        if kind != "job":
            return not p.first
        if suffix == "submitted":
            return False
        team = self.teams.cached(kind, token, before=sequence)
        return team is not None and not p.owns(team)

    def seen(self, event: Event, sequence: int) -> None:
        """An event parsed (at ``sequence``): a submission's team is remembered (before the next
        message is skipped or not)."""
        if self.partitioning.partitions > 1 and isinstance(event, JobSubmitted):
            self.teams.remember("job", subject_token(event.aggregate_id), event.spec.team, sequence)

    async def owned(self, converted: "Converted") -> list[bool]:
        """For each entry of a converted batch, whether this partition applies it; a job's event
        by its team as named before it. An entry without an event (poison, or skipped) has no
        operations: kept or not, it only moves the position."""
        p = self.partitioning
        if p.partitions == 1:
            return [True] * len(converted.entries)
        out = []
        for entry, event in zip(converted.entries, converted.events, strict=True):
            if event is None or type(event).aggregate != "job":
                out.append(p.first)
            else:
                out.append(p.owns(await self.teams.team_of(event, entry[0])))
        return out

    async def dead_letters(self, poison: Sequence[tuple[Msg, str]]) -> list[tuple[Msg, str]]:
        """The poison this partition dead-letters: a message on a job's subject by the partition
        of the job's team (which never skips it), any other by partition 0; so each once."""
        p = self.partitioning
        if p.partitions == 1:
            return list(poison)
        mine = []
        for msg, reason in poison:
            parts = subject_parts(msg.subject)
            team = (await self.teams.lookup("job", parts[1], before=eventlog.sequence(msg))
                    if parts is not None and parts[0] == "job" else None)
            if p.owns(team):
                mine.append((msg, reason))
        return mine
