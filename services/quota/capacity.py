"""Quota arithmetic for one GPU flavor in one cohort tree: guaranteed quota, borrowing, lending.

For each queue ``q`` of the tree, with nominal ``n``, lending limit ``L`` (default: ``n``),
borrowing limit ``B`` (default: unlimited) and usage ``u``:

* its own part is ``min(u, n)``, its borrowed part ``u - min(u, n)``;
* it can lend ``min(L, n - own)``: unused nominal, less what it keeps back (``n - L`` is never lent);
* the tree is consistent when the borrowed parts, summed, fit in what may be lent, summed, and
  no queue borrows more than its ``B``.

A request fits when the tree stays consistent with it added. A queue outside any cohort can
only use its own nominal. Nested cohorts share one pool: the whole tree under the root cohort.

A queue's limits across its flavors (:func:`check_limits`) come on top of the pools: its
weighted limit (``Σ GPUs held × the flavor's weight``) and each priority class's share of its
nominal (``max_share × nominal`` of each flavor, to the thousandth of a GPU), borrowed GPUs
counted in both.

Every amount here is in thousandths of a GPU (``milli``): a quarter-GPU job takes 250 of a
queue's nominal of 8 GPUs (8,000), not a whole GPU. Messages say GPUs (:func:`gpus_text`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from schemas import QueueConfigured, QuotaWaitReason

MILLI = 1000
"""Thousandths of a GPU in one GPU: the unit of every amount in this module."""


def gpus_text(milli: int | float) -> str:
    """An amount in thousandths of a GPU, told in GPUs: 8000 -> '8', 7750 -> '7.75'."""
    return f"{milli / MILLI:g}"


@dataclass(frozen=True)
class Limits:
    nominal: int
    borrowing_limit: int | None = None
    lending_limit: int | None = None

    @classmethod
    def in_milli(cls, nominal: int, borrowing_limit: int | None, lending_limit: int | None) -> Limits:
        """A queue's quota for one flavor, configured in GPUs, in thousandths."""
        def milli(gpus: int | None) -> int | None:
            return None if gpus is None else gpus * MILLI
        return cls(nominal * MILLI, milli(borrowing_limit), milli(lending_limit))

    @property
    def lendable_cap(self) -> int:
        return self.nominal if self.lending_limit is None else min(self.lending_limit, self.nominal)


@dataclass(frozen=True)
class Verdict:
    fits: bool
    borrowed: int = 0  # how much of the request is borrowed
    reason: QuotaWaitReason | None = None
    message: str = ""


