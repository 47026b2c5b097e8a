"""A policy's replay: the op outputs and random draws a policy keeps, and their bits."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from .._errors import RecomputationMismatchError
from ._local import hidden
from ._ops import _draw_into, _OpInfo
from ._storage import StorageKey, storage_key


def _generator(
    where: torch.Tensor | list[torch.Tensor], kwargs: dict[str, Any]
) -> torch.Generator | None:
    """The generator a random op draws from: its ``generator=``, or the default one of
    CPU or CUDA; None if not known."""
    if kwargs.get("generator") is not None:
        return kwargs["generator"]
    tensors = [where] if isinstance(where, torch.Tensor) else where
    if not tensors:
        return None
    device = tensors[0].device
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


class _KeptDraw:
    """The values an in-place random op wrote, kept to be written again in the re-run.

    NOTE [kept draws]: a policy may keep a random draw. The forward notes the
    generator's state right after the draw; the re-run writes the kept values
    into the op's target instead of drawing, and sets the generator to that
    state, so every op after it draws what it drew in the forward. ``bernoulli_``
    (dropout's mask on CPU) draws only 0 and 1: kept as bits, 1/32 of float32.
    Other in-place draws keep a copy. A blank (nothing reads the values) writes
    nothing.
    """

    __slots__ = ("bits", "values")

    def __init__(self, func: Any, target: torch.Tensor | None) -> None:
        self.values: torch.Tensor | None = None
        self.bits: torch.Tensor | None = None
        if target is None:
            return
        with hidden(), torch.no_grad():
            if func._schema.name == "aten::bernoulli_":
                self.bits = _pack_bits(target)
            else:
                self.values = target.detach().clone()

    @property
    def nbytes(self) -> int:
        kept = self.bits if self.bits is not None else self.values
        return 0 if kept is None else kept.untyped_storage().nbytes()

    def blank(self) -> _KeptDraw:
        return _KeptDraw(None, None)

    def replay(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        into = _draw_into(func)
        assert into is not None
        target = args[into]
        with hidden(), torch.no_grad():
            if self.bits is not None:
                _unpack_bits_into(self.bits, target)
            elif self.values is not None:
                target.copy_(self.values)
        return target


# Multiplying eight 0/1 bytes, read as one little-endian int64, by this gathers
# byte k's bit at bit 56 + k, with no carries between the partial products.
_GATHER = 0x0102040810204080


def _pack_bits(t: torch.Tensor) -> torch.Tensor:
    """Pack a tensor of zeros and ones into uint8, eight elements a byte, in logical order."""
    flat = t.reshape(-1) != 0
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if sys.byteorder == "little":
        words = flat.view(torch.uint8).view(torch.int64)
        return ((words * _GATHER) >> 56).to(torch.uint8)
    b = flat.view(-1, 8).view(torch.uint8)
    packed = b[:, 0].clone()
    for i in range(1, 8):
        packed |= b[:, i] << i
    return packed


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The uint8 zeros and ones `_pack_bits` packed, ``numel`` of them."""
    shifts = _SHIFTS.get(packed.device)
    if shifts is None:
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        _SHIFTS[packed.device] = shifts
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:numel]


def _unpack_bits_into(packed: torch.Tensor, target: torch.Tensor) -> None:
    """Write the zeros and ones `_pack_bits` packed into ``target``, in its dtype.

    A contiguous target of whole bytes is filled by one lookup in a 256 x 8
    table of every byte's eight values (faster on CPU than unpacking by
    shifts); any other target by shifts and a copy.
    """
    numel = target.numel()
    if target.is_contiguous() and numel % 8 == 0 and numel:
        key = (target.dtype, target.device)
        table = _TABLES.get(key)
        if table is None:
            table = _unpack_bits(
                torch.arange(256, dtype=torch.uint8, device=target.device), 256 * 8
            ).view(256, 8)
            table = table.to(target.dtype)
            _TABLES[key] = table
        torch.index_select(table, 0, packed.long(), out=target.view(-1, 8))
        return
    target.copy_(_unpack_bits(packed, numel).view(target.shape))


class _ReplayMismatch(RecomputationMismatchError):
    def __init__(self, kept: str, now: str, position: int) -> None:
        super().__init__(
            f"forget: the recomputation ran {now} as op {position + 1} where the forward ran "
            f"{kept}, whose output the policy kept; the function must run the same ops both "
            "times."
        )


def _fresh_aliases(outputs: Any) -> Any:
    """Detached aliases of the tensors in an op's outputs (new objects, same memory)."""
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
    return outputs


