"""forget.plan on any nn.Module: module-tree candidates, measured by the allocator, exact.

Models are built here from tiny configs (no downloads): a nested model of our own
(an encoder stack whose layers take a keyword argument), and Hugging Face's
Llama, BERT (dropout on) and ResNet (BatchNorm). Each is planned once per module
at 75 % and 50 % of its plain peak and at its least feasible budget, on a clock
that runs nothing (conftest.py: times do not matter here, bytes do); each plan's
step is measured again by the allocator and run against the plain step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import forget
from forget import BudgetInfeasibleError, TreePlan
from forget import policies as policies_
from forget.planning import TreePlanner, _clock
from forget.planning._tree_apply import RegionForward
from forget.planning._tree_candidates import find_candidates, first_difference

pytestmark = pytest.mark.usefixtures("fixed_clock")

BUDGETS = ("75%", "50%", "least")


# ------------------------------------------------------------------ models


class Block(nn.Module):
    """A pre-norm residual MLP block; ``scale`` comes by keyword, as HF layers' arguments do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        return x + scale * self.drop(self.mlp(self.norm(x)))


class Encoder(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, scale=scale)
        return self.norm(x)


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.encoder = Encoder(width, depth)
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x), scale=scale))


def _net(depth: int = 4) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    return Net(depth=depth).train(), {"x": torch.randn(32, 16, 8), "scale": 0.5}


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def _llama(layers: int = 2) -> tuple[nn.Module, dict[str, Any]]:
    tf = _transformers()
    config = tf.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 32))
    return tf.LlamaForCausalLM(config).train(), {"input_ids": ids, "labels": ids}


def _bert() -> tuple[nn.Module, dict[str, Any]]:
    tf = _transformers()
    config = tf.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        vocab_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )  # hidden and attention dropout 0.1: replayed exactly
    torch.manual_seed(0)
    ids = torch.randint(1, 64, (4, 64))
    return tf.BertForMaskedLM(config).train(), {"input_ids": ids, "labels": ids}


def _resnet() -> tuple[nn.Module, dict[str, Any]]:
    tf = _transformers()
    config = tf.ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[2, 2],
        layer_type="basic",
        num_labels=3,
    )
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    return tf.ResNetForImageClassification(config).train(), {
        "pixel_values": x,
        "labels": torch.arange(8) % 3,
    }


MODELS: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "net": _net,
    "llama": _llama,
    "bert": _bert,
    "resnet": _resnet,
}


def _loss(output: Any) -> torch.Tensor:
    return output.loss if hasattr(output, "loss") else output.sum()


