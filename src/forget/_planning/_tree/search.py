"""How the planner walks the cost model's frontier for one budget, measuring as it goes.

`search_frontier` measures assignments along the frontier near the budget (NOTE [tree
plans measured] in `.planner`); `drop_regions` measures, beside the frontier, the cheapest
fit less one region (NOTE [one region fewer]).

NOTE [close enough]: a measured step costs a few plain steps (the guard's ledger
and the allocator's record see every op), and the search measured points that
could save a fraction of a millisecond over the last fit (benchmarks/measured.md,
"Single measurements behind the NOTEs"). So the search stops once the points
left between the last fit and the first miss are predicted to save no more than
a 64th of the predicted forward (the top candidates' ``forward_s``) over the last
fit: a plan the search stops at is at most that slower, by the cost model, than
one it would have gone on to find. The walk of NOTE [one region fewer] keeps its
variants: each saves one small region's re-run, under this tolerance alone, but
they add up along the walk.

NOTE [one region fewer]: the search walks the frontier the cost model predicts,
so an assignment off it is never measured, however well it would fit; where the
model mispredicts peaks that can lose the plan (benchmarks/measured.md, "Single
measurements behind the NOTEs"). So where the search measured a miss the model
had predicted to fit, the planner also measures the cheapest fitting assignment
with one of its regions or options dropped, lowest predicted peak first: a
fitting one is cheaper by construction (it re-runs less), and the walk goes on
from it, `_MAX_DROPS` measurements at most. Where the model over-predicts, the
walk measures the variants whose prediction, less the error measured on their
source, fits. A variant predicted past the budget by more than the model ever
over-predicted is left unmeasured, and so is one the model predicts to save no
time.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .planner import TreePlanner

__all__ = ["Key", "choices_key", "drop_regions", "search_frontier", "tolerance_s"]

#: An assignment as a dict key: its (name, choice) pairs, sorted.
Key = tuple[tuple[str, str], ...]

# Assignments measured along the frontier for one budget, at most.
_MAX_PROBES = 10
# The search stops once a fitting and a missing point are predicted this close:
# within the plain peak over this (a finer step trades less than 0.8 % of it).
_RESOLUTION = 128
# The search stops where what is left to gain is below the forward's time over this.
_TIME_RESOLUTION = 64  # NOTE [close enough]
# Assignments with one region fewer measured per budget, at most (NOTE [one region fewer]).
_MAX_DROPS = 4


def choices_key(choices: Mapping[str, str]) -> Key:
    """``choices`` as a key of the planner's tables of measured assignments."""
    return tuple(sorted(choices.items()))


def tolerance_s(forward_s: float) -> float:
    """The least predicted saving the search goes on for (NOTE [close enough])."""
    return forward_s / _TIME_RESOLUTION


def search_frontier(planner: TreePlanner, budget_bytes: int) -> None:
    """Measure assignments along the frontier near the budget (NOTE [tree plans measured])."""
    predicted = [peak for peak, _ in planner.frontier]
    extras = [extra for _, extra in planner.frontier]
    lo, hi = -1, len(predicted)  # the last index known to fit, the first known not to
    i = min(max(bisect_right(predicted, budget_bytes) - 1, 0), hi - 1)
    step = 1
    for _ in range(_MAX_PROBES):
        peak = planner.peak(planner.choices_at(i))
        if peak <= budget_bytes:
            lo, nxt = i, i + step
        else:
            # The points below likely miss by as much as this one did: step at least
            # past the last one predicted to fit with that error.
            corrected = bisect_right(predicted, budget_bytes - (peak - predicted[i])) - 1
            hi, nxt = i, min(i - step, corrected)
            if corrected < 0 and lo < 0:
                break  # none is predicted to fit with that error: NOTE [least on demand]
        step *= 2
        known = lo >= 0 and hi < len(predicted)
        if hi - lo <= 1 or (
            known and predicted[hi] - predicted[lo] <= planner.plain_peak // _RESOLUTION
        ):
            break
        # NOTE [close enough]: no point left between them is predicted to save more.
        if lo >= 0 and extras[lo] - extras[hi - 1] <= planner.tolerance_s:
            break
        i = nxt if lo < nxt < hi else (lo + hi) // 2


def drop_regions(planner: TreePlanner, budget_bytes: int) -> None:
    """Measure the cheapest fitting assignment less one region (NOTE [one region fewer])."""
    missed = any(
        planner.predicted_peak(choices) <= budget_bytes < peak for choices, peak in planner.tried()
    )
    tries = 0
    while tries < _MAX_DROPS:
        fitting = [(c, peak) for c, peak in planner.fitting(budget_bytes) if c]
        if not fitting:
            return
        best, best_peak = min(fitting, key=lambda cp: planner.extra_s(cp[0]))
        variants = [{k: v for k, v in best.items() if k != name} for name in best]
        # Only a variant predicted to save time is worth a step: a region whose option
        # was timed at no extra cost (regenerate, say) saves nothing dropped.
        cost = planner.extra_s(best)
        untried = [
            v
            for v in variants
            if choices_key(v) not in planner.measured and planner.extra_s(v) < cost
        ]
        if not missed:  # the model foresaw every miss: only where it over-predicted
            error = best_peak - planner.predicted_peak(best)
            untried = [v for v in untried if planner.predicted_peak(v) + error <= budget_bytes]
        else:  # none predicted to miss by more than the model ever over-predicted
            over = max(planner.predicted_peak(c) - peak for c, peak in planner.measured.values())
            untried = [v for v in untried if planner.predicted_peak(v) - over <= budget_bytes]
        for variant in sorted(untried, key=planner.predicted_peak)[: _MAX_DROPS - tries]:
            tries += 1
            if planner.peak(variant) <= budget_bytes:
                break  # a cheaper fit: drop from it next
        else:
            return
