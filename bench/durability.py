"""What `sync_interval: always` costs: acknowledged JetStream publishes on a nats-server with the
default periodic fsync and on one that syncs every write before it acknowledges (what
deploy/nats-server.conf and k8s/components/nats run), in the same run, on the same disk.

    python -m bench.durability [--raw N] [--sequential N] [--repeats R] [--json PATH]

Each server is one node (R1) on a temporary directory; the messages are those of `python -m
bench`'s ceiling (700 bytes, a Nats-Msg-Id each), published sequentially (one ack awaited per
publish: what one service append waits for) and pipelined (1,000 awaiting their ack). R3 adds a
round trip to a quorum whose members each sync too; it is not measured here (one machine).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import nats
from nats.js.api import StorageType, StreamConfig

from bench import command_line
from bench.__main__ import raw_publish, raw_publish_pipelined
from gpusched.dev import stack as devstack


async def _server(sync_always: bool, work: Path):
    server = devstack.NatsServer(work / ("always" if sync_always else "default"), sync_always=sync_always).start()
    nc = await nats.connect(server.url(), user="admin", password=server.creds.users["admin"])
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="RAW", subjects=["raw.>"], storage=StorageType.FILE, duplicate_window=120))
    return server, nc, js


async def main(args) -> dict:
    """Both servers up at once; each repeat measures one, then the other, the first alternating,
    so that the machine's other load falls on both alike."""
    work = Path(tempfile.mkdtemp(prefix="gpusched-durability-"))
    figures = {k: {"sequential_msgs_per_s": [], "pipelined_msgs_per_s": []} for k in ("default", "always")}
    servers = {}
    try:
        servers = {"default": await _server(False, work), "always": await _server(True, work)}
        for r in range(args.repeats):
            for kind in (("default", "always") if r % 2 == 0 else ("always", "default")):
                _, nc, js = servers[kind]
                figures[kind]["sequential_msgs_per_s"].append(await raw_publish(js, args.sequential, f"raw.s{r}"))
                figures[kind]["pipelined_msgs_per_s"].append(await raw_publish_pipelined(nc, args.raw, f"raw.p{r}"))
    finally:
        for server, nc, _ in servers.values():
            await nc.close()
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    for f in figures.values():
        f["sequential_median"] = statistics.median(f["sequential_msgs_per_s"])
        f["pipelined_median"] = statistics.median(f["pipelined_msgs_per_s"])
    default, always = figures["default"], figures["always"]
    return {"repeats": args.repeats, "default": default, "always": always,
            "ratio_sequential": always["sequential_median"] / default["sequential_median"],
            "ratio_pipelined": always["pipelined_median"] / default["pipelined_median"]}


def report(r: dict) -> None:
    print(f"\nsync_interval: always against the default (one nats-server, R1; medians of {r['repeats']}, the order alternating)")
    print(f"{'publishes':<44} {'default':>12} {'always':>12} {'ratio':>7}")
    for label, key, ratio in (("sequential (one ack awaited each), msg/s", "sequential_median", "ratio_sequential"),
                              ("pipelined (1,000 in flight), msg/s", "pipelined_median", "ratio_pipelined")):
        print(f"{label:<44} {r['default'][key]:>12,.0f} {r['always'][key]:>12,.0f} {r[ratio]:>7.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw", type=int, default=20_000, help="pipelined publishes per repeat")
    parser.add_argument("--sequential", type=int, default=3_000, help="sequential publishes per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    command_line(parser, main, report)
