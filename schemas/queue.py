"""Queue and cohort configuration events (``gpusched.queue.<name>.*``, ``gpusched.cohort.<name>.*``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .envelope import NAME_PATTERN, Contract, Event


class FlavorQuota(Contract):
    """Quota of one GPU flavor in one queue, in GPUs."""

    flavor: str = Field(pattern=NAME_PATTERN)
    nominal: int = Field(ge=0, le=1_000_000, description="Guaranteed GPUs")
    borrowing_limit: int | None = Field(default=None, ge=0, description="Max GPUs borrowed; None = unlimited")
    lending_limit: int | None = Field(default=None, ge=0, description="Max GPUs lent; None = all unused")
    weight: float = Field(default=1.0, gt=0, le=1000, description="Value of one GPU of this flavor in weighted units")


class GpuHourBudget(Contract):
    """GPU-hours (weighted units) a queue may hold quota for per calendar period (UTC)."""

    gpu_hours: float = Field(ge=0, le=1e9)
    period: Literal["day", "week", "month"] = "month"


class ClassLimit(Contract):
    """The most the attempts of one priority class may hold in a queue, per flavor:
    ``max_share × nominal`` of each flavor, to the thousandth of a GPU (so ``floor(max_share ×
    nominal)`` whole-GPU jobs), borrowed GPUs included. A limit naming a
    class no job of the queue has (one no policy defines, say) limits nobody."""

    priority_class: str = Field(pattern=NAME_PATTERN, description="A priority class (spec.priority_class)")
    max_share: float = Field(gt=0, le=1, allow_inf_nan=False,
                             description="Share of the queue's nominal of each flavor the class may hold, in (0, 1]")


class PreemptionPolicy(Contract):
    """What a queue's waiting jobs may preempt to get quota (Kueue's ClusterQueue preemption)."""

    reclaim_within_cohort: Literal["any", "lower-priority", "never"] = Field(
        default="any",
        description="When the queue is below its nominal and that quota is lent: reclaim it from "
                    "borrowers of any priority, only from lower-priority borrowers, or never",
    )
    within_queue: Literal["never", "lower-priority"] = Field(
        default="never",
        description="Preempt the queue's own lower-priority attempts so a higher-priority job fits in its quota",
    )


class QueueConfigured(Event):
    aggregate: ClassVar[str] = "queue"
    type: Literal["QueueConfigured"] = "QueueConfigured"
    name: str = Field(pattern=NAME_PATTERN)
    cohort: str | None = Field(default=None, pattern=NAME_PATTERN)
    allowed_teams: tuple[str, ...] = Field(default=(), description="Teams that may submit; empty = none")
    allowed_users: tuple[str, ...] = Field(default=(), description="Extra users; empty = any user of the teams")
    allowed_priority_classes: tuple[str, ...] = Field(default=(), description="Empty = all classes")
    quotas: tuple[FlavorQuota, ...] = Field(default=(), max_length=64)
    strict_fifo: bool = Field(default=False, description="A head that does not fit blocks the queue")
    budget: GpuHourBudget | None = Field(default=None, description="GPU-hour budget per period; None: unlimited")
    weighted_limit: float | None = Field(
        default=None, ge=0, le=1e12, allow_inf_nan=False,
        description="Most the queue may hold in weighted units: Σ GPUs held × the flavor's weight, borrowed "
                    "GPUs included; None: unlimited",
    )
    class_limits: tuple[ClassLimit, ...] = Field(default=(), max_length=64,
                                                 description="Per priority class: its share of the nominal")
    preemption: PreemptionPolicy = Field(default_factory=PreemptionPolicy)

    @model_validator(mode="after")
    def _unique_flavors(self) -> "QueueConfigured":
        flavors = [q.flavor for q in self.quotas]
        dupes = sorted({f for f in flavors if flavors.count(f) > 1})
        if dupes:
            raise ValueError(f"quotas lists flavor(s) {dupes} more than once")
        classes = [c.priority_class for c in self.class_limits]
        if dupes := sorted({c for c in classes if classes.count(c) > 1}):
            raise ValueError(f"class_limits lists priority class(es) {dupes} more than once; each class once")
        return self


class QueueDeleted(Event):
    aggregate: ClassVar[str] = "queue"
    type: Literal["QueueDeleted"] = "QueueDeleted"
    name: str = Field(pattern=NAME_PATTERN)


class CohortConfigured(Event):
    aggregate: ClassVar[str] = "cohort"
    type: Literal["CohortConfigured"] = "CohortConfigured"
    name: str = Field(pattern=NAME_PATTERN)
    parent: str | None = Field(default=None, pattern=NAME_PATTERN)
    usage_half_life_seconds: float | None = Field(
        default=None, gt=0, le=90 * 86_400,
        description="Fair order blends in usage decayed with this half-life; None: current usage only",
    )
    history_weight: float = Field(default=0.5, ge=0, le=1, description="Share of decayed usage in the blend")
