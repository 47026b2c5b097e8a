"""CUDA paths: RNG replay on the device, buffers on the device. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import forget

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_dropout_on_cuda_recomputes_identically():
    x = torch.randn(256, 256, device="cuda", requires_grad=True)

    def f(a):
        return nn.functional.dropout(a.sin(), 0.5).exp()

    torch.cuda.manual_seed(0)
    f(x).sum().backward()
    plain = x.grad.clone()
    x.grad = None
    torch.cuda.manual_seed(0)
    forget.forget(f, x).sum().backward()
    assert torch.equal(plain, x.grad)


def test_cuda_rng_stream_unchanged_after_step():
    x = torch.randn(64, device="cuda", requires_grad=True)
    torch.cuda.manual_seed(1)
    nn.functional.dropout(x, 0.5).exp().sum().backward()
    after_plain = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(1)
    forget.forget(lambda a: nn.functional.dropout(a, 0.5).exp(), x).sum().backward()
    assert torch.equal(after_plain, torch.rand(4, device="cuda"))


def test_batchnorm_state_on_cuda():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).cuda()
    ours = copy.deepcopy(plain)
    x = torch.randn(16, 8, device="cuda")
    plain(x).square().sum().backward()
    forget.forget(ours, x).square().sum().backward()
    for a, b in zip(plain.state_dict().values(), ours.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_recomputation_frees_activations_on_cuda():
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = forget.forget(lambda a: a.sin().exp().cos().sum(), x)
    kept = torch.cuda.memory_allocated() - base
    y.backward()
    assert kept < 4 * 1024 * 1024  # no 4 MiB activation kept: only a scalar output


def test_kept_dropout_masks_on_cuda_replay_exactly():
    # NOTE [kept draws]: CUDA dropout is native_dropout (fresh mask and output); kept,
    # it is not drawn again, the CUDA generator is set to the state it left (so the
    # draw after it matches), and the RNG after the step is the plain run's.
    from forget import policies

    x = torch.randn(128, 64, device="cuda", requires_grad=True)

    def f(a):
        h = nn.functional.dropout(a.sin(), 0.5)
        return h * torch.rand_like(h)

    torch.cuda.manual_seed(0)
    f(x).sum().backward()
    plain, after_plain = x.grad.clone(), torch.rand(4, device="cuda")
    x.grad = None
    torch.cuda.manual_seed(0)
    y = forget.checkpoint(f, x, policy=policies.save_outputs_of(*policies.DROPOUT))
    y.sum().backward()
    assert torch.equal(plain, x.grad)
    assert torch.equal(after_plain, torch.rand(4, device="cuda"))


def test_fast_path_on_cuda_matches_plain_over_steps_and_flips():
    # NOTE [fast path]: on a device no buffer value is compared (it would wait for
    # the stream); the learned training flags and versions decide. Dropout draws on
    # the device RNG, BatchNorm updates statistics without bumping versions.
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32)
    ).cuda()
    ours = copy.deepcopy(plain)
    for step in range(6):
        for m in (plain, ours):
            m.train(step not in (2, 3))
        x = torch.randn(16, 32, device="cuda")
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.cuda.manual_seed(step)
        plain(a).square().sum().backward()
        torch.cuda.manual_seed(step)
        forget.checkpoint(ours, b).square().sum().backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
        for p, q in zip(plain.parameters(), ours.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        for p, q in zip(plain.buffers(), ours.buffers(), strict=True):
            assert torch.equal(p, q), step


def _cap_step(net: nn.Module, rows: int) -> int:
    """A step of the cap tests on ``rows`` rows: what it allocated at its peak."""
    net.zero_grad(set_to_none=True)
    torch.cuda.manual_seed(rows)
    x = torch.randn(rows, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    net(x).square().mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def test_a_cap_on_cuda_holds_every_step_capped_and_repeated():
    # The cap's CUDA count (memory_allocated at region boundaries, the allocator's peak
    # teaching the reserve) and its repeated decisions (NOTE [steps of known shapes]),
    # by the allocator, over shapes that vary and come back.
    torch.manual_seed(0)

    def block():
        return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))

    plain = nn.Sequential(*[block() for _ in range(6)]).cuda()
    capped = copy.deepcopy(plain)

    _cap_step(plain, 2048)  # the plain peak at the largest shape, after a warm-up
    budget = int(0.6 * _cap_step(plain, 2048))
    handle = forget.cap(capped, budget)
    for rows in (512, 2048, 1024, 2048, 512, 2048, 1024):
        _cap_step(plain, rows)
        want = {n: p.grad.clone() for n, p in plain.named_parameters()}
        got = _cap_step(capped, rows)
        assert got <= budget, (rows, got, budget, handle.last_step)
        assert all(torch.equal(want[n], p.grad) for n, p in capped.named_parameters())
    assert any(s.repeated and s.evicted for s in handle.steps)
    handle.remove()


def test_a_cap_on_cuda_evicting_in_part_holds_every_step_and_stays_exact():
    # NOTE [partial evictions] on the CUDA count: blocks whose selective keep is a
    # fifth of what they hold go in part first; every step by the allocator.
    torch.manual_seed(0)

    def block():
        return nn.Sequential(
            nn.Linear(256, 1024), nn.GELU(), nn.Tanh(), nn.Sigmoid(), nn.Dropout(0.1),
            nn.Linear(1024, 256),
        )  # fmt: skip

    plain = nn.Sequential(*[block() for _ in range(6)]).cuda()
    capped = copy.deepcopy(plain)

    _cap_step(plain, 2048)
    budget = int(0.6 * _cap_step(plain, 2048))
    handle = forget.cap(capped, budget)  # partial="selective", the default
    for rows in (2048, 2048, 1024, 2048):
        _cap_step(plain, rows)
        want = {n: p.grad.clone() for n, p in plain.named_parameters()}
        got = _cap_step(capped, rows)
        assert got <= budget, (rows, got, budget, handle.last_step)
        assert all(torch.equal(want[n], p.grad) for n, p in capped.named_parameters())
    assert any(s.partial for s in handle.steps)
    handle.remove()


def test_free_and_a_share_mean_for_a_cap_what_they_mean_for_a_plan():
    # NOTE [one budget], NOTE [free budget]: "free" less the one margin; a share of the
    # plain step's peak, which the cap predicts on fake tensors for each shape.
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU()) for _ in range(4)])
    net = net.cuda()
    free, total = torch.cuda.mem_get_info()
    margin = max(256 << 20, int(total * 0.05))
    handle = forget.cap(net, "free")
    assert abs(handle.budget_bytes - (free - margin)) <= 64 << 20  # others may allocate
    handle.remove()
    x = torch.randn(512, 256, device="cuda")
    plain = forget.measure(lambda: net(x).sum().backward()).peak_bytes  # by the ledger
    net.zero_grad(set_to_none=True)
    handle = forget.cap(net, "60%")
    net(x).sum().backward()
    assert handle.budget_bytes == int(0.6 * plain)
    handle.remove()
