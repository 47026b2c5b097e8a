"""Tensor subclasses without a storage of their own, fake and meta tensors, saved identity.

Differential: each case runs plain, under torch.utils.checkpoint where torch
runs it, and under forget; gradients must be bitwise equal.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
import torch
from torch.utils._pytree import tree_map

import forget
from forget import policies as P
from forget._engine import storage_key

SIZE_OPS = {
    torch.ops.aten.sym_size.default: lambda t: t.shape,
    torch.ops.aten.sym_stride.default: lambda t: t.stride(),
    torch.ops.aten.sym_numel.default: lambda t: t.numel(),
    torch.ops.aten.dim.default: lambda t: t.dim(),
}


class Wrapped(torch.Tensor):
    """A wrapper subclass, as DTensor and float8/NF4 tensors are: no storage of its own.

    With ``policy="sizes"`` it also answers size queries from Python.
    """

    elem: torch.Tensor
    policy: str | None

    @staticmethod
    def __new__(cls, elem: torch.Tensor, policy: str | None = None) -> Wrapped:
        extra = {"dispatch_sizes_strides_policy": policy} if policy else {}
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            elem.shape,
            dtype=elem.dtype,
            device=elem.device,
            requires_grad=elem.requires_grad,
            **extra,
        )
        out.elem, out.policy = elem, policy
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Wrapped({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in SIZE_OPS:
            return SIZE_OPS[func](args[0].elem)
        policy = next(a.policy for a in args if isinstance(a, Wrapped))

        def unwrap(x):
            return x.elem if isinstance(x, Wrapped) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: Wrapped(x, policy) if isinstance(x, torch.Tensor) else x, out)


def _inner(t: torch.Tensor) -> torch.Tensor:
    return t.elem if isinstance(t, Wrapped) else t


POLICIES = [None, "sizes"]


def _mlp_step(x):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    return lambda a: torch.nn.functional.gelu(lin(a)).sin()


@pytest.mark.parametrize("policy", POLICIES, ids=["plain_sizes", "python_sizes"])
def test_a_wrapper_subclass_input_gives_torchs_gradients(policy):
    # Storage keys of every argument once raised "invalid python storage" here.
    grads = {}
    for how in ("plain", "torch", "forget"):
        f = _mlp_step(None)
        x = Wrapped(torch.arange(12.0).reshape(3, 4) / 7, policy).requires_grad_()
        if how == "plain":
            out = f(x)
        elif how == "torch":
            out = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)
        else:
            out = forget.checkpoint(f, x, use_reentrant=False)
        assert isinstance(out, Wrapped)
        out.sum().backward()
        grads[how] = _inner(x.grad).clone()
    assert torch.equal(grads["forget"], grads["plain"])
    assert torch.equal(grads["forget"], grads["torch"])


@pytest.mark.parametrize("policy", POLICIES, ids=["plain_sizes", "python_sizes"])
def test_a_wrapper_subclass_parameter_gets_the_plain_gradient(policy):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    lin.weight = torch.nn.Parameter(Wrapped(lin.weight.detach().clone(), policy))
    twin = copy.deepcopy(lin)
    x = torch.randn(3, 4, requires_grad=True)
    lin(x).tanh().sum().backward()
    y = x.detach().requires_grad_()
    forget.forget(lambda a: twin(a).tanh(), y).sum().backward()
    assert torch.equal(_inner(twin.weight.grad), _inner(lin.weight.grad))
    assert torch.equal(y.grad, x.grad)


@pytest.mark.parametrize(
    "run",
    [
        lambda g, x: forget.forget(g, x),
        lambda g, x: forget.checkpoint(g, x, use_reentrant=False, policy=P.save_outputs_of("exp")),
        lambda g, x: forget.forget(lambda a: forget.forget(g, a), x),
    ],
    ids=["region", "policy_region", "nested"],
)
def test_subclass_intermediates_recompute_exactly(run):
    # A plain input meets a subclass constant: every intermediate is a subclass.
    c = Wrapped(torch.linspace(-1, 1, 12).reshape(3, 4))

    def g(a):
        return ((a + c).exp() * 2).sum(dim=1)

    x = torch.randn(3, 4, requires_grad=True)
    g(x).sum().backward()
    plain = x.grad.clone()
    x.grad = None
    run(g, x).sum().backward()
    assert torch.equal(x.grad, plain)


def test_batchnorm_on_a_subclass_input_updates_its_statistics_once():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4)
    twin = copy.deepcopy(bn)
    x = Wrapped(torch.randn(8, 4)).requires_grad_()
    bn(x).sum().backward()
    plain = _inner(x.grad).clone()
    x.grad = None
    forget.checkpoint(twin, x, use_reentrant=False).sum().backward()
    assert torch.equal(_inner(x.grad), plain)
    for name, value in bn.state_dict().items():
        assert torch.equal(_inner(twin.state_dict()[name]), _inner(value)), name
    assert int(twin.num_batches_tracked) == 1


def test_meta_inputs_give_gradients_of_the_right_shape():
    lin = torch.nn.Linear(4, 4, device="meta")
    x = torch.randn(3, 4, device="meta", requires_grad=True)
    forget.checkpoint(lambda a: lin(a).relu(), x, use_reentrant=False).sum().backward()
    assert x.grad.device.type == "meta" and x.grad.shape == (3, 4)
    assert lin.weight.grad is not None and lin.weight.grad.shape == (4, 4)


def test_fake_tensors_run_as_under_torchs_checkpoint(recwarn):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    lin = torch.nn.Linear(4, 4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(3, 4, requires_grad=True)
        forget.checkpoint(lambda a: lin(a).sin(), x, use_reentrant=False).sum().backward()
        assert isinstance(x.grad, FakeTensor) and x.grad.shape == (3, 4)
    # No data pointer of a fake tensor is read (torch warns on that).
    assert not [w for w in recwarn if "data pointer" in str(w.message)]


def test_storage_keys_tell_storages_apart_and_key_storage_less_tensors_by_object():
    a = torch.arange(6.0)
    assert storage_key(a) == storage_key(a[2:]) == storage_key(a.view(2, 3))
    assert storage_key(a) != storage_key(a.clone())
    w = Wrapped(a)
    assert storage_key(w) == storage_key(w) != storage_key(Wrapped(a))
    assert storage_key(w) != storage_key(a)


class _SaveBoth(torch.autograd.Function):
    seen: ClassVar[list[torch.Tensor]] = []

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        _, b = ctx.saved_tensors
        _SaveBoth.seen.append(b)
        return grad * b, None


@pytest.mark.parametrize("how", ["torch", "forget"])
def test_a_saved_input_that_needs_no_grad_comes_back_as_the_same_object(how):
    # NOTE [saved identity]
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    checkpoint = torch.utils.checkpoint.checkpoint if how == "torch" else forget.checkpoint
    _SaveBoth.seen.clear()
    checkpoint(lambda x, y: _SaveBoth.apply(x.sin(), y), a, b, use_reentrant=False).sum().backward()
    assert _SaveBoth.seen[-1] is b
    assert torch.equal(a.grad, a.detach().cos() * b)
