"""NOTE [regenerate]: saved GELU / SiLU outputs rebuilt in backward, bitwise."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import forget
from forget import policies as P
from forget._cli._models import build_model


class _MLP(nn.Module):
    def __init__(self, act: str = "gelu") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.act = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.fc1(h)
        z = F.gelu(z, approximate="tanh") if self.act == "tanh" else getattr(F, self.act)(z)
        return h + self.fc2(z)


def _step(model: nn.Module, x: torch.Tensor, regen: P.Policy | None, create_graph=False):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    if regen is None:
        report = forget.measure(model, x)
    else:
        with forget.regenerating(regen):
            report = forget.measure(model, x)
    y = report.result
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=create_graph)
    grads = torch.autograd.grad(gx.sum(), list(model.parameters())) if create_graph else None
    return report.saved_bytes, gx, grads


@pytest.mark.parametrize("act", ["gelu", "tanh", "silu"])
@pytest.mark.parametrize("shape", [(8, 16), (2, 4, 16)])  # 3-d: Linear saves a view
def test_regenerated_outputs_give_the_plain_gradients_bitwise_in_fewer_bytes(act, shape):
    model, x = _MLP(act), torch.randn(*shape)
    plain = _step(model, x, None)
    ours = _step(model, x, P.regenerate())
    assert torch.equal(plain[1], ours[1])
    # Exactly the activation's output is spared: 64 floats per row.
    rows = x.numel() // 16
    assert plain[0] - ours[0] == rows * 64 * 4
    # Only the op named is rebuilt.
    other = "aten.silu" if act != "silu" else "aten.gelu"
    assert _step(model, x, P.regenerate(other))[0] == plain[0]


def test_regenerated_outputs_under_double_backward():
    model, x = _MLP(), torch.randn(2, 4, 16)
    plain = _step(model, x, None, create_graph=True)
    ours = _step(model, x, P.regenerate(), create_graph=True)
    assert torch.equal(plain[1], ours[1])
    assert all(torch.equal(a, b) for a, b in zip(plain[2], ours[2], strict=True))


def test_the_op_runs_again_once_per_unpack_and_a_live_output_is_used_as_is(monkeypatch):
    from forget._engine import _regenerate

    calls = []
    rule = _regenerate._RULES["GeluBackward0"]
    monkeypatch.setitem(
        _regenerate._RULES,
        "GeluBackward0",
        (rule[0], lambda n, out: (lambda r: lambda: calls.append(1) or r())(rule[1](n, out))),
    )
    x = torch.randn(4, 16, requires_grad=True)
    fc = nn.Linear(16, 16)
    with forget.regenerating(P.regenerate("gelu")):
        y = fc(F.gelu(x))
    y.sum().backward()
    assert calls == [1]
    # Held by the caller, the output is not rebuilt; modified in place, it raises.
    with forget.regenerating(P.regenerate("gelu")):
        g = F.gelu(x)
        y = fc(g)
    y.sum().backward()
    assert calls == [1]
    with forget.regenerating(P.regenerate("gelu")):
        g = F.gelu(x)
        y = fc(g)
    with torch.no_grad():
        g.add_(1)
    with pytest.raises(RuntimeError, match="modified in place after it was saved"):
        y.sum().backward()


def test_regenerate_is_no_region_policy():
    policy = P.regenerate()
    assert policy.regenerate == set(P.REGENERABLE)
    assert str(policy) == (
        "regenerate outputs of aten.bernoulli_, aten.gelu, aten.mul, "
        "aten.native_layer_norm, aten.silu"
    )
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(TypeError, match="is not a region's policy"):
        forget.checkpoint(F.gelu, x, policy=policy)

    with (
        pytest.raises(TypeError, match=r"regenerating\(\) takes"),
        forget.regenerating(P.save_nothing),
    ):
        pass
    with pytest.raises(ValueError, match=r"cannot rebuild aten\.relu"):
        P.regenerate("relu")
    with pytest.raises(ValueError, match="does not combine"):
        P.either(policy, P.save_outputs_of("mm"))


class _Body(nn.Module):
    """A region's body: GELU MLP, a norm, then an outer product whose backward is the peak."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.norm = nn.BatchNorm1d(16) if norm == "batch" else nn.Identity()
        self.regen: P.Policy | None = None
        self.runs: list[bool] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.runs.append(forget.in_recomputing())
        with forget.regenerating(self.regen) if self.regen else contextlib.nullcontext():
            v = self.norm(self.fc2(F.gelu(self.fc1(h))))
            return (v.unsqueeze(-1) * v.unsqueeze(-2)).sum(-1)


