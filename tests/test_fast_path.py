"""NOTE [fast path]: a call site's first region runs exact and learns; later ones run on
saved-tensor hooks alone, under a guard. Every test is differential against a plain
step (bitwise on CPU) and checks which path ran by the dispatch mode the forward saw."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import forget
from forget import ForgetError
from forget._engine import fast_path
from forget._engine._sites import SMALL_BUFFER_BYTES


class _Seen(nn.Module):
    """Wraps a module; notes the dispatch mode each call of its forward ran under."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.modes: list[str | None] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = _get_current_dispatch_mode()
        self.modes.append(None if mode is None else type(mode).__name__)
        return self.inner(x)


def _steps(make, n: int, *, x_shape=(6, 8), flip=None):
    """n steps of plain and forget on twin modules; assert they agree bit for bit."""
    torch.manual_seed(0)
    plain = make()
    ours = _Seen(copy.deepcopy(plain))
    for step in range(n):
        if flip is not None:
            flip(step, plain, ours.inner)
        x = torch.randn(*x_shape, generator=torch.Generator().manual_seed(step))
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(100 + step)
        out_plain = plain(a)
        out_plain.square().sum().backward()
        torch.manual_seed(100 + step)
        out_ours = forget.checkpoint(ours, b)
        out_ours.square().sum().backward()
        assert torch.equal(out_plain, out_ours), step
        assert torch.equal(a.grad, b.grad), step
        for p, q in zip(plain.parameters(), ours.inner.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), step
        for p, q in zip(plain.buffers(), ours.inner.buffers(), strict=True):
            assert torch.equal(p, q), step
    return ours.modes


def _forwards(modes: list[str | None]) -> list[str | None]:
    """The forward's mode of each step (each step runs a forward and, maybe, a re-run)."""
    return modes[0::2]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 8))


def _bn() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))


def test_later_calls_run_without_a_dispatch_mode_and_draw_the_same_masks():
    modes = _steps(_mlp, 4)
    # First forward exact (its tracker), every later forward and re-run without one.
    assert modes[0] == "StateTracker"
    assert modes[2:] == [None] * 6


def test_batchnorm_statistics_stay_bitwise_through_training_flips():
    def flip(step, a, b):
        for m in (a, b):
            m.train(step not in (2, 3))

    modes = _steps(_bn, 6, flip=flip)
    # Learned in training, fast; the flip to eval learns again, then fast; back to
    # training learns again.
    assert _forwards(modes)[:2] == ["StateTracker", None]
    assert modes.count("StateTracker") >= 3


