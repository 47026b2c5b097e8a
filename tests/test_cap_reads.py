"""forget.cap on CPU reads the allocator's own record (NOTE [what the count misses]).

The model here has what the cap's count of tensors cannot see: a backward that
allocates a scratch buffer of its own, as oneDNN's convolutions do. Peaks are
the allocator's, by ``forget.measure(..., probe="profiler")``.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

import forget
from forget._engine import Region
from forget._memory import AllocatorRecord, allocator_peak
from forget._runtime._cap import _cap_with


class _Scratch(torch.autograd.Function):
    """Identity whose backward allocates three times its gradient for itself."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        scratch = torch.empty(g.numel() * 3, dtype=g.dtype)
        scratch.fill_(1.0)
        return g * scratch[: g.numel()].view_as(g)


class Scratch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scratch.apply(x)


def _net() -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(32, 256), nn.GELU(), Scratch(), nn.Linear(256, 32))
        for _ in range(4)
    ]
    return nn.Sequential(*blocks)


def _step(net: nn.Module, rows: int) -> None:
    net.zero_grad(set_to_none=True)
    torch.manual_seed(rows)
    net(torch.randn(rows, 32)).square().mean().backward()


def _peak(net: nn.Module, rows: int) -> int:
    return forget.measure(lambda: _step(net, rows), probe="profiler").peak_bytes


