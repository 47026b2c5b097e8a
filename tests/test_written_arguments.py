"""A region that writes into its own argument in place: exact, and its argument may go.

NOTE [arguments written in place]: such an argument is held weakly beside an alias
of its storage; these tests run the step with the caller holding the argument and
with the caller dropping it (the ``x = block(x)`` of every sequential model).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import forget
from forget import ForgetError

WIDTH = 8
POLICIES = [None, forget.policies.save_outputs_of("aten.addmm")]


def _head(saved: bool) -> nn.Module:
    """A dropout in place first; the Linear then saves the argument, or the Tanh does not."""
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh()] if saved else [nn.Tanh(), nn.Linear(WIDTH, 4)]
    return nn.Sequential(nn.Dropout(0.3, inplace=True), *layers)


def _argument() -> tuple[torch.Tensor, torch.Tensor]:
    """A weight, and an op's output made from it: the argument a region writes into."""
    w = torch.eye(WIDTH).add(0.1).requires_grad_()
    torch.manual_seed(1)
    return w, torch.randn(5, WIDTH) @ w


def _step(run, keep: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """A step whose region's argument is an op's output, kept or dropped by the caller."""
    w, x = _argument()
    held = x if keep else None
    y = run(x)
    del x
    y.square().sum().backward()
    return [w.grad], held


@pytest.mark.parametrize("saved", [True, False], ids=["saved", "unsaved"])
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "dropped"])
@pytest.mark.parametrize("policy", POLICIES, ids=["all", "policy"])
def test_a_region_writing_into_its_argument_is_exact(policy, keep, saved):
    head = _head(saved)
    plain, x_plain = _step(head, keep)
    plain_params = [p.grad.clone() for p in head.parameters()]
    head.zero_grad(set_to_none=True)
    region = forget.Forget(head, policy=policy)
    got, x_got = _step(region, keep)
    assert torch.equal(plain[0], got[0])
    assert all(torch.equal(a, b.grad) for a, b in zip(plain_params, head.parameters(), strict=True))
    if keep:  # the caller sees the values the write left, as plain
        assert torch.equal(x_plain, x_got)


def test_under_create_graph_a_kept_argument_is_exact_and_a_dropped_one_raises():
    lin = nn.Linear(WIDTH, WIDTH)

    def f(a: torch.Tensor) -> torch.Tensor:
        # No op saves the argument after the write: only the caller can hold it.
        return lin(a.mul_(2.0).exp())

    def penalty(run, keep: bool) -> torch.Tensor:
        w, x = _argument()
        held = x if keep else None
        y = run(x)
        del x
        (g,) = torch.autograd.grad(y.sum(), [w], create_graph=True)
        g.square().sum().backward()
        del held
        return w.grad

    plain = penalty(f, True)
    assert torch.equal(plain, penalty(lambda a: forget.forget(f, a), True))
    with pytest.raises(ForgetError, match="wrote in place into an argument"):
        penalty(lambda a: forget.forget(f, a), False)
