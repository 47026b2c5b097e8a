"""What a plan runs: a model or list of blocks as a chain of stages with one loss.

NOTE [finer stages]: where equal blocks cost equal memory, a budget that some
segment count fills is met best by that uniform segmentation (parameter
gradients break the equality only a little: NOTE [parameter gradients]). Cutting
blocks finer opens schedules not on whole blocks: a region may end inside a
block, and part of a block may be kept while the rest is forgotten (a GPT
block's attention and MLP halves differ in bytes kept per second of re-run).
With ``split``, a block that offers stages (``forget_stages()``, name ->
callable run in turn; an ``nn.Sequential``'s children) becomes that many stages,
less those joined at a dead cut (NOTE [dead cuts]); they meet at single tensors,
as blocks do. The baselines stay on whole blocks and remain candidates, so the
search space only grows. A plan made with ``split`` records ``block_stages``
(and ``stage_parts``) and splits the blocks again when it runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, cast

import torch
from torch import Tensor, nn

from .._engine import InTurn, storage_key
from ..policies import Policy, as_policy

Block = Callable[[Tensor], Tensor]
LossFn = Callable[[Tensor], Tensor]


def _default_loss(output: Tensor) -> Tensor:
    return output.sum()


def _nbytes(t: Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _check_tensor(value: object, what: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(
            f"forget: plan runs a chain of blocks, each taking and returning one tensor; "
            f"{what} is {type(value).__name__}"
        )
    return value


# ------------------------------------------------------------------ targets


@dataclass
class _Target:
    """What is planned: the blocks, and how one training step runs them."""

    blocks: Sequence[Block]
    modules: list[nn.Module]
    inputs: tuple[Any, ...]
    kind: str  # "sequential", "block_model" or "callables"
    model: Any  # the nn.Module (a reference model for kind "block_model"), or None
    loss_fn: LossFn | None
    # NOTE [finer stages]: with split, ``blocks`` are the blocks' stages, block
    # ``i`` giving ``block_sizes[i]`` of them (None: one stage per block).
    block_sizes: tuple[int, ...] | None = None
    # NOTE [dead cuts]: how many of the stages a block offers each planned stage
    # runs in turn (None: one each).
    stage_parts: tuple[int, ...] | None = None
    names: list[str] = field(default_factory=list)

    def chain_input(self) -> Tensor:
        if self.kind == "block_model":
            assert self.model is not None
            with torch.no_grad():
                h = self.model.embed(self.inputs[0])
        else:
            h = _check_tensor(self.inputs[0], "the sample input")
        return h.detach().requires_grad_(h.is_floating_point())

    def step(self, runner: Block | None) -> None:
        if self.kind == "block_model":
            assert self.model is not None
            before = self.model.blocks_runner
            self.model.blocks_runner = runner
            try:
                self.model.step(*self.inputs)
            finally:
                self.model.blocks_runner = before
            return
        loss_fn = self.loss_fn or _default_loss
        # As ``loss_fn(model(x)).backward()``: the output is not held during backward.
        loss_fn(self._forward(runner)).backward()

    def _forward(self, runner: Block | None) -> Tensor:
        h = _check_tensor(self.inputs[0], "the sample input")
        if runner is not None:
            return runner(h)
        for block in self.blocks:
            h = block(h)
        return h


def sub_stages(block: object) -> list[tuple[str, Block]] | None:
    """The stages a block offers (NOTE [finer stages]), or None when it is one stage.

    A block offers them with a ``forget_stages()`` method returning a dict of
    name -> callable (tensor -> tensor), which run in turn compute what the
    block computes; an ``nn.Sequential`` block offers its children.

    Raises:
        TypeError: ``forget_stages()`` returned something else.
    """
    offer = getattr(block, "forget_stages", None)
    if callable(offer):
        stages = offer()
        if (
            not isinstance(stages, Mapping)
            or not stages
            or not all(isinstance(k, str) and callable(v) for k, v in stages.items())
        ):
            raise TypeError(
                f"forget: {type(block).__name__}.forget_stages() must return a non-empty dict "
                "of name -> callable (tensor -> tensor)"
            )
        return list(stages.items())
    if isinstance(block, nn.Sequential) and len(block) > 0:
        return list(block.named_children())
    return None


def _joined(parts: Sequence[Block]) -> Block:
    """Stages a block offers, run in turn as one planned stage (NOTE [dead cuts]).

    Modules join as an ``nn.Sequential``, so parameters, buffers, train/eval
    and ``repr`` (NOTE [alike stages]) are those of the parts; plain callables
    join as an `InTurn`, which carries no such description.
    """
    if all(isinstance(p, nn.Module) for p in parts):
        return nn.Sequential(*(p for p in parts if isinstance(p, nn.Module)))
    return InTurn(parts)


def _group(parts: Sequence[Block], groups: Sequence[int]) -> list[Block]:
    """``parts`` run ``groups[k]`` at a time: a group of one is the part itself."""
    out: list[Block] = []
    start = 0
    for size in groups:
        chunk = parts[start : start + size]
        out.append(chunk[0] if size == 1 else _joined(chunk))
        start += size
    return out


def _dead_cuts(target: _Target, offered: list[list[tuple[str, Block]]]) -> list[list[int]]:
    """Per block, the groups of its stages that meet only at dead cuts.

    NOTE [dead cuts]: the memory model keeps a stage's input and output alive
    until its backward (`forget.schedules._schedule`), exact when some backward
    reads them. A cut no backward reads (between BatchNorm, which saves its input,
    and ReLU, which saves its output) is held in a plain step only until the next
    stage has run; counted to the end of the forward, it put the predicted peak of
    the reference CNN far above the measured one (benchmarks/measured.md, "Single
    measurements behind the NOTEs"). So the stages either side of a dead cut are
    planned as one: the planner loses only a region's start there. A cut is dead
    when no tensor a stage of the block saves for backward, nor the block's output,
    shares its storage; found by running each block once with grad on the sample
    input, leaving no trace.
    """
    groups: list[list[int]] = []
    h = target.chain_input()
    with untouched(target):
        for parts in offered:
            saved: set[tuple[torch.device, int]] = set()

            def pack(t: Tensor, saved: set[tuple[torch.device, int]] = saved) -> Tensor:
                saved.add(storage_key(t))
                return t

            cuts: list[Tensor] = []
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                for k, (_, part) in enumerate(parts):
                    if k:
                        cuts.append(h)
                    h = _check_tensor(part(h), "the output of a block's stage")
            saved.add(storage_key(h))
            sizes = [1]
            for cut in cuts:
                if storage_key(cut) in saved:
                    sizes.append(1)
                else:
                    sizes[-1] += 1
            groups.append(sizes)
            del cuts
            h = h.detach().requires_grad_(h.is_floating_point())
    return groups


def _split(target: _Target) -> _Target:
    """The same target, its blocks replaced by their stages (NOTE [finer stages]).

    Stages that meet only at dead cuts are joined (NOTE [dead cuts]).
    """
    offered = [sub_stages(block) or [("", block)] for block in target.blocks]
    groups = _dead_cuts(target, offered) if any(len(o) > 1 for o in offered) else []
    blocks: list[Block] = []
    names: list[str] = []
    sizes: list[int] = []
    parts: list[int] = []
    for k, (name, block_parts) in enumerate(zip(target.names, offered, strict=True)):
        grouping = groups[k] if groups else [1] * len(block_parts)
        blocks += _group([stage for _, stage in block_parts], grouping)
        start = 0
        for size in grouping:
            sub = "+".join(n for n, _ in block_parts[start : start + size])
            names.append(f"{name}.{sub}" if sub else name)
            start += size
        sizes.append(len(grouping))
        parts += grouping
    joined = tuple(parts) if any(n > 1 for n in parts) else None
    return dataclasses.replace(
        target, blocks=blocks, names=names, block_sizes=tuple(sizes), stage_parts=joined
    )


def _target(
    model: object, inputs: tuple[Any, ...], loss_fn: LossFn | None, split: bool = False
) -> _Target:
    if not isinstance(split, bool):
        raise TypeError(f"forget: split must be a bool, got {type(split).__name__}")
    target = _whole_target(model, inputs, loss_fn)
    target.names = _stage_names(target)
    return _split(target) if split else target


class ChainModel(Protocol):
    """What planning reads of a chain model (NOTE [chain models])."""

    blocks: nn.ModuleList
    blocks_runner: Callable[[Tensor], Tensor] | None

    def embed(self, x: Tensor) -> Tensor: ...

    def step(self, x: Tensor, target: Tensor) -> Any: ...


def is_chain_model(model: object) -> TypeGuard[ChainModel]:
    """Whether ``model`` runs its blocks as a chain the planner may replace (NOTE [chain models]).

    NOTE [chain models]: a module that runs ``stem -> blocks -> head`` and lets a
    planned runner stand in for its loop over the blocks is planned as a chain:
    it has ``blocks`` (an ``nn.ModuleList``), a ``blocks_runner`` attribute
    (``None``: its own loop; else a callable running all blocks), and
    ``embed(x)`` (the first block's input) and ``step(x, target)`` (one training
    step) methods. The reference models of `forget._cli._models` are such models;
    planning knows them by these names alone, not by their class.
    """
    return (
        isinstance(model, nn.Module)
        and isinstance(getattr(model, "blocks", None), nn.ModuleList)
        and hasattr(model, "blocks_runner")
        and all(callable(getattr(model, name, None)) for name in ("embed", "step"))
    )


def _whole_target(model: object, inputs: tuple[Any, ...], loss_fn: LossFn | None) -> _Target:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"forget: loss_fn must be callable, got {type(loss_fn).__name__}")
    if is_chain_model(model):
        if len(inputs) != 2:
            raise TypeError(
                "forget: plan of a reference model takes its sample (input, target), "
                f"got {len(inputs)} sample inputs"
            )
        if loss_fn is not None:
            raise TypeError("forget: a reference model brings its own loss; drop loss_fn")
        blocks = list(model.blocks)
        module = cast(nn.Module, model)
        return _Target(blocks, [module], inputs, "block_model", model, None)
    if len(inputs) != 1:
        raise TypeError(
            f"forget: plan takes one sample input for the first block, got {len(inputs)}"
        )
    if isinstance(model, nn.Sequential):
        blocks = list(model)
        return _Target(blocks, [model], inputs, "sequential", model, loss_fn)
    if isinstance(model, nn.Module):
        raise TypeError(
            f"forget: plan takes an nn.Sequential, an nn.ModuleList or list of blocks, or a "
            f"chain model (blocks, embed, step), got {type(model).__name__}; pass its list of "
            "blocks, p = forget.plan(model.layers, x, budget=...), and run them with "
            "p.apply(model.layers), a callable over the blocks"
        )
    if isinstance(model, Sequence | nn.ModuleList) and not isinstance(model, str | bytes):
        blocks = list(model)
        for i, block in enumerate(blocks):
            if not callable(block):
                raise TypeError(
                    f"forget: block {i} of the chain is not callable ({type(block).__name__})"
                )
        modules = [b for b in blocks if isinstance(b, nn.Module)]
        return _Target(blocks, modules, inputs, "callables", None, loss_fn)
    raise TypeError(
        "forget: plan takes an nn.Sequential, an nn.ModuleList or list of blocks, or a "
        f"chain model (blocks, embed, step), got {type(model).__name__}"
    )


def _parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def _cuda_devices(modules: Sequence[nn.Module], inputs: Sequence[Any]) -> list[int]:
    devices = {p.device for m in modules for p in m.parameters()}
    devices |= {x.device for x in inputs if isinstance(x, Tensor)}
    return sorted(d.index or 0 for d in devices if d.type == "cuda")


@contextlib.contextmanager
def untouched(target: _Target) -> Iterator[None]:
    """Run trial steps that leave no trace: RNG, buffers and ``.grad`` restored after."""
    params = _parameters(target.modules)
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for m in target.modules for b in m.buffers()]
    try:
        with torch.random.fork_rng(devices=_cuda_devices(target.modules, target.inputs)):
            yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def zero_grads(target: _Target) -> None:
    for p in _parameters(target.modules):
        p.grad = None


def _stage_names(target: _Target) -> list[str]:
    if target.kind == "block_model":
        return [f"blocks.{i}" for i in range(len(target.blocks))]
    if target.kind == "sequential":
        assert target.model is not None
        # Keys, not named_children(): that one lists a module used twice only once.
        return list(target.model._modules)
    return [
        f"{i}:{type(b).__name__ if isinstance(b, nn.Module) else getattr(b, '__name__', 'fn')}"
        for i, b in enumerate(target.blocks)
    ]


def _check_options(options: Mapping[str, object] | None) -> dict[str, Policy]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(
            "forget: options maps option names to policies, e.g. "
            f"{{'matmuls': forget.policies.save_outputs_of(*forget.policies.MATMUL)}}, "
            f"got {type(options).__name__}"
        )
    out: dict[str, Policy] = {}
    for name, value in options.items():
        policy = as_policy(value)  # type: ignore[arg-type]
        if policy is None:
            raise ValueError(f"forget: option {name!r} keeps nothing; that is 'forgotten' already")
        out[name] = policy
    return out
