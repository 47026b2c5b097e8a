"""Solve a module tree for a budget: the exact Pareto solver of its cost model.

`solve_tree` returns the `TreeSchedule` with the least extra time whose step
peak, in the model of NOTE [tree cost model] (`._tree`), fits a budget;
`tree_frontier` gives the whole trade-off from the same cached solve.

NOTE [tree Pareto solver]: every formula of NOTE [tree cost model] is
non-decreasing in each child's figures, so a subtree's assignment that another
beats or ties on held, peak and extra at once can be dropped, whatever its
ancestors choose. Bottom-up, each node keeps that Pareto set; children combine
left to right through a state, child ``(h, p, e)`` taking ``(H, P, E)`` to
``(H + h, max(P, H + p), E + e)``, pruned the same way, so the result is exact.
A node keeps two sets, for the top level and inside a region (in-region options
only), one list when they agree; states link back, so the assignment is rebuilt
by walking the links. Byte figures are rounded up to units ``u`` for pruning
only; the exact figures ride along and judge the plan, so it always fits. The
root's peak sums at most ``2N + 1`` rounded terms for ``N`` nodes, so the plan
for ``B`` is at least as fast as the exact optimum for ``B - (2N + 1)(u - 1)``
and the least budget reported exceeds the exact least by at most that. ``u = 1``
(the default) is exact; sets stay small for repeated layers but can grow
exponentially when every figure differs, which a coarser unit bounds. A prune
sorts and keeps a staircase of (peak, extra): ``O(n log n)``.
"""

from __future__ import annotations

import functools
import numbers
import operator
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from .._errors import BudgetInfeasibleError
from ._solve import _check_budget
from ._tree import FORGET, KEEP, Tree, TreeNode, TreeOption, _check_tree
from ._units import format_bytes

__all__ = ["TreeSchedule", "solve_tree", "tree_frontier", "tree_min_feasible_bytes"]


@dataclass(frozen=True)
class TreeSchedule:
    """A plan for a module tree: a choice per node, and what the model predicts for it.

    Attributes:
        choices: node name to choice, for the nodes not kept (``"forget"`` or a
            leaf option's name), in execution order; a node not named is kept.
        peak_bytes: predicted step peak (``base_bytes`` included), exact bytes.
        extra_s: predicted seconds added to the plain step.
        held_bytes: bytes the root holds from its forward to its backward.
        budget_bytes: the budget it was planned for, or None.
    """

    choices: dict[str, str]
    peak_bytes: int
    extra_s: float
    held_bytes: int
    budget_bytes: int | None = None

    def __str__(self) -> str:
        budget = "" if self.budget_bytes is None else f", budget {format_bytes(self.budget_bytes)}"
        lines = [f"tree plan: peak {format_bytes(self.peak_bytes)}{budget}, +{self.extra_s:.4g} s"]
        lines += [f"  {name}: {choice}" for name, choice in self.choices.items()]
        return "\n".join(lines if self.choices else [*lines, "  (every node kept)"])


def solve_tree(tree: Tree, budget_bytes: int, *, unit_bytes: int = 1) -> TreeSchedule:
    """Choose, for every module of the tree, how to run it so the step fits the budget.

    Forgetting a module keeps only its inputs through the forward and runs it
    once more in backward; a leaf option (a policy keep, regenerate, offload)
    trades less. The plan has the least extra time among every assignment whose
    peak, in the model of NOTE [tree cost model], fits ``budget_bytes``. The
    solve is cached per tree and unit, so planning many budgets costs one.

    Args:
        tree: the modules and their figures.
        budget_bytes: the most the step may allocate, ``base_bytes`` included.
        unit_bytes: resolution of the pruning; 1 (exact) by default. A coarser
            unit bounds the work, and the plan may be slower than the exact
            optimum by what ``(2 * len(tree) + 1) * (unit_bytes - 1)`` bytes buy
            (NOTE [tree Pareto solver]); it always fits.

    Returns:
        The plan, whose ``peak_bytes <= budget_bytes``.

    Raises:
        BudgetInfeasibleError: no assignment fits; the message names the least
            budget that does (`tree_min_feasible_bytes`).
        TypeError, ValueError: a tree, budget or unit of the wrong type or sign.

    Example:
        >>> from forget.schedules import Tree, TreeNode, solve_tree
        >>> layers = tuple(
        ...     TreeNode(f"enc.{i}", own_bytes=400, input_bytes=100, forward_s=1.0)
        ...     for i in range(4)
        ... )
        >>> tree = Tree(TreeNode("enc", layers, input_bytes=100, forward_s=4.0), base_bytes=1000)
        >>> plan = solve_tree(tree, 2000)
        >>> plan.choices, plan.peak_bytes, plan.extra_s
        ({'enc.0': 'forget', 'enc.1': 'forget'}, 2000, 2.0)
    """
    budget = _check_budget(budget_bytes)
    peaks, points = _solved(_check_tree(tree), _check_unit(unit_bytes))
    i = bisect_right(peaks, budget) - 1
    if i < 0:
        raise _infeasible(tree, budget, peaks[0])
    peak, extra, held, entry = points[i]
    choices: dict[str, str] = {}
    _rebuild(tree.root, entry, choices)
    return TreeSchedule(choices, peak, extra, held, budget)