@dataclass
class Pool:
    """One flavor in one cohort tree (``cohort`` None: a lone queue)."""

    flavor: str
    cohort: str | None
    limits: dict[str, Limits] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)
    # Derived, computed on first use after limits and used are filled in, kept up to date by charge().
    _totals: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    _borrowers: str | None = field(default=None, repr=False, compare=False)

    def copy(self) -> Pool:
        """A copy whose usage can change without changing this pool's (the limits are shared:
        they never change)."""
        return Pool(self.flavor, self.cohort, self.limits, dict(self.used), self._totals, self._borrowers)

    def own(self, q: str, used: int | None = None) -> int:
        u = self.used.get(q, 0) if used is None else used
        return min(u, self.limits[q].nominal)

    def borrowed(self, q: str, used: int | None = None) -> int:
        u = self.used.get(q, 0) if used is None else used
        return u - self.own(q, u)

    def lendable(self, q: str, used: int | None = None) -> int:
        return max(0, min(self.limits[q].lendable_cap, self.limits[q].nominal - self.own(q, used)))

    def totals(self) -> tuple[int, int]:
        """(borrowed, lendable) over the tree."""
        if self._totals is None:
            self._totals = (sum(self.borrowed(q) for q in self.limits), sum(self.lendable(q) for q in self.limits))
        return self._totals

    def borrowers(self) -> str:
        if self._borrowers is None:
            self._borrowers = ", ".join(
                f"{p} {gpus_text(self.borrowed(p))}" + (f" (borrowingLimit {gpus_text(self.limits[p].borrowing_limit)})"
                                            if self.limits[p].borrowing_limit is not None else "")
                for p in sorted(self.limits) if self.borrowed(p) > 0
            ) or "none"
        return self._borrowers

    def ceiling(self, q: str) -> int:
        """The most the queue could ever hold of this flavor: its nominal plus what it may
        borrow when the rest of the tree is idle."""
        lim = self.limits[q]
        if self.cohort is None:
            return lim.nominal
        others = sum(other.lendable_cap for name, other in self.limits.items() if name != q)
        return lim.nominal + (others if lim.borrowing_limit is None else min(others, lim.borrowing_limit))

    def lent_by(self) -> dict[str, int]:
        """What each queue's unused nominal is covering of the others' borrowing, filling lenders
        in name order (an attribution for reporting; the constraint is on the totals)."""
        borrowed, _ = self.totals()
        out = {}
        for q in sorted(self.limits):
            take = min(self.lendable(q), borrowed)
            out[q] = take
            borrowed -= take
        return out

    def check(self, q: str, request: int) -> Verdict:
        lim = self.limits[q]
        used = self.used.get(q, 0)
        after = used + request
        borrowed_after = self.borrowed(q, after)
        head = f"queue {q} nominal {self.flavor} {gpus_text(lim.nominal)}, used {gpus_text(used)}"
        need = gpus_text(request)
        if self.cohort is None:
            if borrowed_after == 0:
                return Verdict(True)
            return Verdict(False, reason=QuotaWaitReason.NOMINAL_EXHAUSTED,
                           message=f"{head}; needs {need} more; no cohort to borrow from")
        if lim.borrowing_limit is not None and borrowed_after > lim.borrowing_limit:
            return Verdict(False, reason=QuotaWaitReason.BORROWING_LIMIT,
                           message=f"{head} (borrowed {gpus_text(self.borrowed(q))}); needs {need}: would borrow "
                                   f"{gpus_text(borrowed_after)}, above its borrowingLimit "
                                   f"{gpus_text(lim.borrowing_limit)}")
        # One computation gives the verdict and the numbers its message states (docs/quota.md,
        # "What a reason may claim"): the message tells the very amounts the test compared.
        total_borrowed, total_lendable = self.totals()
        others_lendable = total_lendable - self.lendable(q)
        if borrowed_after == 0:
            # Even within its own nominal a queue must find that quota unlent: what the others
            # borrowed has to stay covered by what is still lendable once it takes its share.
            if total_borrowed - self.borrowed(q) <= others_lendable + self.lendable(q, after):
                return Verdict(True)
            return Verdict(False, reason=QuotaWaitReason.NOMINAL_LENT,
                           message=f"{head}; needs {need}; its unused quota is lent out in cohort {self.cohort}; "
                                   f"borrowed by: {self.borrowers()}")
        # Borrowing: the others' lendable quota less everything already borrowed in the tree (this
        # queue's own borrowing included: it is lent already) is what is free to lend.
        extra = borrowed_after - self.borrowed(q)
        free = others_lendable - total_borrowed
        if extra <= free:
            return Verdict(True, borrowed=extra)
        return Verdict(False, reason=QuotaWaitReason.COHORT_EXHAUSTED,
                       message=f"{head}; needs {need}, would borrow {gpus_text(extra)}; cohort {self.cohort} has "
                               f"{gpus_text(max(0, free))} {self.flavor} of quota free to lend; "
                               f"borrowed by: {self.borrowers()}")

    def charge(self, q: str, request: int) -> None:
        borrowed, lendable = self.totals()
        before_b, before_l = self.borrowed(q), self.lendable(q)
        self.used[q] = self.used.get(q, 0) + request
        self._totals = (borrowed - before_b + self.borrowed(q), lendable - before_l + self.lendable(q))
        self._borrowers = None


# -- a queue's limits across flavors ----------------------------------------------------------------


def class_cap(max_share: float, nominal: int) -> int:
    """Thousandths of a GPU of a flavor a priority class may hold in a queue whose nominal is
    ``nominal`` GPUs: ``floor(max_share × nominal × 1000)`` (rounded first, so 0.29 × 100 GPUs is
    29 GPUs, not 28.999). Whole-GPU jobs fit ``floor(max_share × nominal)`` of them, as before."""
    return math.floor(round(max_share * nominal * MILLI, 6))


