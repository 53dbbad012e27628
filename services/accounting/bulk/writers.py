"""Writer processes: a rebuild's ranges of the log read, converted and written in parallel,
committed in log order.

A rebuild cuts the log [start, end] into ranges of ``batch`` stream sequences and deals them
round-robin to WRITERS processes, each with its own NATS and Postgres connection: range k goes
to writer k % WRITERS. A writer reads its range through the log's reader
(:func:`runtime.eventlog.read_batches` from the range's first sequence to its last, as
(sequence, payload) pairs through a :class:`runtime.eventlog.RawDeliveryClient`), converts and
plans it (:func:`services.accounting.pipeline.entries`, :func:`services.accounting.sink.prepare`),
then waits for the turn: a token the writer of the
previous range sends after its transaction committed. Meanwhile, and while it writes, it reads
its next range. So ranges commit in log order, one at a time, while the next ones are being
read and converted; no message passes through a second process. The token also says whether a
range failed (then every later one is refused: the position must never move past events that
were not written) and carries the event ids of the ranges since this writer's last one, for its
Bloom filter of applied ids. The parent only starts the writers and collects their results in
range order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient

from runtime import eventlog
from runtime.settings import NatsTls
from services.accounting import pipeline, sink
from services.accounting.bulk.collector import BatchCollector
from services.accounting.target import ReplayError, connect

WRITERS = 2


@dataclass(frozen=True)
class NatsOptions:
    """How a writer process connects: the parent's server and credentials, and TLS as the
    environment gives it (GPUSCHED_NATS_TLS_*: paths, which cross a process boundary where an
    SSL context the caller built does not). A ``tls://`` URL carries over too."""

    servers: tuple[str, ...]
    user: str | None = None
    password: str | None = None
    token: str | None = None
    tls: NatsTls | None = None

    @classmethod
    def of(cls, nc: NatsClient) -> NatsOptions:
        url = nc.connected_url
        if url is None:
            raise ReplayError("NATS is not connected")
        tls = NatsTls.from_env()
        if nc.options.get("tls") is not None and tls is None:
            raise ReplayError("a rebuild's writer processes cannot reuse the caller's TLS context; set "
                              "GPUSCHED_NATS_TLS_CA (and _CERT/_KEY) or connect with a tls:// URL (the system's trust "
                              "store), or replay without writer_process")
        return cls(servers=(url.geturl(),), user=nc.options.get("user"), password=nc.options.get("password"),
                   token=nc.options.get("token"), tls=tls)

    async def connect(self) -> NatsClient:
        auth = {k: v for k, v in (("user", self.user), ("password", self.password), ("token", self.token)) if v}
        nc = eventlog.RawDeliveryClient()  # the ranges' reads skip nats-py's per-message handling
        if self.user:
            auth["inbox_prefix"] = eventlog.inbox_prefix(self.user)
        if self.tls is not None:
            auth.update(self.tls.connect_options())
        await nc.connect(list(self.servers), name="gpusched-replay-writer", allow_reconnect=False, connect_timeout=5,
                         **auth)
        return nc


def ranges(start: int, end: int, batch: int) -> list[tuple[int, int]]:
    """[start, end] as consecutive ranges of ``batch`` sequences (the last one shorter)."""
    return [(lo, min(lo + batch - 1, end)) for lo in range(start, end + 1, batch)]


async def read_range(nc: NatsClient, lo: int, hi: int) -> list[eventlog.Payload]:
    """The log's (stream sequence, payload) pairs with lo <= sequence <= hi, in order (a
    sequence deleted from the stream is absent)."""
    out: list[eventlog.Payload] = []
    async for payloads in eventlog.read_batches(nc.jetstream(), from_seq=lo, to_seq=hi, batch=hi - lo + 1,
                                                client=nc, payloads=True):
        out += payloads
    return out


