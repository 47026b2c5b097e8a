"""forget.plan on any nn.Module: module-tree candidates, measured by the allocator, exact.

The models (tests/_tree_models.py) are built from tiny configs (no downloads): a
nested model of our own (an encoder stack whose layers take a keyword argument),
and Hugging Face's Llama, BERT (dropout on) and ResNet (BatchNorm). Each is planned
once per module at 75 % and 50 % of its plain peak (where 50 % is out of reach, at
the budget its error names) and at its least feasible budget, on a clock that runs
nothing (`FixedClock`: times do not matter here, bytes do; the wall clock's choice
among fitting plans is tested below); each
plan's step is measured again by the allocator and run against the plain step, and
its plan is applied, removed and saved as JSON. Candidates, figures and the
structure check: test_tree_plan_candidates.py; inputs, loss and bad input:
test_tree_plan_inputs.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
import torch
from torch import nn

import forget
from _tree_models import MODELS, _allocator_peak, _step
from forget import BudgetInfeasibleError, Plan
from forget._planning import FixedClock, TreePlanner, WallClock
from forget._planning._tree.search import choices_key as _key
from forget._regions import RegionForward

BUDGETS = ("75%", "50%", "least")


# ------------------------------------------------------------------ planned


@dataclasses.dataclass
class Planned:
    name: str
    model: nn.Module  # as planned: never applied to, compared against
    inputs: dict[str, Any]
    planner: TreePlanner
    plans: dict[str, Plan]
    errors: dict[str, BudgetInfeasibleError]  # a budget out of reach: what it raised


@pytest.fixture(scope="module", params=list(MODELS))
def planned(request: pytest.FixtureRequest) -> Planned:
    model, inputs = MODELS[request.param]()
    planner = TreePlanner(model, (), inputs, repeats=1, clock=FixedClock())
    plans: dict[str, Plan] = {}
    errors: dict[str, BudgetInfeasibleError] = {}
    for budget in ("75%", "50%"):
        try:
            plans[budget] = planner.plan(budget)
        except BudgetInfeasibleError as error:
            # Out of reach: planned at the budget the error names, which must plan
            # (`test_an_infeasible_budget_names_one_that_plans`).
            errors[budget] = error
            plans[budget] = planner.plan(error.min_feasible_bytes)
    plans["least"] = planner.plan(planner.least())
    return Planned(request.param, model, inputs, planner, plans, errors)


def _plan(planned: Planned, budget: str) -> Plan:
    return planned.plans[budget]


def test_an_infeasible_budget_names_one_that_plans(planned):
    least = planned.plans["least"]
    assert "75%" not in planned.errors  # 75 % of the plain peak is in reach on every model
    for budget, error in planned.errors.items():
        # The error names the least measured, or, where a step that might need less
        # passed the budget, a budget measured to fit; planning there works at once.
        assert error.min_feasible_bytes >= least.min_feasible_bytes > error.budget_bytes
        assert error.budget_bytes == forget.schedules.parse_budget(budget, least.plain_peak_bytes)
        if error.min_feasible_bytes > least.min_feasible_bytes:
            assert "steps that may need less passed this budget" in str(error)
        plan = planned.plans[budget]
        assert plan.budget_bytes == error.min_feasible_bytes
        assert plan.measured_peak_bytes <= plan.budget_bytes


# ------------------------------------------------------------------ budgets


@pytest.mark.parametrize("budget", BUDGETS)
def test_allocator_peak_of_the_planned_step_is_within_the_budget(planned, budget):
    plan = _plan(planned, budget)
    model = copy.deepcopy(planned.model)
    plan.apply(model)
    peak = _allocator_peak(model, planned.inputs)
    # The planner's figure may hold what a first use in the process allocates for
    # good (a selective region's 8,200 B of bit-unpacking tables): a later step
    # reads the same or less, as the planner's own second measurement does.
    again = planned.planner.measure_peak(plan.choices)
    assert peak == again <= plan.measured_peak_bytes <= plan.budget_bytes
    assert plan.budget_bytes < plan.plain_peak_bytes
    assert plan.choices  # something is forgotten below the plain peak
    if budget != "least" and budget not in planned.errors:
        assert plan.budget_bytes == forget.schedules.parse_budget(budget, plan.plain_peak_bytes)


@pytest.mark.parametrize("budget", BUDGETS)
def test_planned_step_equals_the_plain_step_bitwise(planned, budget):
    plan = _plan(planned, budget)
    plain = copy.deepcopy(planned.model)
    model = plan.apply(copy.deepcopy(planned.model))
    for _ in range(2):  # the second step sees the buffers (BatchNorm) the first left
        loss, grads, buffers = _step(model, planned.inputs)
        loss0, grads0, buffers0 = _step(plain, planned.inputs)
        assert torch.equal(loss, loss0)
        assert grads.keys() == grads0.keys() and grads
        assert all(torch.equal(grads[n], grads0[n]) for n in grads0)
        assert buffers.keys() == buffers0.keys()
        assert all(torch.equal(buffers[n], buffers0[n]) for n in buffers0)


def test_least_feasible_budget_works_and_one_byte_less_raises(planned):
    least = planned.plans["least"]
    assert isinstance(least, Plan)
    assert least.measured_peak_bytes <= least.budget_bytes == least.min_feasible_bytes
    with pytest.raises(BudgetInfeasibleError) as error:
        planned.planner.plan(least.min_feasible_bytes - 1)
    assert error.value.min_feasible_bytes == least.min_feasible_bytes
    assert f"{least.min_feasible_bytes:,} B" in str(error.value)


def test_the_least_is_searched_for_only_where_wanted():
    # NOTE [least on demand]: a budget the search fits measures neither assignment of
    # least memory; the plan says its least is a budget measured to fit.
    model, inputs = MODELS["net"]()
    planner = TreePlanner(model, (), inputs, repeats=1, clock=FixedClock())
    plan = planner.plan("75%")
    scan = [planner.choices_at(0), planner.baseline()]
    assert not any(_key(choices) in planner.measured for choices in scan)
    assert not plan.least_searched
    peaks = [peak for _, peak in planner.measured.values()]
    assert plan.min_feasible_bytes == min(peaks) <= plan.measured_peak_bytes
    assert "least budget measured to fit" in str(plan)
    assert Plan.from_dict(plan.to_dict()) == plan
    # A budget nothing fits: both are tried under it, which stops them, then for the
    # error under the predicted plain peak (NOTE [an infeasible budget named]).
    with pytest.raises(BudgetInfeasibleError) as error:
        planner.plan(plan.plain_peak_bytes // 10)
    assert all(_key(choices) in planner.measured for choices in scan)
    measured = min(peak for _, peak in planner.measured.values())
    named = max(measured, planner.profile.forward_peak_bytes)
    assert error.value.min_feasible_bytes == named <= plan.min_feasible_bytes
    assert planner.least_searched() and planner.plan("75%").least_searched
    assert planner.plan(named).measured_peak_bytes <= named  # it fits, as named
    least = planner.least()  # under the predicted plain peak (no budget given): measured
    assert planner.least_searched() and least <= measured
    again = planner.plan("75%")
    assert again.least_searched and again.min_feasible_bytes == least
    assert "least feasible budget" in str(again)
    with pytest.raises(BudgetInfeasibleError) as error:
        planner.plan(least - 1)
    assert error.value.min_feasible_bytes == least


@pytest.mark.parametrize("budget", ["75%", "50%"])
def test_on_the_wall_clock_the_plan_is_one_measured_to_fit_and_runs_exactly(budget):
    # Times are real here, so which fitting assignment wins varies from run to run
    # (NOTE [tree plans measured]): the choice is exercised; only what holds for any
    # winner is asserted.
    model, inputs = MODELS["net"]()
    planner = TreePlanner(model, (), inputs, repeats=1, clock=WallClock())
    plan = planner.plan(budget)
    fitting = [choices for choices, peak in planner.measured.values() if peak <= plan.budget_bytes]
    assert plan.choices in fitting
    assert plan.measured_peak_bytes <= plan.budget_bytes < plan.plain_peak_bytes
    assert plan.measured_peak_bytes == planner.measured[_key(plan.choices)][1]
    plain = copy.deepcopy(model)
    planned = plan.apply(copy.deepcopy(model))
    loss, grads, _ = _step(planned, inputs)
    loss0, grads0, _ = _step(plain, inputs)
    assert torch.equal(loss, loss0) and grads.keys() == grads0.keys()
    assert all(torch.equal(grads[n], grads0[n]) for n in grads0)


def test_planning_leaves_the_model_as_it_was(planned):
    fresh, _ = MODELS[planned.name]()
    state = planned.model.state_dict()
    assert list(state) == list(fresh.state_dict())
    assert all(torch.equal(state[k], v) for k, v in fresh.state_dict().items())
    assert all(p.grad is None for p in planned.model.parameters())
    modules = list(planned.model.modules())
    assert not any(isinstance(m.__dict__.get("forward"), RegionForward) for m in modules)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in modules)


def test_plan_reports_both_probes_and_prints_a_tree(planned):
    plan = _plan(planned, "75%")
    text = str(plan)
    assert plan.probe == "profiler"
    assert f"measured {plan.measured_peak_bytes:,} B by the allocator (profiler)" in text
    assert f"ledger {plan.ledger_peak_bytes:,} B" in text
    rows = plan.rows()
    assert rows[0]["module"] == "<model>" and rows[0]["depth"] == 0
    for name, choice in plan.choices.items():
        (row,) = [r for r in rows if r["module"] == name]
        assert row["choice"] == choice
        line = next(line for line in text.splitlines() if f" {name} (" in line)
        assert choice in line and f"{row['held_bytes']:,}" in line


# ------------------------------------------------------------------ apply, remove, JSON


def test_apply_and_remove_keep_state_dict_keys_and_restore_plain_behaviour(planned):
    plan = _plan(planned, "least")
    model = copy.deepcopy(planned.model)
    plain = _allocator_peak(copy.deepcopy(model), planned.inputs)
    keys = list(model.state_dict())
    before = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    assert plan.apply(model) is model
    assert list(model.state_dict()) == keys
    for name in plan.choices:
        assert isinstance(model.get_submodule(name).forward, RegionForward)
    with pytest.raises(ValueError, match="already"):
        plan.apply(model)
    assert plan.remove(model) is model
    assert list(model.state_dict()) == keys
    assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == before
    assert not model._forward_pre_hooks and "_forget_tree_plan" not in model.__dict__
    with pytest.raises(ValueError, match="no plan is applied"):
        plan.remove(model)
    assert _allocator_peak(model, planned.inputs) == plain


def test_the_plain_peak_is_predicted_without_running_the_plain_step(planned):
    # NOTE [tree figures]: the fake run's ledger peak plus the most workspace of any
    # candidate alone. Fake tensors take the paths of an unreadable input (Llama's
    # eager mask is built where the real step skips it: +12.6 % here), so close, not equal.
    plan = _plan(planned, "least")
    plain = _allocator_peak(copy.deepcopy(planned.model), planned.inputs)
    assert abs(plan.plain_peak_bytes - plain) <= 0.15 * plain


def test_json_round_trip(planned, tmp_path):
    plan = _plan(planned, "least")
    again = Plan.from_json(plan.to_json())
    assert again == plan
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan and json.loads(plan.to_json())["format"] == "forget.tree_plan/1"
    model = loaded.apply(copy.deepcopy(planned.model))
    assert _allocator_peak(model, planned.inputs) == plan.measured_peak_bytes
    with pytest.raises(ValueError, match="not a saved forget plan"):
        Plan.from_dict({"format": "forget.plan/1"})


# ------------------------------------------------------------------ the printout


def _printed_plan(least_searched: bool) -> Plan:
    """A plan forgetting ``model`` whose two layers stay kept inside it (issue 45, item 7)."""
    layers = tuple(
        forget.schedules.TreeNode(f"model.layers.{i}", own_bytes=29_384_704, input_bytes=1000)
        for i in range(2)
    )
    model = forget.schedules.TreeNode("model", layers, own_bytes=4096, input_bytes=512)
    root = forget.schedules.TreeNode("<model>", (model,), own_bytes=64)
    return Plan(
        choices={"model": "forget"},
        tree=forget.schedules.Tree(root),
        budget_bytes=10_000,
        measured_peak_bytes=9_000,
        ledger_peak_bytes=8_000,
        plain_peak_bytes=60_000_000,
        plain_ledger_peak_bytes=59_000_000,
        min_feasible_bytes=9_000,
        predicted_peak_bytes=9_500,
        predicted_extra_s=0.001,
        probe="profiler",
        structure=(("", "Outer"), ("model", "Inner"), ("model.layers.0", "Layer")),
        least_searched=least_searched,
    )


def test_a_kept_module_inside_a_forgotten_region_holds_bytes_only_in_the_rerun():
    plan = _printed_plan(least_searched=True)
    rows = {r["module"]: r for r in plan.rows()}
    assert (rows["model"]["held_bytes"], rows["model"]["rerun_bytes"]) == (512, 0)
    layer = rows["model.layers.0"]
    assert (layer["choice"], layer["held_bytes"], layer["rerun_bytes"]) == ("keep", 0, 29_384_704)
    assert (rows["<model>"]["held_bytes"], rows["<model>"]["rerun_bytes"]) == (64, 0)
    text = str(plan)
    line = next(line for line in text.splitlines() if " model.layers.0 (" in line)
    assert "(29,384,704)" in line and " 29,384,704" not in line.replace("(29", "")
    assert "holds nothing from forward to backward" in text
    assert "only while its region re-runs in backward" in text


def test_a_plan_without_regions_in_regions_prints_no_rerun_note():
    plan = dataclasses.replace(
        _printed_plan(least_searched=True), choices={"model.layers.1": "forget"}
    )
    assert "re-runs in backward" not in str(plan)
    assert all(r["rerun_bytes"] == 0 for r in plan.rows())


def test_the_printout_names_the_api_way_to_the_least_budget_not_the_cli():
    text = str(_printed_plan(least_searched=False))
    assert "forget plan --budgets" not in text
    assert "min_feasible_bytes" in text and "BudgetInfeasibleError" in text
    assert "least feasible budget: 9,000 B" in str(_printed_plan(least_searched=True))
