"""Nothing outlives a step: tensors, Python objects and Regions do not pile up.

A small model (regions, nested regions, dropout, BatchNorm) trains for a few
hundred steps under `forget`; after a warm-up the number of live
``torch.Tensor`` objects must not change at all, and the number of objects
the garbage collector tracks may move only by a small fixed slack. Separately,
every ``forget._engine.Region`` must be gone once backward (without
``retain_graph``) has run and the output is dropped.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import forget
from forget._engine import Region

WIDTH = 8

# The gc count may move by a few objects between two samples for reasons that are
# not leaks: the interpreter's and torch's internal caches (type attribute caches,
# dispatch-key caches, interned frames of the test itself) settle within a few
# objects (measured: 0 on torch 2.13). A leak of one Region, slot or tensor per
# step would add hundreds over the measured steps, far above this slack.
GC_SLACK = 16


@pytest.fixture
def everything_in_view():
    """Every object in ``gc.get_objects()``, for the test; frozen again after.

    conftest.py freezes what each test finds alive, and frozen objects are not in
    ``gc.get_objects()``: a region an earlier test leaked would hide. Tests that
    check no region is alive see every object.
    """
    gc.unfreeze()
    gc.collect()
    yield
    gc.collect()
    gc.freeze()


# type(), not isinstance(): isinstance reads ``__class__``, which some objects in
# torch.distributed answer with a FutureWarning (an error under this test suite).
def _tensors_alive() -> int:
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def _regions_alive() -> int:
    return sum(1 for o in gc.get_objects() if issubclass(type(o), Region))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(0.3)
        self.inner = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.bn(self.lin(x)).relu())
        # A nested region inside the block's region.
        return x + forget.forget(lambda a: self.inner(a).tanh(), h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = forget.forget(block, x)
        return self.head(x)


def _train(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        del loss


def test_hundreds_of_steps_keep_live_tensors_and_objects_flat(request):
    torch.manual_seed(0)
    net = Net().train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(4, WIDTH, requires_grad=True)
    _train(net, opt, x, 20)  # warm-up: optimizer state, op caches, lazy imports
    gc.collect()
    tensors_before, objects_before = _tensors_alive(), len(gc.get_objects())
    _train(net, opt, x, 300)
    gc.collect()
    tensors_after, objects_after = _tensors_alive(), len(gc.get_objects())
    assert tensors_after == tensors_before
    assert abs(objects_after - objects_before) <= GC_SLACK, (objects_before, objects_after)
    request.getfixturevalue("everything_in_view")
    assert _regions_alive() == 0


def _region_tree(x: torch.Tensor, lin: nn.Module) -> torch.Tensor:
    def outer(a: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(lin(a).sin(), 0.5)
        return forget.forget(lambda b: lin(b).exp(), h).sum()

    return forget.forget(outer, x)


@pytest.mark.parametrize("how", ["backward", "autograd_grad", "subset_grad", "retain_twice"])
@pytest.mark.usefixtures("everything_in_view")
def test_regions_are_freed_after_backward(how):
    torch.manual_seed(0)
    lin = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(3, WIDTH, requires_grad=True)
    assert _regions_alive() == 0  # everything_in_view collected
    y = _region_tree(x, lin)
    assert _regions_alive() == 2  # the outer region and the inner one of the forward
    if how == "backward":
        y.backward()
    elif how == "autograd_grad":
        torch.autograd.grad(y, [x, *lin.parameters()])
    elif how == "subset_grad":
        torch.autograd.grad(y, [x])
    else:
        y.backward(retain_graph=True)
        y.backward()
    del y
    # Regions hold no reference cycle with the graph: refcounting alone frees them.
    assert _regions_alive() == 0


@pytest.mark.usefixtures("everything_in_view")
def test_dropping_the_output_without_backward_frees_the_regions():
    lin = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(3, WIDTH, requires_grad=True)
    y = _region_tree(x, lin)
    del y
    assert _regions_alive() == 0


@pytest.mark.usefixtures("everything_in_view")
def test_double_backward_frees_the_regions():
    lin = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(3, WIDTH, requires_grad=True)
    y = _region_tree(x, lin)
    (gx,) = torch.autograd.grad(y, [x], create_graph=True)
    gx.sum().backward()
    del y, gx
    gc.collect()
    assert _regions_alive() == 0


@pytest.mark.parametrize("backward", [True, False], ids=["backward", "dropped"])
@pytest.mark.parametrize(
    "policy", [None, forget.policies.save_outputs_of("aten.addmm")], ids=["all", "policy"]
)
@pytest.mark.usefixtures("everything_in_view")
def test_a_region_that_writes_into_its_argument_is_freed(policy, backward):
    # NOTE [arguments written in place]: the write's node, made in the region, saves
    # through the region's pack; the region holding the argument made a cycle through C++.
    head = nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(WIDTH, 4))
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(3, WIDTH) @ w
    y = forget.Forget(head, policy=policy)(x)
    assert _regions_alive() == 1
    if backward:
        y.sum().backward()
    del x, y
    gc.collect()
    assert _regions_alive() == 0


def _garbage_tensors() -> int:
    """Tensors only the garbage collector would free (held by reference cycles), collected."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = sum(1 for o in gc.garbage if issubclass(type(o), torch.Tensor))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    gc.collect()
    return found


@pytest.mark.parametrize(
    "policy",
    [None, forget.policies.save_outputs_of("aten.mm", "aten.addmm")],
    ids=["forget all", "policy keeps"],
)
def test_a_region_step_frees_its_tensors_without_the_garbage_collector(policy):
    # A region's re-run holds its policy's kept tensors; a reference cycle in the re-run
    # would keep them until the next collection, which a long training loop (or a
    # planner timing steps back to back) meets with the next step's tensors alive.
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
    region = forget.Forget(block, policy=policy)
    x = torch.randn(16, WIDTH, requires_grad=True)
    gc.collect()
    counts = []
    for run in (block, region):
        run(x).sum().backward()
        counts.append(_garbage_tensors())
    assert counts == [0, 0], f"tensors in reference cycles after a step (plain, region): {counts}"
