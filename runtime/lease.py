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
  makes that fail: the lease is lost.
* **Release**: on a clean stop, ``delete`` conditional on the revision, so a standby need not
  wait out the ttl.

The lease keeps two actives from deciding at once in the steady state; it cannot stop a paused
process from appending a decision it took just before its lease ran out. That is harmless: each
decision is appended conditional on the last sequence of its aggregate that the decider saw
(runtime/loop.py), so one taken on an out-of-date state is refused, and its id is derived from
what it decides, so the new active taking the same decision is the same event (JetStream drops
the repeat). tests/integration/test_failover.py shows both.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

log = logging.getLogger(__name__)

KEY = "active"


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
        return self._kv

    @property
    def held(self) -> bool:
        return self.revision is not None

    async def try_acquire(self) -> bool:
        """Take the lease if nobody holds it."""
        kv = await self._bucket()
        try:
            self.revision = await kv.create(KEY, self.holder.encode())
        except KeyWrongLastSequenceError:
            return False
        log.info("lease acquired", extra={"service": self.service, "holder": self.holder})
        return True

    async def renew(self) -> bool:
        """Keep it; False when it was lost (someone else wrote the key, or it aged out)."""
        if self.revision is None:
            return False
        kv = await self._bucket()
        try:
            self.revision = await kv.update(KEY, self.holder.encode(), last=self.revision)
            return True
        except KeyWrongLastSequenceError:
            self.revision = None
            return False

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
        except KeyWrongLastSequenceError:
            pass  # no longer ours anyway
        self.revision = None
        log.info("lease released", extra={"service": self.service, "holder": self.holder})
