"""gpusched's applications: the CLI, the HTTP API and console (gpusched.api), the dev stack. The
Python SDK is its own distribution (sdk/, ``gpusched_sdk``); ``gpusched.Client``,
``gpusched.AsyncClient`` and its errors are re-exported from it.

The SDK names are loaded on first use, so ``import gpusched`` stays cheap for the CLI."""

from typing import Any

__all__ = ["Client", "AsyncClient", "ApiError", "Unauthorized", "Forbidden", "NotFound", "Rejected", "InvalidInput",
           "WaitTimeout"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import gpusched_sdk

        return getattr(gpusched_sdk, name)
    raise AttributeError(f"module 'gpusched' has no attribute {name!r}")