def _grads(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def budget() -> int:
    net = _net()
    _step(net, 256)
    return int(0.8 * _peak(net, 256))


def test_a_read_step_teaches_the_cap_what_its_count_missed(budget):
    # Unread, the count misses the scratch buffers and every step passes the cap.
    unread = _net()
    handle = _cap_with(unread, budget, read_allocator="never")
    assert [_peak(unread, 256) > budget for _ in range(2)] == [True, True]
    assert handle.last_step is not None and handle.last_step.allocator_peak_bytes is None
    # Read, the first step (nothing read yet) passes the cap as before; from the
    # second on the steps hold, a larger shape too (its reserve scaled from the read).
    plain, read = _net(), _net()
    handle = forget.cap(read, budget)
    peaks = []
    for rows in (256, 256, 128, 320, 320, 384):
        peaks.append(_peak(read, rows))
        _step(plain, rows)
        expected, got = _grads(plain), _grads(read)
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert peaks[0] > budget and max(peaks[1:]) <= budget, [p / budget for p in peaks]
    read_steps = [s.allocator_peak_bytes for s in handle.steps]
    # The first step, the next of its size (its read passed the cap), each larger one;
    # none of a size whose read held.
    assert [p is not None for p in read_steps] == [True, True, False, True, False, True]
    # Read within `measure`, a step's figure is measure's own (NOTE [records within a measure]).
    assert read_steps[0] == peaks[0] and read_steps[3] == peaks[3]


def test_a_cap_that_cannot_hold_for_what_it_read_refuses_and_reads_a_size_until_it_holds(budget):
    net = _net()
    handle = forget.cap(net, budget)
    _peak(net, 256)  # read: over the cap
    second = _peak(net, 256)  # read again, as its size's read passed the cap
    assert second <= budget and handle.last_step.allocator_peak_bytes == second
    with pytest.raises(forget.ForgetError, match="cannot hold"):
        _step(net, 1024)  # a quarter of the scratch alone passes it
    # The record of the refused step is stopped: torch's profiler is free.
    assert allocator_peak(lambda: torch.ones(1000)) == 4000
    # Its regions go with the model: the read step's hold on its backward nodes, cut
    # short, would have kept its graph alive in a cycle the collector cannot see.
    del net, handle
    gc.unfreeze()  # conftest freezes what each test finds alive
    gc.collect()
    try:
        assert not any(issubclass(type(o), Region) for o in gc.get_objects())
    finally:
        gc.freeze()


def test_every_step_read_on_request_and_its_figure_the_allocator_peak(budget):
    net = _net()
    handle = _cap_with(net, 10 * budget, read_allocator="every")
    for _ in range(3):
        _step(net, 64)
    steps = handle.steps
    assert [s.repeated for s in steps] == [False, True, True]
    assert all(s.allocator_peak_bytes is not None for s in steps)
    # Read by the cap's own record, from the forward to backward's end (the input
    # was made before): within the input's bytes of measure's figure, which has it.
    measured = _peak(net, 64)
    assert 0 <= measured - handle.last_step.allocator_peak_bytes <= 64 * 32 * 4


def _user_profiler_starts() -> bool:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.ones(3)
    return True


@pytest.mark.parametrize("after", ["reports read", "optimizer step", "no-grad forward", "remove"])
def test_the_record_stops_where_the_user_may_start_a_profiler(after):
    from torch.optim.optimizer import _global_optimizer_pre_hooks as optimizer_hooks

    hooks = len(optimizer_hooks)
    net = _net()
    handle = forget.cap(net, 10**9)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    _step(net, 64)  # the first step is read: the record is open past its backward
    assert len(optimizer_hooks) == hooks + 1
    assert torch.autograd.profiler.kineto_available() and torch._C._autograd._profiler_enabled()
    if after == "reports read":
        assert handle.last_step is not None and handle.last_step.allocator_peak_bytes
    elif after == "optimizer step":
        optimizer.step()
    elif after == "no-grad forward":
        with torch.no_grad():
            net(torch.randn(4, 32))
    else:
        handle.remove()
    assert not torch._C._autograd._profiler_enabled()
    assert len(optimizer_hooks) == hooks  # the cap's hook on optimizer steps is gone
    assert _user_profiler_starts()
    if after != "remove":
        assert handle.steps[0].allocator_peak_bytes is not None


def test_a_users_profiler_running_already_leaves_the_step_unread():
    net = _net()
    handle = forget.cap(net, 10**9)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        _step(net, 64)
    _step(net, 32)  # smaller, but the first the cap could read
    assert [s.allocator_peak_bytes is None for s in handle.steps] == [True, False]


def test_forgets_own_probe_stops_a_record_left_open():
    net = _net()
    forget.cap(net, 10**9)
    _step(net, 64)  # its record open, its handle dropped
    assert torch._C._autograd._profiler_enabled()
    assert allocator_peak(lambda: torch.ones(1000)) == 4000


def test_an_allocator_record_reads_the_peak_between_its_marks():
    heard = []
    record = AllocatorRecord(heard.append)
    assert record.start()
    a = torch.empty(1000)  # 4,000 B
    record.mark("one")
    b = torch.empty(500)  # 2,000 B
    del a
    record.mark("two")
    c = torch.empty(4000)  # 16,000 B
    del b, c
    reading = record.stop()
    assert heard == [reading] and not record.running
    one, two = reading.marks["one"], reading.marks["two"]
    assert reading.peak(until=one) == 4000
    assert reading.peak(one, two) == 6000
    assert reading.peak(since=two) == 18000
    assert reading.peak() == 18000
    # One per thread: a record started while another is open stops that one first.
    first, second = AllocatorRecord(heard.append), AllocatorRecord()
    assert first.start() and second.start()
    assert not first.running and len(heard) == 2
    second.stop()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not AllocatorRecord().start()  # a profiler not forget's: nothing started
    # A probe inside `allocator_peak` does not stop its record (which would read a
    # part of the call): it finds the profiler busy.
    with pytest.raises(RuntimeError, match="profiler runs already"):
        allocator_peak(lambda: allocator_peak(lambda: torch.ones(10)))
    with pytest.raises(RuntimeError, match="profiler runs already"):
        forget.measure(lambda: allocator_peak(lambda: torch.ones(10)), probe="profiler")


def test_read_allocator_of_another_name_is_refused():
    with pytest.raises(ValueError, match="read_allocator"):
        _cap_with(_net(), 10**9, read_allocator="sometimes")


def _gpt2(**overrides: Any) -> nn.Module:
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    config = tf.GPT2Config(
        vocab_size=128, n_embd=32, n_head=2, n_layer=4, n_positions=128, **overrides
    )
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(config).train()


def _lm_step(model: nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # dropout's draws, the same in every copy
    ids = torch.arange(256).remainder(127).add(1).view(2, 128)
    model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("cache", [True, False], ids=["defaults", "use_cache=False"])
@pytest.mark.parametrize("read_allocator", ["largest", "never"])
def test_a_second_step_of_known_shapes_reserves_what_the_forward_reached(read_allocator, cache):
    # NOTE [forward reaches]: the first step, knowing nothing, reserves a whole layer
    # past every boundary and evicts all four; the second, at the shapes the first
    # read, reserves what the allocator reached there and keeps the last layer.
    plain = _gpt2(use_cache=cache)
    _lm_step(plain)
    budget = forget.measure(lambda: _lm_step(plain), probe="profiler").peak_bytes // 2
    expected = _grads(plain)
    model = _gpt2(use_cache=cache)
    # Whole regions only: what the reach changes is how many go.
    handle = _cap_with(model, budget, read_allocator=read_allocator, partial=None)
    peaks = []
    for _ in range(3):
        peaks.append(forget.measure(lambda: _lm_step(model), probe="profiler").peak_bytes)
        got = _grads(model)
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[k], got[k]) for k in expected)
    evicted = [len(s.evicted) for s in handle.steps]
    assert evicted == ([4, 3, 3] if read_allocator == "largest" else [4, 4, 4])
    assert max(peaks) <= budget, [p / budget for p in peaks]
    if read_allocator == "largest":
        # Its estimate is the allocator's reach: within 1 % of the cap of the peak.
        # With the key/value cache on (GPT-2's default), which holds every layer's
        # keys and values past it, the estimate stays above the peak by more than
        # 1 % of the cap (not yet understood): only its side is asserted there.
        second = handle.steps[1]
        assert second.estimated_peak_bytes >= peaks[1]
        assert cache or second.estimated_peak_bytes - peaks[1] <= budget // 100
