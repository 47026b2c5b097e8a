"""A cap that evicts regions in part (NOTE [partial evictions], NOTE [partial drops]).

Differential: the same steps plain, and under a cap whose regions keep their
matmuls' outputs through a partial eviction; gradients and buffers bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import forget
from _cap_steps import _equal, _step
from forget import policies
from forget._engine import DroppableRegion
from forget._runtime import EVICTIONS
from forget._runtime._cap import _cap_with
from forget.policies import DEFAULT_OPTIONS

SELECTIVE = DEFAULT_OPTIONS["selective"]


def _block() -> nn.Module:
    # Its policy keeps a fifth of what it holds: the first linear layer's output and
    # dropout's mask as bits, beside the norm's, GELU's, tanh's and dropout's outputs.
    return nn.Sequential(
        nn.Linear(16, 64),
        nn.BatchNorm1d(64),
        nn.GELU(),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(64, 16),
    )


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_block() for _ in range(4)]).train()


def _region_grads(drop: str) -> tuple[dict[str, torch.Tensor], int, int]:
    """A block run as a droppable region with the selective policy, dropped as ``drop``:
    its gradients, the bytes its policy kept, and the matmul calls its backward saw."""
    block = _block().train()
    block.load_state_dict(_reference.state_dict())
    torch.manual_seed(1)
    x = torch.randn(32, 16, requires_grad=True)
    if drop == "plain":
        out, kept = block(x), 0
    else:
        region = DroppableRegion(block, (x,), {}, policy=SELECTIVE)
        out = region.run_forward()
        kept = sum(region.kept_output_bytes.values())
        if drop.startswith("released"):  # as if run without the policy from here
            region.release_kept()
            assert not region.kept_output_bytes
            with pytest.raises(ValueError, match="partial drop needs"):
                region.drop(partial=True)
        if drop == "released, then whole":
            region.drop()
        if drop in ("partial", "partial, then whole"):
            region.drop(partial=True)
            assert region.partly_dropped and not region.dropped
        if drop in ("whole", "partial, then whole"):
            region.drop()
            assert region.dropped and not region.partly_dropped
            assert not region.kept_output_bytes
    torch.manual_seed(99)  # the backward's draws are not the forward's
    with torch.profiler.profile() as prof:
        out.square().sum().backward()
    # The profiler records a replayed op once and a computed one twice (the policy's
    # dispatch mode, then the kernel under it).
    matmuls = sum(e.count for e in prof.key_averages() if e.key == "aten::addmm")
    grads = {n: p.grad for n, p in block.named_parameters()}
    grads["x"] = x.grad
    buffers = {f"buffer {n}": b.clone() for n, b in block.named_buffers()}
    return {**grads, **buffers}, kept, matmuls


torch.manual_seed(0)
_reference = _block()


def test_a_droppable_region_with_a_policy_drops_in_part_or_whole_and_stays_exact():
    plain, _, _ = _region_grads("plain")
    drops = ("kept", "partial", "whole", "partial, then whole", "released", "released, then whole")
    found = {drop: _region_grads(drop) for drop in drops}
    for drop, (grads, kept, _) in found.items():
        assert _equal(plain, grads), drop
        # The first linear layer's output (32 x 64 floats) and dropout's mask as bits;
        # not the last one's, which no re-run reads (NOTE [unneeded kept outputs]).
        assert kept == 32 * 64 * 4 + 32 * 64 // 8, drop
    # Held, nothing re-runs; in part, the re-run replays the kept matmuls; whole, it
    # computes them again (the kernel's own event besides the replay's).
    assert found["kept"][2] == found["released"][2] == 0
    assert 0 < found["partial"][2] < found["whole"][2] == found["partial, then whole"][2]
    assert found["released, then whole"][2] == found["whole"][2]


def test_a_partial_drop_needs_a_policy():
    x = torch.randn(4, 16, requires_grad=True)
    region = DroppableRegion(_block(), (x,), {})
    region.run_forward()
    with pytest.raises(ValueError, match="partial drop needs a region run with a policy"):
        region.drop(partial=True)


def _plain_peak(rows: int) -> int:
    net = _net()
    _step(net, rows)
    return forget.measure(lambda: _step(net, rows)).peak_bytes


@pytest.mark.parametrize("share", [0.65, 0.45])
def test_a_cap_evicting_in_part_keeps_the_plain_gradients_buffers_and_the_cap(share):
    budget = int(share * _plain_peak(256))
    plain, capped = _net(), _net()
    handle = forget.cap(capped, budget)  # partial="selective", the default
    peaks = []
    shapes = (256, 256, 256, 128, 256, 192)
    for rows in shapes:
        want = _step(plain, rows)
        peaks.append(forget.measure(lambda r=rows: _step(capped, r)).peak_bytes)
        assert _equal(want, {n: p.grad for n, p in capped.named_parameters()})
    for a, b in zip(plain.buffers(), capped.buffers(), strict=True):
        assert torch.equal(a, b)  # BatchNorm's statistics, updated once per step
    assert max(peaks) <= budget, [p / budget for p in peaks]
    steps = handle.steps
    # The first step, at shapes no record read, evicts whole regions only; the next
    # of those shapes, reading its reaches, goes in part first.
    assert steps[0].evicted and not steps[0].partial
    second = steps[1]
    assert second.partial, "the cap evicted nothing in part"
    if share == 0.65:  # in part only
        assert not second.evicted
    else:  # some in part, some of them then whole
        assert second.evicted and not set(second.evicted) & set(second.partial)
    # The last step at 256 repeats the decision of the last capped one: the same
    # regions in part and whole, run as policy and forgotten regions from the start.
    at_256 = [s for s, rows in zip(steps, shapes, strict=True) if rows == 256]
    assert at_256[-1].repeated
    decided = [s for s in at_256 if not s.repeated][-1]
    assert decided.partial
    assert (at_256[-1].partial, at_256[-1].evicted) == (decided.partial, decided.evicted)
    handle.remove()


def test_shapes_seen_and_never_read_are_read_once_then_go_in_part():
    # The larger shape is read first; the smaller one, never larger than any read,
    # evicts whole on its first step, is read on its second, goes in part on its
    # third (its decision), and repeats that on its fourth.
    budget = int(0.55 * _plain_peak(192))
    plain, capped = _net(), _net()
    handle = forget.cap(capped, budget)
    shapes = (256, 192, 192, 192, 192)
    for rows in shapes:
        want = _step(plain, rows)
        assert forget.measure(lambda r=rows: _step(capped, r)).peak_bytes <= budget
        assert _equal(want, {n: p.grad for n, p in capped.named_parameters()})
    read = [s.allocator_peak_bytes is not None for s in handle.steps]
    assert read == [True, False, True, False, False], read
    small = handle.steps[1:]
    assert [bool(s.partial) for s in small] == [False, False, True, True]
    assert [s.repeated for s in small] == [False, False, False, True]
    handle.remove()


@pytest.mark.parametrize(
    ("partial", "error", "match"),
    [
        ("regenerate", ValueError, "names no keep"),
        (3, TypeError, "takes 'selective', a forget.policies.Policy or None, got int"),
        (policies.regenerate(), ValueError, "is no partial keep"),
        (policies.save_nothing, ValueError, "is no partial keep"),
        (policies.save_everything, ValueError, "is no partial keep"),
    ],
)
def test_bad_partials(partial, error, match):
    net = _net()
    with pytest.raises(error, match=match):
        _cap_with(net, 10**6, partial=partial)
    assert "forward" not in net.__dict__  # nothing applied


def test_a_region_that_keeps_too_much_runs_without_the_policy_from_then_on(monkeypatch):
    from forget._runtime import _cap

    policies_seen: list[list[bool]] = []

    class Counted(DroppableRegion):
        def __init__(self, *args, **kwargs):
            policies_seen[-1].append(kwargs.get("policy") is not None)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_cap, "DroppableRegion", Counted)
    torch.manual_seed(0)

    # Its policy keeps the first linear layer's output: half of what it holds.
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)]
        )

    net = make()
    budget = int(0.85 * forget.measure(_step, make(), 64).peak_bytes)
    handle = forget.cap(net, budget)  # partial="selective", the default
    for _ in range(3):  # the first read, the second capped under the policy, and again
        policies_seen.append([])
        forget.measure(_step, net, 64)
    # Read: none under the policy. Then the first block under it keeps too much, and
    # its kind runs without it from then on: the blocks after it in that step too.
    assert policies_seen[:2] == [[False] * 3, [True, False, False]]
    assert all(not seen or not any(seen) for seen in policies_seen[2:])
    assert handle.steps[0].evicted and not any(s.partial for s in handle.steps)


@pytest.mark.parametrize("eviction", sorted(EVICTIONS))
def test_every_eviction_order_evicts_in_part_first_and_stays_exact(eviction, monkeypatch):
    from forget._runtime import _steps

    # Per step, in order; the steps held here, so that none's id is another's.
    evictions: dict[_steps.Step, list[tuple[str, bool]]] = {}
    evict = _steps.Step._evict

    def spied(self, entry, partial=False):
        evictions.setdefault(self, []).append((entry.name, partial))
        evict(self, entry, partial)

    monkeypatch.setattr(_steps.Step, "_evict", spied)
    budget = int(0.5 * _plain_peak(256))
    plain, capped = _net(), _net()
    handle = _cap_with(capped, budget, eviction=eviction, partial="selective")
    for rows in (256, 256, 128):
        want = _step(plain, rows)
        peak = forget.measure(lambda r=rows: _step(capped, r)).peak_bytes
        assert peak <= budget, (eviction, peak / budget)
        assert _equal(want, {n: p.grad for n, p in capped.named_parameters()})
    first, second = handle.steps[:2]  # the second, of shapes the first read
    assert second.partial and not first.partial
    # A region goes whole only once it went in part.
    in_second = list(evictions.values())[1]
    for i, (name, partial) in enumerate(in_second):
        if not partial:
            assert (name, True) in in_second[:i]