class Blank:
    """Shape, strides, dtype and device of a kept output nothing will read."""

    __slots__ = ("device", "dtype", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride = tuple(t.shape), tuple(t.stride())
        self.dtype, self.device = t.dtype, t.device

    def fill(self) -> torch.Tensor:
        """An uninitialized tensor of this layout (NOTE [unneeded kept outputs])."""
        with hidden():
            return torch.empty_strided(
                self.shape, self.stride, dtype=self.dtype, device=self.device
            )


def _filled(outputs: Any) -> Any:
    """Outputs with each `Blank` made a tensor, at the moment its op is replayed."""
    if isinstance(outputs, Blank):
        return outputs.fill()
    if isinstance(outputs, (list, tuple)) and any(isinstance(o, Blank) for o in outputs):
        return type(outputs)(o.fill() if isinstance(o, Blank) else o for o in outputs)
    return outputs


def _blanks(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return Blank(outputs)
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(Blank(o) if isinstance(o, torch.Tensor) else o for o in outputs)
    return outputs


def _clones(outputs: Any) -> Any:
    with torch.no_grad():
        if isinstance(outputs, torch.Tensor):
            return outputs.detach().clone()
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(
                o.detach().clone() if isinstance(o, torch.Tensor) else o for o in outputs
            )
        return outputs


_SHIFTS: dict[torch.device, torch.Tensor] = {}


_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


class PolicyReplay:
    """What a `StateTracker` does for a policy: keep op outputs and draws, drop the unneeded.

    NOTE [policy replay] (in `StateTracker`): the forward keeps the outputs of the
    ops the policy saves; the re-run replays them. This mixin holds that part of
    the tracker; the tracker's ``__init__`` sets the attributes declared here.
    """

    _created: set[StorageKey]
    _decide: Callable[[str, int], Any] | None
    _draw_readers: dict[int, set[int]]
    _inputs: dict[int, set[StorageKey]]
    _kept_keys: dict[int, set[StorageKey]]
    _replay: dict[int, tuple[str, Any, Any]] | None
    _seeded: list[int]
    _seen: set[tuple[Any, ...]]
    draw_states: dict[int, tuple[torch.Generator, torch.Tensor]]
    drawn_storages: dict[StorageKey, int]
    kept: dict[int, tuple[str, Any, Any]]
    kept_storages: dict[StorageKey, Any]
    packed: set[StorageKey]
    packed_draws: set[int]
    snapshots: list[tuple[torch.Tensor, torch.Tensor]]

    def _keep(
        self,
        position: int,
        info: _OpInfo,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        tensors: list[torch.Tensor],
    ) -> None:
        """Keep an op's outputs if the policy says so; ``tensors`` empty: an in-place draw."""
        assert self._decide is not None
        into = info.draw_into if not tensors else None
        target = args[into] if into is not None and into < len(args) else None
        generator = None
        if info.seeded:
            generator = _generator(target if target is not None else tensors, kwargs)
            if generator is None:
                return  # a device whose generator we do not know: drawn again
        measured = tensors if target is None else [target]
        nbytes = sum(t.untyped_storage().nbytes() for t in measured)
        action = self._decide(info.name, nbytes)
        if action.value == "recompute":
            return
        if generator is not None:
            with hidden():
                self.draw_states[position] = (generator, generator.get_state())
        if target is not None:
            # NOTE [kept draws]: its own copy (bits for bernoulli_), not the target's
            # memory, which later ops may write into (dropout's div_) and autograd saves;
            # those saves are rebuilt by the re-run from the replayed values.
            self.kept[position] = (info.name, _KeptDraw(info.op, target), action)
            self.drawn_storages[storage_key(target)] = position
            self._inputs.pop(position, None)
            self._draw_readers.pop(position, None)
            return
        self.kept[position] = (info.name, _fresh_aliases(out), action)
        self._kept_keys[position] = {storage_key(t) for t in tensors}
        self._inputs.pop(position, None)  # replayed, not re-run: reads nothing
        self._draw_readers.pop(position, None)
        for t in tensors:
            self.kept_storages[storage_key(t)] = action

    def prune_draw_states(self) -> None:
        """Keep only the generator states a re-run needs.

        NOTE [kept draws]: the state after a kept draw is needed only if a random op
        that is drawn again (not kept) follows it before the next kept draw. Call
        once, after the forward.
        """
        needed: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        for here, after in zip(self._seeded, [*self._seeded[1:], None], strict=True):
            state = self.draw_states.get(here)
            if state is not None and after is not None and after not in self.draw_states:
                needed[here] = state
        self.draw_states = needed

    def drop_unneeded_kept(self, stop: int | None = None) -> int:
        """Replace kept outputs that nothing will read by blanks; return the bytes freed.

        NOTE [unneeded kept outputs]: a policy keeps op outputs so that the re-run
        replays them instead of running their ops. A kept output is needed only if
        backward reads it (autograd packed its storage: ``packed``) or an op that
        will re-run reads its values (a view or ``empty_like`` reads none). Walking
        the ops backwards settles this in one pass, since an op reads only what
        earlier ops made. An unneeded one (a block's last matmul, whose output only
        the next block reads; under ``save_everything`` most outputs autograd does
        not save) is replayed as an uninitialized tensor of its shape, which nothing
        reads: without this a policy could keep more than the plain run saves. Ops
        at ``stop`` and after it never run again (NOTE [early stop]), so what they
        read is not needed. Kept draws are settled by position (NOTE [kept draws]).
        Call once, after the forward, when ``packed`` holds every kept storage the
        forward's pack saw.
        """
        needed = set(self.packed)
        draws = set(self.packed_draws)
        freed = 0
        for position in sorted(set(self._inputs) | set(self.kept), reverse=True):
            if stop is not None and position >= stop and position not in self.kept:
                continue
            if position in self.kept:
                name, outputs, action = self.kept[position]
                if isinstance(outputs, _KeptDraw):
                    if position not in draws:
                        freed += outputs.nbytes
                        self.kept[position] = (name, outputs.blank(), action)
                elif not self._kept_keys[position] & needed:
                    freed += sum(t.untyped_storage().nbytes() for t in _tensors(outputs))
                    self.kept[position] = (name, _blanks(outputs), action)
            else:
                needed |= self._inputs[position]
                draws |= self._draw_readers.get(position, set())
        self._inputs, self._kept_keys, self.kept_storages = {}, {}, {}
        self.drawn_storages, self.packed_draws, self._draw_readers = {}, set(), {}
        return freed

    def _copy_kept_before_write(self, t: torch.Tensor) -> None:
        """Copy on write: a kept or replayed output is about to be written into."""
        key = storage_key(t)
        for table in (self.kept, self._replay or {}):
            for position, (name, outputs, action) in list(table.items()):
                if any(storage_key(o) == key for o in _tensors(outputs)):
                    table[position] = (name, _clones(outputs), action)