def writer_main(dsn: str, schema: str, nats_options: NatsOptions, mine: list[tuple[int, int]], capacity: int,
                 writers: int, turn_in, turn_out, results) -> None:
    collector = BatchCollector()
    collector.__enter__()  # for the life of the process
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(connect(dsn, schema))
    # Ranges commit one at a time, each after the previous one's commit: a commit that waited
    # for its WAL flush would hold up every writer. So they do not wait,
    # except this writer's last range: its flush makes every range before it durable too. A
    # Postgres crash before then loses the last commits together with the position that covers
    # them (a commit is still all or nothing), and a rerun applies those ranges again.
    loop.run_until_complete(conn.execute("SET synchronous_commit = off"))
    nc = loop.run_until_complete(nats_options.connect())
    applied = None
    if capacity and not loop.run_until_complete(conn.fetchval("SELECT EXISTS (SELECT FROM applied_events)")):
        # A fresh target: every id applied goes into a Bloom filter, so that only the ids in it
        # are looked up: about 3.6 bytes an event at one false positive in a million, so that a
        # lookup (a scan while the key is deferred) is rare.
        from rbloom import Bloom

        applied = Bloom(max(capacity, 1000), 1e-6)
    # The turn is read eagerly by a thread, so that the previous writer never waits for this one
    # to want it (a token can be larger than a pipe's buffer).
    turn_in = _eager(turn_in)

    async def read(lo: int, hi: int) -> tuple[list, str | None]:
        try:
            return await read_range(nc, lo, hi), None
        except Exception as err:  # said in turn, below: no later range may be written
            return [], f"reading the range {lo}..{hi} failed: {err!r}"

    # The next range is read while this one waits for the turn and is written: the read runs
    # whenever this writer would otherwise wait (for the turn, for Postgres). So a writer holds
    # at most two ranges.
    pending = loop.create_task(read(*mine[0])) if mine else None
    try:
        for k, (lo, hi) in enumerate(mine):
            t, cpu = time.perf_counter(), time.process_time()
            payloads, unread = loop.run_until_complete(pending)
            pending = loop.create_task(read(*mine[k + 1])) if k + 1 < len(mine) else None
            read_s = time.perf_counter() - t  # what the read left to wait for
            prepared = sink.prepare(pipeline.entries(payloads))
            ids = list(prepared.first)
            # The filter holds the ids of every range this writer has heard of so far: what it
            # flags is found before the turn (which holds up every writer); in the turn, only
            # the ids of the ranges committed since (the token's) are checked, exactly.
            flagged = own = None
            if applied is not None:
                own = set(ids)
                flagged = {event_id for event_id in ids if event_id in applied}
            turn_asked = time.perf_counter()
            if (token := loop.run_until_complete(loop.run_in_executor(None, turn_in.get))) is None:
                raise ReplayError("the writer of the previous range exited without handing on the turn")
            failed, recent = token  # the previous range has committed (or failed)
            failed = failed or unread
            waited = time.perf_counter() - turn_asked
            if failed is None:
                maybe = None if own is None else flagged.union(*(own.intersection(batch) for batch in recent))
                try:
                    if k == len(mine) - 1:
                        loop.run_until_complete(conn.execute("SET synchronous_commit = on"))
                    loop.run_until_complete(sink.apply_batch(conn, prepared, maybe_applied=maybe))
                except Exception as err:
                    failed = f"the range {lo}..{hi} failed: {err!r}"
            try:  # the next writer needs the ids of the writers - 1 ranges since its own last one
                turn_out.send((failed, (recent + [ids])[-(writers - 1):] if writers > 1 else []))
            except OSError:  # it has no range left and has exited: nobody needs the turn
                pass
            if applied is not None and failed is None:  # after the turn is handed on
                for batch in recent:
                    applied.update(batch)
                applied.update(ids)
            n = len(payloads)
            del prepared, ids, payloads
            collector.after_batch()
            results.send((failed, n, read_s, waited, time.perf_counter() - t, time.process_time() - cpu))
            if failed is not None:
                return
    finally:
        if pending is not None:
            pending.cancel()
            loop.run_until_complete(asyncio.gather(pending, return_exceptions=True))
        loop.run_until_complete(nc.close())
        loop.run_until_complete(conn.close())


def _eager(conn) -> queue.Queue:
    """A queue that a daemon thread fills with every message from ``conn``; None once it closes."""
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        try:
            while True:
                q.put(conn.recv())
        except (EOFError, OSError):
            q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


class RangeWriters:
    """WRITERS writer processes over the ranges of [start, end] (see above); :meth:`results`
    yields each range's outcome in log order."""

    def __init__(self, options: NatsOptions, dsn: str, schema: str, start: int, end: int, batch: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.ranges = ranges(start, end, batch)
        writers = max(1, min(WRITERS, len(self.ranges)))
        turns = [ctx.Pipe(duplex=False) for _ in range(writers)]  # turns[i]: into writer i
        self._results, self._procs = [], []
        for i in range(writers):
            results_r, results_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=writer_main, name=f"replay-writer-{i}", daemon=True,
                               args=(dsn, schema, options, self.ranges[i::writers], end - start + 1, writers,
                                     turns[i][0], turns[(i + 1) % writers][1], results_w))
            proc.start()
            results_w.close()  # the writer's end: held here too, a writer's death would go unnoticed
            self._results.append(results_r)
            self._procs.append(proc)
        turns[0][1].send((None, []))  # the first range's turn
        for turn in turns:
            for end_ in turn:
                end_.close()

    async def results(self):
        """(range, (failed, events read, read s, turn waited s, wall s, CPU s)) in log order."""
        loop = asyncio.get_running_loop()
        for k, rng in enumerate(self.ranges):
            yield rng, await loop.run_in_executor(None, self._receive, k % len(self._procs))

    def _receive(self, i: int):
        try:
            return self._results[i].recv()
        except EOFError:  # its end closed: the writer is gone
            self._procs[i].join(5)
            raise ReplayError(f"writer process {i} exited (code {self._procs[i].exitcode}) before its result") from None

    def kill(self) -> None:
        """Stop every writer now (a failed or interrupted rebuild leaves none behind)."""
        for proc in self._procs:
            proc.kill()

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for proc in self._procs:
            await loop.run_in_executor(None, proc.join, 30)
            if proc.is_alive():
                proc.kill()
