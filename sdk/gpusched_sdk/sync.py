""":class:`Client`: :class:`~gpusched_sdk.client.AsyncClient`'s synchronous face, made from it.

Each Client owns a private event loop on a daemon thread (a portal) and its AsyncClient lives
there; every public method of AsyncClient becomes a method of Client with the same name,
signature and documentation, which runs the coroutine on that loop and returns its result (an
async iterator becomes an iterator pulled one item at a time). Nothing is written twice, so the
two faces cannot drift; tests/unit/test_sdk_faces.py checks it. It works where a loop already runs
in the calling thread (a Jupyter kernel), since the client's loop is its own."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from .client import AsyncClient

T = TypeVar("T")


class _Portal:
    """An event loop on its own daemon thread; :meth:`run` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gpusched-sdk", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:  # KeyboardInterrupt in the caller: the work stops too
            future.cancel()
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class _Iterator(Iterator[Any]):
    """An async iterator of the portal's loop, pulled synchronously; :meth:`close` (or the end,
    or garbage collection) closes it there."""

    def __init__(self, portal: _Portal, source: Any) -> None:
        self._portal, self._source, self._done = portal, source, False

    def __iter__(self) -> "_Iterator":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            return self._portal.run(self._source.__anext__())
        except StopAsyncIteration:
            self._done = True
            raise StopIteration from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        if hasattr(self._source, "aclose") and not self._portal.loop.is_closed():
            self._portal.run(self._source.aclose())

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: S110 - the loop may be gone at interpreter exit
            pass


def _sync(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """The synchronous method ``name`` of Client, from AsyncClient's ``method``."""

    @functools.wraps(method)
    def call(self: "Client", *args: Any, **kwargs: Any) -> Any:
        out = getattr(self._async, name)(*args, **kwargs)
        if inspect.iscoroutine(out):
            return self._portal.run(out)
        if hasattr(out, "__anext__"):
            return _Iterator(self._portal, out)
        return out

    call.__qualname__ = f"Client.{name}"
    return call


def public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The public methods of ``cls`` (its API): every callable attribute without a leading _."""
    return {name: value for name, value in vars(cls).items() if not name.startswith("_") and callable(value)}


class Client:
    """The API, synchronously: every method of :class:`~gpusched_sdk.AsyncClient`, not awaited
    (its async iterators are plain iterators here). ``url`` and ``token`` default to
    GPUSCHED_API_URL and GPUSCHED_API_TOKEN. Use as a context manager, or call :meth:`close`."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout_s: float = 60.0) -> None:
        self._portal = _Portal()
        try:
            self._async = self._portal.run(_make(url, token, timeout_s))
        except BaseException:
            self._portal.stop()
            raise
        self.url = self._async.url

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections and stop the client's loop (the sync face of ``aclose``)."""
        if self._portal.loop.is_closed():
            return
        try:
            self._portal.run(self._async.aclose())
        finally:
            self._portal.stop()


async def _make(url: str | None, token: str | None, timeout_s: float) -> AsyncClient:
    return AsyncClient(url, token, timeout_s=timeout_s)


for _name, _method in public_methods(AsyncClient).items():
    if _name != "aclose":  # close(), above, also stops the loop
        setattr(Client, _name, _sync(_name, _method))
del _name, _method
