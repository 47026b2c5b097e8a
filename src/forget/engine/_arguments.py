"""A region's arguments as a flat list and back: the re-run rebuilds them from the leaves.

NOTE [fast path]: a region flattens its arguments at every call, to find its
tensor inputs; pytree does it with several Python calls per argument. `flatten`
does the common calls by hand (plain leaves; keyword arguments and tuples or
lists of leaves, as a Hugging Face layer takes them) and hands the rest to
pytree.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

__all__ = ["flatten", "unflatten"]


# Argument types that are leaves of a pytree (NOTE [fast path]: no flattening cost).
_LEAVES = (torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None))
_LEAF_TYPES = frozenset(_LEAVES)


def flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """``pytree.tree_flatten((args, kwargs))``, flattened by hand for the common calls.

    With only leaf arguments the spec is ``None``; with keyword arguments, tuples
    or lists of leaves (a Hugging Face layer's ``position_embeddings``), it is a
    `_Shallow`, which `unflatten` reads as pytree would its spec, at a tenth of
    pytree's calls; anything deeper goes through pytree.
    """
    if not kwargs and _LEAF_TYPES.issuperset(map(type, args)):
        return list(args), None
    flat: list[Any] = []
    shapes: list[tuple[type, int] | None] = []
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind in _LEAVES:
            flat.append(value)
            shapes.append(None)
        elif kind is tuple or kind is list:
            for item in value:
                if type(item) not in _LEAVES:
                    return pytree.tree_flatten((args, kwargs))
            flat += value
            shapes.append((kind, len(value)))
        else:
            return pytree.tree_flatten((args, kwargs))
    return flat, _Shallow(len(args), tuple(kwargs), tuple(shapes))


class _Shallow(NamedTuple):
    """How `flatten` flattened arguments one level deep: the positional count, the
    keywords, and per argument ``None`` (a leaf) or the (tuple or list, length) of it."""

    positional: int
    keywords: tuple[str, ...]
    shapes: tuple[tuple[type, int] | None, ...]


def unflatten(flat: list[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if spec is None:
        return tuple(flat), {}
    if isinstance(spec, _Shallow):
        values, i = [], 0
        for shape in spec.shapes:
            if shape is None:
                values.append(flat[i])
                i += 1
            else:
                kind, n = shape
                values.append(kind(flat[i : i + n]))
                i += n
        return tuple(values[: spec.positional]), dict(
            zip(spec.keywords, values[spec.positional :], strict=True)
        )
    args, kwargs = pytree.tree_unflatten(flat, spec)
    return args, kwargs
