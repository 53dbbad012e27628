"""Quota adapter: the shared decision loop around :class:`QuotaCore`."""

from runtime.loop import run_service
from services.quota.domain import QuotaCore


def main() -> None:
    run_service("quota", lambda settings, clock: QuotaCore())


if __name__ == "__main__":
    main()
