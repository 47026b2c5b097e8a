"""A step of shapes a cap has seen hold repeats its decision, with no count.

NOTE [steps of known shapes]: differential against plain steps and against the
capped steps the decisions came from; the regions a step runs are counted.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import forget
from _cap_steps import _step
from forget._runtime import _cap


def _net() -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Dropout(0.2), nn.Linear(64, 16))
        for _ in range(3)
    ]
    return nn.Sequential(*blocks).train()


@pytest.fixture
def counted(monkeypatch):
    """How many regions ran as the cap's droppable regions, and as forgotten ones."""
    count = {"droppable": 0, "forgotten": 0}

    def counting(kind, original):
        def call(*args, **kwargs):
            count[kind] += 1
            return original(*args, **kwargs)

        return call

    monkeypatch.setattr(_cap, "DroppableRegion", counting("droppable", _cap.DroppableRegion))
    monkeypatch.setattr(_cap, "run_region", counting("forgotten", _cap.run_region))
    return count


def _exact(plain: nn.Module, capped: nn.Module, rows: int) -> None:
    want, got = _step(plain, rows), _step(capped, rows)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_a_step_of_shapes_that_fit_runs_plain_and_exact(counted):
    plain, capped = _net(), _net()
    handle = forget.cap(capped, 10**9)
    kinds = []
    for rows in (8, 8, 16, 16, 8):
        before = dict(counted)
        _exact(plain, capped, rows)
        assert handle.last_step is not None
        ran = {k: counted[k] - before[k] for k in counted}
        kinds.append((handle.last_step.repeated, ran["droppable"], ran["forgotten"]))
    # A new shape runs capped (its three blocks as regions); a known one plain.
    assert kinds == [(False, 3, 0), (True, 0, 0), (False, 3, 0), (True, 0, 0), (True, 0, 0)]
    for a, b in zip(plain.buffers(), capped.buffers(), strict=True):
        assert torch.equal(a, b)  # BatchNorm's statistics, updated once per step
    assert [s.repeated for s in handle.steps] == [k for k, _, _ in kinds]


def test_a_step_that_evicted_repeats_its_evictions_exactly_and_within_the_cap(counted):
    plain, capped = _net(), _net()
    probe = copy.deepcopy(plain)
    peak = forget.measure(lambda: _step(probe, 64)).peak_bytes
    handle = forget.cap(capped, int(peak * 0.8))
    capped_peaks = []
    for _ in range(2):  # the second capped step's decision is the one repeated
        want = _step(plain, 64)
        capped_peaks.append(forget.measure(lambda: _step(capped, 64)).peak_bytes)
        assert all(torch.equal(want[n], p.grad) for n, p in capped.named_parameters())
        assert handle.last_step is not None and handle.last_step.evicted
        assert not handle.last_step.repeated
    evicted = handle.last_step.evicted
    for _ in range(2):
        before = dict(counted)
        want = _step(plain, 64)
        got = forget.measure(lambda: _step(capped, 64)).peak_bytes
        assert all(torch.equal(want[n], p.grad) for n, p in capped.named_parameters())
        assert handle.last_step is not None and handle.last_step.repeated
        assert handle.last_step.evicted == evicted
        assert counted["droppable"] == before["droppable"]
        assert counted["forgotten"] - before["forgotten"] == len(evicted)
        assert got <= capped_peaks[-1]
        assert got <= handle.budget_bytes
    for a, b in zip(plain.buffers(), capped.buffers(), strict=True):
        assert torch.equal(a, b)


def test_a_cap_changed_decides_again():
    net = _net()
    probe = copy.deepcopy(net)
    peak = forget.measure(lambda: _step(probe, 64)).peak_bytes
    handle = forget.cap(net, int(peak * 0.8))
    for _ in range(3):
        _step(net, 64)
    assert handle.last_step is not None and handle.last_step.repeated
    assert handle.last_step.evicted
    handle.set_budget(10**9)  # higher: the evictions may not all be needed
    _step(net, 64)
    assert handle.last_step is not None and not handle.last_step.repeated
    _step(net, 64)
    assert handle.last_step is not None and handle.last_step.repeated
    assert not handle.last_step.evicted
    known = handle.last_step.estimated_peak_bytes
    handle.set_budget(known - 1)  # below what the step of these shapes held
    _step(net, 64)
    assert handle.last_step is not None and not handle.last_step.repeated


def test_a_step_that_could_not_hold_is_never_repeated():
    net = _net()
    handle = forget.cap(net, 1000)
    for _ in range(3):  # raised each time: no decision learned from a step that raised
        with pytest.raises(forget.ForgetError, match="cannot hold this step"):
            _step(net, 8)
    assert handle._known == {}
    handle.set_budget(10**9)
    _step(net, 8)
    _step(net, 8)
    assert handle.last_step is not None and handle.last_step.repeated


def test_what_the_key_holds_a_step_to():
    net = _net()
    handle = forget.cap(net, 10**9)
    _step(net, 8)
    _step(net, 8)
    assert handle.last_step is not None and handle.last_step.repeated
    net[0][0].weight.requires_grad_(False)  # one gradient fewer: other bytes
    _step(net, 8)
    assert handle.last_step is not None and not handle.last_step.repeated
    net[1].eval()  # one module's flag
    _step(net, 8)
    assert handle.last_step is not None and not handle.last_step.repeated
    off = forget.cap(_net(), 10**9)
    off.repeat_known_shapes = False  # a model whose memory depends on its values
    for _ in range(3):
        _step(off.model, 8)
        assert off.last_step is not None and not off.last_step.repeated


def test_a_plain_step_holds_no_more_than_the_capped_step_it_learned_from():
    # The premise: the capped step that evicted nothing counted at least what the plain
    # step of its shapes allocates (CPU: the allocator's own events, forget.measure).
    net = _net()
    handle = forget.cap(net, 10**9)
    capped = forget.measure(lambda: _step(net, 32)).peak_bytes
    assert handle.last_step is not None and not handle.last_step.repeated
    known = handle.last_step.estimated_peak_bytes
    for _ in range(2):
        got = forget.measure(lambda: _step(net, 32)).peak_bytes
        assert handle.last_step is not None and handle.last_step.repeated
        assert got <= known
        assert got <= capped


@pytest.mark.parametrize("above", ["estimate", "cap"])
def test_a_repeated_step_above_its_estimate_on_cuda_is_decided_again(monkeypatch, above):
    # Stands in for a CUDA step: the allocator's peak since the repeated step began is
    # read at the next step; above the decision's estimate (or the cap) the decision is
    # forgotten and the shapes run capped, whose own peak teaches the reserve.
    net = _net()
    handle = forget.cap(net, 10**9)
    _step(net, 8)
    _step(net, 8)
    repeat = handle._repeat
    assert repeat is not None and repeat.closed and repeat.key in handle._known
    handle._repeat = SimpleNamespace(
        cuda="cuda",
        key=repeat.key,
        decision=repeat.decision,
        start=0,
        closed=True,
        allocator_peak_bytes=None,
    )
    reached = repeat.decision.estimate + 1 if above == "estimate" else 10**9 + 1
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: reached)
    handle._close_previous()
    assert repeat.key not in handle._known
    assert handle._extra_bytes == 0  # the capped step's allocator peak teaches it
    monkeypatch.undo()
    _step(net, 8)
    assert handle.last_step is not None and not handle.last_step.repeated
