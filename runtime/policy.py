"""The priority classes and preemption rate limit in force, folded from PolicyConfigured events
(schemas.priority). Admission, quota and scheduler each keep one in their state, so a snapshot
carries it."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.priority import DEFAULT_PRIORITY_CLASSES, PolicyConfigured, PreemptionRateLimit, PriorityClass


@dataclass
class PolicyBook:
    """``classes``: the classes new jobs may use. ``known``: those plus every class a policy has
    retired, with the parameters it last had: the victim policy still needs them for jobs
    admitted under it. ``preemption``: the rate limit a policy set; None until the first policy
    (the scheduler's configured defaults hold). ``version``: policies folded so far."""

    classes: dict[str, PriorityClass] = field(default_factory=lambda: dict(DEFAULT_PRIORITY_CLASSES))
    known: dict[str, PriorityClass] = field(default_factory=lambda: dict(DEFAULT_PRIORITY_CLASSES))
    preemption: PreemptionRateLimit | None = None
    version: int = 0

    @classmethod
    def starting_with(cls, classes: dict[str, PriorityClass]) -> PolicyBook:
        """In force before the first policy: ``classes`` (the built-in ones unless a test or a
        what-if run gives others)."""
        return cls(dict(classes), dict(classes))

    def apply(self, event: PolicyConfigured) -> None:
        self.classes = {pc.name: pc for pc in event.priority_classes}
        self.known = {**self.known, **self.classes}
        self.preemption = event.preemption
        self.version += 1
