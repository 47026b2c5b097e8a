"""forget.forget: the seed's contract and DESIGN.md's, each point differentially."""

from __future__ import annotations

import collections
import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import forget
from forget import ForgetError, RecomputationMismatchError
from forget._engine import ordinal


class Counted:
    """A function that counts its calls and records in_recomputing() at each."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0
        self.flags: list[bool] = []

    def __call__(self, *xs):
        self.calls += 1
        self.flags.append(forget.in_recomputing())
        return self.fn(*xs)


def _grads(*ts):
    return [None if t.grad is None else t.grad.clone() for t in ts]


def _leaves(seed=0, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, requires_grad=True) for s in shapes]


def test_not_callable_raises_type_error_before_running():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match="forget: func must be callable, but got int"):
        forget.forget(1, x)


def test_exp_and_sin_gradients_are_bitwise_equal_to_plain():
    x, w = _leaves(0, (4, 5), (5, 3))
    f = Counted(lambda a, b: ((a @ b).sin() * a.sum()).exp())
    y = f(x, w)
    y.sum().backward()
    plain = _grads(x, w)
    x.grad = w.grad = None
    y2 = forget.forget(f, x, w)
    assert torch.equal(y, y2)
    y2.sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(x, w), strict=True))
    assert f.calls == 3  # plain, forget's forward, one recomputation
    assert f.flags == [False, False, True]


def test_function_saving_nothing_is_not_rerun():
    x, y = _leaves(1, (3,), (3,))
    f = Counted(lambda a, b: a + b)
    forget.forget(f, x, y).sum().backward()
    assert f.calls == 1
    assert torch.equal(x.grad, torch.ones(3))


def test_forward_keeps_no_intermediate():
    x = torch.randn(16, 16, requires_grad=True)
    kept: list[torch.Tensor] = []

    def pack(t):
        kept.append(t)
        return t

    def f(a):
        return a.exp().sin().cos().sum()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forget.forget(f, x)
    # Inside the region forget's hooks see every save; nothing reaches outer hooks.
    assert kept == []
    grad_fn_saved = [
        getattr(y.grad_fn.next_functions[0][0], name)
        for name in dir(y.grad_fn.next_functions[0][0])
        if name.startswith("_raw_saved_")
    ]
    assert grad_fn_saved  # cos saves its input ...
    y.backward()  # ... which is rebuilt on demand
    assert x.grad is not None


def test_tuple_and_single_returns_keep_their_form():
    x, y = _leaves(2, (3,), (3,))
    one = forget.forget(lambda a: (a * 2,), x)
    assert isinstance(one, tuple) and len(one) == 1
    two = forget.forget(lambda a, b: (a * b, a - b), x, y)
    assert isinstance(two, tuple) and len(two) == 2
    single = forget.forget(lambda a: a * 2, x)
    assert isinstance(single, torch.Tensor)


@pytest.mark.parametrize(
    ("n", "word"),
    [
        (1, "1st"),
        (2, "2nd"),
        (3, "3rd"),
        (4, "4th"),
        (11, "11th"),
        (12, "12th"),
        (13, "13th"),
        (21, "21st"),
        (22, "22nd"),
        (111, "111th"),
        (112, "112th"),
        (101, "101st"),
    ],
)
def test_ordinals(n, word):
    assert ordinal(n) == word


@pytest.mark.parametrize("n", [1, 2, 3, 4, 11, 12, 13, 21, 22, 111])
def test_tuple_with_non_tensor_names_the_ordinal_and_type(n):
    x = torch.ones(2, requires_grad=True)

    def f(a):
        out: list[object] = [a * 1 for _ in range(n)]
        out[n - 1] = 3.5
        return tuple(out)

    with pytest.raises(TypeError, match=rf"forget: the {ordinal(n)} element .* but float"):
        forget.forget(f, x)


@pytest.mark.parametrize("value", [[1], {"a": 1}, None, 3])
def test_other_return_types_raise_naming_the_type(value):
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match=f"but {type(value).__name__} was returned"):
        forget.forget(lambda a: value, x)


def test_numpy_float_inputs_become_leaf_tensors_requiring_grad():
    seen = []

    def f(a):
        seen.append(a)
        return (a * a).sum()

    arr = np.arange(4, dtype=np.float32)
    y = forget.forget(f, arr)
    assert seen[0].requires_grad and isinstance(seen[0], torch.Tensor)
    y.backward()
    assert torch.equal(seen[0].grad, torch.from_numpy(arr * 2))


def test_numpy_integer_input_is_a_type_error():
    with pytest.raises(TypeError, match="numpy array of dtype int64"):
        forget.forget(lambda a: a, np.arange(3, dtype=np.int64))


def test_numpy_integer_error_suggests_a_conversion_that_works():
    # The message's advice, followed, gives a gradient: a float tensor that requires grad.
    with pytest.raises(TypeError, match=r"torch\.from_numpy\(x\)\.float\(\)") as info:
        forget.forget(torch.sin, np.arange(4))
    assert "from_numpy(x).float()" in str(info.value)
    x = torch.from_numpy(np.arange(4)).float().requires_grad_()
    forget.forget(torch.sin, x).sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach()))


def test_non_tensor_inputs_are_constants():
    x = torch.ones(3, requires_grad=True)
    y = forget.forget(lambda a, k, name: (a * k).exp(), x, 3.0, "tag")
    y.sum().backward()
    assert torch.equal(x.grad, 3 * torch.exp(torch.full((3,), 3.0)))


def test_double_backward_matches_plain():
    (x,) = _leaves(3, (5,))

    def f(a):
        return (a.sin() * a.exp()).sum()

    (g1,) = torch.autograd.grad(f(x), x, create_graph=True)
    (gg1,) = torch.autograd.grad(g1.sum(), x)
    (g2,) = torch.autograd.grad(forget.forget(f, x), x, create_graph=True)
    (gg2,) = torch.autograd.grad(g2.sum(), x)
    assert torch.equal(g1, g2)
    assert torch.equal(gg1, gg2)


def test_grad_on_subset_of_inputs():
    x, y = _leaves(4, (3, 3), (3, 3))
    f = lambda a, b: (a @ b).tanh().sum()  # noqa: E731
    (gx,) = torch.autograd.grad(f(x, y), x)
    (gx2,) = torch.autograd.grad(forget.forget(f, x, y), x)
    assert torch.equal(gx, gx2)
    assert x.grad is None and y.grad is None


def test_retain_graph_twice_recomputes_and_accumulates_like_plain():
    (x,) = _leaves(5, (4,))
    f = Counted(lambda a: a.exp().sin().sum())
    y = f(x)
    y.backward(retain_graph=True)
    y.backward()
    plain = x.grad.clone()
    x.grad = None
    y2 = forget.forget(f, x)
    y2.backward(retain_graph=True)
    y2.backward()
    assert torch.equal(plain, x.grad)
    assert f.calls == 1 + 1 + 2  # plain; forward; one recomputation per backward


def test_closure_and_module_parameters_get_grads_when_no_input_requires_grad():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)  # no grad
    lin(x).tanh().sum().backward()
    plain = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    forget.forget(lambda a: lin(a).tanh(), x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, lin.parameters(), strict=True))


def test_no_grad_caller_runs_once_and_matches():
    (x,) = _leaves(6, (3,))
    f = Counted(lambda a: a.exp())
    with torch.no_grad():
        y = forget.forget(f, x)
    assert f.calls == 1 and not y.requires_grad
    assert torch.equal(y, x.detach().exp())


def test_nested_forget_matches_plain_and_counts():
    (x,) = _leaves(7, (6,))
    inner = Counted(lambda a: a.sin().exp())
    outer = Counted(lambda a: forget.forget(inner, a.cos()).tanh())
    plain = lambda a: inner.fn(a.cos()).tanh()  # noqa: E731
    plain(x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    forget.forget(outer, x).sum().backward()
    assert torch.equal(g, x.grad)
    # outer: forward + 1 recomputation; inner: forward, again in outer's re-run, its own re-run.
    assert outer.calls == 2
    assert inner.calls == 3


def test_nested_region_keeps_its_input_through_the_outer_region():
    x = torch.randn(1000, requires_grad=True)
    stored = []

    def inner(a):
        return a.sin()

    def outer(a):
        h = a.exp()  # an intermediate of the outer region
        stored.append(h)
        return forget.forget(inner, h).sum()

    import weakref

    y = forget.forget(outer, x)
    ref = weakref.ref(stored.pop())
    assert ref() is None  # the inner region does not keep the outer intermediate alive
    y.backward()
    assert torch.equal(x.grad, x.detach().exp() * x.detach().exp().cos())


def test_dropout_and_rrelu_recompute_identically():
    x = torch.randn(64, 32, requires_grad=True)
    drop, rrelu = nn.Dropout(0.5), nn.RReLU()

    def f(a):
        return rrelu(drop(a) * 3).sum()

    torch.manual_seed(42)
    f(x).backward()
    plain = x.grad.clone()
    x.grad = None
    torch.manual_seed(42)
    forget.forget(f, x).backward()
    assert torch.equal(plain, x.grad)


def test_global_rng_stream_is_unchanged_by_recomputation():
    x = torch.randn(8, requires_grad=True)
    torch.manual_seed(3)
    torch.nn.functional.dropout(x, 0.5).exp().sum().backward()
    after_plain = torch.rand(3)
    torch.manual_seed(3)
    forget.forget(lambda a: torch.nn.functional.dropout(a, 0.5).exp(), x).sum().backward()
    assert torch.equal(after_plain, torch.rand(3))


def test_region_without_random_ops_keeps_no_rng_state():
    x = torch.randn(4, requires_grad=True)
    from forget._engine import Region

    r = Region(lambda a: a.exp(), (x,), {})
    r.run_forward()
    assert r._rng is None
    r2 = Region(lambda a: torch.nn.functional.dropout(a, 0.5), (x,), {})
    r2.run_forward()
    assert r2._rng is not None


def test_autocast_state_is_replayed():
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = (x @ w).float().sin().sum()
    y.backward()
    plain = _grads(x, w)
    x.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = forget.forget(lambda a, b: (a @ b).float().sin().sum(), x, w)
    y2.backward()  # backward outside autocast: the re-run must still be in bf16
    assert torch.equal(y, y2)
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(x, w), strict=True))


def test_input_modified_in_place_after_forward_raises():
    x = torch.randn(4, requires_grad=True)
    h = x * 1
    y = forget.forget(lambda a: a.exp().sum(), h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(ForgetError, match=r"1st tensor input .* modified in place"):
        y.backward()


def test_recomputation_that_differs_raises_naming_the_mismatch():
    x = torch.randn(4, requires_grad=True)

    def f(a):
        if forget.in_recomputing():
            return (a[:2].exp()).sum()
        return a.exp().sum()

    y = forget.forget(f, x)
    with pytest.raises(RecomputationMismatchError, match=r"shape=\[4\].*shape=\[2\]"):
        y.backward()


def test_recomputation_saving_fewer_tensors_raises():
    x = torch.randn(4, requires_grad=True)

    def f(a):
        if forget.in_recomputing():
            return a * 2
        return a.exp().sin()

    y = forget.forget(f, x)
    with pytest.raises(RecomputationMismatchError, match=r"saved 0 tensors .* forward saved 2"):
        y.sum().backward()


def test_in_recomputing_restored_after_exception_in_recomputation():
    x = torch.randn(4, requires_grad=True)

    def f(a):
        if forget.in_recomputing():
            raise ValueError("boom")
        return a.exp()

    y = forget.forget(f, x)
    with pytest.raises(ValueError, match="boom"):
        y.sum().backward()
    assert not forget.in_recomputing()


def test_in_recomputing_false_outside():
    assert forget.in_recomputing() is False


def test_early_stop_runs_no_op_after_the_last_saved_tensor():
    x = torch.randn(4, requires_grad=True)
    steps: list[int] = []

    def f(a):
        h = a.exp()  # the only saved tensor: exp saves its result
        for i in range(5):
            h = h + 1  # saves nothing
            steps.append(i)
        return h

    forget.forget(f, x).sum().backward()
    # NOTE [early stop]: the re-run stops as the op after exp starts.
    assert steps == [0, 1, 2, 3, 4]


def test_early_stop_skips_the_kernel_whose_inputs_were_saved_last():
    # mul's autograd layer saves both of its inputs before its kernel runs; nothing
    # needs the kernel's output, so the re-run stops as mul starts: exp and sin run
    # again, mul does not (NOTE [early stop]).
    x = torch.randn(8, requires_grad=True)

    def f(a):
        return a.exp() * a.sin()

    def backward_ops(y):
        names: list[str] = []

        class Log(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.__name__.split(".")[0] in ("exp", "sin", "mul"):
                    names.append(func.__name__.split(".")[0])
                return func(*args, **(kwargs or {}))

        with Log():
            y.sum().backward()
        return collections.Counter(names)

    plain = backward_ops(f(x))
    ours = backward_ops(forget.forget(f, x))
    assert ours - plain == collections.Counter({"exp": 1, "sin": 1})
    assert plain - ours == collections.Counter()


def test_rrelu_noise_is_filled_before_the_recomputation_stops():
    x = torch.randn(16, requires_grad=True)
    rrelu = nn.RReLU()
    torch.manual_seed(0)
    rrelu(x).sum().backward()
    plain = x.grad.clone()
    x.grad = None
    torch.manual_seed(0)
    forget.forget(rrelu, x).sum().backward()
    assert torch.equal(plain, x.grad)


def test_buffers_restored_after_recomputation_bitwise():
    torch.manual_seed(0)
    plain_bn, forget_bn = nn.BatchNorm1d(5), nn.BatchNorm1d(5)
    x = torch.randn(8, 5, requires_grad=True)
    for _ in range(3):
        plain_bn(x).square().sum().backward()
        forget.forget(forget_bn, x).square().sum().backward()
    for a, b in zip(plain_bn.state_dict().values(), forget_bn.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("make", "tracked"),
    [
        (lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Dropout(0.5)), False),
        (lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()), False),
        (lambda: lambda a: forget.forget(torch.tanh, a.exp()).sin(), True),
    ],
    ids=["stateless", "batchnorm", "nested"],
)
def test_re_run_watches_ops_only_where_the_forward_needed_it(monkeypatch, make, tracked):
    # NOTE [plain re-run]: no policy, no region inside: the re-run needs no dispatch
    # mode (BatchNorm's statistics are put back around its forward). Gradients are the
    # plain run's either way.
    from forget._engine import _region

    made: list[bool] = []

    class Counting(_region.StateTracker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(bool(kwargs.get("recomputing")))

    monkeypatch.setattr(_region, "StateTracker", Counting)
    torch.manual_seed(0)
    f = make()
    g = copy.deepcopy(f)
    x = torch.randn(8, 4, requires_grad=True)
    torch.manual_seed(1)
    f(x).square().sum().backward()
    plain = x.grad.clone()
    x.grad = None
    torch.manual_seed(1)
    forget.forget(g, x).square().sum().backward()
    assert (True in made) == tracked
    assert torch.equal(plain, x.grad)