@pytest.mark.parametrize("norm", ["none", "batch"])  # batch: the re-run has a dispatch mode
def test_regenerating_inside_a_region_drops_what_its_rerun_would_hold(norm):
    # NOTE [regenerate in a re-run]: the first forward keeps nothing anyway; the
    # re-run holds the GELU output no longer, and gradients stay bitwise.
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))

    def step(body: _Body, region: bool) -> tuple[int, list[torch.Tensor]]:
        body.zero_grad(set_to_none=True)
        body.runs.clear()
        h = x.clone().requires_grad_()

        def run() -> None:
            y = forget.forget(body, h) if region else body(h)
            y.square().sum().backward()

        peak = forget.measure(run).peak_bytes
        return peak, [h.grad, *(p.grad for p in body.parameters())]

    body = _Body(norm)
    plain = step(body, False)
    forgotten = step(body, True)
    body.regen = P.regenerate()
    ours = step(body, True)
    assert body.runs == [False, True]  # one forward, one re-run
    for a, b in zip(plain[1], ours[1], strict=True):
        assert torch.equal(a, b)
    # The peak is the outer product's backward, after the re-run: the GELU
    # output (64 floats a row) is what the re-run no longer holds then.
    assert forgotten[0] - ours[0] == 256 * 64 * 4


@pytest.mark.parametrize("how", ["double backward", "policy region", "nested region"])
def test_regenerating_inside_a_region_stays_exact(how):
    # NOTE [regenerate in a re-run]: under create_graph the re-run keeps its
    # tensors (they carry history); a policy region replays its kept outputs and
    # regenerates the rest; a region nested in the body keeps to itself.
    body = _Body("none")
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(2))

    def grads(region: bool) -> list[torch.Tensor]:
        body.zero_grad(set_to_none=True)
        h = x.clone().requires_grad_()
        if not region:
            y = body(h)
        elif how == "policy region":
            y = forget.checkpoint(body, h, policy=P.save_outputs_of("addmm"))
        elif how == "nested region":
            y = forget.forget(lambda t: forget.forget(body, t * 2) / 2, h)
        else:
            y = forget.forget(body, h)
        if region and how == "nested region":
            y = y * 2
        elif how == "nested region":
            y = body(h * 2)
        params = [h, *body.parameters()]
        first = torch.autograd.grad(y.square().sum(), params, create_graph=how == "double backward")
        if how != "double backward":
            return list(first)
        return list(torch.autograd.grad(sum(g.square().sum() for g in first), params))

    plain = grads(False)
    body.regen, body.runs = None, []
    grads(True)
    without = body.runs  # the re-runs the region makes without regenerating
    body.regen, body.runs = P.regenerate(), []
    ours = grads(True)
    for a, b in zip(plain, ours, strict=True):
        assert torch.equal(a, b)
    assert body.runs == without and True in without


def test_a_regions_outputs_are_left_to_the_region():
    # NOTE [region outputs]: a LayerNorm ending a region saved slots, not tensors;
    # checking its output for a rebuild would re-run the region in the forward.
    torch.manual_seed(0)
    ln, fc = nn.LayerNorm(16), nn.Linear(16, 16)
    runs: list[bool] = []

    def region(h: torch.Tensor) -> torch.Tensor:
        runs.append(forget.in_recomputing())
        return ln(h * 2)

    x = torch.randn(8, 16, requires_grad=True)
    y = forget.forget(region, x)
    with forget.regenerating(P.regenerate()):
        z = fc(y)
    assert runs == [False]  # nothing re-ran in the forward
    z.square().sum().backward()
    assert runs == [False, True]
    expected = torch.autograd.grad(fc(ln(x * 2)).square().sum(), x)[0]
    assert torch.equal(x.grad, expected)