def _step(model: nn.Module, inputs: dict[str, Any], seed: int = 3) -> tuple[Any, ...]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = _loss(model(**inputs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss.detach(), grads, buffers


def _allocator_peak(model: nn.Module, inputs: dict[str, Any]) -> int:
    model.zero_grad(set_to_none=True)
    return forget.measure(lambda: _loss(model(**inputs)).backward(), probe="profiler").peak_bytes


@dataclasses.dataclass
class Planned:
    name: str
    model: nn.Module  # as planned: never applied to, compared against
    inputs: dict[str, Any]
    planner: TreePlanner
    plans: dict[str, TreePlan | BudgetInfeasibleError]


@pytest.fixture(scope="module", params=list(MODELS))
def planned(request: pytest.FixtureRequest) -> Planned:
    model, inputs = MODELS[request.param]()
    with _clock.using(_clock.FixedClock()):
        planner = TreePlanner(model, (), inputs, repeats=1)
        plans: dict[str, TreePlan | BudgetInfeasibleError] = {}
        for budget in BUDGETS:
            if budget == "least":
                least = planner.plan(planner.plain_peak).min_feasible_bytes
                plans[budget] = planner.plan(least)
                continue
            try:
                plans[budget] = planner.plan(budget)
            except BudgetInfeasibleError as error:
                plans[budget] = error
    return Planned(request.param, model, inputs, planner, plans)


def _plan(planned: Planned, budget: str) -> TreePlan:
    plan = planned.plans[budget]
    if isinstance(plan, BudgetInfeasibleError):
        # Only 50 % may be out of reach; then the error names the least, measured.
        assert budget == "50%"
        least = planned.plans["least"]
        assert isinstance(least, TreePlan)
        assert plan.min_feasible_bytes == least.min_feasible_bytes > plan.budget_bytes
        pytest.skip(f"50 % is below the least feasible budget ({plan.min_feasible_bytes:,} B)")
    return plan


# ------------------------------------------------------------------ budgets


@pytest.mark.parametrize("budget", BUDGETS)
def test_allocator_peak_of_the_planned_step_is_within_the_budget(planned, budget):
    plan = _plan(planned, budget)
    model = copy.deepcopy(planned.model)
    plan.apply(model)
    peak = _allocator_peak(model, planned.inputs)
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert peak == plan.measured_peak_bytes <= plan.budget_bytes
    assert plan.budget_bytes < plan.plain_peak_bytes
    assert plan.choices  # something is forgotten below the plain peak
    if budget != "least":
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
    assert isinstance(least, TreePlan)
    assert least.measured_peak_bytes <= least.budget_bytes == least.min_feasible_bytes
    with pytest.raises(BudgetInfeasibleError) as error:
        planned.planner.plan(least.min_feasible_bytes - 1)
    assert error.value.min_feasible_bytes == least.min_feasible_bytes
    assert f"{least.min_feasible_bytes:,} B" in str(error.value)


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
    with pytest.raises(ValueError, match="no tree plan"):
        plan.remove(model)
    assert _allocator_peak(model, planned.inputs) == plan.plain_peak_bytes


def test_json_round_trip(planned, tmp_path):
    plan = _plan(planned, "least")
    again = TreePlan.from_json(plan.to_json())
    assert again == plan
    plan.save(tmp_path / "plan.json")
    loaded = TreePlan.load(tmp_path / "plan.json")
    assert loaded == plan and json.loads(plan.to_json())["format"] == "forget.tree_plan/1"
    model = loaded.apply(copy.deepcopy(planned.model))
    assert _allocator_peak(model, planned.inputs) == plan.measured_peak_bytes
    with pytest.raises(ValueError, match="tree plan"):
        TreePlan.from_dict({"format": "forget.plan/1"})


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
    assert "test_tree_plan.Block" in str(error.value) and "Sequential" in str(error.value)
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


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * mask


class _GatedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Gated() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(x, 0.5)  # made in the step, read by every layer
        for layer in self.layers:
            x = layer(x, mask=mask)
        return x


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


def test_candidates_restrict_by_name_pattern_or_type():
    model, inputs = _net()
    planner = TreePlanner(model, (), inputs, candidates="encoder.layers.*", repeats=1)
    nodes = [n.name for n in planner.tree.root.children]
    assert nodes == [f"encoder.layers.{i}" for i in range(4)]
    plan = planner.plan("60%")
    assert set(plan.choices) <= set(nodes) and plan.measured_peak_bytes <= plan.budget_bytes
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
    loaded = TreePlan.from_json(plan.to_json(), options=options)
    plain = copy.deepcopy(model)
    planned = loaded.apply(copy.deepcopy(model))
    loss, grads, _ = _step(planned, inputs)
    loss0, grads0, _ = _step(plain, inputs)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], grads0[n]) for n in grads0)
    if "matmuls" in plan.choices.values():
        with pytest.raises(ValueError, match="options="):
            TreePlan.from_json(plan.to_json()).apply(copy.deepcopy(model))


# ------------------------------------------------------------------ inputs and loss


