"""Operations metrics from the read models, for the accounting service's Prometheus endpoint and
``gpusched metrics``: GPU capacity and allocation per flavor, measured GPU utilization and
allocated-but-idle GPU time (from NVML telemetry, where an executor reports it), wait p50/p95 per
queue, congestion (pending jobs, oldest pending age), failure reasons (top N), team usage and cost.

Computed on scrape (cached for a few seconds), from one read-only snapshot of the database, so
every scrape is consistent with itself. Fragmentation is the scheduler's
(``gpusched_scheduler_fragmentation_ratio{flavor}``, ``gpusched_scheduler_largest_placeable_gang{flavor}``).
Measured utilization comes from NodeTelemetryReported (the local executor's NVML windows); without
telemetry those metrics are absent, not 0. Nodes on Kubernetes are measured by NVIDIA's DCGM
exporter, which is scraped directly. The sim executor's modelled windows (``source`` ``simulated``)
are never counted as measured: they make the ``*_utilization_simulated_ratio`` gauges instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from schemas.jobstate import PLACED_STATES
from services.accounting import queries

TOP_FAILURES = 10
WAIT_WINDOW_S = queries.WAIT_WINDOW_S  # wait percentiles over attempts that started in the last day (log time)
TELEMETRY_WINDOW_S = 3600.0  # measured utilization over the telemetry windows of the last hour (clipped)
IDLE_BELOW = 0.05  # an allocated GPU whose mean utilization is below this sat idle

HELP = {
    "gpusched_gpu_capacity": ("GPUs on schedulable, not lost nodes", ("flavor",)),
    "gpusched_gpu_allocated": ("GPUs held by scheduled or running attempts", ("flavor",)),
    "gpusched_gpu_allocation_ratio": ("Allocated / capacity", ("flavor",)),
    "gpusched_team_gpu_allocated": ("GPUs held by a team's scheduled or running attempts", ("team", "flavor")),
    "gpusched_gpu_utilization_measured_ratio": (
        "Mean NVML utilization of the GPUs that reported telemetry in the last hour, time-weighted", ("flavor",)),
    "gpusched_node_gpu_utilization_measured_ratio": (
        "Mean NVML utilization of a node's GPUs over the last hour, time-weighted", ("flavor", "node")),
    "gpusched_gpu_utilization_simulated_ratio": (
        "Mean simulated utilization (the sim executor's model, not measured) of the GPUs it reported in the last "
        "hour, time-weighted", ("flavor",)),
    "gpusched_node_gpu_utilization_simulated_ratio": (
        "Mean simulated utilization (not measured) of a node's GPUs over the last hour, time-weighted",
        ("flavor", "node")),
    "gpusched_gpu_allocated_measured_seconds": (
        "GPU-seconds in the last hour that GPUs were allocated to attempts and measured", ("flavor",)),
    "gpusched_gpu_allocated_idle_seconds": (
        f"Of those, GPU-seconds whose mean utilization while allocated was below {IDLE_BELOW:g}", ("flavor",)),
    "gpusched_gpu_allocated_idle_ratio": ("Allocated-idle / allocated measured GPU-seconds, last hour", ("flavor",)),
    "gpusched_queue_wait_seconds": ("Wait from queued to started, attempts started in the last day",
                                    ("queue",)),
    "gpusched_queue_pending_jobs": ("Admitted jobs not placed yet, by what they wait for (quota or node)",
                                    ("queue", "waiting_for")),
    "gpusched_queue_oldest_pending_age_seconds": ("Age of the longest-waiting of them (since queued)",
                                                  ("queue", "waiting_for")),
    "gpusched_failed_jobs": (f"Failed jobs by reason (top {TOP_FAILURES})", ("reason",)),
    "gpusched_team_gpu_seconds": ("GPU-seconds in the usage ledger", ("team", "flavor")),
    "gpusched_team_cost": ("Cost of the usage ledger under the current price book", ("team", "currency")),
    "gpusched_accounting_read_model_sequence": ("Stream sequence the read models are at", ()),
    "gpusched_service_desired_replicas": ("Replicas an inference service should have (docs/serving.md)",
                                          ("service", "team")),
    "gpusched_service_replicas": ("An inference service's replicas by state: ready, starting (placed, not ready), "
                                  "pending (asked for, or lost and retrying)", ("service", "team", "state")),
    "gpusched_service_sla_breach": ("1 while fewer replicas are ready than desired (sum_over_time: breach time)",
                                    ("service", "team")),
    "gpusched_service_replica_ready_seconds": (
        "From a replica asked for (scale-up, replacement, rollout) to ready, replicas ready in the last day",
        ("service",)),
}


# Team cost in SQL (a scrape must not load the ledger): the same rule as chargeback.PriceBook —
# each attempt's interval split at the versions' effective times, the latest version logged for
# one effective time winning — for GPU, CPU and memory prices.
_TEAM_COST = """
    WITH latest AS (
        SELECT DISTINCT ON (effective_from) effective_from, gpu_prices, cpu_core_hour, memory_gib_hour
        FROM price_books WHERE name = 'default' ORDER BY effective_from, sequence DESC),
    v AS (
        SELECT *, coalesce(lead(effective_from) OVER (ORDER BY effective_from), 'infinity') AS until FROM latest)
    SELECT u.team, sum(
        greatest(0, extract(epoch FROM least(u.ended_at, v.until) - greatest(u.started_at, v.effective_from)))::float8
        / 3600.0 * (u.gpus * coalesce((v.gpu_prices ->> u.flavor)::float8, 0)
                    + CASE WHEN u.ended_at > u.started_at THEN
                        (u.cpu_core_seconds * coalesce(v.cpu_core_hour, 0)
                         + u.memory_gib_seconds * coalesce(v.memory_gib_hour, 0))
                        / extract(epoch FROM u.ended_at - u.started_at)::float8 ELSE 0 END)) AS cost
    FROM usage_ledger u JOIN v ON u.started_at < v.until AND u.ended_at > v.effective_from
    GROUP BY u.team ORDER BY u.team"""


# Telemetry windows overlapping (now - window, now], each weighted by its overlap in seconds; a
# GPU's allocated time in a window is the overlap times its share of samples taken while allocated.
_TELEMETRY = """
    WITH w AS (
        SELECT t.node, coalesce(n.gpu_flavor, '-') AS flavor, t.source, t.utilization, t.allocated_utilization,
               t.allocated_samples::float8 / t.samples AS allocated_share,
               greatest(0, extract(epoch FROM least(t.window_end, $1::timestamptz)
                                   - greatest(t.window_start, $1::timestamptz - make_interval(secs => $2))))::float8
                   AS seconds
        FROM gpu_telemetry t LEFT JOIN nodes n ON n.name = t.node
        WHERE t.window_end > $1::timestamptz - make_interval(secs => $2) AND t.window_start < $1::timestamptz)
    SELECT source, flavor, node, sum(seconds) AS seconds, sum(seconds * utilization) AS busy_seconds,
           sum(seconds * allocated_share) AS allocated_seconds,
           sum(CASE WHEN allocated_utilization < $3 THEN seconds * allocated_share ELSE 0 END) AS idle_seconds
    FROM w WHERE seconds > 0 GROUP BY source, flavor, node ORDER BY source, flavor, node"""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


async def gather(conn: asyncpg.Connection, now: datetime, *,
                 telemetry_window_s: float = TELEMETRY_WINDOW_S) -> list[Sample]:
    out: list[Sample] = []

    def add(name: str, value: float, **labels: str) -> None:
        out.append(Sample(name, tuple(labels.items()), float(value)))

    async with conn.transaction(isolation="repeatable_read", readonly=True):
        capacity = dict(await conn.fetch(
            "SELECT gpu_flavor, sum(gpu_count) FROM nodes WHERE NOT lost AND NOT unschedulable "
            "AND gpu_flavor IS NOT NULL GROUP BY 1"))
        allocated = dict(await conn.fetch(
            "SELECT flavor, sum(total_gpus * coalesce(gpu_milli, 1000) / 1000.0::float8) FROM jobs "
            "WHERE state = ANY($1::text[]) AND flavor IS NOT NULL AND finished_at IS NULL GROUP BY 1",
            list(PLACED_STATES)))
        team_allocated = await conn.fetch(
            "SELECT team, flavor, sum(total_gpus * coalesce(gpu_milli, 1000) / 1000.0::float8) AS gpus FROM jobs "
            "WHERE state = ANY($1::text[]) AND flavor IS NOT NULL AND finished_at IS NULL GROUP BY 1, 2 ORDER BY 1, 2",
            list(PLACED_STATES))
        waits = await queries.wait_percentiles(conn, by_queue=True, window_s=WAIT_WINDOW_S)
        pending = await queries.pending_by_queue(conn)
        failures = await conn.fetch(
            "SELECT reason, count(*) AS n FROM jobs WHERE state = 'failed' GROUP BY reason "
            "ORDER BY n DESC, reason LIMIT $1", TOP_FAILURES)
        team_usage = await conn.fetch(
            "SELECT team, flavor, sum(gpu_seconds) AS s FROM usage_ledger GROUP BY 1, 2 ORDER BY 1, 2")
        team_cost = await conn.fetch(_TEAM_COST)
        currency = await conn.fetchval(
            "SELECT currency FROM price_books WHERE name = 'default' AND effective_from <= $1 "
            "ORDER BY effective_from DESC, sequence DESC LIMIT 1", now)
        position = await queries.position(conn)
        services = await queries.services(conn)
        ready_in = await conn.fetch(
            """SELECT service, percentile_cont(0.5) WITHIN GROUP (ORDER BY s) AS p50,
                      percentile_cont(0.99) WITHIN GROUP (ORDER BY s) AS p99, count(*) AS n, sum(s) AS total
               FROM (SELECT service, extract(epoch FROM ready_at - requested_at)::float8 AS s FROM service_replicas
                     WHERE ready_at IS NOT NULL AND ready_at > (SELECT max(ready_at) FROM service_replicas)
                           - make_interval(secs => $1)) r
               GROUP BY service""", WAIT_WINDOW_S)
        telemetry = await conn.fetch(_TELEMETRY, now, telemetry_window_s, IDLE_BELOW)
    for flavor in sorted(set(capacity) | set(allocated)):
        cap, alloc = capacity.get(flavor) or 0, allocated.get(flavor) or 0
        add("gpusched_gpu_capacity", cap, flavor=flavor)
        add("gpusched_gpu_allocated", alloc, flavor=flavor)
        add("gpusched_gpu_allocation_ratio", alloc / cap if cap else 0.0, flavor=flavor)
    for r in team_allocated:
        add("gpusched_team_gpu_allocated", r["gpus"], team=r["team"], flavor=r["flavor"])
    for svc in services:
        who = {"service": svc["service"], "team": svc["team"]}
        add("gpusched_service_desired_replicas", svc["desired"], **who)
        for state in ("ready", "starting", "pending"):
            add("gpusched_service_replicas", svc[state], **who, state=state)
        add("gpusched_service_sla_breach", float(svc["ready"] < svc["desired"]), **who)
    for r in sorted(ready_in, key=lambda r: r["service"]):
        for q in ("0.5", "0.99"):
            add("gpusched_service_replica_ready_seconds", r["p50" if q == "0.5" else "p99"], service=r["service"],
                quantile=q)
        add("gpusched_service_replica_ready_seconds_count", r["n"], service=r["service"])
        add("gpusched_service_replica_ready_seconds_sum", r["total"], service=r["service"])
    _utilization(telemetry, add)
    for w in sorted(waits, key=lambda w: w.queue or ""):
        add("gpusched_queue_wait_seconds", w.p50, queue=w.queue, quantile="0.5")
        add("gpusched_queue_wait_seconds", w.p95, queue=w.queue, quantile="0.95")
        add("gpusched_queue_wait_seconds_count", w.n, queue=w.queue)
        add("gpusched_queue_wait_seconds_sum", w.total, queue=w.queue)
    for r in sorted(pending, key=lambda r: (r["queue"] or "", r["waiting_for"])):
        labels = {"queue": r["queue"] or "-", "waiting_for": r["waiting_for"]}
        add("gpusched_queue_pending_jobs", r["n"], **labels)
        age = max(0.0, (now - r["oldest"]).total_seconds()) if r["oldest"] else 0.0
        add("gpusched_queue_oldest_pending_age_seconds", age, **labels)
    for r in failures:
        add("gpusched_failed_jobs", r["n"], reason=r["reason"] or "-")
    for r in team_usage:
        add("gpusched_team_gpu_seconds", r["s"], team=r["team"], flavor=r["flavor"])
    for r in team_cost:
        add("gpusched_team_cost", r["cost"], team=r["team"], currency=currency or "USD")
    add("gpusched_accounting_read_model_sequence", position)
    return out


def _utilization(rows, add: Callable[..., None]) -> None:
    """Measured utilization per flavor and node, and allocated-idle GPU time per flavor, from NVML
    windows; simulated utilization per flavor and node from the sim executor's. Nothing at all
    without telemetry: absent, not 0."""
    simulated = [r for r in rows if r["source"] == "simulated"]
    rows = [r for r in rows if r["source"] != "simulated"]
    per_flavor: dict[str, list[float]] = {}
    for r in simulated:
        f = per_flavor.setdefault(r["flavor"], [0.0, 0.0])
        f[0], f[1] = f[0] + r["seconds"], f[1] + r["busy_seconds"]
    for flavor, (seconds, busy) in sorted(per_flavor.items()):
        add("gpusched_gpu_utilization_simulated_ratio", busy / seconds, flavor=flavor)
    for r in simulated:  # ordered by flavor, node
        add("gpusched_node_gpu_utilization_simulated_ratio", r["busy_seconds"] / r["seconds"], flavor=r["flavor"],
            node=r["node"])
    per_flavor = {}
    for r in rows:
        f = per_flavor.setdefault(r["flavor"], [0.0, 0.0, 0.0, 0.0])
        for i, k in enumerate(("seconds", "busy_seconds", "allocated_seconds", "idle_seconds")):
            f[i] += r[k]
    for flavor, (seconds, busy, allocated, idle) in sorted(per_flavor.items()):
        add("gpusched_gpu_utilization_measured_ratio", busy / seconds, flavor=flavor)
        add("gpusched_gpu_allocated_measured_seconds", allocated, flavor=flavor)
        add("gpusched_gpu_allocated_idle_seconds", idle, flavor=flavor)
        if allocated > 0:
            add("gpusched_gpu_allocated_idle_ratio", idle / allocated, flavor=flavor)
    for r in rows:  # ordered by flavor, node
        add("gpusched_node_gpu_utilization_measured_ratio", r["busy_seconds"] / r["seconds"], flavor=r["flavor"],
            node=r["node"])


def has_telemetry(samples: list[Sample]) -> bool:
    return any(s.name == "gpusched_gpu_utilization_measured_ratio" for s in samples)


SUMMARIES = {"gpusched_queue_wait_seconds", "gpusched_service_replica_ready_seconds"}  # quantiles, _count and _sum


def families(samples: list[Sample]) -> list[Metric]:
    out: list[Metric] = []
    for name, (help_text, label_names) in HELP.items():
        if name in SUMMARIES:
            summary = Metric(name, help_text, "summary")
            for s in samples:
                if s.name == name or s.name in (f"{name}_count", f"{name}_sum"):
                    summary.add_sample(s.name, dict(s.labels), s.value)
            out.append(summary)
            continue
        family = GaugeMetricFamily(name, help_text, labels=list(label_names))
        for s in samples:
            if s.name == name:
                family.add_metric([v for _, v in s.labels], s.value)
        out.append(family)
    return out


class ReadModelCollector:
    """A prometheus_client collector that queries the read models on scrape (from the HTTP
    server's thread, on its own connection), at most once per ``cache_s``."""

    def __init__(self, dsn: str, now: Callable[[], datetime] = lambda: datetime.now(UTC),
                 cache_s: float = 5.0) -> None:
        self.dsn, self.now, self.cache_s = dsn, now, cache_s
        self._lock = threading.Lock()
        self._at = 0.0
        self._samples: list[Sample] = []

    def describe(self):
        return []  # no query at registration

    def collect(self):
        with self._lock:
            if time.monotonic() - self._at > self.cache_s:
                try:
                    self._samples = asyncio.run(self._gather())
                    self._at = time.monotonic()
                except (OSError, asyncpg.PostgresError):
                    pass  # the last good snapshot (or none) rather than a failed scrape
        return families(self._samples)

    async def _gather(self) -> list[Sample]:
        conn = await asyncpg.connect(self.dsn, timeout=5)
        try:
            return await gather(conn, self.now())
        finally:
            await conn.close()


def register(dsn: str, registry: CollectorRegistry = REGISTRY, **kwargs) -> ReadModelCollector:
    collector = ReadModelCollector(dsn, **kwargs)
    registry.register(collector)
    return collector


def unregister(collector: ReadModelCollector, registry: CollectorRegistry = REGISTRY) -> None:
    try:
        registry.unregister(collector)
    except KeyError:
        pass


async def exposition(conn: asyncpg.Connection, now: datetime) -> bytes:
    """The text format, for ``gpusched metrics --format prometheus``."""
    samples = await gather(conn, now)

    class _Fixed:
        def collect(self):
            return families(samples)

    registry = CollectorRegistry()
    registry.register(_Fixed())
    return generate_latest(registry)
