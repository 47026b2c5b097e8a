"""`apply_forget`: wrap the matching submodules of a model in `Forget`, in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

from ._nn import Forget
from .policies import Policy

__all__ = ["apply_forget"]

M = TypeVar("M", bound=nn.Module)

CheckFn = Callable[[nn.Module], bool] | type | tuple[type, ...]


def apply_forget(
    model: M,
    check_fn: CheckFn,
    *,
    policy: Policy | bool | None = None,
    preserve_rng_state: bool = True,
) -> M:
    """Replace, in place, every outermost submodule matching ``check_fn`` by a `Forget` of it.

    Each wrapped submodule keeps only its inputs for backward and runs its
    forward once more in backward: the activations inside the matching blocks
    are traded for one extra forward of each. Match whole blocks (a
    transformer layer, a residual block), not single layers, so that one
    input stands for many activations.

    The walk goes from the root down and stops at a match, so a match inside
    a match is left alone (its activations are already forgotten by the outer
    region). The root itself is never replaced, even when it matches (wrap it
    with `Forget` yourself for that): the caller keeps the object it passed.
    A module that is already a `Forget` is neither wrapped again nor entered,
    so applying twice changes nothing. ``state_dict()`` keys stay those of
    the plain model (`Forget` adds no prefix), so checkpoints load either way.
    A submodule shared by several parents gets one wrapper, shared alike.

    Args:
        model: the model to change, in place.
        check_fn: which submodules to wrap: a callable ``module -> bool``, or a
            class or tuple of classes (matched with ``isinstance``).
        policy: passed to each `Forget` (`forget.policies`); ``None`` keeps nothing.
        preserve_rng_state: passed to each `Forget` (dropout stays exact).

    Returns:
        ``model`` itself, changed.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``check_fn`` is neither
            callable nor a class or non-empty tuple of classes.

    Example:
        >>> import torch, forget
        >>> from torch import nn
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
        >>> keys = list(net.state_dict())
        >>> net = forget.apply_forget(net, nn.Sequential)
        >>> [type(block).__name__ for block in net]
        ['Forget', 'Forget', 'Forget']
        >>> list(net.state_dict()) == keys
        True
        >>> net(torch.randn(2, 4)).sum().backward()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"forget: apply_forget changes an nn.Module, got {type(model).__name__}; "
            "pass the model itself."
        )
    matches = _as_predicate(check_fn)
    wrappers: dict[int, Forget] = {}  # id of a wrapped module -> its one wrapper

    def walk(parent: nn.Module) -> None:
        # Not named_children(): it yields a shared module once, under its first name only.
        for name, child in list(parent._modules.items()):
            if child is None or isinstance(child, Forget):
                continue
            wrapper = wrappers.get(id(child))
            if wrapper is None and matches(child):
                wrapper = Forget(child, preserve_rng_state=preserve_rng_state, policy=policy)
                wrappers[id(child)] = wrapper
            if wrapper is not None:
                setattr(parent, name, wrapper)
            else:
                walk(child)

    if not isinstance(model, Forget):
        walk(model)
    return model


def _as_predicate(check_fn: CheckFn) -> Callable[[nn.Module], bool]:
    """Turn a class, a tuple of classes or a callable into a ``module -> bool``."""
    if isinstance(check_fn, type):
        cls = check_fn
        return lambda module: isinstance(module, cls)
    if isinstance(check_fn, tuple):
        if check_fn and all(isinstance(c, type) for c in check_fn):
            classes = check_fn
            return lambda module: isinstance(module, classes)
        got = ", ".join(type(c).__name__ for c in check_fn) or "nothing"
        raise TypeError(
            f"forget: apply_forget's check_fn as a tuple must hold classes, got a tuple of "
            f"({got}); a tuple is matched with isinstance. Pass classes such as "
            "(nn.TransformerEncoderLayer,), or a callable module -> bool."
        )
    if callable(check_fn):
        return check_fn
    raise TypeError(
        f"forget: apply_forget's check_fn must be a callable module -> bool, a class or a "
        f"tuple of classes, got {type(check_fn).__name__}; it decides which submodules "
        "to wrap. Pass e.g. nn.TransformerEncoderLayer or lambda m: isinstance(m, Block)."
    )