def tree_frontier(tree: Tree, *, unit_bytes: int = 1) -> tuple[tuple[int, float], ...]:
    """Return the memory/time trade-off of the tree: every (peak, extra) no plan beats.

    Args:
        tree: the modules and their figures.
        unit_bytes: as for `solve_tree`.

    Returns:
        ``(peak_bytes, extra_s)`` pairs, peaks rising and extra times falling:
        the first is the least feasible budget, the last the fastest plan (0 s
        extra). `solve_tree` for a budget returns the last pair that fits.
    """
    return tuple(p[:2] for p in _solved(_check_tree(tree), _check_unit(unit_bytes))[1])


def tree_min_feasible_bytes(tree: Tree, *, unit_bytes: int = 1) -> int:
    """Return the least budget, in exact bytes, for which `solve_tree` has a plan.

    `solve_tree` succeeds at this budget and raises `BudgetInfeasibleError` one
    byte below it, for the same ``unit_bytes``.
    """
    return _solved(_check_tree(tree), _check_unit(unit_bytes))[0][0]


# --- helpers -----------------------------------------------------------------------------


def _check_unit(unit_bytes: object) -> int:
    if isinstance(unit_bytes, bool) or not isinstance(unit_bytes, numbers.Integral):
        raise TypeError(f"forget: unit_bytes must be an int, got {type(unit_bytes).__name__}")
    if unit_bytes < 1:
        raise ValueError(f"forget: unit_bytes must be >= 1, got {unit_bytes}")
    return int(unit_bytes)


def _infeasible(tree: Tree, budget: int, minimum: int) -> BudgetInfeasibleError:
    return BudgetInfeasibleError(
        f"forget: no tree plan fits budget_bytes={budget} for this {len(tree)}-node tree; "
        f"the smallest feasible budget is {minimum} bytes ({format_bytes(minimum)}), because "
        f"even the leanest plan holds base_bytes={tree.base_bytes} and what its leanest "
        f"choices keep; raise the budget to at least {minimum} bytes, or offer more choices "
        "(forget, offload) on the modules that hold the most",
        budget_bytes=budget,
        min_feasible_bytes=minimum,
    )


# --- the solver (NOTE [tree Pareto solver]) --------------------------------------------------

# An entry: (held units, peak units, extra_s, held bytes, peak bytes, link); the first
# three are what pruning compares. A node's entry links (choice, state link); a
# state link is None or (previous state link, the child's entry), children last-first.
_Entry = tuple[int, int, float, int, int, Any]
_START: _Entry = (0, 0, 0.0, 0, 0, None)
_KEY = operator.itemgetter(0, 1, 2)


_Point = tuple[int, float, int, _Entry]  # step peak, extra_s, held bytes, root entry


@functools.lru_cache(maxsize=8)
def _solved(tree: Tree, unit: int) -> tuple[tuple[int, ...], tuple[_Point, ...]]:
    """The root's exact (peak, extra) frontier, peaks rising: (peaks, points)."""
    top, _ = _fronts(tree.root, unit)
    base, floor = tree.base_bytes, tree.floor_bytes
    ranked = sorted(((max(base + e[4], floor), e[2], e[3], e) for e in top), key=_KEY)
    points: list[_Point] = []
    for point in ranked:
        if not points or point[1] < points[-1][1]:
            points.append(point)
    return tuple(p[0] for p in points), tuple(points)


