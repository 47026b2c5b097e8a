"""What `measure` and `saved` return: frozen reports of exact bytes.

NOTE [end of forward]: ``saved_bytes`` is the live total just before the first op
that runs under an autograd graph task (``torch._C._current_graph_task_id()`` is
not -1), i.e. when the engine starts the first backward of the call. Everything
the forward left alive counts: tensors saved for backward, the inputs a
rematerialized region keeps, the forward's outputs (the loss), and the seed
gradient ``backward()`` makes before the engine starts (``ones_like(loss)``).
`saved` lists those tensors one by one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch


def _empty() -> Mapping[str, int]:
    return MappingProxyType({})


@dataclass(frozen=True)
class RegionStats:
    """Memory seen inside a `region` (all its entries together), in bytes.

    Attributes:
        name: the region's name.
        entries: how many times the region was entered.
        peak_bytes: the highest live total of the call reached while the region
            was open (the whole call's live memory, not only the region's own).
        allocated_bytes: bytes of storages created while the region was open.
        kept_bytes: bytes of those still alive when the region closed (in a
            forward: what the region leaves for backward and its outputs).
    """

    name: str
    entries: int
    peak_bytes: int
    allocated_bytes: int
    kept_bytes: int


@dataclass(frozen=True)
class MemoryReport:
    """What a call allocated, in bytes of tensor storage (deduplicated by storage).

    Only storages created inside the call count; parameters, inputs and views of
    them do not.

    Attributes:
        peak_bytes: the highest live total during the call.
        saved_bytes: the live total when the first backward of the call started
            (NOTE [end of forward]), or at the end of the call when no backward ran;
            ``None`` where the probe cannot tell (``probe="cuda"``).
        end_bytes: the live total when the call returned (its result included).
        forward_peak_bytes: the peak over ops run outside backward (forward, and
            anything after backward such as an optimizer step); ``None`` where the
            probe cannot tell.
        backward_peak_bytes: the peak over ops run by the autograd engine
            (recomputation included); 0 when no backward ran, ``None`` where the
            probe cannot tell.
        device_peak_bytes: device type (``"cpu"``, ``"cuda"``) -> peak of that
            device's live total (each device's own peak).
        device_saved_bytes: device type -> its share of ``saved_bytes``.
        device_end_bytes: device type -> its share of ``end_bytes``.
        regions: region name -> `RegionStats` (ledger probe only).
        backward_ran: whether the autograd engine ran during the call.
        probe: which probe measured: ``"ledger"``, ``"profiler"`` or ``"cuda"``.
        result: what the callable returned.
    """

    peak_bytes: int
    saved_bytes: int | None
    end_bytes: int
    forward_peak_bytes: int | None
    backward_peak_bytes: int | None
    device_peak_bytes: Mapping[str, int] = field(default_factory=_empty)
    device_saved_bytes: Mapping[str, int] = field(default_factory=_empty)
    device_end_bytes: Mapping[str, int] = field(default_factory=_empty)
    regions: Mapping[str, RegionStats] = field(default_factory=dict)
    backward_ran: bool = False
    probe: str = "ledger"
    result: Any = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        def fmt(v: int | None) -> str:
            return "-" if v is None else f"{v:,}"

        rows = [
            ("peak_bytes", fmt(self.peak_bytes)),
            ("saved_bytes", fmt(self.saved_bytes)),
            ("end_bytes", fmt(self.end_bytes)),
            ("forward_peak_bytes", fmt(self.forward_peak_bytes)),
            ("backward_peak_bytes", fmt(self.backward_peak_bytes)),
        ]
        for dev, v in sorted(self.device_peak_bytes.items()):
            rows.append((f"peak_bytes[{dev}]", fmt(v)))
        width = max(len(k) for k, _ in rows)
        vwidth = max(len(v) for _, v in rows)
        lines = [f"MemoryReport (probe={self.probe})"]
        lines += [f"  {k:<{width}}  {v:>{vwidth}}" for k, v in rows]
        if self.regions:
            lines.append("  regions (entries, peak, allocated, kept bytes):")
            for r in self.regions.values():
                lines.append(
                    f"    {r.name}: {r.entries}, {r.peak_bytes:,}, {r.allocated_bytes:,}, "
                    f"{r.kept_bytes:,}"
                )
        return "\n".join(lines)


# -- saved(): what a function keeps for backward ---------------------------------


@dataclass(frozen=True)
class SavedTensor:
    """One storage a function keeps for backward.

    Attributes:
        source: where its memory came from: the op that made it (``"aten.exp"``),
            ``"input 0"``, ``"input 'name'"``, ``"parameter fc.weight"``,
            ``"buffer bn.running_mean"``, or ``"external"`` (made before the call).
        how: ``"saved"`` (autograd saved it, through the outermost saved-tensor
            hook) or ``"kept"`` (alive at return though not saved that way: the
            inputs a `forget.forget` or ``torch.utils.checkpoint`` region keeps).
        shape: shape of the first tensor seen on this storage.
        dtype: its dtype.
        device: its device, as a string.
        nbytes: bytes of the storage.
        count: how many saved tensors share the storage (0 for kept ones).
        external: whether the memory predates the call (inputs, parameters).
    """

    source: str
    how: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    nbytes: int
    count: int
    external: bool


@dataclass(frozen=True)
class SavedReport:
    """What a function keeps for backward, one row per storage.

    Attributes:
        tensors: the rows, in the order first saved (kept ones last).
        total_bytes: bytes of the rows made inside the call (inputs and
            parameters excluded: they are alive anyway).
        external_bytes: bytes of the rows that predate the call.
    """

    tensors: tuple[SavedTensor, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if not t.external)

    @property
    def external_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.external)

    def __str__(self) -> str:
        header = ("source", "how", "shape", "dtype", "device", "bytes", "saves")
        rows = [
            (
                t.source,
                t.how,
                str(list(t.shape)),
                str(t.dtype).removeprefix("torch."),
                t.device,
                f"{t.nbytes:,}",
                str(t.count),
            )
            for t in self.tensors
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        right = {5, 6}

        def line(r: tuple[str, ...]) -> str:
            cells = [
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            return "  ".join(cells).rstrip()

        out = [line(header), line(tuple("-" * w for w in widths))]
        out += [line(r) for r in rows]
        out.append(
            f"total {self.total_bytes:,} bytes made in the call "
            f"(+ {self.external_bytes:,} bytes of inputs and parameters)"
        )
        return "\n".join(out)
