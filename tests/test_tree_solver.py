"""Tests of the module-tree planner (forget.schedules.solve_tree): pure, no torch.

The solver is checked against brute force over every assignment of small random
trees, on figures checked by hand on a two-level model, at the budget boundary,
and under a coarse unit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forget._errors import BudgetInfeasibleError
from forget.schedules import (
    Tree,
    TreeFigures,
    TreeNode,
    TreeOption,
    solve_tree,
    tree_figures,
    tree_frontier,
    tree_min_feasible_bytes,
)

PROFILE = settings(derandomize=True, deadline=None, max_examples=150)

# Every assignment of a subtree, with its figures: (choices, held, peak, extra).
Assignment = tuple[dict[str, str], int, int, float]


def brute_force(node: TreeNode, inside: bool = False) -> list[Assignment]:
    """Enumerate every assignment of ``node``'s subtree, straight from the model's rules.

    ``inside``: under a forgotten ancestor, where only ``in_regions`` options run.
    """

    def children(inner: bool) -> list[Assignment]:
        combos: list[Assignment] = [({}, 0, 0, 0.0)]  # held, peak, extra so far
        for child in node.children:
            combos = [
                ({**c, **cc}, held + h, max(peak, held + p), extra + e)
                for c, held, peak, extra in combos
                for cc, h, p, e in brute_force(child, inner)
            ]
        return combos

    a, w, t, out = node.own_bytes, node.work_bytes, node.tail_bytes, []
    for c, held, peak, extra in children(inside):
        out.append((c, a + held, max(a + held + w, a - t + peak), extra))
    if node.can_forget:
        for c, held, peak, extra in children(True):
            c = {**c, node.name: "forget"}
            peak = node.input_bytes + max(a + held + w, a - t + peak)
            out.append((c, node.input_bytes, peak, node.forward_s + extra))
    for o in node.options:
        if o.in_regions or not inside:
            out.append(({node.name: o.name}, o.held_bytes, o.peak_bytes, o.extra_s))
    return out


def best_extra(every: list[Assignment], base: int, budget: int, floor: int = 0) -> float | None:
    fits = [extra for _, _, peak, extra in every if max(base + peak, floor) <= budget]
    return min(fits) if fits else None


@st.composite
def trees(draw: Any, max_nodes: int = 8, min_time: int = 0) -> Tree:
    """Random trees of up to ``max_nodes`` nodes; times are whole seconds, so sums are exact."""
    n = draw(st.integers(1, max_nodes))
    parents = [draw(st.integers(0, i - 1)) for i in range(1, n)]
    built: dict[int, TreeNode] = {}
    for i in reversed(range(n)):
        options = []
        for k in range(draw(st.integers(0, 2))):
            held = draw(st.integers(0, 60))
            options.append(
                TreeOption(
                    f"opt{k}",
                    held,
                    held + draw(st.integers(0, 60)),
                    float(draw(st.integers(min_time, 4))),
                    in_regions=draw(st.booleans()),
                )
            )
        built[i] = TreeNode(
            f"m{i}",
            tuple(built[j] for j in range(i + 1, n) if parents[j - 1] == i),
            own_bytes=(own := draw(st.integers(0, 80))),
            tail_bytes=draw(st.sampled_from([0, own, own // 2])),
            input_bytes=draw(st.integers(0, 60)),
            forward_s=float(draw(st.integers(min_time, 4))),
            options=tuple(options),
            can_forget=draw(st.integers(0, 3)) > 0,
            work_bytes=draw(st.sampled_from([0, 0, *range(5, 80, 15)])),
        )
    # A floor (the gradients at backward's end) now below every plan, now above some.
    floor = draw(st.sampled_from([0, 0, *range(50, 400, 25)]))
    return Tree(built[0], base_bytes=draw(st.integers(0, 100)), floor_bytes=floor)


def interesting_budgets(every: list[Assignment], base: int, floor: int = 0) -> list[int]:
    peaks = {max(base + peak, floor) for _, _, peak, _ in every}
    return sorted({0, max(peaks) + 1} | peaks | {p - 1 for p in peaks if p})


# --- brute force ---------------------------------------------------------------------------


@PROFILE
@given(trees())
def test_solve_tree_matches_brute_force_on_every_budget(tree):
    every = brute_force(tree.root)
    base, floor = tree.base_bytes, tree.floor_bytes
    # The model as the solver evaluates it agrees with the enumeration, to the byte;
    # no step peaks below the floor (NOTE [tree cost model]).
    for choices, held, peak, extra in every[:: max(1, len(every) // 100)]:
        assert tree_figures(tree, choices) == (held, max(base + peak, floor), extra)
    # The frontier is the brute-force Pareto front of (step peak, extra).
    front: list[tuple[int, float]] = []
    for peak, extra in sorted((max(base + p, floor), e) for _, _, p, e in every):
        if not front or extra < front[-1][1]:
            front.append((peak, extra))
    assert tree_frontier(tree) == tuple(front)
    least = front[0][0]
    assert tree_min_feasible_bytes(tree) == least
    last = None
    for budget in interesting_budgets(every, base, floor):
        expected = best_extra(every, base, budget, floor)
        if expected is None:
            with pytest.raises(BudgetInfeasibleError) as info:
                solve_tree(tree, budget)
            assert info.value.min_feasible_bytes == least
            continue
        plan = solve_tree(tree, budget)
        assert plan.extra_s == expected
        assert plan.peak_bytes <= budget
        assert plan.budget_bytes == budget
        assert "keep" not in plan.choices.values()
        assert tree_figures(tree, plan.choices) == (plan.held_bytes, plan.peak_bytes, expected)
        assert last is None or expected <= last  # never dearer with more memory
        last = expected


@PROFILE
@given(trees())
def test_least_feasible_budget_works_and_one_byte_less_raises(tree):
    least = tree_min_feasible_bytes(tree)
    assert solve_tree(tree, least).peak_bytes == least
    if least == 0:
        return
    with pytest.raises(BudgetInfeasibleError) as info:
        solve_tree(tree, least - 1)
    assert (info.value.budget_bytes, info.value.min_feasible_bytes) == (least - 1, least)
    assert str(info.value).startswith("forget: no tree plan fits")
    assert f"smallest feasible budget is {least} bytes" in str(info.value)


@PROFILE
@given(trees(min_time=1), st.integers(0, 50))
def test_keep_everything_when_the_budget_allows(tree, spare):
    kept = tree_figures(tree, {})
    plan = solve_tree(tree, kept.peak_bytes + spare)
    # Every other choice costs time here, so nothing else is as fast.
    assert plan.choices == {}
    assert (plan.held_bytes, plan.peak_bytes, plan.extra_s) == tuple(kept)
    assert tree_frontier(tree)[-1] == (kept.peak_bytes, 0.0)


# --- quantisation --------------------------------------------------------------------------


@settings(PROFILE, max_examples=40)
@given(trees(), st.sampled_from([2, 16, 100]))
def test_coarse_unit_plans_fit_exactly_and_lose_at_most_the_bound(tree, unit):
    every = brute_force(tree.root)
    base, floor = tree.base_bytes, tree.floor_bytes
    margin = (2 * len(tree) + 1) * (unit - 1)  # NOTE [tree Pareto solver]
    least = tree_min_feasible_bytes(tree, unit_bytes=unit)
    assert tree_min_feasible_bytes(tree) <= least <= tree_min_feasible_bytes(tree) + margin
    for budget in [*interesting_budgets(every, base, floor), least, max(least - 1, 0)]:
        exact = best_extra(every, base, budget, floor)
        within_margin = best_extra(every, base, budget - margin, floor)
        try:
            plan = solve_tree(tree, budget, unit_bytes=unit)
        except BudgetInfeasibleError as error:
            assert budget < least == error.min_feasible_bytes
            assert within_margin is None
            continue
        assert budget >= least
        figures = tree_figures(tree, plan.choices)
        assert figures == (plan.held_bytes, plan.peak_bytes, plan.extra_s)
        assert figures.peak_bytes <= budget
        assert exact is not None and plan.extra_s >= exact
        assert within_margin is None or plan.extra_s <= within_margin


def test_coarse_unit_can_miss_a_plan_that_fits_exactly():
    # Rounded to 100-byte units, both options peak at 2 units, and the faster one
    # hides the leaner; the exact solve keeps both.
    root = TreeNode(
        "m",
        own_bytes=300,
        can_forget=False,
        options=(TreeOption("lean", 0, 101, 1.0), TreeOption("fast", 0, 150, 0.5)),
    )
    tree = Tree(root)
    assert tree_frontier(tree) == ((101, 1.0), (150, 0.5), (300, 0.0))
    assert solve_tree(tree, 120).choices == {"m": "lean"}
    assert tree_frontier(tree, unit_bytes=100) == ((150, 0.5), (300, 0.0))
    with pytest.raises(BudgetInfeasibleError) as info:
        solve_tree(tree, 120, unit_bytes=100)
    assert info.value.min_feasible_bytes == 150


# --- a two-level model, by hand ------------------------------------------------------------


def encoder_model() -> Tree:
    """An embedding, a two-layer encoder, a head; only the encoder and its layers forget."""
    layers = tuple(
        TreeNode(f"encoder.{i}", own_bytes=300, input_bytes=100, forward_s=4.0) for i in range(2)
    )
    return Tree(
        TreeNode(
            "model",
            (
                TreeNode("embed", own_bytes=800, input_bytes=10, forward_s=1.0, can_forget=False),
                TreeNode("encoder", layers, input_bytes=100, forward_s=8.0),
                TreeNode("head", own_bytes=500, input_bytes=100, forward_s=2.0, can_forget=False),
            ),
            own_bytes=50,
            forward_s=11.0,
            can_forget=False,
        ),
        base_bytes=1000,
    )


ENCODER_CASES = {
    # keep: model held 50 + 800 + 600 + 500; peak 50 + max(800, 800 + 600, 1400 + 500)
    "keep-all": ({}, (1950, 1000 + 1950, 0.0)),
    # encoder.0 forgotten: held 100, peak 100 + 300; encoder keep: held 100 + 300,
    # peak max(400, 100 + 300); model peak 50 + max(800, 800 + 400, 1200 + 500)
    "one-layer": ({"encoder.0": "forget"}, (1750, 1000 + 1750, 4.0)),
    # encoder keep: held 200, peak max(400, 100 + 400); model 50 + max(800, 1300, 1000 + 500)
    "layers": ({"encoder.0": "forget", "encoder.1": "forget"}, (1550, 1000 + 1550, 8.0)),
    # encoder forgotten: held 100, peak 100 + 600; model 50 + max(800, 1500, 900 + 500)
    "encoder": ({"encoder": "forget"}, (1450, 1000 + 1550, 8.0)),
    # encoder forgotten, encoder.0 inside: encoder peak 100 + max(400, 100 + 300),
    # extra 8 + 4; model 50 + max(800, 800 + 500, 900 + 500)
    "nested": ({"encoder": "forget", "encoder.0": "forget"}, (1450, 1000 + 1450, 12.0)),
    # both layers inside: encoder peak 100 + max(400, 100 + 400), extra 8 + 4 + 4
    "nested-both": (
        {"encoder": "forget", "encoder.0": "forget", "encoder.1": "forget"},
        (1450, 1000 + 1450, 16.0),
    ),
}


@pytest.mark.parametrize("case", ENCODER_CASES.values(), ids=ENCODER_CASES.keys())
def test_figures_of_a_two_level_model_by_hand(case):
    choices, expected = case
    assert tree_figures(encoder_model(), choices) == TreeFigures(*expected)


def test_nested_regions_win_at_the_least_budget_of_the_two_level_model():
    tree = encoder_model()
    # The head's backward sees the embedding, the encoder's held bytes and its own:
    # 50 + 800 + 100 + 500 at the least, so the encoder must be forgotten, and its
    # re-run must fit 600 on top of its input, so encoder.0 must be forgotten in it.
    assert tree_min_feasible_bytes(tree) == 2450
    plan = solve_tree(tree, 2450)
    assert plan.choices == {"encoder": "forget", "encoder.0": "forget"}
    assert (plan.held_bytes, plan.peak_bytes, plan.extra_s) == (1450, 2450, 12.0)
    assert str(plan) == (
        "tree plan: peak 2.39 KiB, budget 2.39 KiB, +12 s\n  encoder: forget\n  encoder.0: forget"
    )
    assert tree_frontier(tree) == ((2450, 12.0), (2550, 8.0), (2750, 4.0), (2950, 0.0))
    assert solve_tree(tree, 2749).extra_s == 8.0
    # Either layer alone: the first holds 400 in the head's backward, the second peaks
    # 300 + 400 in the encoder's.
    assert solve_tree(tree, 2750).choices in ({"encoder.0": "forget"}, {"encoder.1": "forget"})
    assert str(solve_tree(tree, 9999)).endswith("\n  (every node kept)")


def test_work_and_tail_of_a_language_model_head():
    # The loss's backward runs first, with both layers held: it allocates 700 (the
    # logits' gradient) and frees the 150 it saved (the log-probabilities); a layer's
    # own backward allocates 50.
    layers = tuple(
        TreeNode(f"layer.{i}", own_bytes=300, input_bytes=100, forward_s=4.0, work_bytes=50)
        for i in range(2)
    )
    root = TreeNode(
        "model", layers, own_bytes=200, can_forget=False, work_bytes=700, tail_bytes=150
    )
    tree = Tree(root, base_bytes=1000)
    # keep: held 200 + 600; peak max(200 + 600 + 700, 50 + max(350, 300 + 350))
    assert tree_figures(tree, {}) == (800, 2500, 0.0)
    # layer.1 forgotten holds 100 and re-runs to 100 + 300 + 50 beside layer.0's 300:
    # max(200 + 400 + 700, 50 + max(350, 300 + 450))
    assert tree_figures(tree, {"layer.1": "forget"}) == (600, 2300, 4.0)
    # Both forgotten: the loss's work on 200 of inputs is the peak.
    both = {"layer.0": "forget", "layer.1": "forget"}
    assert tree_figures(tree, both) == (400, 1000 + 200 + 200 + 700, 8.0)
    assert tree_min_feasible_bytes(tree) == 2100
    assert solve_tree(tree, 2100).choices == both
    # Without work, the tail decides: forgetting both peaks at 50 + 100 + 400 in
    # layer.1's re-run, below layer.0 alone (200 + 100 + 300 in the loss's backward).
    bare = Tree(
        replace(root, work_bytes=0, children=tuple(replace(n, work_bytes=0) for n in layers))
    )
    assert tree_figures(bare, both).peak_bytes == 550
    assert tree_figures(bare, {"layer.0": "forget"}).peak_bytes == 600
    assert solve_tree(bare, 550).choices == both
    # Without the tail, the loss's saved bytes stay through every layer's backward.
    held = Tree(replace(bare.root, tail_bytes=0))
    assert tree_figures(held, both).peak_bytes == 700
    assert solve_tree(held, 600).choices == {"layer.0": "forget"}


def test_options_obey_in_regions_and_fix_their_subtree():
    mlp = TreeNode("block.layer.mlp", own_bytes=400, input_bytes=100, forward_s=1.0)
    layer = TreeNode(
        "block.layer",
        (mlp,),
        own_bytes=100,
        input_bytes=100,
        forward_s=2.0,
        options=(
            TreeOption("selective", 200, 300, 0.5),  # top level only
            TreeOption("regenerate", 0, 450, 0.75, in_regions=True),
        ),
    )
    block = TreeNode("block", (layer,), input_bytes=10, forward_s=2.0)
    head = TreeNode("head", own_bytes=250, can_forget=False)
    tree = Tree(TreeNode("model", (block, head), can_forget=False))
    # block kept: held 200, peak 300; model peak max(300, 200 + 250)
    assert tree_figures(tree, {"block.layer": "selective"}) == (450, 450, 0.5)
    # block forgotten: held 10, peak 10 + 450, extra 2 + 0.75; model max(460, 10 + 250)
    regenerate = {"block": "forget", "block.layer": "regenerate"}
    assert tree_figures(tree, regenerate) == (260, 460, 2.75)
    # Selective inside the forgotten block would peak at max(10 + 300, 10 + 250): it
    # is not offered there, so the least budget is selective's at the top level.
    with pytest.raises(ValueError, match=r"'selective' inside the forgotten region 'block'"):
        tree_figures(tree, {"block": "forget", "block.layer": "selective"})
    assert min(p for _, _, p, _ in brute_force(tree.root)) == 450
    assert tree_min_feasible_bytes(tree) == 450
    assert solve_tree(tree, 450).choices == {"block.layer": "selective"}
    assert solve_tree(tree, 460).choices == {"block.layer": "selective"}
    keep_mlp = {"block.layer": "regenerate", "block.layer.mlp": "keep"}
    assert tree_figures(tree, keep_mlp) == (250, 450, 0.75)


def test_a_deep_model_solves_quickly_and_consistently():
    # 24 layers of (attention, mlp), each with options: the exact sets stay small
    # because equal layers give equal sums.
    def block(i: int) -> TreeNode:
        options = (
            TreeOption("selective", 600, 900, 0.2),
            TreeOption("regenerate", 300, 1300, 0.3, in_regions=True),
        )
        parts = tuple(
            TreeNode(f"layers.{i}.{part}", own_bytes=size, input_bytes=128, forward_s=t)
            for part, size, t in (("attn", 900, 1.0), ("mlp", 1200, 1.5))
        )
        return TreeNode(f"layers.{i}", parts, 0, 128, 2.5, options)

    stack = TreeNode("layers", tuple(block(i) for i in range(24)), 0, 128, 60.0)
    tree = Tree(TreeNode("model", (stack,), 4000, 64, 61.0), base_bytes=10_000)
    front = tree_frontier(tree)
    assert [p for p, _ in front] == sorted({p for p, _ in front})
    assert [e for _, e in front] == sorted({e for _, e in front}, reverse=True)
    for peak, extra in front[:: max(1, len(front) // 20)]:
        plan = solve_tree(tree, peak)
        assert (plan.peak_bytes, plan.extra_s) == (peak, extra)
        assert tree_figures(tree, plan.choices).peak_bytes == peak


# --- validation ----------------------------------------------------------------------------


def _encoder_with(**changes: Any) -> Any:
    return lambda: TreeNode("encoder", **changes)


BAD_INPUTS = {
    "negative-own-bytes": (
        _encoder_with(own_bytes=-1),
        ValueError,
        r"TreeNode 'encoder'\.own_bytes must be >= 0 bytes, got -1",
    ),
    "negative-work-bytes": (
        _encoder_with(work_bytes=-1),
        ValueError,
        r"TreeNode 'encoder'\.work_bytes must be >= 0 bytes, got -1",
    ),
    "tail-above-own": (
        _encoder_with(own_bytes=10, tail_bytes=11),
        ValueError,
        r"TreeNode 'encoder'\.tail_bytes=11 is above its own_bytes=10",
    ),
    "float-input-bytes": (
        _encoder_with(input_bytes=1.5),
        TypeError,
        r"TreeNode 'encoder'\.input_bytes must be an int",
    ),
    "negative-forward": (
        _encoder_with(forward_s=-1.0),
        ValueError,
        r"TreeNode 'encoder'\.forward_s must be a finite time >= 0",
    ),
    "child-not-a-node": (
        _encoder_with(children=("encoder.0",)),
        TypeError,
        r"TreeNode 'encoder'\.children must hold TreeNode values, got str",
    ),
    "can-forget-not-bool": (
        _encoder_with(can_forget=1),
        TypeError,
        r"TreeNode 'encoder'\.can_forget must be a bool",
    ),
    "two-options-one-name": (
        _encoder_with(options=(TreeOption("a", 0, 0, 0.0), TreeOption("a", 1, 1, 0.0))),
        ValueError,
        r"TreeNode 'encoder' has two options named 'a'",
    ),
    "empty-name": (lambda: TreeNode(""), TypeError, r"TreeNode\.name must be a non-empty str"),
    "option-peak-below-held": (
        lambda: TreeOption("offload", 100, 99, 0.1),
        ValueError,
        r"TreeOption 'offload'\.peak_bytes=99 is below its held_bytes=100",
    ),
    "option-reserved-name": (
        lambda: TreeOption("forget", 0, 0, 0.0),
        ValueError,
        r"TreeOption\.name 'forget' is reserved",
    ),
    "option-negative-held": (
        lambda: TreeOption("offload", -5, 0, 0.0),
        ValueError,
        r"TreeOption 'offload'\.held_bytes must be >= 0",
    ),
    "duplicate-node-names": (
        lambda: Tree(TreeNode("m", (TreeNode("m.a"), TreeNode("m.a")))),
        ValueError,
        r"two nodes named 'm\.a'",
    ),
    "negative-base": (
        lambda: Tree(TreeNode("m"), base_bytes=-1),
        ValueError,
        r"Tree\.base_bytes must be >= 0",
    ),
    "root-not-a-node": (lambda: Tree("m"), TypeError, r"Tree\.root must be a TreeNode, got str"),
}


@pytest.mark.parametrize("case", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_figures_raise_naming_the_node_and_field(case):
    build, error, pattern = case
    with pytest.raises(error, match=f"^forget: .*{pattern}"):
        build()


BAD_CHOICES = {
    "unknown-node": ({"decoder": "forget"}, r"no node named 'decoder'"),
    "unknown-choice": (
        {"encoder.0": "offload"},
        r"node 'encoder\.0' has no choice 'offload'; its choices are: 'keep', 'forget'",
    ),
    "cannot-forget": (
        {"head": "forget"},
        r"node 'head' has no choice 'forget'; it cannot be forgotten \(can_forget=False\); "
        r"its choices are: 'keep'$",
    ),
}


@pytest.mark.parametrize("case", BAD_CHOICES.values(), ids=BAD_CHOICES.keys())
def test_bad_choices_raise_naming_the_node(case):
    choices, pattern = case
    with pytest.raises(ValueError, match=f"^forget: .*{pattern}"):
        tree_figures(encoder_model(), choices)


def test_a_choice_under_a_leaf_option_raises():
    inner = TreeNode("block.inner", own_bytes=10, input_bytes=10)
    block = TreeNode("block", (inner,), options=(TreeOption("offload", 0, 40, 1.0, True),))
    tree = Tree(block)
    assert tree_figures(tree, {"block": "offload", "block.inner": "keep"}) == (0, 40, 1.0)
    with pytest.raises(ValueError, match=r"'block\.inner' takes 'forget' inside 'block', whose"):
        tree_figures(tree, {"block": "offload", "block.inner": "forget"})


BAD_CALLS = {
    "negative-budget": (lambda t: solve_tree(t, -1), ValueError, r"budget_bytes must be >= 0"),
    "float-budget": (lambda t: solve_tree(t, 2.5e3), TypeError, r"budget_bytes must be an int"),
    "zero-unit": (lambda t: solve_tree(t, 9999, unit_bytes=0), ValueError, r"unit_bytes must"),
    "bool-unit": (lambda t: tree_frontier(t, unit_bytes=True), TypeError, r"unit_bytes must"),
    "not-a-tree": (lambda t: solve_tree(t.root, 9999), TypeError, r"expected a .*Tree, got"),
    "choices-not-mapping": (lambda t: tree_figures(t, ["encoder"]), TypeError, r"a mapping"),
}


@pytest.mark.parametrize("case", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_calls_raise(case):
    call, error, pattern = case
    with pytest.raises(error, match=f"^forget: .*{pattern}"):
        call(encoder_model())
