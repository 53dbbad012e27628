"""Snapshots of a decision service's state, so that a start costs the state, not the history.

A start loads the service's newest snapshot and folds only the events after it; without a usable
snapshot it folds the whole log, as before. The result is the same state either way
(tests/unit/test_snapshots.py checks it on a log of 100,000+ events).

* **What is saved**: the core's state (``snapshot_state()``), the stream sequence it includes and
  the loop's per-aggregate sequences (the concurrency check's), pickled and compressed.
* **Where**: one object named ``state`` in the NATS Object Store bucket ``snapshots-<service>``
  (stream ``OBJ_snapshots-<service>``), which the service creates. Only that service's credential
  may write or read it (gpusched/permissions.py): pickle runs code on load, so a snapshot must
  come from the service itself.
* **When**: after a batch, once ``snapshot_every`` events were applied since the last one and
  ``snapshot_min_interval_s`` passed, and on a clean stop.
* **Which is usable**: one taken from this log (the event stream's creation time: a stream deleted
  and provisioned again is another log) whose code version matches the running code (a digest of
  the sources of the core's package, ``schemas`` and ``runtime``: any change there may change the
  state's shape or what the fold makes of an event) and whose sequence the stream holds. Anything
  else is ignored, with a log line saying why, and the service folds the whole log.

A snapshot is never needed for correctness: losing it costs a longer start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import sys
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

import schemas

log = logging.getLogger(__name__)

OBJECT = "state"
FORMAT = 1  # of the pickled payload below; part of the version


def bucket(service: str) -> str:
    return f"snapshots-{service}"


def stream(service: str) -> str:
    """The stream behind the service's bucket (the Object Store's naming)."""
    return f"OBJ_{bucket(service)}"


@cache
def _package_digest(directory: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(directory.rglob("*.py")):
        h.update(str(path.relative_to(directory)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def code_version(core: object) -> str:
    """A digest of the code that shapes and folds the core's state: the packages of the core's
    class and of its bases, ``schemas`` and ``runtime``."""
    dirs = {Path(schemas.__file__).parent, Path(__file__).parent}
    for cls in type(core).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and getattr(module, "__file__", None) and cls is not object:
            dirs.add(Path(module.__file__).parent)
    h = hashlib.sha256(f"format {FORMAT}, python {sys.version_info[:2]}".encode())
    for d in sorted(dirs):
        h.update(_package_digest(d).encode())
    return h.hexdigest()[:32]


@dataclass
class Snapshot:
    version: str
    log_id: str  # the event stream's creation time
    applied_seq: int  # the state includes every event up to this stream sequence
    last_seq: dict[str, int]  # the loop's per-aggregate sequences (runtime.loop)
    state: Any  # what the core's snapshot_state() returned

    def encode(self) -> bytes:
        return zlib.compress(pickle.dumps((self.last_seq, self.state), protocol=pickle.HIGHEST_PROTOCOL), 1)

    @classmethod
    def decode(cls, version: str, log_id: str, applied_seq: int, data: bytes) -> "Snapshot":
        last_seq, state = pickle.loads(zlib.decompress(data))
        return cls(version, log_id, applied_seq, last_seq, state)


class SnapshotStore:
    """The service's bucket. ``load`` returns None for anything not usable, saying why."""

    def __init__(self, js: JetStreamContext, service: str, replicas: int = 1) -> None:
        self.js, self.service, self.replicas = js, service, replicas
        self._store: ObjectStore | None = None

    async def _bucket(self) -> ObjectStore:
        if self._store is None:
            try:
                self._store = await self.js.object_store(bucket(self.service))
            except NotFoundError:
                self._store = await self.js.create_object_store(
                    bucket(self.service), config=api.ObjectStoreConfig(
                        description=f"{self.service}'s state snapshots (runtime/snapshot.py)",
                        storage=api.StorageType.FILE, replicas=self.replicas))
        return self._store

    async def save(self, snap: Snapshot) -> int:
        """Write the snapshot (replacing the one before); returns its size in bytes."""
        data = snap.encode()
        meta = api.ObjectMeta(name=OBJECT, description=json.dumps(
            {"version": snap.version, "log": snap.log_id, "applied_seq": snap.applied_seq}))
        store = await self._bucket()
        await store.put(OBJECT, data, meta=meta)
        return len(data)

    async def load(self, version: str, log_id: str, log_end: int) -> Snapshot | None:
        """The saved snapshot if it was written by this code from this log, and the log still
        reaches it."""
        store = await self._bucket()
        try:
            info = await store.get_info(OBJECT)
        except NotFoundError:
            log.info("no snapshot yet: folding the whole log", extra={"bucket": bucket(self.service)})
            return None
        try:
            meta = json.loads(info.description or "")
            saved_version, saved_log, applied_seq = str(meta["version"]), str(meta["log"]), int(meta["applied_seq"])
        except (ValueError, KeyError, TypeError):
            log.warning("snapshot without readable metadata ignored", extra={"bucket": bucket(self.service)})
            return None
        if saved_log != log_id:
            log.info("snapshot of another event log ignored (the stream was provisioned again): folding the whole log",
                     extra={"saved": saved_log, "running": log_id})
            return None
        if saved_version != version:
            log.info("snapshot of another code version ignored: folding the whole log",
                     extra={"saved": saved_version, "running": version})
            return None
        if applied_seq > log_end:
            log.warning("snapshot ahead of the log ignored: folding the whole log",
                        extra={"applied_seq": applied_seq, "log_end": log_end})
            return None
        result = await store.get(OBJECT)
        try:
            return Snapshot.decode(version, log_id, applied_seq, result.data)
        except Exception as err:  # a damaged object: the log is still whole
            log.warning("snapshot unreadable, ignored: folding the whole log", extra={"error": repr(err)})
            return None
