"""Storage identity: one helper for "which memory does this tensor use".

The engine asks whether two tensors share memory (a saved tensor an op of the
region made, an argument an op wrote into) by `storage_key`, the device and
address of the tensor's storage: cheap, and equal for every view of one
storage. A tensor with no storage of its own (a wrapper subclass made with
``_make_wrapper_subclass``, as DTensor, float8 and NF4 tensors are; a meta or
fake tensor) has no address to compare: its key is the object itself, so only
the very same tensor matches it, which can only err towards keeping a tensor
the region made (memory, never exactness). The ledger follows a storage
*object* (its records must survive a ``resize_``, which moves the address), so
it keys by the object `storage_of` returns; torch keeps one Python object per
live storage.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "StorageKey",
    "StorageKeyCache",
    "storage_key",
    "storage_keys",
    "storage_of",
    "view_key",
]

#: ``(device, address)`` of a storage, or ``(device, "object", id)`` of a tensor
#: without one: the two shapes never compare equal.
StorageKey = tuple[Any, ...]

#: Tensor types with a storage of their own and no ``__torch_dispatch__`` to run.
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def storage_of(t: Any) -> torch.UntypedStorage | None:
    """The storage of a dense tensor, or ``None`` (sparse, meta, storage-less subclass)."""
    if type(t) in PLAIN_TYPES:  # the common type, asked without a call
        return t.untyped_storage() if t.layout == torch.strided and not t.is_meta else None
    if isinstance(t, torch.UntypedStorage):
        return None if t.device.type == "meta" else t
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_key(t: torch.Tensor) -> StorageKey:
    """The device and address of ``t``'s storage: equal for every view of one storage.

    A tensor without a storage of its own is keyed by the object itself.
    """
    if type(t) in PLAIN_TYPES:
        return (t.device, t.untyped_storage().data_ptr())
    s = storage_of(t)
    if s is not None and s.device.type != "meta":  # a fake tensor's storage is meta
        try:
            return (t.device, s.data_ptr())
        except RuntimeError:  # a wrapper whose storage is a placeholder
            pass
    return (t.device, "object", id(t))


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[StorageKey]:
    """The `storage_key` of each tensor with elements: a guard's or a step's set of
    what is outside, made at every call (the common type's key inlined)."""
    return {
        (t.device, t.untyped_storage().data_ptr()) if type(t) in PLAIN_TYPES else storage_key(t)
        for t in tensors
        if t.numel()
    }


class StorageKeyCache:
    """`storage_keys` of the same tensors call after call (a site's parameters and
    buffers, NOTE [cached walks]), worked out again only when one of them changed.

    Each call reads, for every tensor, its id, its data pointer and its element
    count, three passes that make no Python call per tensor; the keys are reused
    while all three are as before. A parameter whose ``data`` was swapped keeps
    its id, but its data pointer moves with the storage. The one miss, a new
    storage whose view starts at the very address of the freed old one, gives a
    key no live storage has, and leaves the new storage out of the set: its
    tensor, saved, counts as the region's own, which costs memory, never a value
    (the re-run reads it again, as a global's). Subclasses (whose data pointer
    may not exist) are keyed afresh at every call.
    """

    __slots__ = ("_keys", "_seen")

    def __init__(self) -> None:
        self._seen: list[int] | None = None
        self._keys: set[StorageKey] = set()

    def keys(self, tensors: list[torch.Tensor]) -> set[StorageKey]:
        """`storage_keys` of ``tensors`` (do not change the set returned)."""
        if not _ALL_PLAIN.issuperset(map(type, tensors)):
            return storage_keys(tensors)
        seen = [*map(id, tensors), *map(_data_ptr, tensors), *map(_numel, tensors)]
        if seen != self._seen:
            self._seen, self._keys = seen, storage_keys(tensors)
        return self._keys


_ALL_PLAIN = frozenset(PLAIN_TYPES)
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel


def view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """`storage_key` plus the view's offset, shape and stride: equal for the same view."""
    return (*storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
