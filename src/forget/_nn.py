"""Module wrappers: `Forget` (one region) and `ForgetSequential` (a chain in segments)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from torch import nn

from ._engine import InTurn, run_region
from .policies import Policy, as_policy

__all__ = ["Forget", "ForgetSequential", "forget_sequential"]

_PREFIX = "module."


class Forget(nn.Module):
    """Wrap a module so that its forward runs as a forgotten region.

    The wrapper keeps only the inputs of the module for backward and re-runs
    the module once in backward; memory of the module's activations is traded
    for one more forward. ``state_dict()`` keys are those of the wrapped
    module, so checkpoints load either way.

    Args:
        module: the module to wrap.
        preserve_rng_state: replay RNG in the recomputation (dropout stays exact).
        policy: which op outputs to keep, recompute or offload (`forget.policies`);
            ``None`` keeps nothing.

    Example:
        >>> import torch, forget
        >>> block = forget.Forget(torch.nn.Linear(3, 3))
        >>> sorted(block.state_dict())
        ['bias', 'weight']
        >>> block(torch.randn(2, 3)).sum().backward()
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        preserve_rng_state: bool = True,
        policy: Policy | bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"forget: Forget wraps an nn.Module, got {type(module).__name__}.")
        self.module = module
        self.preserve_rng_state = preserve_rng_state
        self.policy = as_policy(policy)
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module as a forgotten region."""
        return run_region(
            self.module,
            args,
            kwargs,
            preserve_rng_state=self.preserve_rng_state,
            policy=self.policy,
        )


def _strip_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    inner = prefix + _PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_prefix(
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    inner = prefix + _PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


class ForgetSequential(nn.Sequential):
    """An ``nn.Sequential`` whose layers run in ``segments`` forgotten regions.

    Like ``torch.utils.checkpoint.checkpoint_sequential``, but a module: the
    layers keep their names (``state_dict`` keys equal the plain Sequential's),
    and each segment keeps only its input for backward. With ``segments``
    regions over ``n`` layers, activation memory drops to about the segment
    inputs plus one segment's activations, for one more forward.

    Args:
        modules: the layers, in order (an ``nn.Sequential`` or any iterable of modules).
        segments: number of contiguous regions, 1 <= segments <= number of layers.
    """

    def __init__(self, modules: Iterable[nn.Module], segments: int) -> None:
        if isinstance(modules, nn.Sequential):
            super().__init__(OrderedDict(modules.named_children()))  # keeps the names
        else:
            super().__init__(*modules)
        layers = list(self)
        if not isinstance(segments, int) or not 1 <= segments <= max(len(layers), 1):
            raise ValueError(
                f"forget: segments must be an int in [1, {len(layers)}] for {len(layers)} "
                f"layers, got {segments!r}."
            )
        self.segments = segments

    def _bounds(self) -> list[tuple[int, int]]:
        n = len(self)
        # Equal segments, the first ones one layer longer when n % segments != 0.
        size, extra = divmod(n, self.segments)
        bounds, start = [], 0
        for s in range(self.segments):
            end = start + size + (1 if s < extra else 0)
            bounds.append((start, end))
            start = end
        return bounds

    def forward(self, x: Any) -> Any:
        """Run the layers, each segment as a forgotten region."""
        layers = list(self)
        for start, end in self._bounds():
            segment = layers[start:end]
            name = "segment(" + ", ".join(type(m).__name__ for m in segment) + ")"
            x = run_region(InTurn(segment, name), (x,), {})
        return x


def forget_sequential(modules: Iterable[nn.Module], segments: int) -> ForgetSequential:
    """Return a `ForgetSequential` running ``modules`` in ``segments`` forgotten regions.

    Example:
        >>> import torch, forget
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> chained = forget.forget_sequential(net, segments=2)
        >>> chained(torch.randn(2, 4)).sum().backward()
    """
    return ForgetSequential(modules, segments)
