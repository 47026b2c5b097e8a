"""Planning within the budget: the guard on measured steps, and no plain step run.

NOTE [guarded steps] and NOTE [planning within the budget]: every step the tree
planner runs on real tensors is stopped once it allocates past the budget, so
a misprediction is a measured miss, never a process past the budget; the model
is left as it was. Bytes here are the ledger's (`forget._memory.Ledger`), which
sees every storage any part of planning makes, the planner's own included.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import forget
from _tree_models import MODELS, _allocator_peak, _assert_untouched, _snapshot, _with_grads
from forget import schedules as S
from forget._memory import Ledger, watch
from forget._planning import TreePlanner

pytestmark = pytest.mark.usefixtures("fixed_clock")


def _model(name: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    model, inputs = MODELS[name]()
    return _with_grads(model), inputs


def _ledger_peak(call: Any) -> tuple[int, Any]:
    """The most bytes alive at once while ``call()`` runs, every storage it makes counted."""
    ledger = Ledger()
    try:
        with watch(ledger):
            result = call()
    finally:
        ledger.close()
    return ledger.peak, result


@pytest.mark.parametrize("name", ["net", "resnet"])
def test_a_step_past_its_limit_is_stopped_and_leaves_the_model_as_it_was(name):
    model, inputs = _model(name)
    planner = TreePlanner(model, (), inputs, repeats=1)
    everything = planner.baseline()
    exact = planner.measure_peak(everything)
    before = _snapshot(model)
    stopped = planner.guarded(everything, limit_bytes=exact // 2)
    assert stopped.stopped and stopped.bytes > exact // 2
    _assert_untouched(model, before)  # parameters, .grad (objects and values), buffers
    # Nothing of the stopped step stays behind: the same step measures as before.
    again = planner.guarded(everything, limit_bytes=exact)
    assert not again.stopped and again.bytes == exact


@pytest.mark.parametrize("name", ["net", "resnet"])
def test_a_misprediction_is_a_measured_miss_and_the_plan_still_fits(name):
    model, inputs = _model(name)
    planner = TreePlanner(model, (), inputs, repeats=1)
    budget = planner.measure_peak(planner.choices_at(0)) + 1  # the least-memory point fits
    # Force the cost model to under-predict every peak by half: every frontier point
    # is then predicted to fit a budget just above the least, which most steps pass.
    frontier = planner.frontier
    planner.choices_at = lambda i: S.solve_tree(planner.tree, frontier[i][0]).choices  # type: ignore[method-assign]
    planner.frontier = [(peak // 2, extra) for peak, extra in frontier]
    before = _snapshot(model)
    peak, plan = _ledger_peak(lambda: planner.plan(budget))
    assert planner.stopped, "no step predicted to fit was stopped: the test forced nothing"
    assert all(bound > budget for _, bound in planner.stopped.values())
    assert plan.measured_peak_bytes <= budget
    # The planner itself: a stopped step passes the budget by the one allocation that
    # stopped it (NOTE [guarded steps]), then frees everything; what the planner holds
    # for itself (the model's buffers, copied to be restored, a few scalars) is small.
    stopped_at = max(bound for _, bound in planner.stopped.values())
    assert peak <= max(budget, stopped_at) * 1.01
    _assert_untouched(model, before)


@pytest.mark.parametrize("name", ["net", "llama", "resnet"])
def test_plan_never_runs_the_plain_step_and_stays_within_the_budget(name):
    model, inputs = _model(name)
    plain = _allocator_peak(copy.deepcopy(model), inputs)
    budget = plain * 3 // 4
    before = _snapshot(model)
    planner = TreePlanner(model, (), inputs, repeats=1, budget=budget)
    peak, plan = _ledger_peak(lambda: planner.plan(budget))
    assert plan.measured_peak_bytes <= budget
    # A stopped step passes the budget by the one allocation that stopped it (NOTE
    # [guarded steps]); the planner's own records are small.
    stopped_at = max((bound for _, bound in planner.stopped.values()), default=0)
    assert peak <= max(budget, stopped_at) * 1.01, f"planning held {peak:,} B over {budget:,} B"
    # The profile: its capture within the budget; a module's step alone within the
    # plain step's peak (NOTE [heavy modules]), which passes 75 % on the ResNet alone
    # (its stem at full resolution).
    profiled, _ = _ledger_peak(lambda: TreePlanner(model, (), inputs, repeats=1, budget=budget))
    assert profiled <= (plain if name == "resnet" else budget * 1.01), (
        f"profiling held {profiled:,} B"
    )
    _assert_untouched(model, before)


def _chain() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(6)
    ]
    return torch.nn.Sequential(*blocks), (torch.randn(128, 64),), {}


def _llama_lm() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    """Issue 45's Llama, small: its config's defaults but the sizes (the cache on)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=86,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=512,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 64))
    return transformers.LlamaForCausalLM(config).train(), (), {"input_ids": ids, "labels": ids}


