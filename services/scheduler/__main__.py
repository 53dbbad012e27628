"""Scheduler adapter: the shared decision loop around :class:`SchedulerCore`."""

from gpusched.service import run_service
from services.scheduler.domain import SchedulerCore


def main() -> None:
    run_service("scheduler", lambda settings, clock: SchedulerCore())


if __name__ == "__main__":
    main()
