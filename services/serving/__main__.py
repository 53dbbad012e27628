"""The serving controller: the shared decision loop around :class:`ServingCore`."""

from __future__ import annotations

from runtime.loop import run_service
from services.serving.domain import ServingCore


def main() -> None:
    run_service("serving", lambda settings, clock: ServingCore())


if __name__ == "__main__":
    main()