def _fronts(node: TreeNode, unit: int) -> tuple[list[_Entry], list[_Entry]]:
    """The node's Pareto sets at the top level and inside a forgotten region.

    Recursive, as deep as the tree: module trees are tens of levels deep, not hundreds.
    """
    kids = [_fronts(child, unit) for child in node.children]
    inside_states = _own(node, _combine([inside for _, inside in kids]), unit)
    same = all(top is inside for top, inside in kids)
    top_states = inside_states if same else _own(node, _combine([top for top, _ in kids]), unit)
    i, qi = node.input_bytes, _up(node.input_bytes, unit)
    forgets: list[_Entry] = []
    if node.can_forget:
        fwd = node.forward_s
        forgets = [(qi, qi + s[1], fwd + s[2], i, i + s[4], (FORGET, s[5])) for s in inside_states]

    def front(states: list[_Entry], inside: bool) -> list[_Entry]:
        keeps = [(*s[:5], (KEEP, s[5])) for s in states]
        mine = [_leaf(o, unit) for o in node.options if o.in_regions or not inside]
        return _prune(keeps + forgets + mine)

    inside = front(inside_states, True)
    if same and all(o.in_regions for o in node.options):
        return inside, inside
    return front(top_states, False), inside


def _up(n_bytes: int, unit: int) -> int:
    """``n_bytes`` in whole units, rounded up: pruning compares these, plans exact bytes."""
    return -(-n_bytes // unit)


def _leaf(option: TreeOption, unit: int) -> _Entry:
    held, peak = option.held_bytes, option.peak_bytes
    return (_up(held, unit), _up(peak, unit), option.extra_s, held, peak, (option.name, None))


def _combine(fronts: list[list[_Entry]]) -> list[_Entry]:
    """The Pareto set of (held, peak, extra) so far over the children, left to right."""
    states = [_START]
    for front in fronts:
        states = _prune(
            [
                (H + c[0], max(P, H + c[1]), E + c[2], XH + c[3], max(XP, XH + c[4]), (link, c))
                for H, P, E, XH, XP, link in states
                for c in front
            ]
        )
    return states


def _own(node: TreeNode, states: list[_Entry], unit: int) -> list[_Entry]:
    """The children's states with the node's own bytes on: its kept figures.

    ``(H, P)`` becomes ``(a + H, max(a + H + w, a - t + P))`` (NOTE [tree cost
    model]): non-decreasing in both, so the set stays a Pareto set (only ties
    may appear, which the node's prune drops).
    """
    a, w, t = node.own_bytes, node.work_bytes, node.tail_bytes
    qa, qw, qr = _up(a, unit), _up(w, unit), _up(a - t, unit)
    return [
        (qa + H, max(qa + H + qw, qr + P), E, a + XH, max(a + XH + w, a - t + XP), link)
        for H, P, E, XH, XP, link in states
    ]


def _prune(entries: list[_Entry]) -> list[_Entry]:
    """Drop every entry another beats or ties on the first three figures."""
    entries.sort(key=_KEY)
    kept: list[_Entry] = []
    peaks: list[int] = []  # the staircase of kept (peak, extra): peaks rise,
    extras: list[float] = []  # extras fall; all held at most the current entry's
    for entry in entries:
        peak, extra = entry[1], entry[2]
        at = bisect_right(peaks, peak)
        if at and extras[at - 1] <= extra:
            continue
        kept.append(entry)
        end = at
        while end < len(peaks) and extras[end] >= extra:
            end += 1
        peaks[at:end] = [peak]
        extras[at:end] = [extra]
    return kept


def _rebuild(node: TreeNode, entry: _Entry, choices: dict[str, str]) -> None:
    """Write the choices of ``node``'s subtree that ``entry`` stands for, pre-order."""
    choice, link = entry[5]
    if choice != KEEP:
        choices[node.name] = choice
    if choice not in (KEEP, FORGET):
        return
    picked = []
    while link is not None:
        link, child_entry = link
        picked.append(child_entry)
    for child, child_entry in zip(node.children, reversed(picked), strict=True):
        _rebuild(child, child_entry, choices)
