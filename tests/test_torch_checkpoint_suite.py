"""torch's own checkpoint tests, ported: each scenario under torch and forget, differentially.

For every test of torch's checkpoint suites (``test/test_utils.py`` TestCheckpoint,
``test/test_autograd.py`` checkpoint tests, TestNestedCheckpoint and
TestSelectiveActivationCheckpoint) that applies to the non-reentrant path on CPU,
the same scenario runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
and ``forget.checkpoint``: outputs, gradients and counts must be equal bitwise, and
where torch raises, forget raises the same type. The comment over each test names
the torch test it ports. Deliberate deviations are asserted as forget's behaviour and
listed in docs/torch_checkpoint.md. Written from the intent of torch's tests, not copied.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

import forget

TORCH = functools.partial(tc.checkpoint, use_reentrant=False)
FORGET = functools.partial(forget.checkpoint, use_reentrant=False)
CHECKPOINTS = {"torch": TORCH, "forget": FORGET}


_CHECKPOINT_ONLY = ("context_fn", "preserve_rng_state", "determinism_check", "early_stop")


def _plain(fn, *args, **kwargs):
    """No checkpoint: the function, without the arguments only a checkpoint takes."""
    return fn(*args, **{k: v for k, v in kwargs.items() if k not in _CHECKPOINT_ONLY})


def _assert_same(a, b, path="result"):
    """Equal structure; tensors equal bitwise (dtype and shape too), the rest equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.device == b.device, path
        if a.device.type != "meta":
            assert torch.equal(a, b), path
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}[{key!r}]")
    else:
        assert a == b, path


def _differential(scenario, *, plain=False):
    """``scenario(ck)`` under torch's and forget's checkpoint (and plain), all equal."""
    results = {}
    runs = {**CHECKPOINTS, **({"plain": _plain} if plain else {})}
    for name, ck in runs.items():
        torch.manual_seed(0)
        results[name] = scenario(ck)
    for name in runs:
        _assert_same(results["torch"], results[name], name)
    return results["forget"]


def _raised(scenario, ck):
    torch.manual_seed(0)
    try:
        scenario(ck)
    except Exception as error:  # the type is what is compared
        return error
    return None


def _raises_same(scenario):
    """torch raises; forget raises an exception of the same type."""
    errors = {name: _raised(scenario, ck) for name, ck in CHECKPOINTS.items()}
    assert errors["torch"] is not None, "torch did not raise"
    assert type(errors["forget"]) is type(errors["torch"]), errors
    return errors


def _grads(*tensors):
    return [t.grad for t in tensors]


# --- test_utils.TestCheckpoint -------------------------------------------------------


def _sequential(ck, functions, segments, x):
    """torch's checkpoint_sequential, for any checkpoint: all segments but the last are
    checkpointed, the last runs plainly."""
    functions = list(functions)
    size = len(functions) // segments

    def run(start, end):
        def segment(inp):
            for fn in functions[start:end]:
                inp = fn(inp)
            return inp

        return segment

    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        x = ck(run(start, end + 1), x)
    return run(end + 1, len(functions))(x)


def _log_call(calls, i, forward, x):
    calls.append(i)
    return forward(x)


class _Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.counter = 0

    def forward(self, x):
        self.counter += 1
        return x * torch.tensor(2.0)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5), nn.ReLU()
    )


class _ModuleListNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.module_list = nn.ModuleList(list(_mlp().children()))

    def forward(self, x):
        for layer in self.module_list:
            x = layer(x)
        return x


# torch: test_utils.TestCheckpoint.test_checkpoint_trigger
def test_checkpoint_trigger():
    def run(ck):
        calls = []
        modules = [_Counted() for _ in range(10)]
        for i, module in enumerate(modules):
            module.forward = functools.partial(_log_call, calls, i, module.forward)
        x = torch.randn(3, 4, requires_grad=True)
        out = _sequential(ck, modules, 2, x)
        after_forward = [m.counter for m in modules]
        out.sum().backward()
        return after_forward, [m.counter for m in modules], sorted(calls), x.grad

    torch.manual_seed(0)
    forward, backward, calls, grad = run(TORCH)
    assert forward == [1] * 10 and backward == [2] * 5 + [1] * 5
    torch.manual_seed(0)
    f_forward, f_backward, f_calls, f_grad = run(FORGET)
    assert calls == sorted([*range(10), *range(5)]) and torch.equal(f_grad, grad)
    # Deliberate deviation: forget runs no module of the first half again. The only
    # tensor backward needs from each is the constant torch.tensor(2.0) it made, which
    # depends on no input: forget keeps it rather than re-running the segment.
    assert f_calls == list(range(10))
    assert f_forward == [1] * 10 and f_backward == [1] * 10


