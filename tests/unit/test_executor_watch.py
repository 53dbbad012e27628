"""The kubernetes backend's list+watch cache against a scripted API: a watch resumes from the
last resourceVersion, 410 Gone relists, API errors back off and relist, the periodic resync
relists. (The real API server is exercised by make test-k8s.)"""

from __future__ import annotations

import json
import time

from kubernetes.client.exceptions import ApiException

from services.executor import kubernetes as k8s


class Resp:
    def __init__(self, body=None, events=()):
        self.data = json.dumps(body).encode() if body is not None else b""
        self._events = events

    def stream(self, amt=None, decode_content=False):
        for ev in self._events:
            yield (json.dumps(ev) + "\n").encode()

    def close(self):
        pass

    def release_conn(self):
        pass


def obj(name, rv):
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": str(rv)}}


class ScriptedApi:
    """Lists and watches each take the next step of their script: a body, a list of watch
    events, or an exception; an exhausted watch script is a quiet watch."""

    def __init__(self, lists, watches=()):
        self.lists, self.watches = list(lists), list(watches)
        self.calls = []

    def __call__(self, **kw):
        self.calls.append(kw)
        steps = self.watches if kw.get("watch") else self.lists
        if not steps:
            time.sleep(0.05)
            return Resp(events=()) if kw.get("watch") else Resp(body=listing(999))
        step = steps.pop(0)
        if isinstance(step, Exception):
            raise step
        return Resp(events=step) if kw.get("watch") else Resp(body=step)


def run(api, until, resync_s=3600.0):
    cache = k8s.Cache("things", api, selector="a=b", resync_s=resync_s)
    cache.start()
    deadline = time.monotonic() + 10
    while not until(cache) and time.monotonic() < deadline:
        time.sleep(0.01)
    cache.stop()
    return cache


def listing(rv, *names):
    return {"metadata": {"resourceVersion": str(rv)}, "items": [obj(n, rv) for n in names]}


def names(cache):
    return sorted(o["metadata"]["name"] for o in cache.items())


def test_watch_resumes_from_the_last_resource_version_and_applies_events():
    api = ScriptedApi([listing(10, "a")], [
        [{"type": "ADDED", "object": obj("b", 11)}, {"type": "BOOKMARK", "object": obj("", 12)}],
        [{"type": "DELETED", "object": obj("a", 13)}],
    ])
    cache = run(api, lambda c: len([k for k in api.calls if k.get("watch")]) >= 3)
    assert names(cache) == ["b"]
    watches = [c for c in api.calls if c.get("watch")]
    assert [w["resource_version"] for w in watches[:3]] == ["10", "12", "13"]
    assert all(w["label_selector"] == "a=b" and w["allow_watch_bookmarks"] for w in watches)


def test_410_gone_relists():
    api = ScriptedApi([listing(10, "a"), listing(50, "c")],
                      [[{"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "too old"}}]])
    cache = run(api, lambda c: c.relists >= 2)
    assert cache.relists == 2 and names(cache) == ["c"]


def test_api_errors_back_off_then_relist():
    api = ScriptedApi([ApiException(status=500, reason="boom"), listing(5, "x")])
    t = time.monotonic()
    cache = run(api, lambda c: c.synced.is_set())
    assert cache.errors == 1 and names(cache) == ["x"]
    assert time.monotonic() - t >= k8s.BACKOFF_MIN_S * 0.5  # it waited before retrying


def test_periodic_resync_relists():
    api = ScriptedApi([listing(1, "a"), listing(2, "a", "b")])
    cache = run(api, lambda c: c.relists >= 2, resync_s=1.5)
    assert names(cache) == ["a", "b"]
