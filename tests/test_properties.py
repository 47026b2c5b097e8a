"""Property tests: random op chains in random (nested) regions equal the plain run, bitwise.

Each example draws a chain of ops (linear, pointwise, dropout, BatchNorm with
and without momentum, LayerNorm, residual blocks, a mask product, in-place
relu on an intermediate, RReLU in train mode) and a random tree of regions
over it (regions may contain regions). The same model, input and seed run
plainly and under `forget.forget` for a few SGD steps; after every step the
outputs, the gradients of the inputs and of every parameter, every buffer
and the global RNG state must be bitwise equal, and each top-level region
must have been re-run at most once in backward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import forget

PROFILE = settings(
    derandomize=True,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

WIDTH = 6
BATCH = 5

OPS = (
    "linear",
    "tanh",
    "relu",
    "gelu",
    "sin",
    "exp",
    "dropout0.1",
    "dropout0.5",
    "bn",
    "bn_cumulative",
    "layernorm",
    "residual",
    "mask",
    "relu_",
    "rrelu",
)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x).tanh()


def _layer(op: str) -> nn.Module | None:
    """The module an op owns (its parameters and buffers), or None for a pure op."""
    return {
        "linear": lambda: nn.Linear(WIDTH, WIDTH),
        "gelu": nn.GELU,
        "dropout0.1": lambda: nn.Dropout(0.1),
        "dropout0.5": lambda: nn.Dropout(0.5),
        "bn": lambda: nn.BatchNorm1d(WIDTH, momentum=0.1),
        "bn_cumulative": lambda: nn.BatchNorm1d(WIDTH, momentum=None),
        "layernorm": lambda: nn.LayerNorm(WIDTH),
        "residual": Residual,
        "rrelu": nn.RReLU,
    }.get(op, lambda: None)()


class Chain(nn.Module):
    """A model made of drawn ops; ``apply_op`` runs op ``i`` on ``x`` (``m`` is the mask)."""

    def __init__(self, ops: list[str]) -> None:
        super().__init__()
        self.ops = ops
        self.layers = nn.ModuleList(_layer(op) or nn.Identity() for op in ops)

    def apply_op(self, i: int, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        op = self.ops[i]
        if op == "tanh":
            return x.tanh()
        if op == "relu":
            return torch.relu(x)
        if op == "sin":
            return x.sin()
        if op == "exp":
            return x.clamp(-4.0, 4.0).exp()  # bounded: no inf, so torch.equal stays meaningful
        if op == "mask":
            return x * m
        if op == "relu_":
            h = x * 1.5  # a fresh intermediate (mul by a scalar saves nothing) ...
            return h.relu_()  # ... rewritten in place
        return self.layers[i](x)


# A plan is a list of items: an int (run that op) or a list (a forgotten region).
Plan = list[Any]


@st.composite
def plans(draw: st.DrawFn) -> tuple[list[str], Plan]:
    n = draw(st.integers(min_value=1, max_value=8))
    ops = draw(st.lists(st.sampled_from(OPS), min_size=n, max_size=n))

    def split(lo: int, hi: int, depth: int) -> Plan:
        items: Plan = []
        i = lo
        while i < hi:
            j = draw(st.integers(min_value=i + 1, max_value=hi))
            kind = draw(st.sampled_from(["plain", "region", "region"] if depth < 3 else ["plain"]))
            if kind == "plain":
                items.extend(range(i, j))
            else:
                items.append(split(i, j, depth + 1))
            i = j
        return items

    return ops, split(0, n, 1)


class Counter:
    """Calls of each region function, split by the in_recomputing() flag."""

    def __init__(self) -> None:
        self.forward: dict[int, int] = {}
        self.recompute: dict[int, int] = {}

    def note(self, key: int) -> None:
        table = self.recompute if forget.in_recomputing() else self.forward
        table[key] = table.get(key, 0) + 1


def _run(
    model: Chain, plan: Plan, x: torch.Tensor, m: torch.Tensor, counter: Counter | None
) -> torch.Tensor:
    """Run the plan; with a counter, lists are forgotten regions, otherwise run inline."""
    for item in plan:
        if isinstance(item, int):
            x = model.apply_op(item, x, m)
        elif counter is None:
            x = _run(model, item, x, m, None)
        else:
            x = forget.forget(_region(model, item, counter), x, m)
    return x


def _region(
    model: Chain, plan: Plan, counter: Counter
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def region(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        counter.note(id(plan))
        return _run(model, plan, x, m, counter)

    return region


def _state(model: nn.Module, *leaves: torch.Tensor) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for i, t in enumerate(leaves):
        out[f"input{i}.grad"] = None if t.grad is None else t.grad.clone()
    for name, p in model.named_parameters():
        out[f"{name}.grad"] = None if p.grad is None else p.grad.clone()
        out[name] = p.detach().clone()
    for name, b in model.named_buffers():
        out[name] = b.clone()
    return out


def _assert_same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        va, vb = a[key], b[key]
        if va is None or vb is None:
            assert va is None and vb is None, key
        else:
            assert torch.equal(va, vb), key


def _step(
    model: Chain,
    plan: Plan,
    x: torch.Tensor,
    m: torch.Tensor,
    weight: torch.Tensor,
    counter: Counter | None,
) -> torch.Tensor:
    for t in (x, m, *model.parameters()):
        t.grad = None
    y = _run(model, plan, x, m, counter)
    (y * weight).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    return y.detach()


def _top_regions(plan: Plan) -> list[int]:
    return [id(item) for item in plan if isinstance(item, list)]


def _has_region(plan: Plan) -> bool:
    return any(isinstance(item, list) for item in plan)


@PROFILE
@given(plans(), st.integers(min_value=1, max_value=3), st.integers(0, 2**16))
def test_random_chain_in_random_regions_equals_plain_bitwise(drawn, steps, seed):
    ops, plan = drawn
    torch.manual_seed(seed)
    plain_model = Chain(ops).train()
    forget_model = copy.deepcopy(plain_model)
    g = torch.Generator().manual_seed(seed + 1)
    x0 = torch.randn(BATCH, WIDTH, generator=g)
    m0 = (torch.rand(BATCH, WIDTH, generator=g) > 0.3).float()
    weight = torch.randn(BATCH, WIDTH, generator=g)
    xp, mp = x0.clone().requires_grad_(), m0.clone().requires_grad_()
    xf, mf = x0.clone().requires_grad_(), m0.clone().requires_grad_()

    for step in range(steps):
        torch.manual_seed(seed + 100 + step)
        yp = _step(plain_model, plan, xp, mp, weight, None)
        rng_plain = torch.get_rng_state()

        torch.manual_seed(seed + 100 + step)
        counter = Counter()
        yf = _step(forget_model, plan, xf, mf, weight, counter)
        rng_forget = torch.get_rng_state()

        assert torch.equal(yp, yf), f"output differs at step {step}"
        _assert_same(_state(plain_model, xp, mp), _state(forget_model, xf, mf))
        assert torch.equal(rng_plain, rng_forget), f"global RNG state differs at step {step}"
        for key in _top_regions(plan):
            # Each top-level region runs once in the forward and at most once more in
            # backward (not at all when all it saves are its inputs and parameters,
            # which forget keeps instead of recomputing).
            assert counter.forward[key] == 1
            assert counter.recompute.get(key, 0) <= 1
        if not _has_region(plan):
            assert counter.forward == counter.recompute == {}


def test_nested_regions_three_deep_with_dropout_and_batchnorm_equal_plain():
    """A fixed, hand-written example of what the property covers, kept readable."""
    ops = ["linear", "dropout0.5", "bn", "rrelu", "bn_cumulative", "mask", "relu_", "linear"]
    plan: Plan = [0, [1, [2, [3, 4], 5], 6], 7]
    torch.manual_seed(0)
    plain_model = Chain(ops).train()
    forget_model = copy.deepcopy(plain_model)
    x0 = torch.randn(BATCH, WIDTH)
    m0 = (torch.rand(BATCH, WIDTH) > 0.5).float()
    weight = torch.randn(BATCH, WIDTH)
    xp, mp = x0.clone().requires_grad_(), m0.clone().requires_grad_()
    xf, mf = x0.clone().requires_grad_(), m0.clone().requires_grad_()
    for step in range(3):
        torch.manual_seed(step)
        yp = _step(plain_model, plan, xp, mp, weight, None)
        rng_plain = torch.get_rng_state()
        torch.manual_seed(step)
        counter = Counter()
        yf = _step(forget_model, plan, xf, mf, weight, counter)
        assert torch.equal(yp, yf)
        # The outer region made its dropout mask, so it is re-run, exactly once.
        assert counter.forward[id(plan[1])] == counter.recompute[id(plan[1])] == 1
        assert torch.equal(rng_plain, torch.get_rng_state())
        _assert_same(_state(plain_model, xp, mp), _state(forget_model, xf, mf))
    assert int(forget_model.layers[2].num_batches_tracked) == 3