class _Every(nn.Module):
    """Updates an average every other call: a write that only some calls make."""

    def __init__(self, size: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("avg", torch.zeros(size))
        self.calls = 0
        self.modes: list[object] = []

    def forward(self, x):
        if not forget.in_recomputing():
            self.calls += 1
            self.modes.append(_get_current_dispatch_mode())
        y = self.lin(x)
        if self.calls % 2 == 0:
            with torch.no_grad():
                self.avg[:8].mul_(0.5).add_(y.mean(0))
        return (y * self.avg[:8]).tanh() + y


def test_a_write_only_some_calls_make_is_put_back_before_the_re_run():
    # Call 1 (exact) writes nothing, call 2 (fast) writes: the re-run must see the
    # average the forward saw, and the step leave the one the forward left.
    torch.manual_seed(0)
    plain = _Every()
    ours = copy.deepcopy(plain)
    for step in range(5):
        x = torch.randn(4, 8)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        plain(a).sum().backward()
        forget.checkpoint(ours, b).sum().backward()
        assert torch.equal(a.grad, b.grad), step
        assert torch.equal(plain.avg, ours.avg), step
    assert ours.modes[0] is not None and ours.modes[1:] == [None] * 4


def test_a_write_the_guard_cannot_undo_raises_and_sends_the_site_back_to_exact():
    big = SMALL_BUFFER_BYTES // 4 + 1  # a float buffer over the size copied every call
    torch.manual_seed(0)
    module = _Every(size=big)
    forget.checkpoint(module, torch.randn(4, 8, requires_grad=True)).sum().backward()
    with pytest.raises(ForgetError, match=f"buffer of shape \\[{big}\\]"):
        forget.checkpoint(module, torch.randn(4, 8, requires_grad=True))
    module.calls = 1  # the next call writes: on the exact path, which copies it
    forget.checkpoint(module, torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert [m is None for m in module.modes] == [False, True, False]


def test_a_later_write_into_an_input_raises():
    def f(x, scale):
        if scale.item() > 1:
            scale.mul_(0.5)
        return x.sin() * scale

    x = torch.randn(3, requires_grad=True)
    forget.checkpoint(f, x, torch.tensor(1.0)).sum().backward()
    with pytest.raises(ForgetError, match="argument"):
        forget.checkpoint(f, x, torch.tensor(4.0))


def test_learned_early_stop_and_a_call_that_packs_otherwise():
    tails = []

    class Tail(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x).tanh()  # tanh saves its output: the last pack for short x
            if x.shape[0] > 3:
                h = h.exp()
            tails.append(forget.in_recomputing())
            return h * 2

    torch.manual_seed(0)
    plain, ours = Tail(), Tail()
    ours.load_state_dict(plain.state_dict())
    for rows in (2, 2, 5, 2):
        x = torch.randn(rows, 4)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        plain(a).sum().backward()
        tails.clear()
        forget.checkpoint(ours, b).sum().backward()
        assert torch.equal(a.grad, b.grad)
        # The re-run stops at the last pack, before the tail, when the packs are the
        # learned ones; the 5-row call packs more, and its re-run runs to the end.
        assert tails == ([False, True] if rows == 5 else [False])


def test_fast_path_off_runs_every_call_exact():
    seen = _Seen(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    x = torch.randn(2, 4, requires_grad=True)
    with fast_path(False):
        for _ in range(3):
            forget.checkpoint(seen, x).sum().backward()
    assert _forwards(seen.modes) == ["StateTracker"] * 3
    forget.checkpoint(seen, x).sum().backward()  # learns now, then fast
    forget.checkpoint(seen, x).sum().backward()
    assert _forwards(seen.modes)[3:] == ["StateTracker", None]
    with pytest.raises(TypeError, match="bool"), fast_path(1):  # type: ignore[arg-type]
        pass


def test_explicit_generator_sites_stay_exact():
    g = torch.Generator().manual_seed(0)

    def f(x):
        modes.append(_get_current_dispatch_mode())
        return x * torch.rand(x.shape, generator=g)

    modes: list[object] = []
    x = torch.randn(5, requires_grad=True)
    for _ in range(3):
        g.manual_seed(1)
        y = forget.checkpoint(f, x)
        y.sum().backward()
        g.manual_seed(1)
        assert torch.equal(x.grad, torch.rand(5, generator=g))
        x.grad = None
    assert all(m is not None for m in modes[0::2])  # every forward under the tracker


def test_saved_inputs_keep_their_identity_on_the_fast_path():
    got = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(b)
            return a * b

        @staticmethod
        def backward(ctx, grad):
            (saved,) = ctx.saved_tensors
            got.append(saved)
            return grad * saved, None

    def f(a, b):
        return Keep.apply(a.sin(), b)

    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    for _ in range(3):
        forget.checkpoint(f, a, b).sum().backward()
    assert all(s is b for s in got)


def test_nested_regions_inside_a_fast_region_match_plain():
    inner = nn.Sequential(nn.Linear(6, 6), nn.Tanh())

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.lin = inner, nn.Linear(6, 6)

        def forward(self, x, nested=True):
            h = forget.checkpoint(self.inner, x) if nested else self.inner(x)
            return self.lin(h).sin()

    torch.manual_seed(0)
    outer = Outer()
    for _ in range(3):
        x = torch.randn(4, 6)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        outer(a, nested=False).sum().backward()
        plain = [a.grad] + [p.grad.clone() for p in outer.parameters()]
        outer.zero_grad()
        forget.checkpoint(outer, b).sum().backward()
        ours = [b.grad] + [p.grad.clone() for p in outer.parameters()]
        outer.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(plain, ours, strict=True))


@pytest.mark.parametrize("make", [_mlp, _bn], ids=["dropout", "batchnorm"])
def test_fast_calls_hold_what_the_exact_call_held(make):
    # A plan measured on a site's first (exact) call must hold on its later ones.
    torch.manual_seed(0)
    blocks = [make() for _ in range(3)]
    x = torch.randn(16, 8)

    def step():
        for b in blocks:
            b.zero_grad(set_to_none=True)
        h = x.requires_grad_()
        for b in blocks:
            h = forget.checkpoint(b, h)
        h.square().sum().backward()

    first, second, third = (forget.measure(step) for _ in range(3))
    assert first.peak_bytes == second.peak_bytes == third.peak_bytes
    assert first.saved_bytes == second.saved_bytes == third.saved_bytes


def test_a_function_made_per_call_is_its_own_site_and_stays_exact():
    lin = nn.Linear(4, 4)
    modes: list[object] = []
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(3):

        def f(h):
            modes.append(_get_current_dispatch_mode())
            return lin(h).relu()

        forget.checkpoint(f, x).sum().backward()
    assert all(m is not None for m in modes[0::2])


def test_a_module_level_function_site_learns_once():
    modes = []
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(3):
        forget.checkpoint(_through, lin, x, modes).sum().backward()
    # The forward appends to the caller's very list; a re-run to a rebuilt one.
    assert [m is None for m in modes] == [False, True, True]


def _through(lin: nn.Module, h: torch.Tensor, modes: list[object]) -> torch.Tensor:
    modes.append(_get_current_dispatch_mode())
    return lin(h).relu()


def test_forget_sequential_segments_learn_once():
    # Its segments are callables made per call: the site is their parts.
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)]
    seen = [_Seen(layer) for layer in layers]
    model = forget.forget_sequential(seen, segments=2)
    x = torch.randn(3, 6, requires_grad=True)
    for _ in range(3):
        model(x).sum().backward()
    # Three forwards and three re-runs: only the first forward under a tracker.
    assert seen[0].modes == ["StateTracker"] + [None] * 5


