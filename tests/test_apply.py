"""forget.apply_forget: wrap the matching submodules of a model in place."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import forget
from forget.policies import as_policy


class Block(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(width, 2 * width),
            nn.BatchNorm1d(2 * width),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(2 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Net(nn.Module):
    def __init__(self, depth: int = 3, width: int = 6) -> None:
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.layers = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(width, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _kinds(model: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules()}


def test_wraps_blocks_in_a_nested_module_list():
    net = forget.apply_forget(_net(), Block)
    assert all(isinstance(layer, forget.Forget) for layer in net.layers)
    assert all(isinstance(layer.module, Block) for layer in net.layers)
    assert isinstance(net.stem, nn.Linear)
    assert isinstance(net.head, nn.Sequential)


def test_wraps_only_the_outermost_match():
    net = forget.apply_forget(_net(), nn.Sequential)
    # head and each block's body match; the Linears inside them are not entered.
    assert isinstance(net.head, forget.Forget)
    assert all(isinstance(layer.body, forget.Forget) for layer in net.layers)
    wrapped = [name for name, m in net.named_modules() if isinstance(m, forget.Forget)]
    assert wrapped == ["layers.0.body", "layers.1.body", "layers.2.body", "head"]
    assert not any(isinstance(m, forget.Forget) for m in net.head.module.modules())


def test_outer_match_hides_inner_matches():
    net = forget.apply_forget(_net(), (Block, nn.Sequential))
    wrapped = [name for name, m in net.named_modules() if isinstance(m, forget.Forget)]
    assert wrapped == ["layers.0", "layers.1", "layers.2", "head"]
    assert not any(isinstance(m, forget.Forget) for m in net.layers[0].module.modules())


def test_the_root_is_never_replaced():
    net = nn.Sequential(nn.Sequential(nn.Linear(3, 3)), nn.Linear(3, 3))
    assert forget.apply_forget(net, nn.Sequential) is net
    assert type(net) is nn.Sequential
    assert isinstance(net[0], forget.Forget)
    leaf = nn.Linear(3, 3)
    assert forget.apply_forget(leaf, nn.Linear) is leaf
    assert type(leaf) is nn.Linear


def test_callable_check():
    net = forget.apply_forget(_net(), lambda m: isinstance(m, nn.Linear) and m.in_features == 4)
    wrapped = [name for name, m in net.named_modules() if isinstance(m, forget.Forget)]
    assert wrapped == ["stem"]


def test_tuple_of_classes():
    net = forget.apply_forget(_net(), (nn.Linear, nn.ReLU))
    wrapped = [name for name, m in net.named_modules() if isinstance(m, forget.Forget)]
    assert "stem" in wrapped and "head.0" in wrapped and "head.1" in wrapped
    assert "layers.0.body.0" in wrapped and "layers.0.body.2" in wrapped
    assert "layers.0.body.1" not in wrapped  # BatchNorm1d matches neither


def test_idempotent():
    net = forget.apply_forget(_net(), Block)
    kinds, wrappers = _kinds(net), list(net.layers)
    assert forget.apply_forget(net, Block) is net
    assert _kinds(net) == kinds
    assert all(a is b for a, b in zip(net.layers, wrappers, strict=True))
    # A Forget is not entered either: nothing inside the blocks gets wrapped.
    forget.apply_forget(net, nn.Sequential)
    assert all(type(layer.module.body) is nn.Sequential for layer in net.layers)
    assert isinstance(net.head, forget.Forget)


def test_shared_submodule_gets_one_wrapper():
    shared = nn.Linear(3, 3)
    net = nn.Sequential(shared, nn.ReLU(), shared)
    forget.apply_forget(net, nn.Linear)
    assert net[0] is net[2]
    assert net[0].module is shared


def test_options_reach_each_wrapper():
    net = forget.apply_forget(_net(), Block, policy=True, preserve_rng_state=False)
    for layer in net.layers:
        assert layer.preserve_rng_state is False
        assert layer.policy == as_policy(True)


@pytest.mark.parametrize(
    "check_fn",
    [3, "Block", None, (), (Block, 3), [Block]],
    ids=["int", "str", "none", "empty-tuple", "tuple-with-int", "list"],
)
def test_bad_check_fn(check_fn):
    with pytest.raises(TypeError, match=r"^forget: apply_forget's check_fn"):
        forget.apply_forget(_net(), check_fn)


def test_bad_model():
    with pytest.raises(TypeError, match=r"^forget: apply_forget changes an nn\.Module"):
        forget.apply_forget(lambda x: x, Block)  # type: ignore[type-var]


def test_state_dict_keys_unchanged_and_plain_state_loads():
    plain = _net()
    applied = forget.apply_forget(copy.deepcopy(plain), Block)
    assert list(applied.state_dict()) == list(plain.state_dict())
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    applied.load_state_dict(plain.state_dict())
    for (k, a), b in zip(plain.state_dict().items(), applied.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    plain.load_state_dict(applied.state_dict())


def _steps(model: nn.Module, x: torch.Tensor, steps: int = 2) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        torch.manual_seed(100 + step)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("check_fn", [Block, nn.Sequential], ids=["blocks", "bodies-and-head"])
def test_training_matches_the_plain_model(check_fn):
    plain = _net()
    applied = forget.apply_forget(copy.deepcopy(plain), check_fn)
    x = torch.randn(8, 4)
    for a, b in zip(_steps(plain, x), _steps(applied, x), strict=True):
        assert torch.equal(a, b)
    # state_dict holds the BatchNorm buffers (running stats, num_batches_tracked).
    for (k, a), b in zip(plain.state_dict().items(), applied.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert int(applied.state_dict()["layers.0.body.1.num_batches_tracked"]) == 2
    for p, q in zip(plain.parameters(), applied.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_wrapped_forward_runs_twice_per_step():
    # A pre-hook: the recomputation stops once it has rebuilt the last saved tensor
    # (NOTE [early stop] in _core.py), before the block's final add, so a post-forward
    # hook would not fire in backward.
    def counting(model: nn.Module) -> list[int]:
        calls = [0] * len(model.layers)
        for i, layer in enumerate(model.layers):
            block = layer.module if isinstance(layer, forget.Forget) else layer
            block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        return calls

    plain = _net()
    applied = forget.apply_forget(copy.deepcopy(plain), Block)
    plain_calls, applied_calls = counting(plain), counting(applied)
    x = torch.randn(8, 4)
    _steps(plain, x, steps=2)
    _steps(applied, x, steps=2)
    assert plain_calls == [2, 2, 2]
    assert applied_calls == [4, 4, 4]
    with torch.no_grad():
        applied(x)
    assert applied_calls == [5, 5, 5]  # no recomputation without backward
