"""runtime.teams.partition_durables against a real nats-server: which durables of a
team-partitioned service exist, where each starts, and which are made again."""

from __future__ import annotations

import pytest
from nats.js.errors import NotFoundError

from runtime import eventlog
from runtime.teams import partition_durables
from tests.unit.builders import queue

STREAM = eventlog.EVENTS_STREAM


def name(k: int) -> str:
    return f"svc-p{k}" if k else "svc"


async def made(js, partitions: int, partition: int) -> None:
    await partition_durables(js, stream=STREAM, name=name, partitions=partitions, partition=partition, most=4)


async def info(js, k: int):
    return (await js.consumer_info(STREAM, name(k))).config


async def names(js) -> set[str]:
    return {c.config.name for c in await js.consumers_info(STREAM)}


async def test_partition_0_makes_every_partitions_durable_where_its_own_stopped(admin_js):
    js = admin_js
    await made(js, 3, 0)  # a fresh platform: partition 0 has no durable yet
    assert {"svc-p1", "svc-p2"} <= await names(js) and (await info(js, 1)).description == "partition 1 of 3"
    assert (await info(js, 1)).opt_start_seq is None  # from the log's start, as partition 0's will
    log = eventlog.EventLog(js)
    end = 0
    for i in range(3):
        end = await log.append(queue(f"q{i}"))
    sub = await eventlog.durable_consumer(js, stream=STREAM, durable="svc")
    for msg in await eventlog.fetch(sub, 10, 2.0):
        await msg.ack()
    await sub.unsubscribe()

    # 3 -> 1: partition 0 deletes the others; 1 -> 2: partition 1's is made after partition 0's floor
    await made(js, 1, 0)
    assert not {"svc-p1", "svc-p2"} & await names(js)
    await made(js, 2, 1)  # partition 1 starting first
    assert (await info(js, 1)).opt_start_seq == end + 1 and (await info(js, 1)).description == "partition 1 of 2"

    # tagged for another partitioning: made again; untagged (an earlier release's): kept
    await made(js, 3, 0)
    assert (await info(js, 1)).description == "partition 1 of 3"
    await js.delete_consumer(STREAM, "svc-p2")
    await eventlog.ensure_durable(js, stream=STREAM, durable="svc-p2", start_seq=2)
    await made(js, 3, 0)
    kept = await info(js, 2)
    assert kept.description is None and kept.opt_start_seq == 2
    with pytest.raises(NotFoundError):
        await js.consumer_info(STREAM, "svc-p3")
