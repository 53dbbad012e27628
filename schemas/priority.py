"""Priority classes and the preemption policy (``gpusched.policy.cluster.configured``).

The classes and the global preemption rate limit are configuration in the log: the operator
applies a ``PolicyConfigured`` (``gpusched apply`` with ``priority_classes:`` / ``preemption:``),
and admission, quota and scheduler use it from that event on. Until the first one, the built-in
classes below are in force. A job's priority value and preemptibility are bound when admission
decides it (``JobAdmitted.priority`` / ``preemptible``), so changing a class never rewrites a
decision already in the log; a class's protection window, preemption budget and grace period are
read from the policy in force when a victim is chosen.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .envelope import NAME_PATTERN, Contract, Event

POLICY_ID = "cluster"
"""The one policy aggregate: ``gpusched.policy.cluster.*``."""


class PriorityClass(Contract):
    name: str = Field(pattern=NAME_PATTERN)
    value: int = Field(ge=0, le=1_000_000)
    preemptible: bool = Field(description="May be evicted to make room for higher priority work")
    protection_seconds: float = Field(default=0, ge=0, le=30 * 86_400,
                                      description="Minimum runtime before preemption")
    max_preemptions: int | None = Field(
        default=None, ge=0, le=1_000, description="Preemptions a job of this class may suffer in all; None: no limit"
    )
    preemption_grace_seconds: float = Field(
        default=30.0, ge=0, le=86_400, description="Checkpoint window a preempted job of this class gets"
    )


class PreemptionRateLimit(Contract):
    """The global limit on preemption: at most ``max_per_window`` PreemptionRequested in any
    rolling window of ``window_seconds``, counted from the log."""

    enabled: bool = Field(default=True, description="False: the scheduler preempts nothing")
    max_per_window: int = Field(default=20, ge=0, le=100_000)
    window_seconds: float = Field(default=300.0, ge=1, le=86_400)


class PolicyConfigured(Event):
    """The priority classes and the preemption rate limit in force from this event on. It
    replaces the whole policy: a class it does not list is retired (new jobs may not use it;
    admitted jobs of it keep the parameters it last had)."""

    aggregate: ClassVar[str] = "policy"
    type: Literal["PolicyConfigured"] = "PolicyConfigured"
    priority_classes: tuple[PriorityClass, ...] = Field(min_length=1, max_length=64)
    preemption: PreemptionRateLimit = Field(default_factory=PreemptionRateLimit)

    @model_validator(mode="after")
    def _unique_names(self) -> "PolicyConfigured":
        names = [pc.name for pc in self.priority_classes]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"priority_classes lists name(s) {dupes} more than once; each class once")
        return self


DEFAULT_PRIORITY_CLASSES: dict[str, PriorityClass] = {
    pc.name: pc
    for pc in (
        PriorityClass(name="inference-sla", value=1000, preemptible=False),
        PriorityClass(name="deadline-training", value=800, preemptible=True, protection_seconds=1800,
                      max_preemptions=2, preemption_grace_seconds=120),
        PriorityClass(name="training", value=500, preemptible=True, protection_seconds=600,
                      max_preemptions=5, preemption_grace_seconds=60),
        PriorityClass(name="experiment", value=200, preemptible=True, protection_seconds=300),
        PriorityClass(name="batch-low", value=100, preemptible=True, preemption_grace_seconds=10),
    )
}
"""The built-in classes: in force until the first PolicyConfigured."""