# torch: test_utils.TestCheckpoint.test_checkpoint_valid
def test_checkpoint_valid_grad_with_create_graph():
    model = _mlp()

    def scenario(ck):
        x = torch.randn(1, 100, requires_grad=True)
        out = _sequential(ck, list(model.children()), 2, x)
        (grad,) = torch.autograd.grad(out, x, torch.ones(1, 5), create_graph=True)
        (second,) = torch.autograd.grad(grad.square().sum(), x)
        return out.detach(), grad.detach(), second

    _differential(scenario, plain=True)


# torch: test_utils.TestCheckpoint.test_checkpoint, test_checkpoint_module_list
@pytest.mark.parametrize(
    "build",
    [
        lambda: (_mlp(), lambda m: list(m.children())),
        lambda: (_mlp(), lambda m: m),
        lambda: (_ModuleListNet(), lambda m: list(m.module_list.children())),
        lambda: (_ModuleListNet(), lambda m: m.module_list),
    ],
    ids=["sequential-list", "sequential", "module_list-list", "module_list"],
)
def test_checkpoint_sequential_scenarios(build):
    model, functions = build()

    def scenario(ck):
        model.zero_grad(set_to_none=True)
        x = torch.randn(1, 100, requires_grad=True)
        out = _sequential(ck, functions(model), 2, x)
        out.sum().backward()
        return out.detach(), x.grad, [p.grad for p in model.parameters()]

    _differential(scenario, plain=True)


# torch: test_utils.TestCheckpoint.test_checkpoint_rng_cpu
def test_checkpoint_rng_cpu():
    phase1, phase2 = nn.Dropout(), nn.Dropout()

    def scenario(ck):
        grads = []
        for _ in range(3):
            x = torch.randn(2000, requires_grad=True)
            out = ck(phase2, phase1(x))
            out.sum().backward()
            grads.append(x.grad)
        return grads

    _differential(scenario, plain=True)


# torch: test_utils.TestCheckpoint.test_checkpoint_not_preserve_rng_state_and_without_reentrant
# (an accelerator test in torch; the scenario runs on CPU)
def test_checkpoint_not_preserve_rng_state():
    layer = nn.Dropout()

    def scenario(ck):
        x = torch.randn(200, requires_grad=True)
        out = ck(layer, x, preserve_rng_state=False)
        out.sum().backward()
        return out.detach(), x.grad

    _differential(scenario)


# torch: test_utils.TestCheckpoint.test_checkpoint_non_tensor
def test_checkpoint_non_tensor():
    def run(t1, t2):
        return t1 if t2 is None else t1 + t2

    def scenario(ck):
        x = torch.randn(1, 100, requires_grad=True)
        ck(run, x, None).sum().backward()
        return x.grad

    _differential(scenario, plain=True)


def _mixed(t1, t2, scale, t3):
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


# torch: test_utils.TestCheckpoint.test_checkpoint_non_tensor_inputs_outputs
def test_checkpoint_non_tensor_inputs_outputs():
    def scenario(ck):
        t1, t2 = torch.rand(10, requires_grad=True), torch.rand(10, requires_grad=True)
        t3 = torch.rand(10)
        res = ck(_mixed, t1, t2, 7, t3)
        values = [r.detach() if isinstance(r, torch.Tensor) else r for r in res]
        res[1].sum().backward(retain_graph=True)
        res[4].sum().backward(retain_graph=True)
        res[6].sum().backward()
        try:  # the returned input is the input itself: a fresh sum backpropagates again
            res[6].sum().backward()
            again = "ok"
        except RuntimeError as error:
            again = type(error).__name__
        return values, t1.grad, t2.grad, res[6] is t1, again

    *_, same, again = _differential(scenario, plain=True)
    assert same and again == "ok"


# torch: test_utils.TestCheckpoint.test_checkpoint_no_tensors
def test_checkpoint_no_tensors():
    _differential(lambda ck: ck(_mixed, 0.25, 0.5, 3, 0.75), plain=True)


# torch: test_utils.TestCheckpoint.test_checkpoint_partial_grad
def test_checkpoint_partial_grad():
    def scenario(ck):
        a, b = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
        out = ck(lambda t1, t2: (t1, t2), a, b)
        out[0].sum().backward()
        return a.grad, out[1].requires_grad

    _differential(scenario, plain=True)

    def no_grad_output(ck):  # the output needs no grad: backward through it raises
        a, b = torch.randn(1, 4), torch.randn(1, 4, requires_grad=True)
        ck(lambda t1, t2: t1, a, b).sum().backward()

    _raises_same(no_grad_output)


# torch: test_utils.TestCheckpoint.test_checkpoint_preserves_device_context
# (an accelerator test in torch; here the default device is meta)
def test_checkpoint_preserves_device_context():
    def scenario(ck):
        devices = []

        def fn(x):
            made = torch.empty(4)
            devices.append(made.device.type)
            return x * made.sum()

        with torch.device("meta"):
            x = torch.randn(4, requires_grad=True)
            ck(fn, x).sum().backward()
        return devices, x.grad.device.type

    devices, _ = _differential(scenario)
    assert devices == ["meta", "meta"]


