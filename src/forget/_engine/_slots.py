"""What autograd holds in a region's place of a saved tensor (NOTE [how forget works]).

A `Slot` names the tensor's position in its region, which rebuilds it by re-running;
a `KeptSlot` holds it (kept by a policy, offloaded, or external to every running region).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._errors import ForgetError
from ._local import _packers
from ._offload import Offloaded

if TYPE_CHECKING:
    from ._region import Region

__all__ = [
    "DroppableSlot",
    "KeptSlot",
    "Slot",
    "external",
    "held",
    "ordinal",
    "region_name",
    "saved_meta",
]


def ordinal(n: int) -> str:
    """Spell ``n`` as an English ordinal: 1st, 2nd, 3rd, 4th, 11th, 12th, 21st, 111th."""
    teen = 10 <= n % 100 <= 20
    suffix = "th" if teen else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def external(t: torch.Tensor, key: tuple[torch.device, int]) -> bool:
    """Whether no region running in this thread made ``t``'s memory (inputs, parameters).

    ``key`` is ``t``'s storage key (`storage_key`), worked out once by the caller.
    """
    for tracker in _packers.trackers:
        if tracker.made(key):
            return False
    return t.numel() > 0  # asked last: most saved tensors are the region's own


class Slot:
    """What autograd holds in place of a saved tensor: a region and an index."""

    __slots__ = ("__weakref__", "index", "region")

    def __init__(self, region: Region, index: int) -> None:
        self.region = region
        self.index = index

    def rebuilt(self, keep_graph: bool) -> bool:
        """Whether unpacking it (under ``create_graph`` if ``keep_graph``) re-runs the region."""
        return True


class KeptSlot(Slot):
    """A saved tensor the region keeps: policy-kept (on the device, or offloaded) or external.

    NOTE [external tensors]: a saved tensor whose memory no running region made
    (a region input, a parameter, a view of one) is alive anyway, so keeping it costs
    nothing and spares a recomputation; its version is checked at unpack, as
    autograd checks the tensors it saves.

    NOTE [saved identity]: such a tensor is kept as the very object autograd
    saved, so a custom ``autograd.Function`` gets back what it saved (``saved is
    b``), as under torch's checkpoint. Its history, if any, lies before the region
    (no running region made it), so holding it makes no cycle through the graph,
    as autograd's own saved inputs make none. Under ``create_graph`` it is still
    itself: its own history carries second derivatives, so it is never rebuilt,
    and a region that differentiates with ``create_graph`` inside its forward
    does not re-run itself there to rebuild its inputs.
    """

    __slots__ = ("value", "version")

    def __init__(
        self,
        region: Region,
        index: int,
        value: torch.Tensor | Offloaded,
        version: int | None = None,
    ) -> None:
        super().__init__(region, index)
        self.value = value
        self.version = version

    def rebuilt(self, keep_graph: bool) -> bool:
        # A policy-kept op output is rebuilt under create_graph, for its history; an
        # external tensor never: it is itself (NOTE [saved identity]).
        return keep_graph and self.version is None

    def get(self) -> torch.Tensor:
        if isinstance(self.value, Offloaded):
            self.region.prefetch_offloaded()
            return self.value.fetch()
        if self.version is not None and self.value._version != self.version:
            raise ForgetError(
                f"forget: a tensor of shape {list(self.value.shape)} that "
                f"{region_name(self.region.func)} saved for backward was modified in place after "
                f"the forward (version {self.version} -> {self.value._version}); gradients "
                "would be wrong. Modify it after backward, or clone it before."
            )
        return self.value


class DroppableSlot(Slot):
    """A saved tensor a droppable region made, held until the region is dropped
    (NOTE [droppable regions])."""

    __slots__ = ("value", "version")

    def __init__(self, region: Region, index: int, value: torch.Tensor) -> None:
        self.region = region  # Slot's fields set here: one call less per saved tensor
        self.index = index
        self.value: torch.Tensor | None = value
        self.version = value._version

    def rebuilt(self, keep_graph: bool) -> bool:
        return keep_graph or self.value is None


def held(slot: DroppableSlot) -> torch.Tensor:
    """The tensor a held slot holds, checked against in-place writes as autograd checks."""
    value = slot.value
    assert value is not None
    if value._version != slot.version:
        raise ForgetError(
            f"forget: a tensor of shape {list(value.shape)} that "
            f"{region_name(slot.region.func)} saved for backward was modified in place "
            f"after it was saved (version {slot.version} -> {value._version}); "
            "gradients would be wrong, as autograd says of a plain run. Modify a "
            "clone instead."
        )
    return value


def saved_meta(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
    return (t.shape, t.dtype, t.device)  # a torch.Size is a tuple, and immutable


def region_name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or type(func).__name__
    return f"'{name}'"
