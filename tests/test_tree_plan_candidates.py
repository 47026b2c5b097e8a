"""forget.plan on module trees: which modules are candidates, and what is charged to them.

Default and restricted candidates, leaf options measured per module, the figures
charged to each module, the structure check that refuses a plan on another model,
deep copies of a planned model, and which assignments the planner times. Models:
tests/_tree_models.py.
"""

from __future__ import annotations

import copy
import fnmatch

import pytest
import torch
from torch import nn

import forget
from _tree_models import (
    Block,
    _assert_untouched,
    _GatedStack,
    _llama,
    _net,
    _resnet,
    _snapshot,
    _step,
    _with_grads,
)
from forget import Plan
from forget import policies as policies_
from forget._planning import TreePlanner
from forget._planning._tree.search import choices_key as _key
from forget._planning._tree.search import drop_regions, search_frontier
from forget._regions import find_candidates, first_difference
from forget.policies import DEFAULT_OPTIONS

pytestmark = pytest.mark.usefixtures("fixed_clock")


# ------------------------------------------------------------------ structure


def test_a_model_of_another_structure_is_refused_naming_the_first_difference():
    model, inputs = _net(depth=2)
    plan = forget.plan(model, budget="75%", **inputs)
    deeper, _ = _net(depth=3)
    with pytest.raises(ValueError, match=r"'encoder\.layers\.2' the plan has nothing, Net has "):
        plan.apply(deeper)
    other, _ = _net(depth=2)
    other.encoder.layers[1] = nn.Sequential(nn.Linear(32, 32))
    before = _snapshot(_with_grads(other))
    with pytest.raises(ValueError) as error:
        plan.apply(other)
    assert str(error.value).startswith("forget: this plan was made for another model")
    assert "'encoder.layers.1'" in str(error.value)
    assert "_tree_models.Block" in str(error.value) and "Sequential" in str(error.value)
    _assert_untouched(other, before)
    assert first_difference(plan.structure, model) is None


def test_a_llama_plan_is_refused_on_a_deeper_llama():
    model, inputs = _llama(2)
    least = forget.plan(model, budget=1.0, **inputs).min_feasible_bytes
    plan = forget.plan(model, budget=least, **inputs)
    deeper, _ = _llama(3)
    with pytest.raises(ValueError, match=r"'model\.layers\.2' the plan has nothing"):
        plan.apply(deeper)


# ------------------------------------------------------------------ figures


def test_figures_charge_every_saved_storage_once():
    # NOTE [tree figures], exact bytes (10 x 16 float32 = 640 B): each layer keeps its
    # tanh output (mul saves it); a layer's input, the previous layer's output, is
    # the layer's (its Linear saves it, its region would hold it); the mask every
    # layer reads is the model's, held whatever a layer chooses; the loss is 4 B.
    # Layer 0's input is the step's own and counts nowhere.
    planner = TreePlanner(_GatedStack(), (torch.randn(10, 16),), repeats=1)
    root = planner.tree.root
    assert (root.own_bytes, root.input_bytes) == (640 + 4, 0)
    figures = [(n.name, n.own_bytes, n.input_bytes) for n in root.children]
    assert figures == [("layers.0", 640, 0), ("layers.1", 1280, 640), ("layers.2", 1280, 640)]
    # The base is what the plain step holds beyond: the keep-all plan predicts its peak.
    assert forget.schedules.tree_figures(planner.tree, {}).peak_bytes == planner.plain_peak


# ------------------------------------------------------------------ candidates