def test_samples_plan_for_the_largest_and_a_larger_input_warns_once():
    model, inputs = _net()
    small = {"x": inputs["x"][:8], "scale": 0.5}
    plan = forget.plan(model, budget="70%", samples=[small, inputs], repeats=1)
    assert plan.input_sizes == ({"x": (8, 16, 8)}, {"x": (32, 16, 8)})
    alone = forget.plan(model, budget="70%", repeats=1, **inputs)
    assert plan.plain_peak_bytes == alone.plain_peak_bytes  # measured on the largest
    model = plan.apply(model)
    model(**small)
    model(inputs["x"], scale=0.5)  # no larger than planned: no warning (warnings are errors)
    larger = {"x": torch.randn(33, 16, 8), "scale": 0.5}
    with pytest.warns(UserWarning, match=r"input x has shape \(33, 16, 8\)"):
        model(larger["x"], scale=0.5)  # positional or keyword, the input is named x
    model(**larger)  # once
    plan.remove(model)
    fresh = plan.apply(model)
    with pytest.warns(UserWarning, match="may need more than the budget"):
        fresh(**larger)
    with pytest.raises(TypeError, match="not both"):
        forget.plan(model, inputs["x"], budget="70%", samples=[small])


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return out, out.mean()


def test_an_output_without_loss_needs_loss_fn_and_the_model_is_left_untouched():
    model = _Pair().train()
    x = torch.randn(16, 16, 8)
    with pytest.raises(TypeError, match="loss_fn"):
        forget.plan(model, x, budget="70%")
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    plan = forget.plan(model, x, budget="70%", loss_fn=lambda out: out[0].square().mean())
    assert plan.measured_peak_bytes <= plan.budget_bytes
    with pytest.raises(TypeError, match="one element"):
        forget.plan(model, x, budget="70%", loss_fn=lambda out: out[0])
    llama, inputs = _llama()
    with pytest.raises(TypeError, match="no loss tensor"):
        forget.plan(llama, budget="70%", input_ids=inputs["input_ids"])


def test_chain_and_tree_arguments_are_not_mixed():
    model, inputs = _net()
    with pytest.raises(TypeError, match="chain= and split="):
        forget.plan(model, budget="70%", split=True, **inputs)
    with pytest.raises(ValueError, match="exact tree solver"):
        forget.plan(model, budget="70%", algorithm="uniform", **inputs)
    chain = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(TypeError, match=r"\['candidates'\] are for a module tree"):
        forget.plan(chain, torch.randn(4, 8), budget="70%", candidates="0")
    with pytest.raises(TypeError, match=r"\['scale'\] are for a module tree"):
        forget.plan(chain, torch.randn(4, 8), budget="70%", scale=1.0)


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


# ------------------------------------------------------------------ bad input: the model untouched


