"""Single-active decision services: a lease in NATS KV, so that a standby process can take over
within seconds when the active one dies (docs/operations.md, "High availability").

* **Where**: the key ``active`` in the KV bucket ``lease-<service>`` (stream
  ``KV_lease-<service>``), which the service creates; only that service's credential may touch it
  (gpusched/permissions.py). The bucket's ``ttl`` is the lease's: a value not renewed within it
  ages out of the stream, and the key is free.
* **Acquire**: ``create`` the key, which the server allows only when it holds no value (never
  set, aged out, or deleted). So of any number of processes at most one holds it.
* **Renew**: ``update`` the key conditional on the revision this holder last wrote (the stream's
  expected-last-subject-sequence check), every third of the ttl. Anyone else's write in between
  makes that fail: the lease is lost. A write that landed though its answer was lost (a
  timeout) is recognised by the holder id in the key.
* **Fencing**: the holder gives up deciding before anyone else can take the lease: the key can
  age out no sooner than the ttl after the start of the last write of it that got through
  (``since``), and the loop (runtime/loop.py) stops when a renewal fails and the next could not
  land before that. Between renewals the loop fetches and appends only while the lease is
  :meth:`Lease.current` (less than :data:`CURRENT_SHARE` of the ttl since that write, on this
  process's monotonic clock, which runs on while the process is paused); otherwise it waits for
  the next renewal, or ends when the lease is lost.
* **The ttl** is the bucket's, set when the bucket is created; a process configured with another
  ttl uses the bucket's (and says so), so that processes never disagree about it.
* **Release**: on a clean stop, ``delete`` conditional on the revision, so a standby need not
  wait out the ttl.

A process paused (SIGSTOP, a VM freeze, a long GC) past its lease finds it no longer current
when it wakes, so it neither fetches nor appends; its renewal then fails and it exits. What is
left is a pause that falls between that check and the write to the socket. An append from such
a process is refused when it decides on an aggregate the new active has written since
(each decision is appended conditional on the last sequence of its aggregate that the decider
saw, runtime/loop.py), and a repeat of the new active's decision is the same event (ids are
derived from what is decided; JetStream drops the repeat). A decision about one aggregate
taken on an out-of-date view of another (a GPU the new active gave away meanwhile) is not
caught by those checks: the current-lease check is what keeps it out.
tests/integration/test_failover.py pauses the active scheduler with SIGSTOP past its lease.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

log = logging.getLogger(__name__)

KEY = "active"
CURRENT_SHARE = 0.75
"""The share of the ttl after the last write of the lease during which its holder decides.
Renewals start every third of the ttl after the last one ended, so a holder whose renewals are
answered within a sixth of the ttl never reaches it; a slower one pauses until the answer."""


def bucket(service: str) -> str:
    return f"lease-{service}"


def stream(service: str) -> str:
    """The stream behind the service's bucket (the KV store's naming)."""
    return f"KV_{bucket(service)}"


def holder_id() -> str:
    """This process, as the lease names it: host, pid and a random part (a pid is reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Lease:
    """One process's handle on its service's lease."""

    def __init__(self, js: JetStreamContext, service: str, ttl_s: float, *, replicas: int = 1,
                 holder: str | None = None) -> None:
        self.js, self.service, self.ttl_s, self.replicas = js, service, ttl_s, replicas
        self.holder = holder or holder_id()
        self.revision: int | None = None  # of this holder's last write; None: not held
        self.since = 0.0  # monotonic start of the last write of the key that got through (fencing starts from it)
        self._kv = None

    async def _bucket(self):
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(bucket(self.service))
            except (NotFoundError, BadRequestError):
                self._kv = await self.js.create_key_value(api.KeyValueConfig(
                    bucket=bucket(self.service), history=1, ttl=self.ttl_s, replicas=self.replicas,
                    storage=api.StorageType.FILE,
                    description=f"{self.service}'s single-active lease (runtime/lease.py)"))
            bucket_ttl = (await self._kv.status()).ttl
            if bucket_ttl and abs(bucket_ttl - self.ttl_s) > 1e-3:
                log.warning("the lease bucket's ttl differs from GPUSCHED_LEASE_TTL_S; using the bucket's (delete "
                            "the bucket with every process stopped to change it)",
                            extra={"service": self.service, "bucket_ttl_s": bucket_ttl, "configured_ttl_s": self.ttl_s})
                self.ttl_s = bucket_ttl
        return self._kv

    async def _ours(self) -> int | None:
        """The key's revision if it holds this holder's id (a write of ours whose answer was
        lost), else None."""
        kv = await self._bucket()
        try:
            entry = await kv.get(KEY)
        except KeyNotFoundError:
            return None
        return entry.revision if entry.value == self.holder.encode() else None

    @property
    def held(self) -> bool:
        return self.revision is not None

    def current(self, now: float | None = None) -> bool:
        """Held, and last written less than :data:`CURRENT_SHARE` of the ttl ago: its holder
        may fetch and append."""
        now = time.monotonic() if now is None else now
        return self.held and now < self.since + CURRENT_SHARE * self.ttl_s

    def lose(self) -> None:
        """This process no longer holds it (its renewal failed, or another holder wrote it)."""
        self.revision = None

    async def try_acquire(self) -> bool:
        """Take the lease if nobody holds it."""
        kv = await self._bucket()
        started = time.monotonic()
        try:
            self.revision = await kv.create(KEY, self.holder.encode())
        except KeyWrongLastSequenceError:
            self.revision = await self._ours()
            if self.revision is None:
                return False
            # an earlier create of ours landed though its answer was lost, at a time we do not
            # know: not current (runtime/loop.py decides nothing) until the first renewal
            self.since = float("-inf")
        else:
            self.since = started
        log.info("lease acquired", extra={"service": self.service, "holder": self.holder})
        return True

    async def renew(self) -> bool:
        """Keep it; False when it was lost (someone else wrote the key, or it aged out)."""
        if self.revision is None:
            return False
        kv = await self._bucket()
        started = time.monotonic()
        try:
            self.revision = await kv.update(KEY, self.holder.encode(), last=self.revision)
        except KeyWrongLastSequenceError:
            # An earlier write of ours landed though its answer was lost: still ours, written at
            # a time we do not know, so ``since`` stays at the last write we know of.
            self.revision = await self._ours()
            return self.revision is not None
        self.since = started
        return True

    async def holder_now(self) -> str | None:
        """Who holds it now, as the bucket says (None: nobody)."""
        kv = await self._bucket()
        try:
            entry = await kv.get(KEY)
        except KeyNotFoundError:
            return None
        return entry.value.decode() if entry.value else None

    async def release(self) -> None:
        """Give it up (a clean stop), if still held."""
        if self.revision is None:
            return
        kv = await self._bucket()
        try:
            await kv.delete(KEY, last=self.revision)
        except (KeyWrongLastSequenceError, APIError) as err:  # no longer ours, or another revision: leave it
            log.info("lease not released (no longer this revision); it ages out", extra={"error": repr(err)})
        self.revision = None
        log.info("lease released", extra={"service": self.service, "holder": self.holder})
