"""Offload of kept tensors to host memory, with asynchronous copies on CUDA.

NOTE [offload]: on CUDA, a tensor chosen for offload is copied to pinned host
memory on a side stream, ordered after the work that produced it by an event,
so the copy overlaps the rest of the forward. Bringing it back is also issued
on the side stream; the compute stream waits on an event before first use, and
a region prefetches all of its offloaded tensors at its first fetch. On CPU
there is no device memory to free, so offload keeps the tensor where it is
and says so once.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..policies import Action

__all__ = ["Offloaded", "fetch_kept", "offload", "offload_kept"]

_warned_cpu = False
_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    stream = _streams.get(device)
    if stream is None:
        stream = torch.cuda.Stream(device=device)
        _streams[device] = stream
    return stream


def warn_cpu_once() -> None:
    """Warn, once per process, that offload on CPU keeps tensors in place."""
    global _warned_cpu
    if not _warned_cpu:
        _warned_cpu = True
        warnings.warn(
            "forget: offload of CPU tensors is a no-op (they are already in host memory); "
            "the tensors are kept as a 'save' policy would keep them.",
            UserWarning,
            stacklevel=3,
        )


class Offloaded:
    """A tensor kept in host memory, and how to bring it back."""

    __slots__ = ("_back", "_back_event", "_event", "device", "host", "shape")

    def __init__(self, t: torch.Tensor) -> None:
        self.device = t.device
        self.shape = tuple(t.shape)
        self._back: torch.Tensor | None = None
        self._back_event: Any = None
        self._event: Any
        if t.device.type == "cuda":
            stream = _side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
                    t.detach(), non_blocking=True
                )
                t.record_stream(stream)  # keep t's memory until the copy is done
                self._event = torch.cuda.Event()
                self._event.record(stream)
        else:
            warn_cpu_once()
            self.host = t.detach()
            self._event = None

    def prefetch(self) -> None:
        """Start copying the tensor back to its device (no-op on CPU)."""
        if self._event is None or self._back is not None:
            return
        stream = _side_stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self._event)
            self._back = self.host.to(self.device, non_blocking=True)
            self._back_event = torch.cuda.Event()
            self._back_event.record(stream)

    def fetch(self) -> torch.Tensor:
        """Return the tensor on its device, waiting for the copy back if needed."""
        if self._event is None:
            return self.host
        self.prefetch()
        assert self._back is not None
        torch.cuda.current_stream(self.device).wait_event(self._back_event)
        back = self._back
        back.record_stream(torch.cuda.current_stream(self.device))
        self._back = None  # the caller owns it now; a later fetch copies again
        return back


def offload(t: torch.Tensor) -> Offloaded:
    """Move ``t`` to host memory (asynchronously on CUDA)."""
    return Offloaded(t)


def offload_kept(kept: dict[int, tuple[str, Any, Any]]) -> dict[int, tuple[str, Any, Any]]:
    """Move the kept outputs of offloading ops to host memory (device tensors only)."""
    out = {}
    for position, (name, outputs, action) in kept.items():
        if action is Action.OFFLOAD:
            outputs = pytree.tree_map(
                lambda t: offload(t) if isinstance(t, torch.Tensor) and t.is_cuda else t,
                outputs,
            )
        out[position] = (name, outputs, action)
    return out


def fetch_kept(kept: dict[int, tuple[str, Any, Any]]) -> dict[int, tuple[str, Any, Any]]:
    """The kept outputs, offloaded ones brought back, for a recomputation to replay."""
    return {
        position: (
            name,
            pytree.tree_map(lambda v: v.fetch() if isinstance(v, Offloaded) else v, outputs),
            action,
        )
        for position, (name, outputs, action) in kept.items()
    }
