"""A cap runs a step plain when a step of its shapes fit with nothing evicted.

NOTE [steps known to fit]: differential against plain steps, and against the
same cap with ``plain_when_fits=False``; the regions a step runs are counted.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import forget
from forget.runtime import _cap


def _net() -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Dropout(0.2), nn.Linear(64, 16))
        for _ in range(3)
    ]
    return nn.Sequential(*blocks).train()


def _step(net: nn.Module, rows: int) -> dict[str, torch.Tensor]:
    net.zero_grad(set_to_none=True)
    torch.manual_seed(rows)
    x = torch.randn(rows, 16)
    net(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


@pytest.fixture
def regions_run(monkeypatch):
    """How many candidate regions ran as the cap's regions."""
    count = [0]
    original = _cap.DroppableRegion

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(_cap, "DroppableRegion", counted)
    return count


def test_a_step_of_shapes_that_fit_runs_plain_and_exact(regions_run):
    plain, capped = _net(), _net()
    handle = forget.cap(capped, 10**9)
    kinds = []
    for rows in (8, 8, 16, 16, 8):
        before = regions_run[0]
        want, got = _step(plain, rows), _step(capped, rows)
        assert all(torch.equal(want[n], got[n]) for n in want)
        assert handle.last_step is not None
        kinds.append((handle.last_step.plain, regions_run[0] - before))
    # A new shape runs capped (its three blocks as regions); a known one plain.
    assert kinds == [(False, 3), (True, 0), (False, 3), (True, 0), (True, 0)]
    for a, b in zip(plain.buffers(), capped.buffers(), strict=True):
        assert torch.equal(a, b)  # BatchNorm's statistics, updated once per step
    assert [s.plain for s in handle.steps] == [k for k, _ in kinds]


def test_a_step_that_evicted_or_a_lower_cap_runs_capped_again(regions_run):
    net = _net()
    probe = copy.deepcopy(net)
    peak = forget.measure(lambda: _step(probe, 64)).peak_bytes
    handle = forget.cap(net, int(peak * 0.8))
    for _ in range(2):
        _step(net, 64)
        assert handle.last_step is not None
        assert handle.last_step.evicted and not handle.last_step.plain
    handle.set_budget(10**9)
    _step(net, 64)
    _step(net, 64)
    assert handle.last_step is not None and handle.last_step.plain
    known = handle.last_step.estimated_peak_bytes
    handle.set_budget(known - 1)  # below what the step of these shapes held
    _step(net, 64)
    assert handle.last_step is not None and not handle.last_step.plain


def test_what_the_key_holds_a_step_to(regions_run):
    net = _net()
    handle = forget.cap(net, 10**9)
    _step(net, 8)
    _step(net, 8)
    assert handle.last_step is not None and handle.last_step.plain
    net[0][0].weight.requires_grad_(False)  # one gradient fewer: other bytes
    _step(net, 8)
    assert handle.last_step is not None and not handle.last_step.plain
    net.eval()
    _step(net, 8)
    assert handle.last_step is not None and not handle.last_step.plain
    off = forget.cap(_net(), 10**9, plain_when_fits=False)
    for _ in range(3):
        _step(off.model, 8)
        assert off.last_step is not None and not off.last_step.plain


def test_a_plain_step_holds_no_more_than_the_capped_step_it_learned_from():
    # The premise: the capped step that evicted nothing counted at least what the plain
    # step of its shapes allocates (CPU: the allocator's own events, forget.measure).
    net = _net()
    handle = forget.cap(net, 10**9)
    capped = forget.measure(lambda: _step(net, 32)).peak_bytes
    assert handle.last_step is not None and not handle.last_step.plain
    known = handle.last_step.estimated_peak_bytes
    for _ in range(2):
        got = forget.measure(lambda: _step(net, 32)).peak_bytes
        assert handle.last_step is not None and handle.last_step.plain
        assert got <= known
        assert got <= capped


def test_a_plain_step_that_passed_the_cap_on_cuda_unlearns_its_key():
    # Stands in for a CUDA step: the allocator's peak since the plain step began is read
    # at the next step, and a key whose plain step passed the cap runs capped again.
    net = _net()
    handle = forget.cap(net, 10**9)
    _step(net, 8)
    _step(net, 8)
    assert handle.last_step is not None and handle.last_step.plain
    plain = handle._plain
    assert plain is not None and plain.closed
    handle._plain = SimpleNamespace(
        cuda="cuda", key=plain.key, closed=True, passed=lambda budget: True
    )
    _step(net, 8)
    assert handle.last_step is not None and not handle.last_step.plain
