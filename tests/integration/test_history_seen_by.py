"""A job's history as the API and the console read it for a member (gpusched.gateway.history.
job_events with ``seen_by``), against a real nats-server: another team's job that preempted the
member's is never named; the team's own is; an operator reads the log as it is."""

from __future__ import annotations

from gpusched.gateway import history
from runtime import eventlog
from schemas.tenant import OTHER_TEAMS_JOB
from tests.unit.builders import preempted, preemption_requested, spec, submitted


async def test_a_member_reads_its_history_without_another_teams_job(admin_js):
    log = eventlog.EventLog(admin_js)
    await log.append(submitted("a-long", spec(team="team-a")))
    await log.append(submitted("a-urgent", spec(team="team-a")))
    await log.append(submitted("b-job", spec(team="team-b")))
    await log.append(preemption_requested("a-long", "a-urgent", attempt=1))
    await log.append(preemption_requested("a-long", "b-job", attempt=2))
    await log.append(preempted("a-long", attempt=2, by="b-job"))

    def named(events):
        return [getattr(e, "for_job", None) or getattr(e, "preempted_by", None) for _, e in events][1:]
    assert named(await history.job_events(admin_js, "a-long", seen_by="team-a")) == [
        "a-urgent", OTHER_TEAMS_JOB, OTHER_TEAMS_JOB]
    assert named(await history.job_events(admin_js, "a-long")) == ["a-urgent", "b-job", "b-job"]  # an operator's
    seqs = [s for s, _ in await history.job_events(admin_js, "a-long")]
    assert [s for s, _ in await history.job_events(admin_js, "a-long", seen_by="team-a")] == seqs
