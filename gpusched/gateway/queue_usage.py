"""Per queue and flavor, each quota dimension: guaranteed quota, limits, use, what is borrowed and
what is lent; the queue's weighted limit and weighted use, its priority classes' limits and use,
and its GPU-hour budget. From the read models (:mod:`services.accounting.queries`) with the quota
service's own arithmetic (:mod:`services.quota.capacity`), so the report and the decisions agree."""

from __future__ import annotations

from typing import Any

import asyncpg
from nats.js import JetStreamContext

from schemas import QueueConfigured
from services.accounting import queries
from services.quota.capacity import (MILLI, Limits, Pool, budget_left, budget_spent, class_cap, period_start,
                                     weighted_use)


async def queue_usage(conn: asyncpg.Connection, log: JetStreamContext | None = None) -> list[dict[str, Any]]:
    """Rows of :func:`queries.queue_quotas` with ``used``, ``borrowed``, ``lendable`` and ``lent``,
    in GPUs (fractions where fractional jobs hold quota: 2.25). ``lent`` attributes a cohort tree's
    borrowing to its lenders' unused quota in queue-name order (the platform constrains only the
    totals); a queue outside any cohort lends nothing. Then the dimensions across flavors
    (:func:`_add_dimensions`)."""
    rows = await queries.queue_quotas(conn)
    pools: dict[tuple[str, str], Pool] = {}
    for r in rows:
        pool = pools.setdefault(_pool_of(r), Pool(flavor=r["flavor"], cohort=r["cohort_root"]))
        pool.limits[r["queue"]] = Limits.in_milli(r["nominal"], r["borrowing_limit"], r["lending_limit"])
        pool.used[r["queue"]] = r["used_milli"]
    lent = {key: pool.lent_by() if pool.cohort is not None else {} for key, pool in pools.items()}
    for r in rows:
        pool = pools[_pool_of(r)]
        r["used"] = gpus(r.pop("used_milli"))
        r["borrowed"] = gpus(pool.borrowed(r["queue"]))
        r["lendable"] = gpus(pool.lendable(r["queue"]))
        r["lent"] = gpus(lent[_pool_of(r)].get(r["queue"], 0))
    await _add_dimensions(conn, rows, log)
    return rows


def gpus(milli: int) -> int | float:
    """Thousandths of a GPU as GPUs: a whole number stays an integer (8, not 8.0)."""
    return milli // MILLI if milli % MILLI == 0 else milli / MILLI


async def _add_dimensions(conn: asyncpg.Connection, rows: list[dict[str, Any]], log: JetStreamContext | None) -> None:
    """Each row's flavor ``weight``; its queue's ``weighted_limit`` and ``weighted_used`` (GPUs
    held, borrowed ones too, × weight); ``class_limits`` on this flavor (each class's
    ``max_share``, ``limit`` in GPUs and ``used``); and ``budget_gpu_hours``, ``budget_period``,
    ``budget_used_gpu_hours`` (weighted GPU-hours held this period up to now on the log's clock:
    :func:`services.quota.capacity.budget_spent`) and ``budget_left_gpu_hours``
    (:func:`services.quota.capacity.budget_left`). The quota service also counts a held job's
    declared runtime as committed, which the read models lack."""
    configs = await queries.queue_configs(conn)
    by_class = await queries.class_holdings(conn)
    held: dict[str, dict[str, int]] = {}  # queue -> flavor -> thousandths
    for r in rows:
        held.setdefault(r["queue"], {})[r["flavor"]] = round(r["used"] * MILLI)
    budget_used = await _budget_used(conn, configs, log)
    for r in rows:
        queue = configs.get(r["queue"])
        if queue is None:  # configured after the rows were read: its dimensions next time
            continue
        fq = next((fq for fq in queue.quotas if fq.flavor == r["flavor"]), None)
        r["weight"] = fq.weight if fq is not None else None
        r["weighted_limit"] = queue.weighted_limit
        r["weighted_used"] = round(weighted_use(queue, held[r["queue"]]), 3)
        r["class_limits"] = [{"priority_class": c.priority_class, "max_share": c.max_share,
                              "limit": gpus(class_cap(c.max_share, r["nominal"])),
                              "used": gpus(by_class.get((r["queue"], r["flavor"], c.priority_class), 0))}
                             for c in queue.class_limits]
        r["budget_gpu_hours"] = queue.budget.gpu_hours if queue.budget else None
        r["budget_period"] = queue.budget.period if queue.budget else None
        r["budget_used_gpu_hours"] = budget_used.get(r["queue"])
        r["budget_left_gpu_hours"] = budget_left(queue, budget_used.get(r["queue"], 0.0))


