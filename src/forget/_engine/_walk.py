"""The modules under some roots, with their parameters and buffers: walked once, checked per call.

NOTE [cached walks]: a fast forward's guard (NOTE [fast path]) and a cap's step
(NOTE [the cap's count]) need at every call the modules under some roots, with
their parameters and buffers. ``Module.modules()`` costs a generator per module,
most of those calls' Python work, and the answer seldom changes. `ModuleWalks`
keeps the last walk and checks at each call that every slot of every walked
module's ``_parameters``, ``_buffers`` and ``_modules`` holds the very object
seen, by id and through a weak reference (a live referent with the id seen is
that object; a freed one fails), so the cache keeps nothing alive. Any change (a
buffer replaced by ``model.to(dtype)``, a submodule added) walks again. Only
slots are checked: callers read what changes in place (values, versions,
``p.data``, ``training``, ``grad``) at every call.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from ._storage import StorageKeyCache

__all__ = ["ModuleWalks"]

_call = operator.call
_dicts = operator.attrgetter("_parameters", "_buffers", "_modules")


class ModuleWalks:
    """The last walk of some roots' modules, checked and walked again at each `walk`."""

    __slots__ = ("_modules", "_root_ids", "_slot_ids", "_split", "_tensor_ids", "_tensors", "keys")

    def __init__(self) -> None:
        self._root_ids: list[int] | None = None
        self._modules: list[weakref.ref[nn.Module]] = []
        self._slot_ids: list[int] = []
        self._tensors: list[weakref.ref[torch.Tensor]] = []
        self._tensor_ids: list[int] = []
        self._split = 0  # parameters first, then buffers
        #: The storage keys of the walked parameters and buffers, kept as they are.
        self.keys = StorageKeyCache()

    def walk(
        self, roots: Sequence[nn.Module]
    ) -> tuple[list[nn.Module], list[torch.Tensor], list[torch.Tensor]]:
        """Every module under ``roots`` (each once, as ``Module.modules()`` orders
        them), their parameters and their buffers (each once, in that order)."""
        found = self._check(roots)
        if found is not None:
            return found
        modules: dict[int, nn.Module] = {}
        for root in roots:
            if id(root) not in modules:
                for sub in root.modules():
                    modules.setdefault(id(sub), sub)
        walked = list(modules.values())
        parameters = _unique(p for m in walked for p in m._parameters.values())
        buffers = _unique(b for m in walked for b in m._buffers.values())
        self._root_ids = [*map(id, roots)]
        self._modules = [*map(weakref.ref, walked)]
        self._slot_ids = _slot_ids(walked)
        self._tensors = [*map(weakref.ref, parameters), *map(weakref.ref, buffers)]
        self._tensor_ids = [*map(id, parameters), *map(id, buffers)]
        self._split = len(parameters)
        return walked, parameters, buffers

    def _check(
        self, roots: Sequence[nn.Module]
    ) -> tuple[list[nn.Module], list[torch.Tensor], list[torch.Tensor]] | None:
        if self._root_ids is None or [*map(id, roots)] != self._root_ids:
            return None
        modules: list[Any] = [*map(_call, self._modules)]
        if _slot_ids(modules) != self._slot_ids:  # a freed module reads as no walk
            return None
        tensors: list[Any] = [*map(_call, self._tensors)]
        if [*map(id, tensors)] != self._tensor_ids:
            return None
        return modules, tensors[: self._split], tensors[self._split :]


def _slot_ids(modules: Sequence[nn.Module | None]) -> list[int]:
    """The ids of the modules and of what each holds in its slots, in order (iterators
    all the way: no Python call per module, a tenth of a walk's time)."""
    if None in modules:
        return []  # a freed module: no walk matches
    slots = chain.from_iterable(map(dict.values, chain.from_iterable(map(_dicts, modules))))
    return [*map(id, modules), *map(id, slots)]


def _unique(tensors: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t is not None:
            seen.setdefault(id(t), t)
    return list(seen.values())