def weighted_use(queue: QueueConfigured, held: Mapping[str, int]) -> float:
    """The queue's holding in weighted units: GPUs held of each flavor (flavor -> thousandths)
    times its weight."""
    return sum(held.get(fq.flavor, 0) * fq.weight for fq in queue.quotas) / MILLI


def check_limits(queue: QueueConfigured, flavor: str, request: int, priority_class: str,
                 held: Mapping[str, int], class_held: int) -> Verdict:
    """Whether ``request`` (thousandths of a GPU) of ``flavor`` for a job of ``priority_class`` stay within the
    queue's weighted limit and the class's limit, given what the queue holds (flavor -> GPUs)
    and what the class holds of ``flavor`` in it. Pools are checked apart (:meth:`Pool.check`)."""
    fq = next(fq for fq in queue.quotas if fq.flavor == flavor)
    if request == 0:  # takes nothing: fits even where a lowered limit is already exceeded
        return Verdict(True)
    if queue.weighted_limit is not None:
        use, more = weighted_use(queue, held), request * fq.weight / MILLI
        if use + more > queue.weighted_limit and not math.isclose(use + more, queue.weighted_limit):
            return Verdict(False, reason=QuotaWaitReason.WEIGHTED_LIMIT, message=(
                f"queue {queue.name} holds {use:g} weighted units of its weighted_limit {queue.weighted_limit:g}; "
                f"needs {gpus_text(request)} {flavor} × weight {fq.weight:g} = {more:g} more: "
                f"would hold {use + more:g}"))
    for limit in queue.class_limits:
        if limit.priority_class != priority_class:
            continue
        cap = class_cap(limit.max_share, fq.nominal)
        if class_held + request > cap:
            return Verdict(False, reason=QuotaWaitReason.CLASS_LIMIT, message=(
                f"priority class {priority_class} holds {gpus_text(class_held)} {flavor} in queue {queue.name}; "
                f"needs {gpus_text(request)}: would hold {gpus_text(class_held + request)}, above its class limit "
                f"{gpus_text(cap)} "
                f"({limit.max_share:g} × nominal {fq.nominal})"))
    return Verdict(True)


# -- GPU-hour budgets -------------------------------------------------------------------------------
#
# A queue's budget (``QueueConfigured.budget``) is spent in weighted GPU-hours (GPU-hours of each
# flavor × the flavor's weight) per calendar period (UTC). The quota core decides with these
# functions and every report (CLI, API, console) states budget spent and left with them, on the
# log's clock, so they agree.


def period_start(period: str, at: datetime) -> datetime:
    """The start of the budget period (``day``, ``week`` from Monday, ``month``) that holds ``at``."""
    day = at.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day
    if period == "week":
        return day - timedelta(days=day.weekday())
    return day.replace(day=1)


def next_period(period: str, start: datetime) -> datetime:
    """The start of the budget period after the one starting at ``start`` (when the budget renews)."""
    if period == "day":
        return start + timedelta(days=1)
    if period == "week":
        return start + timedelta(days=7)
    return (start.replace(day=28) + timedelta(days=4)).replace(day=1)


def flavor_weight(queue: QueueConfigured | None, flavor: str) -> float:
    """The weight of one GPU of ``flavor`` in the queue (1 for a flavor or a queue it does not know)."""
    if queue is None:
        return 1.0
    return next((fq.weight for fq in queue.quotas if fq.flavor == flavor), 1.0)


def weighted_gpu_hours(queue: QueueConfigured, gpu_hours: Mapping[str, float]) -> float:
    """GPU-hours of each flavor (flavor -> GPU-hours) in the queue's weighted units: what a
    budget is spent in."""
    return sum(hours * flavor_weight(queue, flavor) for flavor, hours in gpu_hours.items())


def budget_spent(queue: QueueConfigured, gpu_hours: Mapping[str, float]) -> float:
    """Weighted GPU-hours the queue has spent this period, given the GPU-hours of each flavor its
    reservations held in the period (:func:`period_start` up to now), rounded to the thousandth."""
    return round(weighted_gpu_hours(queue, gpu_hours), 3)


def budget_left(queue: QueueConfigured, spent: float) -> float | None:
    """Weighted GPU-hours left of the queue's budget this period (negative: overspent); None
    for a queue without a budget."""
    if queue.budget is None:
        return None
    return round(queue.budget.gpu_hours - spent, 3)
