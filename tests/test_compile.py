"""torch.compile of models that use forget: regions are handed to torch's checkpoint.

NOTE [compile] in src/forget/_core.py: while dynamo traces, a region runs as
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. ``fullgraph=True``
below proves that forget's eager engine (which dynamo cannot trace) is not
entered. Backend ``aot_eager`` runs the same aten kernels as eager on CPU, so
outputs and gradients are bitwise equal, dropout included. See docs/compile.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import forget


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self, width: int = 8, p: float = 0.25) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


class CheckpointedMLP(nn.Module):
    def __init__(self, depth: int = 3, policy: forget.policies.Policy | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = forget.checkpoint(block, x, use_reentrant=False, policy=self.policy)
        return x


Result = tuple[torch.Tensor, list[torch.Tensor]]


def _step(
    model: Callable[[torch.Tensor], torch.Tensor], params: list[nn.Parameter], x: torch.Tensor
) -> Result:
    for p in params:
        p.grad = None
    torch.manual_seed(7)
    out = model(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in params if p.grad is not None]
    assert len(grads) == len(params)
    return out.detach(), grads


def _assert_same(a: Result, b: Result) -> None:
    out_a, grads_a = a
    out_b, grads_b = b
    assert torch.equal(out_a, out_b)
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert torch.equal(ga, gb)


def _plain(model: CheckpointedMLP) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        for block in model.blocks:
            x = block(x)
        return x

    return run


def test_compiled_checkpoint_per_block_matches_eager() -> None:
    torch.manual_seed(0)
    model = CheckpointedMLP().train()
    params = list(model.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = _step(compiled, params, x)
    _assert_same(got, _step(model, params, x))  # forget's eager engine
    _assert_same(got, _step(_plain(model), params, x))  # no checkpointing at all
    _assert_same(got, _step(compiled, params, x))  # a second compiled step


def test_compiled_forget_module_matches_eager() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(Block(), Block()).train()
    wrapped = forget.Forget(inner)
    params = list(inner.parameters())
    x = torch.randn(5, 8)
    compiled = torch.compile(wrapped, backend="aot_eager", fullgraph=True)
    got = _step(compiled, params, x)
    _assert_same(got, _step(wrapped, params, x))
    _assert_same(got, _step(inner, params, x))


def test_compiled_forget_sequential_and_forget_function() -> None:
    torch.manual_seed(0)
    chain = forget.forget_sequential(nn.Sequential(*[Block() for _ in range(4)]), segments=2)
    params = list(chain.parameters())
    x = torch.randn(3, 8)
    compiled = torch.compile(chain, backend="aot_eager", fullgraph=True)
    _assert_same(_step(compiled, params, x), _step(chain, params, x))

    torch._dynamo.reset()
    block = Block(p=0.0)
    bparams = list(block.parameters())
    fn = torch.compile(lambda t: forget.forget(block, t), backend="aot_eager", fullgraph=True)
    _assert_same(_step(fn, bparams, x), _step(block, bparams, x))


def test_policy_is_accepted_under_compile() -> None:
    # Under compile a policy has no effect (torch recomputes per its partitioner);
    # the step still runs and gives the eager gradients.
    torch.manual_seed(0)
    policy = forget.policies.save_outputs_of(*forget.policies.MATMUL)
    model = CheckpointedMLP(depth=2, policy=policy).train()
    params = list(model.parameters())
    x = torch.randn(4, 8)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _assert_same(_step(compiled, params, x), _step(model, params, x))


def _bn_net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU()).train()


def test_batchnorm_buffers_under_compile_are_updated_once() -> None:
    """Documents docs/compile.md: compiled, running statistics end as after a plain step.

    forget does not restore buffers under compile (its dispatch mode is not traced);
    AOTAutograd functionalizes the in-place buffer update into one write after the
    forward graph, and the recomputation in backward is a pure graph that does not
    write it again. So a compiled step updates BatchNorm once, like a plain step,
    while torch's eager checkpoint updates it twice.
    """
    x = torch.randn(16, 6)
    plain = _bn_net(0)
    plain(x).sum().backward()

    compiled_net = _bn_net(0)
    step = torch.compile(forget.Forget(compiled_net), backend="aot_eager", fullgraph=True)
    step(x).sum().backward()

    bn, ref = compiled_net[1], plain[1]
    assert isinstance(bn, nn.BatchNorm1d) and isinstance(ref, nn.BatchNorm1d)
    assert bn.num_batches_tracked.item() == ref.num_batches_tracked.item() == 1
    assert bn.running_mean is not None and ref.running_mean is not None
    assert bn.running_var is not None and ref.running_var is not None
    assert torch.equal(bn.running_mean, ref.running_mean)
    assert torch.equal(bn.running_var, ref.running_var)
    for p, q in zip(compiled_net.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad)

    # For contrast: torch's eager non-reentrant checkpoint counts the batch twice.
    eager_torch = _bn_net(0)
    torch.utils.checkpoint.checkpoint(eager_torch, x, use_reentrant=False).sum().backward()
    assert eager_torch[1].num_batches_tracked.item() == 2


def test_eager_after_compile_still_uses_forget_engine() -> None:
    torch.manual_seed(0)
    model = CheckpointedMLP(depth=1)
    x = torch.randn(2, 8)
    torch.compile(model, backend="aot_eager", fullgraph=True)(x).sum().backward()
    seen: list[bool] = []
    model.blocks[0].register_forward_pre_hook(lambda m, i: seen.append(forget.in_recomputing()))
    model(x).sum().backward()
    assert seen == [False, True]  # eager: the forward, then forget's recomputation


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)).sin())


def _saved_bytes(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, skip: set[int]
) -> int:
    """Bytes of the storages autograd saves for ``fn(x)``'s backward, those in ``skip`` aside.

    Not `forget.measure`: its dispatch mode makes dynamo skip the compiled frames and
    run them eagerly (docs/compile.md). An outer saved-tensor hook sees what the
    compiled graph saves.
    """
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    out.sum().backward()
    return sum(n for ptr, n in seen.items() if ptr not in skip)


def test_compiled_checkpoint_saves_only_region_inputs() -> None:
    # The recomputation really happens in the compiled backward: the compiled graph
    # saves the inputs of the regions (and parameters), no activation inside them.
    torch.manual_seed(0)
    blocks = nn.ModuleList(Wide() for _ in range(4))
    x = torch.randn(32, 64, requires_grad=True)

    def checkpointed(t: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            t = forget.checkpoint(block, t)
        return t

    def plain(t: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            t = block(t)
        return t

    skip = {p.untyped_storage().data_ptr() for p in blocks.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    compiled_plain = torch.compile(plain, backend="aot_eager", fullgraph=True)
    compiled_ck = torch.compile(checkpointed, backend="aot_eager", fullgraph=True)
    saved_plain = _saved_bytes(compiled_plain, x, skip)
    saved_ck = _saved_bytes(compiled_ck, x, skip)
    assert saved_ck == 3 * x.nbytes  # the inputs of blocks 2, 3 and 4
    assert saved_plain > 10 * saved_ck


def test_nested_checkpoints_under_compile() -> None:
    torch.manual_seed(0)
    outer, inner = Block(p=0.1), Block(p=0.1)
    params = [*outer.parameters(), *inner.parameters()]

    def nested(t: torch.Tensor) -> torch.Tensor:
        return forget.checkpoint(lambda u: forget.checkpoint(inner, outer(u)), t)

    x = torch.randn(4, 8)
    compiled = torch.compile(nested, backend="aot_eager", fullgraph=True)
    _assert_same(_step(compiled, params, x), _step(nested, params, x))