class _WritesWeight(nn.Module):
    """Scales its weight in place on the calls ``write`` names: a write into a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.write = False

    def forward(self, x):
        if self.write and not forget.in_recomputing():
            with torch.no_grad():
                self.lin.weight.mul_(1.0)
        return self.lin(x).tanh()


@pytest.mark.parametrize("how", ["setattr", "slot"], ids=["setattr", "slot-written"])
def test_a_parameter_replaced_between_calls_is_watched(how):
    # NOTE [cached walks]: the guard's walk is kept from call to call; a parameter
    # replaced after it (by setattr, or in the slot itself as Module._apply does)
    # must be the one the next call watches, so its write is seen and refused.
    torch.manual_seed(0)
    module = _WritesWeight()
    for _ in range(2):  # the first call learns, the second runs fast
        forget.checkpoint(module, torch.randn(4, 8, requires_grad=True)).sum().backward()
    new = nn.Parameter(torch.randn(8, 8))
    if how == "setattr":
        module.lin.weight = new
    else:
        module.lin._parameters["weight"] = new
    module.write = True
    with pytest.raises(ForgetError, match=r"parameter of shape \[8, 8\]"):
        forget.checkpoint(module, torch.randn(4, 8, requires_grad=True))


def test_a_submodule_replaced_between_calls_is_walked_and_stays_exact():
    def flip(step, a, b):
        if step == 2:  # the same new layer in both, after two calls learned the old one
            torch.manual_seed(7)
            new = nn.Linear(16, 8)
            a[3], b[3] = new, copy.deepcopy(new)

    modes = _steps(_mlp, 5, flip=flip)
    assert _forwards(modes)[:2] == ["StateTracker", None]
