"""forget.checkpoint: a drop-in for torch.utils.checkpoint.checkpoint (non-reentrant)."""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import forget


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Dropout(0.3), nn.Linear(8, 6))


@pytest.mark.parametrize("use_reentrant", [None, False])
def test_grads_equal_torch_checkpoint_and_plain(use_reentrant):
    net = _mlp()
    x = torch.randn(4, 6, requires_grad=True)
    results = []
    for run in ("plain", "torch", "forget"):
        net.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(7)
        if run == "plain":
            y = net(x)
        elif run == "torch":
            y = tc.checkpoint(net, x, use_reentrant=False)
        else:
            y = forget.checkpoint(net, x, use_reentrant=use_reentrant)
        y.square().sum().backward()
        results.append([y.detach(), x.grad, *[p.grad for p in net.parameters()]])
    for a, b, c in zip(*results, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_kwargs_and_nested_non_tensor_outputs():
    x = torch.randn(3, requires_grad=True)

    def f(a, *, scale, extra=None):
        return {"y": (a * scale).exp(), "pair": [a.sin(), "tag"], "n": 3}

    out = forget.checkpoint(f, x, scale=2.0, use_reentrant=False)
    assert out["n"] == 3 and out["pair"][1] == "tag"
    (out["y"].sum() + out["pair"][0].sum()).backward()
    expected = 2 * torch.exp(2 * x.detach()) + x.detach().cos()
    assert torch.equal(x.grad, expected)


def test_tensor_kwargs_reach_the_function_and_get_grads():
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    forget.checkpoint(lambda a, w: (a * w).exp().sum(), x, w=w).backward()
    assert torch.equal(w.grad, x.detach() * (x.detach() * w.detach()).exp())


def test_use_reentrant_true_warns_and_runs_our_engine():
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="use_reentrant=True is ignored"):
        y = forget.checkpoint(lambda a: a.exp(), x, use_reentrant=True)
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


def test_no_warning_by_default():
    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forget.checkpoint(lambda a: a.exp(), x).sum().backward()


def test_bad_determinism_check_and_not_callable():
    with pytest.raises(ValueError, match="determinism_check must be one of"):
        forget.checkpoint(lambda a: a, torch.ones(1), determinism_check="strict")
    with pytest.raises(TypeError, match="function must be callable"):
        forget.checkpoint(None, torch.ones(1))


def test_determinism_check_none_skips_the_metadata_comparison():
    x = torch.randn(4, requires_grad=True)

    def f(a):
        b = a.float() if not forget.in_recomputing() else a.double()
        return b.exp().float().sum()

    with pytest.raises(forget.RecomputationMismatchError, match="dtype"):
        forget.checkpoint(f, x).backward()
    x.grad = None
    forget.checkpoint(f, x, determinism_check="none").backward()
    assert torch.allclose(x.grad, x.detach().exp())


def test_context_fn_contexts_wrap_forward_and_recomputation():
    entered: list[str] = []

    class Ctx:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            entered.append(self.name + ":" + str(forget.in_recomputing()))

        def __exit__(self, *exc: object) -> None:
            return None

    x = torch.randn(3, requires_grad=True)
    y = forget.checkpoint(lambda a: a.exp(), x, context_fn=lambda: (Ctx("fwd"), Ctx("rec")))
    y.sum().backward()
    assert entered == ["fwd:False", "rec:True"]
    forget.checkpoint(lambda a: a.exp(), x, context_fn=lambda: (nullcontext(), nullcontext()))


def test_batchnorm_updated_once_unlike_torch_checkpoint():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ours, theirs = copy.deepcopy(plain), copy.deepcopy(plain)
    x = torch.randn(8, 4)
    plain(x).sum().backward()
    forget.checkpoint(ours, x).sum().backward()
    tc.checkpoint(theirs, x, use_reentrant=False).sum().backward()
    assert int(plain[1].num_batches_tracked) == 1
    assert int(ours[1].num_batches_tracked) == 1
    assert int(theirs[1].num_batches_tracked) == 2  # why forget exists (torch 2.13)
    assert torch.equal(plain[1].running_mean, ours[1].running_mean)
    assert not torch.equal(plain[1].running_mean, theirs[1].running_mean)


def test_preserve_rng_state_false_does_not_replay():
    x = torch.ones(1000, requires_grad=True)
    torch.manual_seed(0)
    y = forget.checkpoint(lambda a: torch.nn.functional.dropout(a, 0.5) * a, x)
    y.sum().backward()
    exact = x.grad.clone()
    x.grad = None
    torch.manual_seed(0)
    y = forget.checkpoint(
        lambda a: torch.nn.functional.dropout(a, 0.5) * a, x, preserve_rng_state=False
    )
    y.sum().backward()
    assert not torch.equal(exact, x.grad)  # a fresh mask in the re-run
