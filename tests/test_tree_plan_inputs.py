"""forget.plan on module trees: inputs, the loss, and bad input.

Samples of several sizes and a larger input than planned, outputs without a loss
(loss_fn), chain and tree arguments not mixed; and bad input that raises and
leaves the model untouched: an infeasible budget, a loss_fn not returning a
scalar, a step that changes structure between runs (and torch's checkpoint
re-running layers in backward, which is no change). Models: tests/_tree_models.py.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import forget
from _tree_models import (
    MODELS,
    Net,
    _assert_untouched,
    _Gated,
    _GatedStack,
    _gpt2,
    _llama,
    _net,
    _snapshot,
    _with_grads,
)
from forget import BudgetInfeasibleError
from forget._planning import TreePlanner

pytestmark = pytest.mark.usefixtures("fixed_clock")


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


class _TakesADict(nn.Module):
    """A model whose forward takes its batch as one dict, on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(3)
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = batch["x"]
        for layer in self.layers:
            h = h + layer(h)
        return h.square().mean()


def test_a_batch_passed_positionally_says_to_pass_it_as_keywords():
    # NOTE [a batch passed positionally]: the model's own error, on a dict whose keys
    # are its forward's keywords, becomes one line that names the fix.
    llama, inputs = _llama()
    before = _snapshot(llama)
    with pytest.raises(TypeError) as info:
        forget.plan(llama, inputs, budget="50%", repeats=1)
    assert str(info.value).startswith(
        "forget: plan ran LlamaForCausalLM with its positional input 0 a dict of "
        "input_ids, labels, and the model's forward failed on it (TypeError: "
    )
    assert str(info.value).endswith(
        "those keys are its forward's keyword inputs, so pass the batch as keywords: "
        "forget.plan(model, **batch, budget=...) (NOTE [a batch passed positionally])"
    )
    assert "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, TypeError)  # torch's, kept as the cause
    assert not str(info.value.__cause__).startswith("forget:")
    _assert_untouched(llama, before)
    # A model that takes a dict is planned as it is, and its own errors stay its own.
    model = _TakesADict().train()
    batch = {"x": torch.randn(64, 8)}
    plan = forget.plan(model, batch, budget="70%", repeats=1)
    assert plan.measured_peak_bytes <= plan.budget_bytes
    with pytest.raises(KeyError, match="'x'"):
        forget.plan(model, {"y": batch["x"]}, budget="70%", repeats=1)


def test_a_model_in_eval_mode_warns_that_the_plan_is_not_the_training_steps():
    # NOTE [the step as given]: planned as it is, with a warning at the user's call.
    model, inputs = _net()
    model.eval()
    with pytest.warns(UserWarning, match="is in eval mode") as record:
        plan = forget.plan(model, budget="70%", repeats=1, **inputs)
    (warning,) = [w for w in record if "eval mode" in str(w.message)]
    assert str(warning.message) == (
        "forget: Net is in eval mode (model.training is False), and the step is planned as "
        "given: dropout off and BatchNorm on its running statistics, so a plan made here "
        "fits the eval-mode step, not the training step, which may hold more (NOTE [the "
        "step as given]); call model.train() before planning to plan the training step"
    )
    assert warning.filename == __file__  # the user's line, not the planner's
    assert not model.training and plan.measured_peak_bytes <= plan.budget_bytes
    forget.plan(model.train(), budget="70%", repeats=1, **inputs)  # no warning: errors


@pytest.mark.parametrize("name", ["algorithm", "chain", "split"])
def test_the_chain_planners_keywords_are_refused_in_one_line(name):
    # One planner: every keyword of plan's means one thing for every model, and a
    # keyword plan does not take goes to the model, whose forward does not take these.
    chain = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(TypeError, match=f"forget: plan takes no {name}= any more"):
        forget.plan(chain, torch.randn(4, 8), budget="70%", **{name: True})


def test_candidates_and_model_keywords_work_for_a_chain_too():
    chain = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8))
    plan = forget.plan(chain, torch.randn(64, 8), budget=1.0, candidates="0", repeats=1)
    assert [n.name for n in plan.tree.root.children] == ["0"]
    model, inputs = _net()
    assert "scale" in inputs  # a keyword input: the model's, beside plan's own
    plan = forget.plan(model, budget="90%", candidates="encoder.layers.*", repeats=1, **inputs)
    assert all(name.startswith("encoder.layers.") for name in plan.choices)


# ------------------------------------------------------------------ bad input: the model untouched


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


