"""What a planning trial touches, restored after it; and a plan's options, checked."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..policies import Policy, as_policy


@dataclass(frozen=True)
class _Target:
    """What a trial step touches: the modules (parameters, buffers) and the inputs."""

    modules: Sequence[nn.Module]
    inputs: tuple[Any, ...]


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
