"""gpusched's applications: the CLI, the HTTP API and console (gpusched.api), the Python SDK
(``gpusched.Client``, ``gpusched.AsyncClient``: gpusched.sdk.client), the dev stack.

The SDK names are loaded on first use, so ``import gpusched`` stays cheap for the CLI."""

from typing import Any

__all__ = ["Client", "AsyncClient", "ApiError", "Unauthorized", "Forbidden", "NotFound", "Rejected", "InvalidInput",
           "WaitTimeout"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gpusched.sdk import client

        return getattr(client, name)
    raise AttributeError(f"module 'gpusched' has no attribute {name!r}")