def _planned(name: str) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    if name == "sequential":
        return _chain()
    if name == "llama-lm":
        pytest.importorskip("transformers")
        return _llama_lm()
    torch.manual_seed(0)
    model, inputs = _model(name)
    return model, (), inputs


@pytest.mark.parametrize(
    ("name", "budget"),
    [
        ("sequential", 1024),
        ("net", 200_000),
        ("llama", 1024),
        ("resnet", 1024),
        ("llama-lm", "50%"),
    ],
    ids=[
        "sequential",
        "net-search-stopped",
        "llama-forward-stopped",
        "resnet-forward-stopped",
        "llama-lm-half",
    ],
)
def test_an_infeasible_budget_names_one_at_which_planning_works_the_first_time(name, budget):
    # NOTE [an infeasible budget named]: the error names no bound where the guard
    # stopped, but the least peak measured, under the predicted plain peak; planning
    # there works at once, and a byte below it names it again. At half the plain peak
    # (issue 45's Llama) the search stops every step at the budget: measured under it,
    # the least was the cost model's, 5,056 B short of the least measured.
    model, args, kwargs = _planned(name)
    plain_model = copy.deepcopy(model)
    plain = forget.measure(lambda: _loss(plain_model(*args, **kwargs)).backward()).peak_bytes
    before = _snapshot(model)
    ledger = Ledger()
    try:
        with watch(ledger), pytest.raises(forget.BudgetInfeasibleError) as info:
            forget.plan(model, *args, budget=budget, repeats=1, **kwargs)
    finally:
        ledger.close()
    held = ledger.peak
    named = info.value.min_feasible_bytes
    if isinstance(budget, str):  # a share of the predicted plain peak
        budget = info.value.budget_bytes
    assert info.value.budget_bytes == budget < named
    assert str(info.value).startswith(f"forget: the budget {budget:,} B is below")
    assert f"plan with a budget of {named:,} B or more" in str(info.value)
    _assert_untouched(model, before)
    # Only an infeasible budget is passed, and by no more than the plain step would hold.
    assert held <= plain * 1.01, f"naming the budget held {held:,} B, plain {plain:,} B"
    plan = forget.plan(model, *args, budget=named, repeats=1, **kwargs)
    assert plan.measured_peak_bytes <= plan.budget_bytes == named
    assert "an estimate" not in str(info.value)
    with pytest.raises(forget.BudgetInfeasibleError) as info:
        forget.plan(model, *args, budget=named - 1, repeats=1, **kwargs)
    assert info.value.min_feasible_bytes == named


def _loss(output: Any) -> torch.Tensor:
    return output.sum() if isinstance(output, torch.Tensor) else output.loss


@pytest.mark.parametrize("budget", [None, "free"], ids=["no budget", "free"])
def test_free_memory_budgets_are_for_cuda(budget):
    # NOTE [free budget]: what the device has free; a step on the CPU has no such figure.
    model, inputs = _model("net")
    kwargs = {} if budget is None else {"budget": budget}
    with pytest.raises(ValueError, match="the CUDA device has free, and this step runs on"):
        forget.plan(model, repeats=1, **kwargs, **inputs)