# --- test_autograd.TestAutograd ------------------------------------------------------


class _Model(nn.Module):
    def __init__(self, ck):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.last = nn.Linear(8, 1)
        self.ck = ck

    def forward(self, x):
        return self.last(self.ck(self.inner, self.first(x).relu())).sum()


# torch: test_autograd.TestAutograd.test_checkpointing_without_reentrant_input_requires_grad_True
# and _False
@pytest.mark.parametrize("requires_grad", [True, False], ids=["input_grad", "no_input_grad"])
def test_checkpointing_without_reentrant_input_requires_grad(requires_grad):
    def scenario(ck):
        model = _Model(ck)
        x = torch.randn(4, 8, requires_grad=requires_grad)
        model(x).backward()
        return x.grad, [p.grad for p in model.parameters()]

    _differential(scenario, plain=True)


class _SavesMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, z, twice):
        ctx.twice = twice
        w = x * y * z
        out = w + w
        ctx.save_for_backward(x, y, z, w, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, y, z, _, _ = ctx.saved_tensors
        if ctx.twice:  # torch raises here; forget hands the same tensors again
            assert len(ctx.saved_tensors) == 5
        return 2 * grad * y * z, 2 * grad * x * z, 2 * grad * x * y, None


# torch: test_autograd.TestAutograd.test_checkpointing_without_reentrant_custom_function_works
def test_checkpointing_without_reentrant_custom_function_works():
    def scenario(ck):
        calls = []

        def fn(x, y, z):
            calls.append(1)
            return _SavesMany.apply(x.sin(), y, z, twice).cos()

        x, y, z = (torch.randn(5, requires_grad=True) for _ in range(3))
        ck(fn, x, y, z).sum().backward()
        return _grads(x, y, z), len(calls)

    twice = False
    _, calls = _differential(scenario)
    assert calls == 2
    twice = True
    assert type(_raised(scenario, TORCH)) is tc.CheckpointError
    # Deliberate deviation: forget keeps what it rebuilt until the node's backward is
    # done, so a second ctx.saved_tensors in the same backward works.
    torch.manual_seed(0)
    grads, _ = scenario(FORGET)
    twice = False
    torch.manual_seed(0)
    _assert_same(grads, scenario(TORCH)[0])


# torch: test_autograd.TestAutograd.test_checkpointing_without_reentrant_parameter_used_in_an_out
def test_checkpointing_without_reentrant_parameter_used_in_an_out():
    def scenario(ck):
        torch.manual_seed(0)
        w = torch.randn(10, 10, requires_grad=True)
        x = torch.randn(10, 10, requires_grad=True)
        inside = ck(lambda a: (a @ w).sin(), x)
        out = inside @ w  # the parameter is used outside the region too
        out.sum().backward()
        return out.detach(), _grads(w, x)

    _differential(scenario, plain=True)


# torch: test_autograd.TestAutograd.test_checkpointing_without_reentrant_arbitrary_input_output
def test_checkpointing_without_reentrant_arbitrary_input_output():
    layer = nn.Linear(5, 5)

    def fn(inputs):
        return {"out": layer(inputs["x"]).sin(), "also": [inputs["x"].exp(), inputs["tag"]]}

    def scenario(ck):
        layer.zero_grad(set_to_none=True)
        x = torch.randn(3, 5, requires_grad=True)
        out = ck(fn, {"x": x, "tag": "t"})
        (out["out"].sum() + out["also"][0].sum()).backward()
        return out["also"][1], x.grad, layer.weight.grad

    _differential(scenario, plain=True)


# torch: test_autograd.TestAutograd.test_checkpointing_without_reentrant_correct_grad
def test_checkpointing_without_reentrant_correct_grad():
    def scenario(ck):
        a = torch.randn(2, requires_grad=True)
        ck(torch.exp, a).sum().backward()
        return a.grad

    _differential(scenario, plain=True)


class _OpLog(TorchDispatchMode):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.log.append(str(func))
        return func(*args, **(kwargs or {}))


# torch: test_autograd.TestAutograd.test_checkpointing_without_reentrant_with_context_fn
def test_checkpointing_without_reentrant_with_context_fn():
    def scenario(ck):
        forward_ops, recompute_ops = [], []
        x = torch.randn(3, requires_grad=True)
        out = ck(
            lambda a: a.sin().cos(),
            x,
            context_fn=lambda: (_OpLog(forward_ops), _OpLog(recompute_ops)),
        )
        ops_before_backward = list(recompute_ops)
        out.sum().backward()
        return forward_ops, ops_before_backward, recompute_ops, x.grad

    results = {}
    for name, ck in CHECKPOINTS.items():
        torch.manual_seed(0)
        results[name] = scenario(ck)
    (t_forward, t_before, t_recompute, t_grad), (f_forward, f_before, f_recompute, f_grad) = (
        results["torch"],
        results["forget"],
    )
    assert t_forward == f_forward == ["aten.sin.default", "aten.cos.default"]
    assert t_before == f_before == [] and torch.equal(t_grad, f_grad)
    # early stop: cos is not run again. Deliberate deviation: torch's recompute context
    # also sees the detach ops of its own machinery; forget's sees the function's ops only.
    assert [op for op in t_recompute if op != "aten.detach.default"] == ["aten.sin.default"]
    assert f_recompute == ["aten.sin.default"]


class _NoGradModule(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(2, 2, bias=False)
        self.lin2 = nn.Linear(2, 2, bias=False)

    def forward(self, x):
        with torch.no_grad():
            return self.lin2(self.linear(x))


# torch: test_autograd.TestAutograd.test_checkpointing_without_reentrant_detached_tensor
def test_checkpointing_without_reentrant_detached_tensor():
    module = _NoGradModule()

    def scenario(ck):
        a = torch.randn(2, 2, requires_grad=True)
        outs = []
        for _ in range(3):
            out = ck(module, a)
            outs.append(out.requires_grad)
            (out + a).sum().backward()
        return outs, a.grad

    _differential(scenario, plain=True)


# torch: test_autograd.TestAutograd.test_checkpointing_without_reentrant_saved_object_identity
def test_checkpointing_without_reentrant_saved_object_identity():
    seen = []

    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx, grad):
            seen.append(ctx.saved_tensors[0])
            return grad, None

    for ck in (_plain, TORCH, FORGET):
        a, b = torch.randn(2, requires_grad=True), torch.randn(2)
        seen.clear()
        ck(Test.apply, a, b).sum().backward()
        assert seen[0] is b


# torch: test_autograd.TestAutograd.test_checkpointing_non_reentrant_autocast_cpu
def test_checkpointing_non_reentrant_autocast_cpu():
    def foo(x, y, z):
        x = torch.mm(x, y)
        y = torch.mm(x, z)
        z = torch.mm(z, z)
        return torch.mm(z, y)

    def scenario(ck):
        x, y, z = (torch.randn(3, 3, requires_grad=True) for _ in range(3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ck(foo, x, y, z)
            out.float().sum().backward()
        return out.detach(), _grads(x, y, z)

    out, _ = _differential(scenario, plain=True)
    assert out.dtype == torch.bfloat16


def _changing(kind):
    """A function whose re-run differs from its forward in ``kind``."""
    runs = []

    def fn(x):
        runs.append(1)
        again = len(runs) > 1
        if kind == "count":  # the re-run saves fewer tensors than the forward
            return x.sin() if again else x.sin().exp()
        if kind == "shape":
            return (x.reshape(2, 2) if again else x).exp()
        return (x.double() if again else x).exp()

    return fn


# torch: test_autograd.TestAutograd.test_checkpoint_detects_non_determinism
@pytest.mark.parametrize("kind", ["count", "shape", "dtype"])
def test_checkpoint_detects_non_determinism(kind):
    errors = {}
    for name, ck in CHECKPOINTS.items():
        x = torch.randn(4, requires_grad=True)
        errors[name] = _raised(lambda ck, x=x: ck(_changing(kind), x).sum().backward(), ck)
    # Deliberate deviation: forget raises its own RecomputationMismatchError; both are
    # RuntimeErrors, torch's is torch.utils.checkpoint.CheckpointError.
    assert type(errors["torch"]) is tc.CheckpointError
    assert type(errors["forget"]) is forget.RecomputationMismatchError
    assert isinstance(errors["forget"], RuntimeError)


# torch: test_autograd.TestAutograd.test_checkpoint_detects_non_determinism
# (its determinism_check="none" part)
def test_determinism_check_none_lets_a_changed_count_through():
    def scenario(ck):
        x = torch.randn(4, requires_grad=True)
        runs = []

        def fn(a):
            runs.append(1)
            return a.sin() * 3.0 if len(runs) > 1 else a.sin()

        ck(fn, x, determinism_check="none").sum().backward()
        return x.grad

    _differential(scenario)


# torch: test_autograd.TestAutograd.test_access_saved_tensor_twice_without_recomputation_works
def test_access_saved_tensor_twice_without_recomputation_works():
    def scenario(ck):
        count = [0]

        def foo(a):
            count[0] += 1
            b = a * a
            c = a * b
            return torch.exp(c)

        a = torch.randn(5, requires_grad=True)
        d = ck(foo, a)
        counts = [count[0]]
        first = d.grad_fn._saved_result.clone()
        counts.append(count[0])
        second = d.grad_fn._saved_result.clone()
        counts.append(count[0])
        d.sum().backward()
        counts.append(count[0])
        try:
            after = d.grad_fn._saved_result
        except RuntimeError as error:
            after = type(error).__name__
        return counts, first, second, a.grad, after

    counts, *_, after = _differential(scenario)
    assert counts == [1, 2, 3, 4] and after == "RuntimeError"


# torch: test_autograd.TestAutograd.test_checkpoint_warns_if_use_reentrant_not_passed_explcitly
def test_use_reentrant_not_passed():
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="use_reentrant"):
        tc.checkpoint(torch.sin, x)
    # Deliberate deviation: forget has one engine (non-reentrant), so no warning.
    forget.checkpoint(torch.sin, x).sum().backward()


# --- test_autograd.TestNestedCheckpoint ----------------------------------------------


def _c(ck, fn):
    return lambda x: ck(fn, x)


def _g(fn):
    return lambda x: torch.autograd.grad(fn(x).sum(), x, create_graph=True)[0]


def _f(x):
    return x.sin().exp().sin()


def _grads_inside(x):
    """Differentiates its own intermediates in its forward, so a region of it re-runs
    midway through its forward (NOTE [re-run in the forward], NOTE [whole re-run])."""
    a = x.sin().exp().sin().sum()
    b = x.sin().exp().sin().sum()
    torch.autograd.grad(a, x)
    torch.autograd.grad(b, x)
    return x.sin()


NESTED_FUNCTIONS = {"f": _f, "grads_inside": _grads_inside}

# Each shape wraps a function in checkpoints (c) and create_graph grads (g).
NESTINGS = {
    "c(f)": lambda ck, f: _c(ck, f),
    "c(c(f))": lambda ck, f: _c(ck, _c(ck, f)),
    "g(c(f))": lambda ck, f: _g(_c(ck, f)),
    "g(c(c(f)))": lambda ck, f: _g(_c(ck, _c(ck, f))),
    "c(g(f))": lambda ck, f: _c(ck, _g(f)),
    "g(c(g(f)))": lambda ck, f: _g(_c(ck, _g(f))),
    "c(g(c(f)))": lambda ck, f: _c(ck, _g(_c(ck, f))),
    "c(g(g(c(f))))": lambda ck, f: _c(ck, _g(_g(_c(ck, f)))),
    "g(c(g(c(f))))": lambda ck, f: _g(_c(ck, _g(_c(ck, f)))),
    "g(c(g(g(c(f)))))": lambda ck, f: _g(_c(ck, _g(_g(_c(ck, f))))),
    "g(c(g(c(g(c(f))))))": lambda ck, f: _g(_c(ck, _g(_c(ck, _g(_c(ck, f)))))),
    "c(c(g(g(f))))": lambda ck, f: _c(ck, _c(ck, _g(_g(f)))),
}


def _graph_dies(fn, x):
    """Whether every node of ``fn(x)``'s graph is freed once the output is dropped."""

    class Marker:
        pass

    def mark():
        out = fn(x)
        refs, seen, todo = [], set(), [out.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            marker = Marker()
            node.metadata["forget_test"] = marker
            refs.append(weakref.ref(marker))
            todo += [next_node for next_node, _ in node.next_functions]
        return refs

    return all(ref() is None for ref in mark())


# torch: test_autograd.TestNestedCheckpoint.test_nested_checkpoint
@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
@pytest.mark.parametrize("function", list(NESTED_FUNCTIONS))
@pytest.mark.parametrize("nesting", list(NESTINGS))
def test_nested_checkpoint(nesting, function, early_stop):
    def scenario(ck):
        with tc.set_checkpoint_early_stop(early_stop):
            fn = NESTINGS[nesting](ck, NESTED_FUNCTIONS[function])
            results = []
            # Twice: the second call of a region's function runs the fast path.
            for _ in range(2):
                x = torch.randn(5, requires_grad=True)
                out = fn(x)
                out.sum().backward()
                results.append((out.detach(), x.grad))
            return results, _graph_dies(fn, torch.randn(5, requires_grad=True))

    _, dies = _differential(scenario, plain=True)
    assert dies


def _then(ck, first, second):
    return lambda x: ck(second, ck(first, x))


def _cos_sin_exp(x):
    return x.cos().sin().exp()


def _sum(fn):
    return lambda x: fn(x).sum()


# torch: test_autograd.TestNestedCheckpoint.test_nested_checkpoint_two_children
@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
def test_nested_checkpoint_two_children(early_stop):
    def scenario(ck):
        def parent(x):
            return ck(_f, x) * ck(torch.cos, x).exp()

        x = torch.randn(5, requires_grad=True)
        with tc.set_checkpoint_early_stop(early_stop):
            out = _g(_g(lambda a: ck(parent, a)))(x)
        out.sum().backward()
        return out.detach(), x.grad

    _differential(scenario, plain=True)


# torch: test_autograd.TestNestedCheckpoint.test_nested_checkpoint_two_children (a chain
# of two checkpointed children, under two grads, the second inside a checkpoint too)
@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
@pytest.mark.parametrize("outer", ["g(g(c(h)))", "g(c(g(c(h))))"])
def test_nested_checkpoint_chained_children(outer, early_stop):
    def scenario(ck):
        h = _then(ck, _f, _cos_sin_exp)
        wrap = {
            "g(g(c(h)))": lambda fn: _g(_sum(_g(_sum(_c(ck, fn))))),
            "g(c(g(c(h))))": lambda fn: _g(_sum(_c(ck, _g(_sum(_c(ck, fn)))))),
        }[outer]
        with tc.set_checkpoint_early_stop(early_stop):
            fn = wrap(h)
            x = torch.randn(3, 3, requires_grad=True)
            out = fn(x)
            out.sum().backward()
            return out.detach(), x.grad, _graph_dies(fn, torch.randn(3, 3, requires_grad=True))

    assert _differential(scenario, plain=True)[2]


# torch: test_autograd.TestNestedCheckpoint.test_nested_checkpoint_non_tensor_inputs_and_outputs
@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
def test_nested_checkpoint_non_tensor_inputs_and_outputs(early_stop):
    def fn(k, a, b, f):
        return f, k, a * b * f, "abcd"

    def scenario(ck):
        ck = functools.partial(ck, early_stop=early_stop)
        a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        out = ck(lambda *args: ck(fn, *args), 5, a, b, 2.5)
        out[2].sum().backward()
        return out[0], out[1], out[3], out[2].detach(), _grads(a, b)

    _differential(scenario, plain=True)


# torch: test_autograd.TestNestedCheckpoint.test_nested_checkpoint_kwargs
@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
def test_nested_checkpoint_kwargs(early_stop):
    def fn(a, blah=None):
        out = a.sin().exp()
        return out * blah if blah is not None else out

    def scenario(ck):
        ck = functools.partial(ck, early_stop=early_stop)
        a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        out = ck(lambda x, blah: ck(fn, x, blah=blah), a, blah=b)
        out.sum().backward()
        return out.detach(), _grads(a, b)

    _differential(scenario, plain=True)


# torch: test_autograd.TestNestedCheckpoint.test_nested_checkpoint_same_graph
@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
def test_nested_checkpoint_same_graph(early_stop):
    def scenario(ck):
        ck = functools.partial(ck, early_stop=early_stop)
        hooks = []

        def inner(x):
            y = x.sin()
            if y.requires_grad:
                y.register_hook(lambda g: hooks.append(1))
            return y.exp()

        x = torch.randn(4, requires_grad=True)
        out = ck(lambda a: ck(inner, a).cos(), x)
        out.sum().backward()
        return x.grad, len(hooks)

    _, hook_calls = _differential(scenario, plain=True)
    assert hook_calls == 1


class _Reenter(torch.autograd.Function):
    """Identity whose backward runs a nested checkpointed backward (a reentrant backward)."""

    @staticmethod
    def forward(ctx, x, ck):
        ctx.x = x.detach()
        ctx.ck = ck
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            x = ctx.x.clone().requires_grad_()
            out = ctx.ck(lambda a: ctx.ck(_f, a), x)
            out.sum().backward()
        return grad * x.grad, None


# torch: test_autograd.TestNestedCheckpoint.test_nested_checkpoint_reentrant_backwards
@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
def test_nested_checkpoint_reentrant_backwards(early_stop):
    def scenario(ck):
        ck = functools.partial(ck, early_stop=early_stop)
        x = torch.randn(4, requires_grad=True)
        out = ck(lambda a: _Reenter.apply(a.sin(), ck), x)
        out.sum().backward()
        return x.grad

    _differential(scenario, plain=True)


# torch: test_autograd.TestNestedCheckpoint.test_nested_checkpoint_set_early_stop
@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
def test_nested_checkpoint_set_early_stop(early_stop):
    def scenario(ck):
        count = [0]

        def fn(x):
            out = x.sin().exp()  # exp saves its output: the last tensor backward needs
            count[0] += 1  # counted after every saved tensor: early stop skips it
            return out.cos() if count[0] < 0 else out + 1

        x = torch.randn(4, requires_grad=True)
        with tc.set_checkpoint_early_stop(early_stop):
            out = ck(fn, x)
        out.sum().backward()
        return count[0], x.grad

    count, _ = _differential(scenario)
    assert count == (1 if early_stop else 2)


# torch: test_autograd.TestNestedCheckpoint
#   .test_nested_checkpoint_set_early_stop_no_recompution_needed
def test_nested_checkpoint_set_early_stop_no_recompution_needed():
    def scenario(ck):
        count = [0]

        def fn(x):
            count[0] += 1
            return x.sin()  # sin saves its input only

        x = torch.randn(4, requires_grad=True)
        with tc.set_checkpoint_early_stop(True):
            out = ck(fn, x)
        out.sum().backward()
        return count[0], x.grad

    torch.manual_seed(0)
    t_count, t_grad = scenario(TORCH)
    torch.manual_seed(0)
    f_count, f_grad = scenario(FORGET)
    assert torch.equal(t_grad, f_grad) and t_count == 2
    # Deliberate deviation: when every tensor backward needs is an input, forget does
    # not run the function again at all; torch re-runs it up to sin.
    assert f_count == 1


# --- test_autograd.TestSelectiveActivationCheckpoint (torch's SAC as context_fn) -------


def _sac(policy):
    return functools.partial(create_selective_checkpoint_contexts, policy)


def _save_mm(ctx, op, *args, **kwargs):
    if op == torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _mm_chain(x, w):
    return torch.mm(torch.mm(x, w).sin(), w).sin()


# torch: test_autograd.TestSelectiveActivationCheckpoint.test_flops_and_mem
def test_sac_flops():
    def scenario(ck):
        x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        out = ck(_mm_chain, x, w, context_fn=_sac(_save_mm))
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        return counter.get_total_flops(), _grads(x, w)

    flops, _ = _differential(scenario)
    assert flops == 4 * 2 * 8**3  # the backward's four mm, no mm recomputed


# torch: test_autograd.TestSelectiveActivationCheckpoint.test_output_already_has_autograd_meta
def test_sac_output_already_has_autograd_meta():
    def fn(x, y):
        return x.view(-1), y.sin().cos()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    def scenario(ck):
        x, y = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
        out = ck(fn, x, y, context_fn=_sac(policy))
        (out[0].sum() + out[1].sum()).backward()
        return out[0].detach(), out[1].detach(), _grads(x, y)

    _differential(scenario, plain=True)


# torch: test_autograd.TestSelectiveActivationCheckpoint.test_bad_inputs
@pytest.mark.parametrize("bad", [["a"], 1], ids=["op_list_of_str", "not_a_policy"])
def test_sac_bad_inputs(bad):
    def scenario(ck):
        x = torch.randn(3, requires_grad=True)
        ck(torch.sin, x, context_fn=functools.partial(create_selective_checkpoint_contexts, bad))

    _raises_same(scenario)


# torch: test_autograd.TestSelectiveActivationCheckpoint.test_policy_with_state
def test_sac_policy_with_state():
    def scenario(ck):
        seen = {"forward": 0, "recompute": 0}

        def policy(ctx, op, *args, **kwargs):
            key = "recompute" if ctx.is_recompute else "forward"
            seen[key] += 1
            # save every other op, counted per pass: the two passes must agree
            if seen[key] % 2:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        x = torch.randn(6, requires_grad=True)
        out = ck(lambda a: a.sin().cos().exp().sin().tanh(), x, context_fn=_sac(policy))
        out.sum().backward()
        return dict(seen), x.grad

    _differential(scenario)


# torch: test_autograd.TestSelectiveActivationCheckpoint.test_storage_lifetime
def test_sac_storage_lifetime():
    def scenario(ck):
        refs = []

        def fn(x, w):
            y = torch.mm(x, w)
            refs.append(weakref.ref(y))
            return y.sin()

        x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        out = ck(fn, x, w, context_fn=_sac(_save_mm))
        alive_before = refs[0]() is not None
        out.sum().backward()
        del out
        return alive_before, all(ref() is None for ref in refs), _grads(x, w)

    _, freed, _ = _differential(scenario)
    assert freed


# torch: test_autograd.TestSelectiveActivationCheckpoint.test_version_counter
def test_sac_version_counter():
    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.sin.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        y = x.sin()
        z = y.exp()  # recomputed from the cached y
        y.mul_(2)  # mutates the tensor SAC cached
        return z * y

    def scenario(ck):
        x = torch.randn(4, requires_grad=True)
        ck(fn, x, context_fn=_sac(policy)).sum().backward()

    _raises_same(scenario)


# torch: test_autograd.TestSelectiveActivationCheckpoint.test_function_with_more_than_one_output
def test_sac_function_with_more_than_one_output():
    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.var_mean.correction:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        var, mean = torch.var_mean(x, dim=0)
        return (var * mean).sin()

    def scenario(ck):
        x = torch.randn(5, 3, requires_grad=True)
        out = ck(fn, x, context_fn=_sac(policy))
        out.sum().backward()
        return out.detach(), x.grad

    _differential(scenario, plain=True)


# torch: test_autograd.TestSelectiveActivationCheckpoint.test_function_with_non_tensor_output
def test_sac_function_with_non_tensor_output():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    def fn(x):
        n = int(x.detach().abs().sum().item() > 0) + 1
        return x.sin() * n, n

    def scenario(ck):
        x = torch.randn(4, requires_grad=True)
        out, n = ck(fn, x, context_fn=_sac(policy))
        out.sum().backward()
        return out.detach(), n, x.grad

    _differential(scenario, plain=True)


# torch: test_autograd.TestSelectiveActivationCheckpoint.test_can_only_trigger_recompute_once
def test_sac_can_only_trigger_recompute_once():
    def scenario(ck):
        x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        out = ck(_mm_chain, x, w, context_fn=_sac(_save_mm)).sum()
        out.backward(retain_graph=True)
        out.backward()

    _raises_same(scenario)


# --- torch 2.14's respect_saved_tensors_hooks (NOTE [respect saved-tensor hooks]) -----

# Whether this torch's checkpoint takes the argument (2.14 and later): found from its
# signature, as a user would. CI's torch (2.13) does not; docs/torch_checkpoint.md says
# how the suite is run by hand on a newer one.
ROUTES = "respect_saved_tensors_hooks" in inspect.signature(tc.checkpoint).parameters
FLAGS = {"unset": None, "False": False, "True": True}


def _sac_under_hooks(ck, flag):
    """``_mm_chain`` under SAC (mm kept) inside counting saved-tensor hooks.

    Returns how many tensors other than the inputs went through the user's pack (the
    two mm outputs SAC keeps, when it routes them), whether every packed tensor was
    unpacked, and the gradients. A checkpoint's inputs are left out of the count:
    torch saves them through the user's hooks, forget keeps them itself.
    """
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    inputs = {x.data_ptr(), w.data_ptr()}
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.data_ptr())
        return t

    def unpack(t):
        unpacked.append(t.data_ptr())
        return t

    extra = {} if flag is None else {"respect_saved_tensors_hooks": flag}
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = ck(_mm_chain, x, w, context_fn=_sac(_save_mm), **extra)
    out.sum().backward()
    routed = [p for p in packed if p not in inputs]
    return (
        len(routed),
        sorted(routed) == sorted(p for p in unpacked if p not in inputs),
        _grads(x, w),
    )


@pytest.mark.parametrize("flag", FLAGS.values(), ids=FLAGS.keys())
def test_sac_respect_saved_tensors_hooks(flag):
    if ROUTES:
        # As torch: unset warns that the default will change; True routes SAC's cache
        # through the hooks, False and unset do not.
        with pytest.warns(FutureWarning) if flag is None else contextlib.nullcontext():
            routed, balanced, _ = _differential(lambda ck: _sac_under_hooks(ck, flag))
        assert routed == (2 if flag else 0) and balanced
        return
    if flag:
        # A torch whose SAC cannot route: raises rather than keep what the hooks
        # should have moved off the device.
        with pytest.raises(ValueError, match="respect_saved_tensors_hooks=True"):
            _sac_under_hooks(FORGET, flag)
        return
    # This torch never routes, and takes no such argument: forget with the flag does
    # what torch does without it.
    results = {}
    for name, ck in {"torch": TORCH, "forget": FORGET}.items():
        torch.manual_seed(0)
        results[name] = _sac_under_hooks(ck, None if name == "torch" else flag)
    _assert_same(results["torch"], results["forget"])
    assert results["forget"][:2] == (0, True)


@pytest.mark.parametrize("flag", FLAGS.values(), ids=FLAGS.keys())
def test_respect_saved_tensors_hooks_never_reaches_the_function(flag):
    seen = []

    def fn(a, **kwargs):
        seen.append(kwargs)
        return a.sin().exp()  # exp saves its output: re-run in backward

    x = torch.randn(3, requires_grad=True)
    forget.checkpoint(fn, x, respect_saved_tensors_hooks=flag, scale=2).sum().backward()
    assert seen == [{"scale": 2}] * 2  # the forward and the re-run


@pytest.mark.parametrize(
    "policy", [forget.policies.save_everything, True], ids=["save_everything", "True"]
)
def test_respect_saved_tensors_hooks_with_a_keeping_policy_raises(policy):
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="held by forget"):
        forget.checkpoint(torch.sin, x, policy=policy, respect_saved_tensors_hooks=True)
    # Unset or False: what forget's policies do anyway; and a policy keeping nothing.
    for flag, kept in [(None, policy), (False, policy), (True, None), (True, False)]:
        out = forget.checkpoint(torch.sin, x, policy=kept, respect_saved_tensors_hooks=flag)
        assert torch.equal(out, x.sin())


def _sac_in(outer, x):
    """torch's SAC checkpoint of ``_mm_chain``, run inside a region of ``outer``."""
    return outer(lambda a: TORCH(_mm_chain, a, a, context_fn=_sac(_save_mm)).exp(), x)


# NOTE [checkpoint-internal hooks]: forget's own hooks are not the user's.
def test_sac_inside_a_forget_region_sees_no_user_hooks():
    def scenario(outer):
        x = torch.randn(4, 4, requires_grad=True)
        _sac_in(outer, x).sum().backward()
        return x.grad

    # No hooks around: nothing to warn about (warnings are errors here), inside a
    # region of torch's or of forget's.
    _differential(scenario)
