"""Scheduler adapter: the shared decision loop around :class:`SchedulerCore`, its configuration
from the environment, the fragmentation gauges it exports after every cycle, and the folded state
kept out of the garbage collector's way (:func:`freeze_state`).

Environment (docs/scheduling.md):

* ``GPUSCHED_SCHEDULER_POLICY``: ``first-fit``, ``best-fit`` (default) or ``fgd``;
* ``GPUSCHED_PREEMPTION``: ``on`` (default) or ``off``;
* ``GPUSCHED_PREEMPTION_MAX_PER_WINDOW`` (default 20) preemptions in any
  ``GPUSCHED_PREEMPTION_WINDOW_S`` (default 300) seconds.

The three preemption variables are defaults: a PolicyConfigured in the log (``gpusched apply``)
replaces them from its event on.
"""

from __future__ import annotations

import gc
import re
from datetime import datetime

from prometheus_client import Gauge

from runtime.loop import DecisionService, run_service
from runtime.settings import ConfigError, env_choice, env_number, env_value
from schemas import Event
from schemas.envelope import NAME_PATTERN
from services.scheduler.domain import PreemptionLimits, SchedulerCore
from services.scheduler.placement import Policy

FRAGMENTATION = Gauge(
    "gpusched_scheduler_fragmentation_ratio",
    "Share of free GPUs of the flavor on nodes with fewer free than the typical request (docs/scheduling.md)",
    ["flavor"],
)
LARGEST_GANG = Gauge(
    "gpusched_scheduler_largest_placeable_gang",
    "Most GPUs one all-or-nothing job with equal per-node shares could get now",
    ["flavor"],
)
FREE_GPUS = Gauge("gpusched_scheduler_free_gpus", "Whole free GPUs on schedulable nodes", ["flavor"])


def export_fragmentation(core: SchedulerCore) -> None:
    for f in core.fragmentation():
        FRAGMENTATION.labels(flavor=f.flavor).set(f.ratio)
        LARGEST_GANG.labels(flavor=f.flavor).set(f.largest_placeable_gang)
        FREE_GPUS.labels(flavor=f.flavor).set(f.free)


class ObservedSchedulerCore(SchedulerCore):
    """The core, with the gauges brought up to date after each cycle that looked at anything."""

    def decide(self, now: datetime) -> list[Event]:
        looked = bool(self._dirty) or self._wake_at is not None
        out = super().decide(now)
        if looked:
            export_fragmentation(self)
        return out


def build_core(settings, clock) -> SchedulerCore:
    policy = Policy(env_choice("GPUSCHED_SCHEDULER_POLICY", Policy.BEST_FIT.value, tuple(p.value for p in Policy)))
    by_flavor = flavor_policies(env_value("GPUSCHED_SCHEDULER_POLICY_BY_FLAVOR", "") or "")
    lost_after = env_number("GPUSCHED_CLUSTER_LOST_AFTER_S", 90.0, minimum=1, maximum=86_400)
    return ObservedSchedulerCore(policy, preemption=preemption_limits(), flavor_policies=by_flavor,
                                 cluster_lost_after_s=lost_after)


def preemption_limits() -> PreemptionLimits:
    """The preemption limits the environment gives: in force until a PolicyConfigured sets them."""
    return PreemptionLimits(
        enabled=env_choice("GPUSCHED_PREEMPTION", "on", ("on", "off")) == "on",
        max_per_window=int(env_number("GPUSCHED_PREEMPTION_MAX_PER_WINDOW", 20, minimum=0, maximum=100_000, integer=True)),
        window_seconds=env_number("GPUSCHED_PREEMPTION_WINDOW_S", 300.0, minimum=1, maximum=86_400),
    )


def flavor_policies(text: str) -> dict[str, Policy]:
    """``GPUSCHED_SCHEDULER_POLICY_BY_FLAVOR``: ``flavor=policy`` pairs separated by commas, e.g.
    ``a100=fgd-spread,l4=best-fit``; the other flavors keep GPUSCHED_SCHEDULER_POLICY."""
    name = "GPUSCHED_SCHEDULER_POLICY_BY_FLAVOR"
    accepted = ", ".join(p.value for p in Policy)
    out: dict[str, Policy] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        flavor, sep, value = (x.strip() for x in item.partition("="))
        if not sep or not re.fullmatch(NAME_PATTERN, flavor):
            raise ConfigError(f"{name}: {item!r} is not flavor=policy; accepted: e.g. a100=fgd-spread,l4=best-fit")
        if flavor in out:
            raise ConfigError(f"{name}: flavor {flavor!r} is given twice")
        try:
            out[flavor] = Policy(value)
        except ValueError:
            raise ConfigError(f"{name}: {item!r} names policy {value!r}; accepted: {accepted}") from None
    return out


class SchedulerService(DecisionService):
    """The shared decision loop; after each rebuild, the folded state is frozen."""

    async def rebuild(self, js) -> int:
        end = await super().rebuild(js)
        freeze_state()
        return end


def freeze_state() -> None:
    """Collect once, then freeze what is left out of later collections. The folded state lives
    as long as the process; unfrozen, every full collection walks all of it, in whichever cycle
    the collector's counters pick (at 50,000 pending, most of a first cycle: docs/performance.md).
    Frozen objects that the state lets go of are still freed by their reference counts; only a
    reference cycle among them would stay, and the state holds none."""
    gc.collect()
    gc.freeze()


def main() -> None:
    run_service("scheduler", build_core, SchedulerService)


if __name__ == "__main__":
    main()