@pytest.mark.usefixtures("fixed_clock")  # bytes and gradients, not times
def test_a_plan_may_keep_gpt_blocks_with_their_activations_regenerated(tmp_path):
    # The GPT block's GELU output is 4x the width, rebuilt for one GELU in backward.
    model = build_model("tiny_gpt", "tiny")
    x, target = model.example_input(generator=torch.Generator().manual_seed(0))
    options = {"regen": P.regenerate()}

    def loss_fn(out):
        return model.loss(out, target)

    with pytest.raises(forget.BudgetInfeasibleError) as info:
        forget.plan(model, x, budget=1000, loss_fn=loss_fn, options=options, repeats=1)
    least = info.value.min_feasible_bytes
    plan = forget.plan(model, x, budget=least, loss_fn=loss_fn, options=options, repeats=1)
    assert "regen" in plan.choices.values()
    block = plan.tree.node("blocks.0")
    (option,) = block.options
    assert option.held_bytes < block.own_bytes  # it keeps less than the block kept whole
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = forget.Plan.load(path, options=options)
    grads = []
    for net in (copy.deepcopy(model), loaded.apply(copy.deepcopy(model))):
        torch.manual_seed(3)
        net.step(x, target)
        grads.append([p.grad for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    planned = loaded.apply(copy.deepcopy(model))
    peak = forget.measure(planned.step, x, target, probe="profiler").peak_bytes
    assert peak <= plan.measured_peak_bytes <= least


def _attention(qkv: torch.Tensor) -> torch.Tensor:
    q, k, v = qkv.unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True).sum(1)


def test_a_dropouts_product_and_float_mask_are_rebuilt_bitwise():
    # NOTE [regenerate a product], NOTE [two-valued masks]: CPU attention dropout
    # multiplies softmax's result (which softmax keeps) by a float mask of 0 and
    # 1/(1-p) (which the product's backward keeps); the next matmul keeps the product.
    qkv = torch.randn(2, 32, 96)
    runs = {}
    for name, policy in [("plain", None), ("mul", P.regenerate("mul")), ("all", P.regenerate())]:
        x = qkv.clone().requires_grad_()
        torch.manual_seed(5)
        with contextlib.ExitStack() as stack:
            if policy is not None:
                stack.enter_context(forget.regenerating(policy))
            report = forget.measure(_attention, x)
        report.result.square().sum().backward()
        runs[name] = (report.saved_bytes, x.grad)
    scores = 2 * 2 * 32 * 32 * 4  # batch, heads, query, key; float32
    assert runs["plain"][0] - runs["mul"][0] == scores
    assert runs["plain"][0] - runs["all"][0] == scores + scores - scores // 4 - 2 * 4
    assert torch.equal(runs["plain"][1], runs["mul"][1])
    assert torch.equal(runs["plain"][1], runs["all"][1])


def test_what_cannot_be_rebuilt_exactly_is_kept():
    from forget._engine._regenerate import _two_valued

    policy = P.regenerate()
    a = torch.randn(64, 64, requires_grad=True)
    # The product's first operand is kept by no one (an addition keeps nothing).
    with forget.regenerating(policy):
        report = forget.measure(lambda: (a + 1) * torch.ones(64, 64) @ a)
    with forget.regenerating(P.regenerate("gelu")):
        kept = forget.measure(lambda: (a + 1) * torch.ones(64, 64) @ a)
    assert report.saved_bytes == kept.saved_bytes
    mask = torch.empty(64, 64).bernoulli_(0.5).div_(0.5)
    assert _two_valued(mask) is not None
    assert torch.equal(_two_valued(mask)(), mask)
    assert _two_valued(torch.ones(64, 64)) is None  # never written in place
    assert _two_valued(mask[:8]) is None  # a view
    assert _two_valued(mask[:8].clone().add_(0)) is None  # too small to pay
    three = mask.clone()
    three[0, 0] = 3.0
    assert _two_valued(three) is None
    signed = mask.clone()
    signed[signed == 0] = -0.0  # equal to 0.0, but not the same bits
    assert _two_valued(signed) is None
    assert _two_valued(torch.zeros(64, 64, device="meta").add_(1)) is None  # CPU only


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-3])
def test_a_layer_norm_output_is_rebuilt_only_where_its_bits_come_out_again(eps):
    # NOTE [regenerate a layer norm]: its backward keeps no eps; 1e-3 is not tried.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32, eps=eps), nn.Linear(32, 16))
    x = torch.randn(4, 8, 16)
    runs = []
    for policy in (None, P.regenerate("native_layer_norm")):
        model.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            if policy is not None:
                stack.enter_context(forget.regenerating(policy))
            report = forget.measure(model, x)
        report.result.square().sum().backward()  # the last Linear's weight reads it
        runs.append((report.saved_bytes, [p.grad for p in model.parameters()]))
    spared = 0 if eps == 1e-3 else 4 * 8 * 32 * 4
    assert runs[0][0] - runs[1][0] == spared
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))
