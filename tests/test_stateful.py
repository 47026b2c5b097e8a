"""Module state after a step under forget equals a plain step's, bit for bit."""

from __future__ import annotations

import collections
import copy
import functools

import pytest
import torch
from torch import nn

import forget
from forget._planning._tree.apply import applied
from forget.policies import DEFAULT_OPTIONS


def _equal_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _equal_grads(a: nn.Module, b: nn.Module) -> bool:
    return all(
        (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def _bn_net(dim: int, momentum: float | None) -> nn.Module:
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dim]
    return nn.Sequential(
        conv(3, 4, 3, padding=1), bn(4, momentum=momentum), nn.ReLU(), nn.Dropout(0.2)
    )


def _input(dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(dim)
    return torch.randn(2, 3, *([5] * dim), generator=g)


WRAPS = {
    "module": lambda m: m,
    "closure": lambda m: lambda x: m(x),
    "partial": lambda m: functools.partial(nn.Module.__call__, m),
    "bound_forward": lambda m: m.forward,
}


@pytest.mark.parametrize("dim", [1, 2, 3], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("wrap", list(WRAPS), ids=list(WRAPS))
def test_batchnorm_state_and_grads_match_plain_over_steps(dim, momentum, wrap):
    torch.manual_seed(0)
    plain = _bn_net(dim, momentum)
    ours = copy.deepcopy(plain)
    func = WRAPS[wrap](ours)
    for step in range(3):
        x = _input(dim) + step
        torch.manual_seed(step)
        plain(x).square().mean().backward()
        torch.manual_seed(step)
        forget.forget(func, x).square().mean().backward()
        assert _equal_state(plain, ours)
        assert _equal_grads(plain, ours)
    assert int(ours[1].num_batches_tracked) == 3


def test_nested_regions_update_state_once():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    ours = copy.deepcopy(plain)
    x = torch.randn(6, 4)

    def outer(h):
        h = ours[0](h)
        h = forget.forget(ours[1], h)  # inner region
        return ours[3](ours[2](h))

    plain(x).pow(2).sum().backward()
    forget.forget(outer, x).pow(2).sum().backward()
    assert _equal_state(plain, ours)
    assert _equal_grads(plain, ours)


def test_repeated_backward_leaves_state_as_plain():
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(3)
    ours = copy.deepcopy(plain)
    x = torch.randn(5, 3, requires_grad=True)
    y = plain(x).exp().sum()
    y.backward(retain_graph=True)
    y.backward()
    y2 = forget.forget(ours, x).exp().sum()
    y2.backward(retain_graph=True)
    y2.backward()  # a second recomputation: state still updated once
    assert _equal_state(plain, ours)


def test_shared_module_in_two_regions():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ours = copy.deepcopy(plain)
    x = torch.randn(4, 3)
    plain(plain(x)).sum().backward()
    forget.forget(ours, forget.forget(ours, x)).sum().backward()
    assert _equal_state(plain, ours)
    assert _equal_grads(plain, ours)


class PowerIteration(nn.Module):
    """A layer whose output depends on a buffer its forward updates (like spectral norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("u", torch.randn(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            v = self.weight.t() @ self.u
            self.u.copy_(self.weight @ v / (self.weight @ v).norm())
            self.calls += 1
        return x @ (self.weight / (self.u @ self.weight @ v))


def test_stateful_layer_whose_output_depends_on_its_state():
    torch.manual_seed(0)
    plain = PowerIteration()
    ours = copy.deepcopy(plain)
    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(2):
        plain(x).tanh().sum().backward()
        forget.forget(ours, x).tanh().sum().backward()
    assert _equal_state(plain, ours)
    assert _equal_grads(plain, ours)
    assert int(ours.calls) == 2


def test_forward_hooks_run_in_recomputation_and_see_the_flag():
    # tanh saves its output, so the region re-runs; the last Linear's addmm saves its
    # inputs, the last tensors backward needs, and the re-run stops as that op starts
    # (NOTE [early stop]): the last Linear does not run again, as under torch's checkpoint.
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    seen: dict[int, list[bool]] = {1: [], 2: []}
    for i in seen:
        net[i].register_forward_hook(
            lambda m, inp, out, i=i: seen[i].append(forget.in_recomputing())
        )
    forget.forget(net, torch.randn(2, 3)).sum().backward()
    assert seen == {1: [False, True], 2: [False]}


def test_region_saving_only_inputs_and_parameters_is_not_rerun():
    lin = nn.Linear(3, 3)
    calls: list[bool] = []
    lin.register_forward_hook(lambda m, i, o: calls.append(forget.in_recomputing()))
    x = torch.randn(2, 3, requires_grad=True)
    forget.forget(lin, x).sum().backward()
    assert calls == [False]  # linear saves x and weight, both alive anyway
    assert torch.equal(lin.weight.grad, torch.ones(3, 1) * x.detach().sum(0))


def test_parameter_modified_in_place_before_backward_raises():
    lin = nn.Linear(3, 3)
    y = forget.forget(lin, torch.randn(2, 3, requires_grad=True))
    with torch.no_grad():
        lin.weight.mul_(2)
    with pytest.raises(forget.ForgetError, match="modified in place after the forward"):
        y.sum().backward()


def test_user_layer_can_branch_on_in_recomputing():
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0  # a Python attribute: not a tensor, so not tracked

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not forget.in_recomputing():
                self.count += 1
            return x.exp()

    c = Counter()
    forget.forget(c, torch.randn(2, requires_grad=True)).sum().backward()
    assert c.count == 1


def test_eval_mode_batchnorm_is_untouched():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3).eval()
    before = copy.deepcopy(bn.state_dict())
    x = torch.randn(4, 3, requires_grad=True)
    forget.forget(bn, x).exp().sum().backward()
    assert all(torch.equal(before[k], v) for k, v in bn.state_dict().items())


# NOTE [write-only state]: counters updated in place and read by nothing else cost no copy.


class _Counting(nn.Module):
    """A layer whose buffers are updated in the ways NOTE [write-only state] sorts out."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("noise", torch.zeros(4))
        self.register_buffer("last", torch.zeros(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.mode == "write_only":
            self.count.add_(1)
        elif self.mode == "read_before_write":
            h = h + self.count  # add saves nothing: only the re-run's tanh output shows it
            self.count.add_(1)
        elif self.mode == "seeded":
            self.noise.bernoulli_(0.5)  # an update that draws random numbers
        elif self.mode == "out":
            torch.mul(h.detach(), 2.0, out=self.last)
        return torch.nn.functional.dropout(h.tanh(), 0.3)


@pytest.mark.parametrize("mode", ["write_only", "read_before_write", "seeded", "out"])
def test_buffers_updated_in_place_match_plain(mode):
    torch.manual_seed(0)
    plain = _Counting(mode)
    ours = copy.deepcopy(plain)
    x = torch.randn(3, 4)
    for step in range(3):
        torch.manual_seed(step)
        plain(x).sum().backward()
        torch.manual_seed(step)
        forget.forget(ours, x).sum().backward()
        assert _equal_state(plain, ours) and _equal_grads(plain, ours)
    assert int(ours.count) == (3 if mode in ("write_only", "read_before_write") else 0)


def test_write_only_counters_cost_no_byte_over_torch_checkpoint():
    # Four BatchNorms: their num_batches_tracked copies were 32 bytes of peak.
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU()) for _ in range(4)
    ]
    x = torch.randn(2, 3, 5, 5)

    def step(run):
        def go():
            for b in blocks:
                b.zero_grad(set_to_none=True)
            h = x
            for b in blocks:
                h = run(b, h)
            h.sum().backward()

        return go

    ours = forget.measure(step(forget.forget))
    theirs = forget.measure(
        step(lambda b, h: torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False))
    )
    assert ours.peak_bytes == theirs.peak_bytes
    assert ours.saved_bytes == theirs.saved_bytes
    # torch updates the counters twice; forget once, like a plain step
    assert [int(b[1].num_batches_tracked) for b in blocks] == [3, 3, 3, 3]  # 1 + 2


# NOTE [hooks of the region's own module]: a tree plan runs a module's bound forward as
# the region's function, so no hook of that module runs around its re-run.


class _RunningAverage(nn.Module):
    """An average and a counter kept in buffers, updated in place and read by nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(()))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.reruns = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.reruns += forget.in_recomputing()
        self.avg.mul_(0.9).add_(x.mean() * 0.1)
        self.count.add_(1)
        return x.tanh()  # tanh saves its output: the region re-runs


STATEFUL = {
    "batchnorm1d": (lambda: nn.BatchNorm1d(4), lambda: nn.Linear(3, 4), (6, 3)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(4), lambda: nn.Conv2d(3, 4, 3), (2, 3, 5, 5)),
    "average": (_RunningAverage, lambda: nn.Linear(3, 4), (6, 3)),
}

# choices -> re-runs of the stateful module's forward over two steps
PLACES = {
    "own_region": ({"block.state": "forget"}, 2),
    "child_of_region": ({"block": "forget"}, 2),
    "own_region_nested": ({"block": "forget", "block.state": "forget"}, 4),
    "own_selective": ({"block.state": "selective"}, 2),
    "own_regenerate": ({"block.state": "regenerate"}, 0),
}


def _stateful_net(kind: str) -> nn.Module:
    state, pre, _ = STATEFUL[kind]
    block = nn.Sequential(collections.OrderedDict(state=state(), act=nn.Tanh()))
    return nn.Sequential(collections.OrderedDict(pre=pre(), block=block, post=nn.Tanh()))


@pytest.mark.parametrize("place", list(PLACES), ids=list(PLACES))
@pytest.mark.parametrize("kind", list(STATEFUL), ids=list(STATEFUL))
def test_stateful_module_under_a_tree_plan_updates_state_once(kind, place, monkeypatch):
    choices, reruns = PLACES[place]
    torch.manual_seed(0)
    plain = _stateful_net(kind)
    ours = copy.deepcopy(plain)
    state = ours.block.state
    if kind != "average":  # count the batch norms that run in a re-run
        batch_norm = torch.nn.functional.batch_norm

        def counting(*args, **kwargs):
            state.reruns = getattr(state, "reruns", 0) + forget.in_recomputing()
            return batch_norm(*args, **kwargs)

        monkeypatch.setattr(torch.nn.modules.batchnorm.F, "batch_norm", counting)
    x = torch.randn(*STATEFUL[kind][2])
    with applied(ours, choices, DEFAULT_OPTIONS):
        for step in range(2):
            plain(x + step).square().sum().backward()
            ours(x + step).square().sum().backward()
            assert _equal_state(plain, ours) and _equal_grads(plain, ours)
    assert state.reruns == reruns
    counter = "num_batches_tracked" if kind != "average" else "count"
    assert int(getattr(ours.block.state, counter)) == 2


@pytest.mark.parametrize(
    "wrap",
    [lambda m: m.forward, lambda m: functools.partial(m.forward)],
    ids=["bound_forward", "partial_of_bound_forward"],
)
def test_region_running_a_batchnorms_own_forward_updates_state_once(wrap):
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(4)
    ours = copy.deepcopy(plain)
    x = torch.randn(6, 4, requires_grad=True)
    for step in range(2):
        plain(x + step).exp().sum().backward()
        forget.checkpoint(wrap(ours), x + step).exp().sum().backward()
        assert _equal_state(plain, ours) and _equal_grads(plain, ours)
    assert int(ours.num_batches_tracked) == 2
