"""forget.Forget and forget.forget_sequential: module wrappers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import forget


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.2), nn.Linear(6, 5), nn.Tanh()
    )


def test_forget_wrapper_state_dict_keys_equal_the_wrapped_modules():
    net = _net()
    wrapped = forget.Forget(copy.deepcopy(net))
    assert list(wrapped.state_dict()) == list(net.state_dict())
    wrapped.load_state_dict(net.state_dict())
    nested = nn.Sequential(forget.Forget(_net()), nn.Linear(5, 1))
    assert list(nested.state_dict())[:2] == ["0.0.weight", "0.0.bias"]
    nested.load_state_dict(nested.state_dict())


def test_forget_wrapper_matches_plain_step():
    net = _net()
    wrapped = forget.Forget(copy.deepcopy(net))
    x = torch.randn(7, 5)
    for step in range(2):
        torch.manual_seed(step)
        net(x).sum().backward()
        torch.manual_seed(step)
        wrapped(x).sum().backward()
    for (k, a), b in zip(net.state_dict().items(), wrapped.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    for p, q in zip(net.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_forget_wrapper_rejects_non_modules():
    with pytest.raises(TypeError, match=r"Forget wraps an nn\.Module"):
        forget.Forget(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.parametrize("segments", [1, 2, 3, 6])
def test_forget_sequential_matches_plain(segments):
    net = _net()
    chained = forget.forget_sequential(copy.deepcopy(net), segments)
    assert list(chained.state_dict()) == list(net.state_dict())
    x = torch.randn(7, 5, requires_grad=True)
    torch.manual_seed(1)
    net(x).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    torch.manual_seed(1)
    chained(x).sum().backward()
    assert torch.equal(gx, x.grad)
    for a, b in zip(net.state_dict().values(), chained.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("segments", [0, 7, 1.5])
def test_forget_sequential_rejects_bad_segments(segments):
    with pytest.raises(ValueError, match=r"segments must be an int in \[1, 6\]"):
        forget.forget_sequential(_net(), segments)


def test_forget_sequential_from_a_list_of_modules():
    layers = [nn.Linear(3, 3) for _ in range(4)]
    chained = forget.forget_sequential(layers, 2)
    assert chained._bounds() == [(0, 2), (2, 4)]
    chained(torch.randn(2, 3)).sum().backward()
    assert all(layer.weight.grad is not None for layer in layers)
