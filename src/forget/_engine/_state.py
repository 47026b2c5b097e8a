"""Buffers that a forward mutates in place, restored around recomputation.

NOTE [state tracking]: a forgotten region runs twice, so outside state it
mutates in place (BatchNorm's running statistics, spectral norm's vector, a
user's counter) would be updated twice, the re-run starting from what the
forward left. A dispatch mode watches the region: an op writing into a tensor
whose storage the region did not make writes external state, copied once before
its first write. Before the re-run the pre-forward values go back, so it sees
what the forward saw; after it, the forward's values, so the step leaves every
module as a plain step does. Writes go through ``.data`` (shared storage, not
the version counter), invisible to autograd's in-place checks. It is general,
knowing nothing of BatchNorm, and it also notes whether the region drew random
numbers, so RNG state is kept only where needed.

NOTE [write-only state]: a counter such as BatchNorm's ``num_batches_tracked``
is only ever updated in place (``add_``), never read by another op of the
region. The re-run needs neither its pre-forward value nor its own update,
so the forward keeps no copy of it: a re-run under a tracker skips such
updates (the value the forward left is already in place); a re-run without
one (NOTE [plain re-run]) copies it only while the module that owns it runs,
and puts it back. So a region holds no byte more than torch's checkpoint
between its forward and its re-run, and torch's updates it twice. Running
statistics of a batch norm in training are write-only too (NOTE [write-only
statistics]). The forward notes, for every
op, which external storages it reads (a read before the first write counts:
``y = x * counter; counter.add_(1)`` keeps its copy); a tensor written only
by non-random ops whose every result is the written tensor itself, one
tensor per op, and read by nothing else, is write-only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._local import _hiding, hidden
from ._ops import _TRAINING_ARG, _op_info, _without_stats
from ._selective import (
    PolicyReplay,
    _filled,
    _fresh_aliases,
    _KeptDraw,
    _ReplayMismatch,
    _tensors,
)
from ._storage import PLAIN_TYPES, storage_key, view_key

__all__ = [
    "StateTracker",
    "StopRecomputation",
    "current_values",
    "detached",
    "dispatch_modes",
    "restore",
    "stop_position",
]


#: How many dispatch modes this thread has on (trackers, torch's own modes).
dispatch_modes = torch._C._len_torch_dispatch_stack


class StopRecomputation(Exception):
    """Raised inside a recomputation once every needed tensor is rebuilt."""


Decide = Callable[[str, int], Any]


def detached(t: torch.Tensor) -> torch.Tensor:
    """A detached alias of ``t`` that no tracker sees (a `hidden` ``t.detach()``).

    NOTE [hidden aliases]: the engine detaches every tensor it saves or rebuilds.
    Under a dispatch mode each ``detach`` is a call into Python; for a plain
    tensor (no subclass whose ``__torch_dispatch__`` must run) the alias is made
    with Python dispatch off, several times cheaper (benchmarks/measured.md).
    Subclasses go through `hidden`. With no mode on the dispatch stack (a fast
    forward, NOTE [fast path]) nothing can see the op: a plain ``detach`` then,
    as entering the switch costs more than the op (benchmarks/measured.md).
    """
    if type(t) in PLAIN_TYPES:
        if not dispatch_modes():
            return t.detach()
        with torch._C._DisableTorchDispatch():
            return t.detach()
    with hidden():
        return t.detach()


def _input_keys(
    args: tuple[Any, ...], kwargs: dict[str, Any], skip: tuple[tuple[int, str], ...] = ()
) -> list[tuple[torch.device, int]]:
    """Storage keys of an op's tensor arguments, in order (lists of tensors included),
    leaving out the arguments in ``skip`` (positions and names, as `_written_args`)."""
    if skip:
        positions, names = {i for i, _ in skip}, {name for _, name in skip}
        args = tuple(v for i, v in enumerate(args) if i not in positions)
        kwargs = {name: v for name, v in kwargs.items() if name not in names}
    keys = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            keys.append(storage_key(value))
        elif isinstance(value, (list, tuple)):
            keys.extend(storage_key(t) for t in value if isinstance(t, torch.Tensor))
    return keys


class StateTracker(PolicyReplay, TorchDispatchMode):
    """Record external tensors written in place, whether RNG was drawn, and policy outputs.

    NOTE [policy replay]: with a policy, the forward keeps the outputs of the ops the
    policy saves, by op position (``kept``); the recomputation, given them as
    ``replay``, returns them instead of running those ops again. A kept output that a
    later op writes into is copied first (copy on write), so what is replayed is the
    value the op produced. Ops that draw random numbers are never kept: skipping one
    would shift the random stream of the ops after it.

    Attributes:
        snapshots: (tensor, value before its first write) in order of first write.
            `split_write_only` takes the write-only ones out at the end of a forward.
        used_rng: True when an op tagged ``nondeterministic_seeded`` ran.
        kept: op position -> (op name, outputs, action) of policy-kept outputs.
        kept_storages: storage key -> action, for the pack hook to look up.
    """

    def __init__(
        self,
        decide: Decide | None = None,
        replay: dict[int, tuple[str, Any, Any]] | None = None,
        recomputing: bool = False,
        skip: list[torch.Tensor] | None = None,
        replay_states: dict[int, tuple[torch.Generator, torch.Tensor]] | None = None,
    ) -> None:
        super().__init__()
        self._recomputing = recomputing
        # NOTE [write-only state]: storages whose pure updates the re-run skips.
        self._skip_tensors = skip or []
        self._skip = {storage_key(t) for t in self._skip_tensors}
        self._reads: set[tuple[torch.device, int]] = set()
        self._decide = decide
        self._replay = replay
        self.kept: dict[int, tuple[str, Any, Any]] = {}
        self.kept_storages: dict[tuple[torch.device, int], Any] = {}
        #: NOTE [kept draws]: the live storages kept draws filled -> draw position, and
        #: the draws autograd saved (``packed_draws``) or a re-run op read, by position.
        #: Their storages may die in the forward and their addresses be reused, so
        #: what reads them is settled while they live, by position, not by address.
        self.drawn_storages: dict[tuple[torch.device, int], int] = {}
        self.packed_draws: set[int] = set()
        self._draw_readers: dict[int, set[int]] = {}
        #: NOTE [kept draws]: position -> (generator, its state after the draw).
        self.draw_states: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self._seeded: list[int] = []
        #: NOTE [explicit generators]: (generator, state before its first draw).
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []
        self._replay_states = replay_states or {}
        # NOTE [unneeded kept outputs]: storages each op read (ops that will re-run)
        # and made (kept ops), by position; forward with a policy only.
        self._trace_inputs = decide is not None and not recomputing
        self._inputs: dict[int, set[tuple[torch.device, int]]] = {}
        self._kept_keys: dict[int, set[tuple[torch.device, int]]] = {}
        self.packed: set[tuple[torch.device, int]] = set()
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.used_rng = False
        self._created: set[tuple[torch.device, int]] = set()
        self._seen: set[tuple[Any, ...]] = set()
        self._started = 0
        self._stop_at: int | None = None
        #: Positions of the ops that wrote into an argument (NOTE [early stop]).
        self.writers: set[int] = set()
        #: NOTE [plain re-run]: whether a region started inside this one.
        self.nested = False
        #: Running statistics that batch norms in training updated (NOTE [fast path]).
        self.statistics: list[torch.Tensor] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disabling decorator, a few
        # microseconds on every op of every region; ours never compiles anything.
        return False

    def made(self, key: tuple[torch.device, int]) -> bool:
        """Whether the storage of this key (`_storage_key`) was made by an op this tracker saw."""
        return key in self._created

    @property
    def position(self) -> int:
        """The position the next op to start will have (ops seen so far)."""
        return self._started

    def stop_at(self, position: int | None) -> None:
        """Raise `StopRecomputation` when the op at ``position`` starts (NOTE [early stop])."""
        self._stop_at = position

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _hiding.depth:
            return func(*args, **kwargs)
        if self._stop_at is not None and self._started >= self._stop_at:
            raise StopRecomputation
        position = self._started
        self._started += 1
        info = _op_info(func)  # NOTE [op info]
        if self._replay is not None and position in self._replay:
            name, outputs, _ = self._replay[position]
            if name != info.name:
                raise _ReplayMismatch(name, info.name, position)
            state = self._replay_states.get(position)
            if state is not None:
                state[0].set_state(state[1])  # NOTE [kept draws]
            if isinstance(outputs, _KeptDraw):
                return outputs.replay(func, args, kwargs)
            return _fresh_aliases(_filled(outputs))
        if info.seeded:
            self.used_rng = True
            self._seeded.append(position)
            generator = kwargs.get("generator")
            if (
                generator is not None
                and not self._recomputing
                and all(g is not generator for g, _ in self.generators)
            ):
                # NOTE [explicit generators]: its state before its first draw here.
                with hidden():
                    self.generators.append((generator, generator.get_state()))
        written = info.written
        inputs: list[tuple[torch.device, int]] | None = None
        if (
            written
            and info.stats
            and len(args) > _TRAINING_ARG
            and args[_TRAINING_ARG] is True
            and isinstance(args[3], torch.Tensor)
        ):
            # NOTE [write-only statistics]
            if not self._recomputing:
                self.statistics += [t for t in args[3:5] if isinstance(t, torch.Tensor)]
            if self._recomputing:
                func, args = _without_stats(func, args)
            written = tuple((i, name) for i, name in written if i not in (3, 4))
        if written:
            self.writers.add(position)
            targets = [
                t
                for i, name in written
                for t in _tensors(args[i] if i < len(args) else kwargs.get(name))
            ]
            pure = len(targets) == 1 and info.update_results is not None
            if pure and self._skip and storage_key(targets[0]) in self._skip:
                # NOTE [write-only state]: the forward's update is already in place.
                results = info.update_results or 0
                if results == 1:
                    return targets[0]
                return (targets[0],) * results if results else None
            if not self._recomputing:
                # A pure update's target is not read.
                self._note_reads(_input_keys(args, kwargs, written if pure else ()))
                if not pure:
                    self._reads.update(storage_key(t) for t in targets)
            for t in targets:
                self._note_write(t)
        elif not self._recomputing:
            # An op that writes nothing reads every tensor argument; the keys also
            # serve the trace below.
            inputs = _input_keys(args, kwargs)
            self._note_reads(inputs)
        if self._trace_inputs and not info.no_data:
            # What reads a view reads its base's storage; layout needs no values.
            if inputs is None:
                inputs = _input_keys(args, kwargs)
            keys = {key for key in inputs if key[0].type != "meta"}
            if self.drawn_storages and (drawn := keys & self.drawn_storages.keys()):
                self._draw_readers[position] = {self.drawn_storages[k] for k in drawn}
                keys -= drawn
            self._inputs[position] = keys
        out = func(*args, **kwargs)
        if info.fresh:
            tensors = [out] if isinstance(out, torch.Tensor) else _tensors(out)
            for t in tensors:
                if t.numel():
                    key = storage_key(t)
                    self._created.add(key)
                    if self.drawn_storages:
                        self.drawn_storages.pop(key, None)  # its address reused: it died
            if self._decide is not None and tensors:
                self._keep(position, info, args, kwargs, out, tensors)
        elif self._decide is not None and info.draw_into is not None:
            self._keep(position, info, args, kwargs, out, [])
        return out

    def _note_reads(self, keys: list[tuple[torch.device, int]]) -> None:
        """Note the external storages (by `_input_keys`) an op reads."""
        created, reads = self._created, self._reads
        for key in keys:
            if key not in created:
                reads.add(key)

    def split_write_only(self) -> list[torch.Tensor]:
        """Drop the snapshots of write-only tensors and return those tensors.

        NOTE [write-only state]. Call once, after the forward.
        """
        write_only = [t for t, _ in self.snapshots if storage_key(t) not in self._reads]
        if write_only:
            keys = {storage_key(t) for t in write_only}
            self.snapshots = [(t, v) for t, v in self.snapshots if storage_key(t) not in keys]
        self._reads = set()
        return write_only

    def _note_write(self, t: torch.Tensor) -> None:
        if t.numel() == 0 or t.device.type == "meta":
            return
        if storage_key(t) in self._created:
            if self.kept or self._replay:
                self._copy_kept_before_write(t)
            return
        key = view_key(t)
        if key in self._seen:
            return
        self._seen.add(key)
        self.snapshots.append((t, t.detach().clone()))


def restore(snapshots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write snapshot values back, last-written first, without bumping versions."""
    with torch.no_grad():
        for t, value in reversed(snapshots):
            t.data.copy_(value)


def current_values(
    snapshots: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy the present values of the tensors in ``snapshots``."""
    with torch.no_grad():
        return [(t, t.detach().clone()) for t, _ in snapshots]


def stop_position(pending: int | None, writers: frozenset[int]) -> int | None:
    """Where a re-run may stop once the last tensor it needs is packed at ``pending``.

    NOTE [early stop]: ``pending`` is the position of the next op to start when
    the tensor was packed. The pack was either of an output of the op before it,
    whose kernel has finished, or of an input of the op at ``pending``, whose
    autograd layer saves its inputs before its kernel runs. Its kernel's output
    is needed by nothing, so the re-run stops before it starts, unless it writes
    into an argument, which may be the tensor just packed (rrelu_with_noise fills
    its saved ``noise``): then it stops once that op has finished. Ops at the
    returned position and after it do not run again; their inputs are not needed
    (NOTE [unneeded kept outputs]). With ``early_stop=False`` (torch's flag) the
    re-run never stops: the whole function runs, and must save as many tensors
    as the forward did.
    """
    if pending is None:
        return None
    return pending + 1 if pending in writers else pending
