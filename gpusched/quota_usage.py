"""Per queue and flavor: guaranteed quota, limits, use, what is borrowed and what is lent, from
the read models (:func:`services.accounting.queries.queue_quotas`) with the quota service's own
arithmetic (:class:`services.quota.capacity.Pool`), so the report and the decisions agree."""

from __future__ import annotations

from typing import Any

import asyncpg

from services.accounting import queries
from services.quota.capacity import Limits, Pool


async def queue_usage(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """Rows of :func:`queries.queue_quotas` with ``borrowed``, ``lendable`` and ``lent``. ``lent``
    attributes a cohort tree's borrowing to its lenders' unused quota in queue-name order (the
    platform constrains only the totals); a queue outside any cohort lends nothing."""
    rows = await queries.queue_quotas(conn)
    pools: dict[tuple[str, str], Pool] = {}
    for r in rows:
        pool = pools.setdefault(_pool_of(r), Pool(flavor=r["flavor"], cohort=r["cohort_root"]))
        pool.limits[r["queue"]] = Limits(r["nominal"], r["borrowing_limit"], r["lending_limit"])
        pool.used[r["queue"]] = r["used"]
    lent = {key: pool.lent_by() if pool.cohort is not None else {} for key, pool in pools.items()}
    for r in rows:
        pool = pools[_pool_of(r)]
        r["borrowed"] = pool.borrowed(r["queue"])
        r["lendable"] = pool.lendable(r["queue"])
        r["lent"] = lent[_pool_of(r)].get(r["queue"], 0)
    return rows


def _pool_of(row: dict[str, Any]) -> tuple[str, str]:
    """A cohort tree shares one pool per flavor; a queue outside any cohort has its own."""
    return (row["cohort_root"] or f"queue {row['queue']}", row["flavor"])


async def queue_now(conn: asyncpg.Connection, queue: str) -> dict[str, Any]:
    """One queue's rows of :func:`queue_usage` and the log position the read models are at."""
    return {"position": await queries.position(conn),
            "flavors": [r for r in await queue_usage(conn) if r["queue"] == queue]}