async def _budget_used(conn: asyncpg.Connection, configs: dict[str, QueueConfigured],
                       log: JetStreamContext | None) -> dict[str, float]:
    """Queue -> weighted GPU-hours its reservations held this budget period, up to now on the
    log's clock (:func:`queries.log_now`); only queues with a budget."""
    now = await queries.log_now(conn, log)
    out: dict[str, float] = {}
    for period in sorted({q.budget.period for q in configs.values() if q.budget is not None}):
        hours = await queries.held_gpu_hours(conn, period_start(period, now), now)
        for queue in (q for q in configs.values() if q.budget is not None and q.budget.period == period):
            out[queue.name] = budget_spent(queue, {fq.flavor: hours.get((queue.name, fq.flavor), 0.0)
                                                   for fq in queue.quotas})
    return out


def _pool_of(row: dict[str, Any]) -> tuple[str, str]:
    """A cohort tree shares one pool per flavor; a queue outside any cohort has its own."""
    return (row["cohort_root"] or f"queue {row['queue']}", row["flavor"])


def table_cells(row: dict[str, Any]) -> dict[str, str]:
    """A row's dimensions beyond GPUs as table cells: the flavor's ``weight``, ``weighted``
    (used/limit, or used), ``classes`` (each class's used/limit on this flavor) and ``budget``
    (used/limit GPU-hours per period)."""
    weight, weighted, limit = row.get("weight"), row.get("weighted_used"), row.get("weighted_limit")
    cells = {"weight": "" if weight is None else f"{weight:g}",
             "weighted": "" if weighted is None else f"{weighted:g}" + ("" if limit is None else f"/{limit:g}"),
             "classes": ", ".join(f"{c['priority_class']} {c['used']}/{c['limit']}"
                                  for c in row.get("class_limits", ())),
             "budget": ""}
    if row.get("budget_gpu_hours") is not None:
        cells["budget"] = (f"{row['budget_used_gpu_hours']:g}/{row['budget_gpu_hours']:g} GPU-h "
                           f"per {row['budget_period']}")
    return cells


QUEUE_LINE = "(queue)"
"""The flavor cell of a queue's own line in :func:`table_rows`."""


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`queue_usage`'s rows as `gpusched queues` shows them: per queue, one line with the
    figures that are the queue's, not a flavor's (``flavor`` :data:`QUEUE_LINE`: its waiting jobs,
    its weighted use against its weighted limit, its budget), then one line per flavor with that
    flavor's figures only (``weighted``: the flavor's share of the weighted use, GPUs held × weight).
    A queue's waiting jobs hold no flavor yet, so they are counted on the queue's line once."""
    out: list[dict[str, Any]] = []
    current = None
    for r in rows:
        cells = table_cells(r)
        if r["queue"] != current:
            current = r["queue"]
            out.append({"queue": r["queue"], "cohort": r["cohort"], "flavor": QUEUE_LINE,
                        "pending_jobs": r.get("pending_jobs"), "weighted": cells["weighted"],
                        "budget": cells["budget"]})
        weight, used = r.get("weight"), r.get("used")
        out.append({**{k: r.get(k) for k in ("queue", "cohort", "flavor", "nominal", "borrowing_limit",
                                             "lending_limit", "used", "borrowed", "lent", "weight")},
                    "queue": "", "cohort": "", "weight": cells["weight"],
                    "weighted": "" if weight is None or used is None else f"{round(used * weight, 3):g}",
                    "classes": cells["classes"]})
    return out


async def queue_now(conn: asyncpg.Connection, queue: str, log: JetStreamContext | None = None) -> dict[str, Any]:
    """One queue's rows of :func:`queue_usage` and the log position the read models are at."""
    return {"position": await queries.position(conn),
            "flavors": [r for r in await queue_usage(conn, log) if r["queue"] == queue]}


async def queues_for(conn: asyncpg.Connection, team: str | None,
                     log: JetStreamContext | None = None) -> list[dict[str, Any]]:
    """:func:`queue_usage` as a team may see it (``team`` None: every queue), each row with the
    ``teams`` that may submit to its queue: what the API's and the console's queues show."""
    rows = await queue_usage(conn, log)
    allowed = await queries.queue_teams(conn)
    out = []
    for r in rows:
        teams = allowed.get(r["queue"], ())
        if team is None or team in teams:
            out.append({**r, "teams": list(teams)})
    return out
