"""The tensors in a step's inputs and outputs, and a call as its backward ends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._engine import StorageKey, storage_key, storage_of

__all__ = ["on_backward_end", "tensor_bytes", "tensors_in"]


def on_backward_end(out: Any, callback: Callable[[], None]) -> None:
    """Call ``callback`` as the backward through ``out`` (its first tensor that requires
    grad) ends: a hook on it queues the callback on autograd's engine."""
    grad = next((t for t in tensors_in(out) if t.requires_grad), None)
    if grad is not None:
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        grad.register_hook(lambda _: engine.queue_callback(callback))


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree``: tuples, lists and dicts walked (a Hugging Face
    ``ModelOutput`` is a dict)."""
    found, todo = [], [tree]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, tuple | list):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
    return found


def tensor_bytes(out: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``out``."""
    seen: dict[StorageKey, int] = {}
    for t in tensors_in(out):
        if (s := storage_of(t)) is not None:
            seen[storage_key(t)] = s.nbytes()
    return sum(seen.values())
