"""Priority classes. Higher value is scheduled first and may preempt lower (scheduler issue)."""

from __future__ import annotations

from pydantic import Field

from schemas.envelope import NAME_PATTERN, Contract


class PriorityClass(Contract):
    name: str = Field(pattern=NAME_PATTERN)
    value: int = Field(ge=0, le=1_000_000)
    preemptible: bool = Field(description="May be evicted to make room for higher priority work")
    protection_seconds: float = Field(default=0, ge=0, description="Minimum runtime before preemption")
    max_preemptions: int | None = Field(
        default=None, ge=0, description="Preemptions a job of this class may suffer in all; None: no limit"
    )
    preemption_grace_seconds: float = Field(
        default=30.0, ge=0, le=86_400, description="Checkpoint window a preempted job of this class gets"
    )


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
