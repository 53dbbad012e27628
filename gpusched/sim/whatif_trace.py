"""An Alibaba-format trace (the openb layout, gpusched/sim/trace.py) as a what-if recording: the
trace's tasks are the submissions, its nodes the cluster, and what the trace recorded (each
task's wait until ``scheduled_time`` and its run until ``deletion_time``) the actual column.

The trace has no teams or queues; its ``qos`` column is the closest thing, so each class of
service is a team (``ls``, ``be``, ``burstable``, ``guaranteed``; ``other`` without one) with a
priority class (LS → ``inference-sla``, Guaranteed → ``deadline-training``, Burstable →
``training``, BE → ``batch-low``), all in one queue ``trace`` whose quota is not the limit (the
scheduler's placement is what the replay measures, as in ``gpusched sim``). A changes file can
change the classes, split the queue's quota, or preemption. Tasks that never ran in the trace are
left out. Costs are 0: a trace has no price book."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from gpusched.sim import trace as tracesim
from gpusched.sim.whatif import Recording, Run, JobOutcome
from schemas import FlavorQuota, JobSpec, JobSubmitted, QueueConfigured, new_event

QOS_TEAMS = {"LS": ("ls", "inference-sla"), "Guaranteed": ("guaranteed", "deadline-training"),
             "Burstable": ("burstable", "training"), "BE": ("be", "batch-low")}
OTHER = ("other", "training")
QUEUE = "trace"


def recording(directory: Path, limit: int | None = None) -> Recording:
    try:
        trace = tracesim.load_trace(directory)
    except (tracesim.TraceError, OSError) as err:
        raise tracesim.TraceError(f"--trace {directory}: {err}") from None
    if not trace.timed:
        raise tracesim.TraceError(f"--trace {directory}: the pod list has no time columns "
                                  f"({', '.join(tracesim.TIME_COLUMNS)}); a what-if replays arrivals and runtimes")
    tasks = [t for t in trace.tasks if t.runtime is not None and t.scheduled is not None][:limit]
    t0 = tracesim.T0
    rec = Recording()
    rec.nodes = {n.name: n for n in trace.nodes}
    teams = sorted({QOS_TEAMS.get(t.qos, OTHER)[0] for t in tasks})
    config = new_event(QueueConfigured, aggregate_id=QUEUE, producer="config", occurred_at=t0, key="trace",
                       name=QUEUE, allowed_teams=tuple(teams),
                       quotas=(FlavorQuota(flavor=tracesim.FLAVOR, nominal=1_000_000),))
    rec.add(0, config)
    for i, task in enumerate(tasks, start=1):
        team, klass = QOS_TEAMS.get(task.qos, OTHER)
        job_id = f"t{i:05d}"
        created = t0 + timedelta(seconds=task.created)
        spec = JobSpec(kind="batch", queue=QUEUE, team=team, priority_class=klass, image="trace",
                       gpus=task.gpus, gpu_milli=task.gpu_milli, cpu_millis=min(task.cpu_milli, 1_024_000),
                       memory_mib=task.memory_mib, gpu_models=task.models)
        rec.add(i, new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=created,
                             key="trace", spec=spec, submitter=team, intake_sequence=i))
        rec.runs[job_id] = [Run(float(task.runtime), None, 0)]  # type: ignore[arg-type]
        started = t0 + timedelta(seconds=task.scheduled)  # type: ignore[arg-type]
        job = JobOutcome(team, QUEUE, created, decision=("admitted", QUEUE))
        attempt = job.attempt(1)
        attempt.flavor, attempt.gpus = tracesim.FLAVOR, task.demand
        attempt.started_at, attempt.ended_at = started, started + timedelta(seconds=task.runtime)  # type: ignore[arg-type]
        job.first_start = started
        rec.actual.jobs[job_id] = job
        rec.last = max(rec.last or created, attempt.ended_at)
    rec.decisions_recorded = False
    return rec
