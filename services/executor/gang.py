"""One attempt, many gang members: how a backend that runs each member separately (a Kubernetes
Job, a local process per member) turns its members' statuses into the one :class:`Observation`
the lifecycle core takes. JobStarted needs the whole gang running; the first member to fail
fails the attempt."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from schemas import FailureReason
from services.executor.lifecycle import Observation, Phase, workload_name


@dataclass(frozen=True)
class MemberStatus:
    """One gang member as its backend classified it."""

    phase: Phase  # PENDING, RUNNING, SUCCEEDED or FAILED
    at: datetime | None = None
    started_at: datetime | None = None
    reason: FailureReason | None = None
    exit_code: int | None = None
    message: str = ""
    ready_at: datetime | None = None  # RUNNING: since when it passes its readiness check; None: not ready


def attempt_observation(job_id: str, attempt: int, members: list[MemberStatus | None], *, seen: list[bool],
                        started_in_log: bool, stopping: bool, now: datetime) -> Observation | None:
    """The attempt's status from its members' (None: that member does not exist).

    * every member missing: GONE when this process saw one before, when it is being
      stopped, or when the log says it started (it vanished while the executor was down);
      otherwise None (never created yet: create it);
    * a member seen before and now missing: FAILED (someone deleted it);
    * any member FAILED: FAILED, with the earliest failure;
    * every member SUCCEEDED: SUCCEEDED at the last finish;
    * every member RUNNING or SUCCEEDED: RUNNING (the whole gang runs) at the last start, ready
      once every running member is ready;
    * else PENDING.
    """
    obs = _aggregate(job_id, attempt, members, seen=seen, started_in_log=started_in_log, stopping=stopping, now=now)
    if stopping and obs is not None and obs.phase in (Phase.SUCCEEDED, Phase.FAILED, Phase.GONE):
        # A stopped attempt ends when the executor sees it end (not when, say, the Job controller
        # first called it failed, which is when the Pod's termination began).
        obs = Observation(obs.job_id, obs.attempt, obs.phase, max(now, obs.at), started_at=obs.started_at,
                          reason=obs.reason, exit_code=obs.exit_code, message=obs.message)
    return obs


def _aggregate(job_id: str, attempt: int, members: list[MemberStatus | None], *, seen: list[bool],
               started_in_log: bool, stopping: bool, now: datetime) -> Observation | None:
    if all(m is None for m in members):
        if any(seen) or stopping or started_in_log:
            return Observation(job_id, attempt, Phase.GONE, now, message="its workloads are gone")
        return None
    for i, m in enumerate(members):
        if m is None and seen[i]:
            return Observation(job_id, attempt, Phase.FAILED, now, reason=FailureReason.BACKEND_ERROR,
                               message=f"gang member {workload_name(job_id, attempt, i)} was deleted")
    present = [m for m in members if m is not None]
    starts = [m.started_at for m in present if m.started_at is not None]
    first_start = min(starts) if starts else None
    failed = [m for m in present if m.phase == Phase.FAILED]
    if failed:
        f = min(failed, key=lambda m: m.at or now)
        return Observation(job_id, attempt, Phase.FAILED, f.at or now, started_at=first_start, reason=f.reason,
                           exit_code=f.exit_code, message=f.message)
    if len(present) < len(members):
        return Observation(job_id, attempt, Phase.PENDING, now)
    if all(m.phase == Phase.SUCCEEDED for m in present):
        return Observation(job_id, attempt, Phase.SUCCEEDED, max(m.at or now for m in present),
                           started_at=first_start, exit_code=0)
    if all(m.phase in (Phase.RUNNING, Phase.SUCCEEDED) for m in present):
        gang_start = max((m.started_at or now) for m in present)
        ready = [m.ready_at for m in present if m.phase == Phase.RUNNING]
        ready_at = max(ready) if all(r is not None for r in ready) else None  # every member that runs is ready
        return Observation(job_id, attempt, Phase.RUNNING, gang_start, started_at=gang_start, ready_at=ready_at)
    return Observation(job_id, attempt, Phase.PENDING, now)