def _snapshot(model: nn.Module) -> tuple[Any, ...]:
    """What planning must leave as it was: values, grads, instance forwards, hooks, modes."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    hooks = [
        (
            m.__dict__.get("forward"),
            m.training,
            *map(dict, (m._forward_pre_hooks, m._forward_hooks)),
        )
        for m in model.modules()
    ]
    return state, grads, hooks


def _assert_untouched(model: nn.Module, before: tuple[Any, ...]) -> None:
    state, grads, hooks = _snapshot(model)
    assert state.keys() == before[0].keys()
    assert all(torch.equal(state[k], before[0][k]) for k in state)
    assert grads.keys() == before[1].keys()
    for name, grad in grads.items():
        assert grad is None if before[1][name] is None else torch.equal(grad, before[1][name])
    assert hooks == before[2]


def _with_grads(model: nn.Module) -> nn.Module:
    for p in model.parameters():  # a step the user ran before planning: its grads stay
        p.grad = torch.randn_like(p)
    return model


def test_an_infeasible_budget_names_the_least_in_bytes_and_leaves_the_model_untouched():
    # That the least named works, and one byte less raises: test_least_feasible_budget_...
    model, inputs = _net(depth=2)
    before = _snapshot(_with_grads(model))
    with pytest.raises(BudgetInfeasibleError) as error:
        forget.plan(model, budget=10_000, repeats=1, **inputs)
    least = error.value.min_feasible_bytes
    assert least > error.value.budget_bytes == 10_000
    assert str(error.value).startswith("forget: ") and f"{least:,} B" in str(error.value)
    _assert_untouched(model, before)


@pytest.mark.parametrize(
    ("loss_fn", "got"),
    [
        (lambda out: out, r"a torch.float32 tensor of shape \(16, 16, 5\)"),
        (lambda out: out.sum().long(), "a torch.int64 tensor of shape"),
        (lambda out: 1.0, "got float"),
    ],
    ids=["not reduced", "integer", "not a tensor"],
)
def test_a_loss_fn_not_returning_a_scalar_raises_and_leaves_the_model_untouched(loss_fn, got):
    model, inputs = _net()
    before = _snapshot(_with_grads(model))
    with pytest.raises(
        TypeError, match=rf"^forget: loss_fn\(output\) must be .* one element.*{got}"
    ):
        forget.plan(model, inputs["x"][:16], budget="70%", loss_fn=loss_fn)
    _assert_untouched(model, before)


class _Changing(nn.Module):
    """A stack whose step changes between runs: on every other forward (a counter, or
    the sign of a dropout-masked sum) a layer is skipped, run twice, or given fewer rows."""

    def __init__(self, change: str) -> None:
        super().__init__()
        self.change, self.runs = change, 0
        self.embed = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.layers = nn.ModuleList(_Gated() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        h = self.drop(self.embed(x))
        odd = bool(h.sum() < 0) if self.change == "data" else self.runs % 2 == 0
        for i, layer in enumerate(self.layers):
            if i == 1 and odd and self.change in ("data", "skip"):
                continue
            for _ in range(2 if i == 1 and odd and self.change == "twice" else 1):
                rows = 1 if i == 2 and odd and self.change == "rows" else len(h)
                h = layer(h[:rows], mask=torch.ones_like(h[:rows]))
        return h


_SHAPES = r"\[\(4, 16\), \(4, 16\)\] in the first run and \[\(1, 16\), \(1, 16\)\]"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "skip",
            r"call 6 of the first run was module 'layers\.1', of the second run .*'layers\.2'",
        ),
        (
            "twice",
            r"call 8 of the first run was module 'layers\.2', of the second run .*'layers\.1'",
        ),
        ("rows", rf"module 'layers\.2' took inputs of shapes {_SHAPES} in the second run"),
        ("data", r"of the (second|third) run .*module 'layers\.[12]'"),
    ],
    ids=["layer skipped", "layer run twice", "fewer rows", "sign of a dropout-masked sum"],
)
def test_a_step_that_changes_structure_between_runs_raises_naming_the_module(change, message):
    # NOTE [one structure per step]: the planner's runs of the step are compared while
    # profiling. The data-dependent flow flips with the dropout mask, a coin per run:
    # some seed's first three runs differ.
    for seed in range(8):
        torch.manual_seed(seed)
        model = _with_grads(_Changing(change).train())
        before = _snapshot(model)
        try:
            TreePlanner(model, (torch.randn(4, 8),), repeats=1)
        except forget.ForgetError as error:
            assert str(error).startswith("forget: _Changing's step changed structure")
            assert re.search(message, str(error)), str(error)
            _assert_untouched(model, before)
            return
    pytest.fail("no seed changed the step's structure")


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


class _Checkpointed(_GatedStack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(x, 0.5)
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, mask=mask, use_reentrant=False)
        return x


def test_re_runs_in_backward_are_no_change_of_structure():
    # NOTE [one structure per step]: torch's checkpoint inside the model re-runs its
    # layers in backward, forget's regions theirs; only the forward's calls count.
    planner = TreePlanner(_Checkpointed(), (torch.randn(10, 16),), repeats=1)
    assert planner.measure_peak({"layers.1": "forget"}) > 0
