"""Helpers shared by the tests of forget.cap (tests/test_cap*.py)."""

from __future__ import annotations

import torch
from torch import nn


def _step(net: nn.Module, rows: int) -> dict[str, torch.Tensor]:
    """A step of a 16-wide net on ``rows`` seeded rows; a copy of its gradients."""
    net.zero_grad(set_to_none=True)
    torch.manual_seed(rows)
    x = torch.randn(rows, 16)
    net(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names, each tensor bitwise equal."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
