"""The serving controller: the shared decision loop around :class:`ServingCore`."""

from __future__ import annotations

from runtime.loop import DecisionService, run_service
from schemas.registry import subject_parts
from services.serving import domain
from services.serving.domain import ServingCore


class ServingService(DecisionService):
    def passes_over(self, subject: str) -> bool:
        """Events of jobs that are no service's replicas (most of the log) are not parsed."""
        return (parts := subject_parts(subject)) is not None and domain.passes_over(parts[0], parts[1])


def main() -> None:
    run_service("serving", lambda settings, clock: ServingCore(), ServingService)


if __name__ == "__main__":
    main()