class _Wide(nn.Module):
    """Blocks whose weights' gradients outweigh what they save, and a layer never used."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(128, 512), nn.Tanh(), nn.Linear(512, 128)) for _ in range(4)
        )
        self.unused = nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_the_least_named_is_never_below_the_gradients_the_step_makes():
    # NOTE [tree cost model]: the step ends holding every gradient it made, whatever
    # is forgotten; counted from the plain step's peak alone, the least named was
    # 1,843,208 B here, below the gradients' 2,107,392 B. The unused layer makes none.
    # NOTE [backward work]: the first layer's backward holds its saved bytes and its
    # temporaries beside every gradient, forgotten or not, so nothing lowers the
    # plain step's peak, and that is the least named, where no step was run.
    torch.manual_seed(0)
    model = _Wide()
    x = torch.randn(128, 128)
    with pytest.raises(BudgetInfeasibleError) as error:
        forget.plan(model, x, budget=1_300_000, loss_fn=torch.sum, repeats=1)
    used = [p for name, p in model.named_parameters() if not name.startswith("unused.")]
    gradients = sum(p.numel() * p.element_size() for p in used)
    assert all(p.grad is None for p in model.parameters())
    plain = forget.measure(lambda: model(x).sum().backward(), probe="profiler").peak_bytes
    assert gradients < error.value.min_feasible_bytes == plain


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
        ("data", r"of the (second|third) run|run on real tensors"),
    ],
    ids=["layer skipped", "layer run twice", "fewer rows", "sign of a dropout-masked sum"],
)
@pytest.mark.filterwarnings("ignore:forget.*does not run on fake tensors")
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


class _InPlaceHead(nn.Module):
    """Repeated blocks, then a head that writes into its input (torchvision's
    EfficientNet classifier: an in-place dropout before the linear layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(3)
        )
        self.head = nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_a_module_that_writes_into_its_input_is_planned_and_exact():
    # NOTE [inputs written in place]: alone, the head's captured input is a leaf,
    # which autograd refuses to let dropout write into; copies of it are not.
    torch.manual_seed(0)
    plain = _InPlaceHead().train()
    model = _InPlaceHead().train()
    model.load_state_dict(plain.state_dict())
    x = torch.randn(512, 16)
    plan = forget.plan(model, x, budget="75%", loss_fn=lambda out: out.square().mean(), repeats=1)
    assert "head" in forget._planning.find_candidates(plain)  # measured alone, on copies
    assert plan.measured_peak_bytes <= plan.budget_bytes
    plan.apply(model)
    for net in (plain, model):
        torch.manual_seed(3)
        net(x).square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_a_module_that_changes_an_input_that_is_no_tensor_is_planned_and_exact():
    # NOTE [arguments that change]: GPT-2 as its config makes it passes one key/value
    # cache to every attention layer, which appends to it; each run of a layer alone
    # starts from a copy of the cache as the layer found it in the step (before, the
    # second run backpropagated into the first's freed graph).
    plain, inputs = _gpt2()
    assert plain.config.use_cache
    planner = TreePlanner(plain, (), inputs, repeats=1)
    for budget in ("75%", "50%"):
        plan = planner.plan(budget)
        assert plan.choices and plan.measured_peak_bytes <= plan.budget_bytes
        model = plan.apply(copy.deepcopy(plain))
        for net in (plain, model):
            net.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            net(**inputs).loss.backward()
        for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (budget, name)


@pytest.mark.parametrize("name", ["resnet", "llama"])
def test_captures_together_plan_as_one_capture_per_module(name, monkeypatch):
    # NOTE [captures together]: the same figures and the same plan, from fewer forwards.
    from forget._planning._tree import alone

    captures = []
    original = alone._capture

    def counted(step, names, layouts):
        captures.append(list(names))
        return original(step, names, layouts)

    monkeypatch.setattr(alone, "_capture", counted)
    plans = []
    for batches in (alone._batches, lambda reps, layouts: [[rep] for rep in reps]):
        monkeypatch.setattr(alone, "_batches", batches)
        captures.clear()
        model, inputs = MODELS[name]()
        planner = TreePlanner(model, (), inputs, repeats=1)
        plans.append((planner.plan("75%"), len(captures), sum(map(len, captures))))
    (together, forwards, reps), (alone_plan, one_each, reps_again) = plans
    assert reps == reps_again == one_each
    assert forwards < one_each if name == "resnet" else forwards <= one_each
    assert together.choices == alone_plan.choices
    assert together.measured_peak_bytes == alone_plan.measured_peak_bytes
    assert together.predicted_peak_bytes == alone_plan.predicted_peak_bytes


def test_batches_hold_no_more_than_the_largest_modules_inputs():
    from forget._planning._tree import alone

    f32 = torch.float32
    layouts = {
        "a": (((4, 8), f32, True),),
        "b": (((2, 8), f32, True),),
        "c": (((2, 8), f32, False),),
        "d": (((1, 8), f32, True), ((1, 8), f32, False)),
        "e": (((4, 8), f32, True),),
    }
    assert alone._batches(list(layouts), layouts) == [["a"], ["b", "c"], ["d"], ["e"]]


def test_a_batch_of_captures_that_passes_the_budget_is_captured_one_at_a_time(monkeypatch):
    from forget._planning._guard import Overrun
    from forget._planning._tree import alone

    original = alone._capture
    sizes = []

    def tight(step, names, layouts):
        sizes.append(len(names))
        if len(names) > 1:
            raise Overrun(1, 2)  # as a guard stopping the batch's forward
        return original(step, names, layouts)

    model, inputs = MODELS["resnet"]()
    expected = TreePlanner(model, (), inputs, repeats=1).plan("75%")
    monkeypatch.setattr(alone, "_capture", tight)
    model, inputs = MODELS["resnet"]()
    got = TreePlanner(model, (), inputs, repeats=1).plan("75%")
    assert max(sizes) > 1 and sizes.count(1) > 0  # a batch stopped, then one at a time
    assert got.choices == expected.choices
    assert got.measured_peak_bytes == expected.measured_peak_bytes
