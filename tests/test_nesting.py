"""Checkpoints nested with ``torch.autograd.grad(..., create_graph=True)`` at any depth.

The intent of torch's TestNestedCheckpoint, in our words: compose a function
with checkpoints (``c``) and gradients that keep their graph (``g``) in
several orders, and the result, and its own gradient, must be the plain
composition's, bitwise; afterwards the graph is freed.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch

import forget
from forget._engine import Region

Fn = Callable[[torch.Tensor], torch.Tensor]


MADE: list[weakref.ref[torch.Tensor]] = []


def f(x: torch.Tensor) -> torch.Tensor:
    h = x.sin().exp()
    MADE.append(weakref.ref(h))  # every forward and re-run of f, to see them freed
    return h.sin()


def plain(fn: Fn) -> Fn:
    return fn


def c(fn: Fn) -> Fn:
    return lambda x: forget.checkpoint(fn, x, use_reentrant=False)


def g(fn: Fn) -> Fn:
    """The gradient of ``fn(x).sum()``, with its graph, so it can be differentiated again."""

    def grad(x: torch.Tensor) -> torch.Tensor:
        (dx,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        return dx

    return grad


def both(fn: Fn) -> Fn:
    """Two checkpointed children of one region."""
    return lambda x: fn(x) * fn(x.cos())


# Each case is built twice: with ``c`` a checkpoint, and with ``c`` the identity.
CASES: dict[str, Callable[[Callable[[Fn], Fn]], Fn]] = {
    "g(c(f))": lambda c: g(c(f)),
    "g(c(g(c(f))))": lambda c: g(c(g(c(f)))),
    "c(g(g(c(f))))": lambda c: c(g(g(c(f)))),
    "g(g(c(c(f))))": lambda c: g(g(c(c(f)))),
    "c(g(c(g(c(f)))))": lambda c: c(g(c(g(c(f))))),
    "g(g(c(both(c(f)))))": lambda c: g(g(c(both(c(f))))),
    "c(g(g(both(c(f)))))": lambda c: c(g(g(both(c(f))))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nested_checkpoints_under_double_grad_match_the_plain_composition(case):
    x = torch.linspace(-1.0, 1.0, 5, requires_grad=True)
    expected = CASES[case](plain)(x)
    (expected_dx,) = torch.autograd.grad(expected.sum(), x)
    y = torch.linspace(-1.0, 1.0, 5, requires_grad=True)
    out = CASES[case](c)(y)
    assert torch.equal(out, expected)
    (dy,) = torch.autograd.grad(out.sum(), y)
    assert torch.equal(dy, expected_dx)


@pytest.mark.parametrize("case", list(CASES))
def test_the_graph_of_a_nested_case_is_freed(case):
    # Autograd nodes take no weak references; the tensors f made, in its forward
    # and in every re-run, and the regions stand for the graph that held them.
    MADE.clear()
    x = torch.linspace(-1.0, 1.0, 5, requires_grad=True)
    out = CASES[case](c)(x)
    assert _regions()  # the graph of ``out`` holds them
    torch.autograd.grad(out.sum(), x)
    del out
    gc.collect()
    assert MADE and [ref() for ref in MADE] == [None] * len(MADE)
    assert not _regions()


def _regions() -> list[Region]:
    return [o for o in gc.get_objects() if type(o) is Region]


@pytest.mark.parametrize("how", ["torch", "forget"])
def test_a_grad_inside_a_region_with_dropout_sees_the_forwards_mask(how):
    # NOTE [re-run in the forward]: the grad re-runs the region midway; its dropout
    # mask must be the forward's, or the result differs from plain silently.
    def body(a: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(a.sin(), 0.5, training=True).exp()
        (da,) = torch.autograd.grad(h.sum(), a, create_graph=True)
        return da

    checkpoint = torch.utils.checkpoint.checkpoint if how == "torch" else forget.checkpoint
    results = []
    for run in (body, lambda a: checkpoint(body, a, use_reentrant=False)):
        torch.manual_seed(0)
        x = torch.linspace(-1.0, 1.0, 16, requires_grad=True)
        out = run(x)
        out.sum().backward()
        results.append((out.detach(), x.grad))
    assert torch.equal(results[1][0], results[0][0])
    assert torch.equal(results[1][1], results[0][1])