def test_default_candidates_are_repeated_blocks_the_modules_above_and_their_stems_and_heads():
    model, _ = _net()
    assert find_candidates(model) == [
        "embed",
        "encoder",
        "encoder.layers",
        *(f"encoder.layers.{i}" for i in range(4)),
        "encoder.norm",
        "head",
    ]
    llama, _ = _llama()
    assert find_candidates(llama) == [
        "model",
        "model.embed_tokens",
        "model.layers",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    resnet, _ = _resnet()
    found = find_candidates(resnet)
    assert {"resnet", "resnet.embedder", "resnet.encoder", "classifier"} <= set(found)
    assert {f"resnet.encoder.stages.{i}" for i in range(2)} <= set(found)
    assert {f"resnet.encoder.stages.1.layers.{i}" for i in range(2)} <= set(found)
    assert "resnet.encoder.stages.1.layers.1.layer.0.convolution" not in found


class _Res(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Linear(width, width), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


class _Level(nn.Module):
    """A UNet's level: its residual blocks in a ModuleList, one at the down levels."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([_Res(width) for _ in range(blocks)])
        self.sample = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.resnets:
            x = block(x)
        return self.sample(x)


class _UNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList([_Level(8, 1), nn.Sequential(_Res(8), nn.Linear(8, 8))])
        self.up = nn.ModuleList([_Level(8, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for level in (*self.down, *self.up):
            x = level(x)
        return x


def test_a_block_type_repeated_over_modulelists_is_a_candidate_in_each():
    # The down level's single residual block shares its type with the up level's two
    # (all in ModuleLists): each is a candidate, and its level above it. In a
    # Sequential a block one of a kind among its siblings is none.
    found = find_candidates(_UNetLike())
    assert {"down.0", "down.0.resnets.0", "up.0", "up.0.resnets.0", "up.0.resnets.1"} <= set(found)
    assert "down.1.0" not in found
    # Inside a repeated block, a ModuleList's children count with their siblings only
    # (a T5 block's sublayers, each one of a kind in its block, are no candidates).
    t5_like = nn.ModuleList([_Level(8, 1) for _ in range(2)])
    found = find_candidates(nn.Sequential(t5_like))
    assert {"0.0", "0.1"} <= set(found)
    assert not any(name.startswith("0.0.resnets.") for name in found)


def test_candidates_restrict_by_name_pattern_or_type():
    model, inputs = _net()
    planner = TreePlanner(model, (), inputs, candidates="encoder.layers.*", repeats=1)
    nodes = [n.name for n in planner.tree.root.children]
    assert nodes == [f"encoder.layers.{i}" for i in range(4)]
    plan = planner.plan("60%")
    assert plan.choices and plan.measured_peak_bytes <= plan.budget_bytes
    # Only matched modules (the layers and, below them, their parts) are regions.
    assert all(fnmatch.fnmatchcase(name, "encoder.layers.*") for name in plan.choices)
    by_type = TreePlanner(model, (), inputs, candidates=[Block, "encoder"], repeats=1)
    (encoder,) = by_type.tree.root.children
    assert encoder.name == "encoder"
    assert [n.name for n in encoder.children] == nodes
    with pytest.raises(ValueError, match="matches no submodule"):
        forget.plan(model, budget="60%", candidates="decoder.*", **inputs)
    with pytest.raises(TypeError, match="candidates"):
        forget.plan(model, budget="60%", candidates=[3], **inputs)


def test_options_are_leaf_choices_measured_per_module():
    model, inputs = _net()
    options = {"matmuls": policies_.save_outputs_of(*policies_.MATMUL)}
    planner = TreePlanner(model, (), inputs, options=options, candidates=Block, repeats=1)
    layer = planner.tree.root.children[0]
    (option,) = layer.options
    assert option.name == "matmuls" and not option.in_regions
    assert option.held_bytes < layer.own_bytes
    plan = planner.plan("80%")
    assert plan.option_names == ("matmuls",) and plan.measured_peak_bytes <= plan.budget_bytes
    loaded = Plan.from_json(plan.to_json(), options=options)
    plain = copy.deepcopy(model)
    planned = loaded.apply(copy.deepcopy(model))
    loss, grads, _ = _step(planned, inputs)
    loss0, grads0, _ = _step(plain, inputs)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], grads0[n]) for n in grads0)
    if "matmuls" in plan.choices.values():
        with pytest.raises(ValueError, match="options="):
            Plan.from_json(plan.to_json()).apply(copy.deepcopy(model))


def test_default_options_on_innermost_candidates_measured_once_per_kind(monkeypatch):
    # NOTE [default options], NOTE [tree figures].
    from forget._planning._tree import alone as _tree_alone

    measured: list[str] = []
    real = _tree_alone._Alone.option_bytes

    def counted(self, policies):
        measured.append(self.forward.__self__.__class__.__name__)
        return real(self, policies)

    monkeypatch.setattr(_tree_alone._Alone, "option_bytes", counted)
    model, inputs = _net()
    candidates = [Block, "encoder", "encoder.norm", "head"]
    planner = TreePlanner(model, (), inputs, candidates=candidates, repeats=1)
    assert planner.policies == dict(DEFAULT_OPTIONS)
    encoder, head = planner.tree.root.children
    assert not encoder.options  # it has candidates below it
    assert not head.options  # a lone Linear: keeping only its matmul's output saves nothing
    *layers, norm = encoder.children
    # A lone LayerNorm has no matmul: a selective region keeps no more than forgetting
    # it (its mean and rstd are spared alike); regenerating its output, which it
    # returns anyway, spares nothing.
    assert norm.options == ()
    # Four alike layers, one measurement: the same bytes held and time; each peak is the
    # layer's own, on the gradients its backward holds (NOTE [backward work]).
    figures = {tuple((o.name, o.held_bytes, o.extra_s) for o in layer.options) for layer in layers}
    assert len(figures) == 1
    # Against a kept layer's peak in its backward: a selective region re-runs on its
    # inputs, and its step alone peaked higher (its re-run beside what it kept);
    # regenerating rebuilds one use at a time and peaks lower (NOTE [options' peaks]).
    keep = [layer.own_bytes + layer.work_bytes for layer in layers]
    peaks = {tuple(o.peak_bytes - k for o in n.options) for n, k in zip(layers, keep, strict=True)}
    ((selective, regenerate),) = peaks
    assert selective > layers[0].input_bytes and regenerate < 0
    options = layers[0].options
    assert [o.name for o in options] == ["selective", "regenerate"]
    assert all(o.held_bytes < layers[0].own_bytes for o in options)
    assert sorted(measured) == ["Block", "LayerNorm", "Linear"]
    plan = planner.plan("80%")
    assert set(plan.choices.values()) & {"selective", "regenerate"}  # partial keeps pay here
    loaded = Plan.from_json(plan.to_json())  # the defaults come back by name
    assert loaded.policies == dict(DEFAULT_OPTIONS)
    planned = loaded.apply(copy.deepcopy(model))
    loss, grads, _ = _step(planned, inputs)
    loss0, grads0, _ = _step(copy.deepcopy(model), inputs)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], grads0[n]) for n in grads0)
    bare = TreePlanner(model, (), inputs, candidates=Block, options={}, repeats=1)
    assert bare.policies == {} and not any(n.options for n in bare.tree.root.children)
    assert set(bare.plan("80%").choices.values()) == {"forget"}


# ------------------------------------------------------------------ copies and timing


def test_a_deep_copy_of_a_planned_model_runs_its_own_modules():
    model, inputs = _net()
    plan = forget.plan(model, budget="60%", repeats=1, **inputs)
    copied = copy.deepcopy(plan.apply(model))
    for name in plan.choices:
        wrapper = copied.get_submodule(name).forward
        assert wrapper.original.__self__ is copied.get_submodule(name)
    loss, grads, _ = _step(copied, inputs)
    loss0, grads0, _ = _step(plan.remove(model), inputs)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], grads0[n]) for n in grads0)


def test_an_assignment_holding_another_fitting_one_and_more_is_not_timed(fixed_clock):
    # NOTE [tree plans measured]: it re-runs all the other re-runs and more.
    planner = TreePlanner(_GatedStack(), (torch.randn(10, 16),), repeats=1)
    one, two = {"layers.0": "forget"}, {"layers.0": "forget", "layers.1": "forget"}
    calls = fixed_clock.calls
    assert planner._fastest([(two, 10), (one, 20)]) == (one, 20)
    assert planner._fastest([(two, 10), ({}, 30), (one, 20)]) == ({}, 30)
    assert fixed_clock.calls == calls  # one candidate left: nothing timed
    planner._fastest([(two, 10), ({"layers.2": "forget"}, 20), (one, 20)])
    assert fixed_clock.calls > calls  # two of them: timed side by side


def _frontier(seconds_apart: float) -> tuple[TreePlanner, list[int], list[int], dict[str, int]]:
    """A planner whose frontier is 1,000 points 1/1000 of the plain peak apart, each
    ``seconds_apart`` faster than the one before, whose steps measure ``error["points"]``
    thousandths of the plain peak (10 unless set) above their prediction.

    Returns it, the predicted peaks, the points it measures (in order) and ``error``.
    """
    planner = TreePlanner(_GatedStack(), (torch.randn(10, 16),), repeats=1)
    plain, n = planner.plain_peak, 1000
    predicted = [plain * i // n for i in range(n)]
    planner.frontier = [(p, (n - i) * seconds_apart) for i, p in enumerate(predicted)]
    measured: list[int] = []
    error = {"points": 10}

    def peak(choices):
        measured.append(int(choices["at"]))
        return predicted[measured[-1]] + error["points"] * plain // n

    planner.choices_at = lambda i: {"at": str(i)}  # type: ignore[method-assign]
    planner.peak = peak  # type: ignore[method-assign]
    return planner, predicted, measured, error


def test_the_search_stops_once_fit_and_miss_are_predicted_within_its_resolution(fixed_clock):
    # NOTE [tree plans measured]: 1,000 frontier points 1/1000 of the plain peak apart,
    # each measured 10 points' worth above its prediction.
    # Each point a second faster than the one before: none is close enough (NOTE [close enough]).
    planner, predicted, measured, _ = _frontier(1.0)
    plain = planner.plain_peak

    def true_peak(i: int) -> int:
        return predicted[i] + 10 * plain // 1000

    budget = plain // 2
    search_frontier(planner, budget)
    lo = max(i for i in measured if true_peak(i) <= budget)
    hi = min(i for i in measured if true_peak(i) > budget)
    assert 0 < predicted[hi] - predicted[lo] <= plain // 128  # stopped within the resolution
    assert hi - lo > 1  # before the points were adjacent (491 would follow)
    # A miss at the predicted point, 10 points' worth over: down to the last point
    # predicted to fit with that error, a fit; one step up, a miss; close enough.
    assert measured == [500, 490, 492]


def test_the_search_stops_where_no_point_is_predicted_to_fit_with_a_miss_error(fixed_clock):
    # NOTE [least on demand]: every point measures 600 points' worth above its
    # prediction, more than the budget leaves even the least (point 0): after the first
    # miss nothing is predicted to fit with its error, and the search ends there, for
    # the least to be measured. A miss of 10 points' worth searches on.
    planner, _, measured, error = _frontier(1.0)
    error["points"] = 600
    search_frontier(planner, planner.plain_peak // 2)
    assert measured == [500]
    error["points"], measured[:] = 10, []
    search_frontier(planner, planner.plain_peak // 2)
    assert measured[:2] == [500, 490] and len(measured) > 2


def test_the_search_stops_once_no_point_left_is_predicted_to_save_time(fixed_clock):
    # NOTE [close enough]: the same frontier, its points a nanosecond apart in time.
    planner, _, measured, _ = _frontier(1e-9)
    assert planner.tolerance_s > 9e-9
    search_frontier(planner, planner.plain_peak // 2)
    # A miss at 500, a fit at 490: the points between save 9 ns at most.
    assert measured == [500, 490]


_BEST = {"a": "forget", "b": "forget", "c": "forget"}


def _without(*names: str) -> frozenset[str]:
    """The regions of `_BEST` less ``names``."""
    return frozenset(_BEST) - set(names)


def _stand_in(
    predicted: dict[frozenset[str], int], true: dict[frozenset[str], int]
) -> tuple[TreePlanner, list[frozenset[str]]]:
    """A planner whose peaks are ``predicted`` (150 else) and measure ``true`` (200 else).

    Returns it and the list of the assignments it measures, in order; a region
    adds one to the predicted time.
    """
    planner = TreePlanner(_GatedStack(), (torch.randn(10, 16),), repeats=1)
    measured: list[frozenset[str]] = []

    def peak(choices):
        measured.append(frozenset(choices))
        planner.measured[_key(choices)] = (dict(choices), true.get(frozenset(choices), 200))
        return planner.measured[_key(choices)][1]

    planner.predicted_peak = lambda c: predicted.get(frozenset(c), 150)  # type: ignore[method-assign]
    planner.extra_s = lambda c: float(len(c))  # type: ignore[method-assign]
    planner.peak = peak  # type: ignore[method-assign]
    return planner, measured


def test_one_region_fewer_is_measured_where_the_model_missed_a_fit(fixed_clock):
    # NOTE [one region fewer]: regions a, b, c; the model thinks dropping any of
    # them overshoots the budget of 100, but without b the step measures 99.
    best, without = _BEST, _without
    predicted = {without(): 90, without("a"): 110, without("b"): 105, without("c"): 101}
    true = {without(): 90, without("a"): 130, without("b"): 99, without("c"): 101}
    planner, measured = _stand_in(predicted, true)
    planner.measured = {(): ({}, 300), (("a", "forget"),): ({"a": "forget"}, 120)}
    drop_regions(planner, 100)
    assert measured == []  # every miss near 100 was foreseen (a alone: predicted 150)
    planner.measured[_key(best)] = (best, 90)
    planner.measured[(("x", "forget"),)] = ({"x": "forget"}, 120)  # predicted 150: foreseen
    drop_regions(planner, 100)
    assert measured == []
    planner.measured[(("y", "forget"),)] = ({"y": "forget"}, 120)
    predicted[frozenset({"y"})] = 95  # a miss the model predicted to fit
    drop_regions(planner, 100)
    # Lowest predicted peak first: without c (101, misses), without b (105, fits); then
    # from {a, c}: {a} was measured before, and {c}, predicted 150, would fit only if
    # over-predicted by 50, where the most the model over-predicted is 30 ({a} and {x},
    # 150 against 120): the walk ends.
    assert measured == [without("c"), without("b")]
    assert min((c for c, p in planner.measured.values() if c and p <= 100), key=len) == {
        "a": "forget",
        "c": "forget",
    }


def test_one_region_fewer_is_measured_where_the_model_over_predicted(fixed_clock):
    # NOTE [one region fewer]: no miss was foreseen wrongly, but the best fit measured
    # 15 below its prediction; a variant whose prediction less 15 fits is measured.
    best, without = _BEST, _without
    predicted = {without(): 95, without("a"): 120, without("b"): 105, without("c"): 130}
    predicted |= {without("a", "b"): 112, without("b", "c"): 140}
    true = {without(): 80, without("a"): 100, without("b"): 92, without("c"): 110}
    true |= {without("a", "b"): 101}
    planner, measured = _stand_in(predicted, true)
    planner.measured = {(): ({}, 300), _key(best): (best, 80)}
    drop_regions(planner, 100)
    # From {a, b, c} (error -15): without b, 105 - 15 fits: measured, 92; without a
    # (120 - 15) and without c (130 - 15) are not. From {a, c} (error -13): {c}
    # (112 - 13) is measured and misses; {a} (140 - 13) is not; the walk ends.
    assert measured == [without("b"), without("a", "b")]
