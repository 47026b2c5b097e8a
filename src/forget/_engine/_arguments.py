"""A region's arguments as a flat list and back: the re-run rebuilds them from the leaves.

NOTE [fast path]: a region flattens its arguments at every call, to find its
tensor inputs; pytree does it with several Python calls per argument. `flatten`
does the common calls by hand (plain leaves; keyword arguments and tuples or
lists of leaves, as a Hugging Face layer takes them) and hands the rest to
pytree.
"""

from __future__ import annotations

import copy
import enum
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

__all__ = ["changing", "copy_structure", "flatten", "may_change", "tensors_in", "unflatten"]


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


# Values a function cannot change in place (NOTE [arguments that change]).
_IMMUTABLE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def may_change(leaf: Any) -> bool:
    """Whether ``leaf``, an argument that is no tensor, is an object a function may
    change in place (NOTE [arguments that change]). An object with no state of its
    own (a sentinel: ``object()``, an instance with nothing in it, an enum member) is
    not: it is passed as itself, so that ``is`` finds it in a re-run too."""
    if isinstance(leaf, (*_IMMUTABLE, torch.Tensor, torch.nn.Module, type, enum.Enum)):
        return False
    if callable(leaf):
        return False
    if isinstance(leaf, dict | list | set | bytearray):
        return True
    return bool(getattr(leaf, "__dict__", None)) or bool(getattr(type(leaf), "__slots__", ()))


def changing(flat: list[Any], spec: Any) -> list[int]:
    """The positions in ``flat`` of the arguments a function may change (NOTE [arguments
    that change]); none where `flatten` took its own path, which holds only leaves."""
    if spec is None or isinstance(spec, _Shallow):
        return []
    return [i for i, leaf in enumerate(flat) if may_change(leaf)]


def copy_structure(leaf: Any) -> Any:
    """A copy of ``leaf`` whose tensors and modules are shared, not copied.

    NOTE [arguments that change]: a function may change an argument that is no
    tensor: transformers passes one key/value cache (``past_key_values``, a
    ``DynamicCache``) to every attention layer, and each appends its keys and
    values to it. A region re-run on the very object would append once more
    (the cache the step returned holding them twice, and an attention that
    reads the whole cache differing from its forward), and the object, holding
    the region's outputs, would keep the region alive in a cycle through
    autograd's graph that the collector cannot see. So a region keeps, for its
    re-runs, a copy made before its forward, and each re-run gets a copy of
    that. A cache appends by binding a new tensor, so a copy of its structure
    keeps what the function found: no bytes. One that writes into its tensors
    in place (a static cache) is not kept so. An object that cannot be copied
    (a lock, a generator) is taken as it is.
    """
    memo = {id(obj): obj for obj in tensors_in(leaf, modules=True)}
    try:
        return copy.deepcopy(leaf, memo)
    except (TypeError, copy.Error):
        return leaf


def tensors_in(obj: Any, modules: bool = False) -> list[Any]:
    """The tensors ``obj`` holds, through containers and attributes, each once (and,
    with ``modules``, the modules it holds, not entered)."""
    found: list[Any] = []
    seen: set[int] = set()
    todo = [obj]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor) or (modules and isinstance(item, torch.nn.Module)):
            found.append(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo.extend(item)
        elif may_change(item):
            todo.extend(getattr(item, "__dict__", {}).values())
            slots = (n for c in type(item).__mro__ for n in getattr(c, "__slots__", ()))
            todo.extend(getattr(item, n) for n in slots if isinstance(n, str) and hasattr(item, n))
    return found
