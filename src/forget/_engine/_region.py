"""A forgotten region: slots for what autograd saves, the re-run, early stop, nesting.

NOTE [how forget works]: the forward runs ``func`` with grad enabled under
saved-tensor hooks whose pack keeps nothing: each tensor autograd wants to
save is replaced by a small ``Slot`` naming its position in the region.
The autograd graph is therefore the ordinary one (parameters of closures get
gradients, ``torch.autograd.grad`` on any subset works, outputs keep their
``grad_fn``), but it holds no activations. The first time backward unpacks a
slot, the region re-runs once (``in_recomputing()`` true, the forward's RNG
and autocast state replayed, module buffers put back, see NOTE [state
tracking]) under hooks that collect the tensors it saves, in the same order,
and it stops as soon as every slot still alive has its tensor.

NOTE [nesting]: the inputs of a region are, to an enclosing region, tensors
saved for backward. A region started inside another region's forward stores
its inputs through the enclosing region's pack, so the enclosing region
keeps none of them; they are rebuilt by the enclosing recomputation when the
inner region needs them.

NOTE [plain re-run]: the dispatch mode of NOTE [state tracking] costs a call into
Python per op (mostly torch's Python dispatch, which any mode pays; figures:
benchmarks/measured.md, "Per-op costs of the engine"). A re-run needs it only to
replay a policy's kept outputs or to tell a nested region which tensors are the
re-run's own. Outside state is put back without it: pre-forward values before the
re-run, the forward's after; write-only state (running statistics, counters) is
copied around its owner module's forward (`_sites.write_only_put_back`), or
around the whole re-run when the region is that module's own method (NOTE [hooks
of the region's own module]). So a region with no policy and no nested region
re-runs without a mode; its early stop raises from the pack hook (the packed
op does not run, as in torch's checkpoint) or, after a write into an argument,
at the next pack.

NOTE [whole re-run]: with ``early_stop=False`` the re-run runs the whole
function, so it must save as many tensors as the forward did; the count is
checked only once the forward is over. A function that calls
``torch.autograd.grad`` on its own intermediates re-runs midway through its
forward (NOTE [re-run in the forward]), and that re-run runs the whole
function, saving more than the forward has saved so far (``g(x)`` of torch's
nesting tests: 7 against 6). ``_in_forward`` tells the two apart on both
paths; whether the region holds a tracker does not: the fast path's forward
runs with none (NOTE [fast path]), so a later call of such a function would be
checked against its unfinished forward's count and raise
`RecomputationMismatchError`.

NOTE [double backward]: when backward runs with ``create_graph=True`` the
collected tensors keep their history from the recomputation (which ran on
the original inputs), so second derivatives flow through them; otherwise
they are detached and the recomputation's graph is dropped at once. External
tensors are never rebuilt (NOTE [saved identity]).

NOTE [nested grad]: a re-run may start regions of its own and differentiate
through them with ``create_graph`` (``grad(checkpoint(grad(checkpoint(f))))``).
Such a region stores its inputs through the re-run's pack, so what that pack
returns must behave as the tensor did: an alias that keeps ``requires_grad``
(else the inner region's own re-run would save nothing), and, when the re-run
keeps its graph, the tensor itself, whose history the second derivatives must
flow through. Every alias the pack returns keeps ``requires_grad`` for this,
whether the enclosing region needs that tensor or not.

NOTE [re-run in the forward]: a function that calls ``torch.autograd.grad``
inside its own region unpacks that region's slots before its forward is over,
so the region re-runs midway. That re-run replays the RNG from the forward's
start (captured before the function runs), so its draws are the forward's.
What the forward learns only at its end (explicit generators' states, outside
state to put back) is not yet known to it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from .._errors import ForgetError, RecomputationMismatchError
from ..policies import Action, Policy
from ._arguments import changing, copy_structure, flatten, unflatten
from ._debug import OpTrace
from ._hooks import region_hooks
from ._local import _packers, hidden
from ._offload import Offloaded, fetch_kept, offload, offload_kept, warn_cpu_once
from ._regenerate import mark_outputs, rerun_pack, resolve
from ._replay import (
    AutocastState,
    RNGState,
    default_device,
    default_device_replayed,
    devices_of,
    generators_replayed,
    recomputing,
)
from ._sites import FastTracker, Guard, Site, site_of, write_only_put_back
from ._slots import (
    DroppableSlot,
    KeptSlot,
    Slot,
    external,
    held,
    ordinal,
    region_name,
    saved_meta,
)
from ._state import (
    StateTracker,
    StopRecomputation,
    current_values,
    detached,
    restore,
    stop_position,
)
from ._storage import PLAIN_TYPES, StorageKey, storage_key, storage_of
from ._written import WrittenArgument, cut_written, held_tensors

__all__ = ["Region"]


def _unpack(slot: Any) -> Any:
    if type(slot) is DroppableSlot and slot.value is not None and not torch.is_grad_enabled():
        return held(slot)  # NOTE [droppable regions]: held, not re-run
    if isinstance(slot, KeptSlot) and not slot.rebuilt(torch.is_grad_enabled()):
        return slot.get()
    if isinstance(slot, Slot):
        # NOTE [double backward]: under create_graph even kept tensors are rebuilt, so
        # second derivatives flow through them.
        return slot.region.unpack(slot.index)
    return resolve(slot)  # a nested region's input that a re-run regenerated


class Region:
    """One call of a forgotten function: what it needs to run again, and nothing more.

    Args:
        func: the function to run.
        args: positional arguments (tensors and constants).
        kwargs: keyword arguments (tensors and constants).
        preserve_rng_state: replay the RNG of CPU and devices in recomputation.
        check: compare shapes, dtypes and devices of rebuilt tensors with the forward's.
        recompute_context: an optional context manager factory entered around the
            recomputation (``context_fn``'s second half in ``forget.checkpoint``).
        policy: which op outputs to keep, recompute or offload (`forget.policies`);
            ``None`` keeps nothing.
        early_stop: stop the re-run once every needed tensor is rebuilt (NOTE [early
            stop]); ``False`` runs the whole function again.
        debug: record the ops of the forward and the re-run, shown on a mismatch
            (NOTE [debug trace]).
    """

    def __init__(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        preserve_rng_state: bool = True,
        check: bool = True,
        recompute_context: Callable[[], Any] | None = None,
        policy: Policy | None = None,
        early_stop: bool = True,
        debug: bool = False,
    ) -> None:
        if policy is not None and policy.regenerate:
            raise TypeError(
                f"forget: {policy} is not a region's policy: it keeps a stage and rebuilds "
                "some outputs in backward; use it with forget.regenerating() or as a "
                "forget.plan option."
            )
        self.func = func
        self.policy = None if policy is None or policy.saves_nothing else policy
        self._tracker: StateTracker | None = None
        self._kept_ops: dict[int, tuple[str, Any, Any]] = {}
        self._draw_states: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self._generators: list[tuple[torch.Generator, torch.Tensor]] = []
        self._offloaded: list[weakref.ref[Slot]] = []
        self._prefetched = False
        self.check = check
        self.recompute_context = recompute_context
        self.preserve_rng_state = preserve_rng_state
        self.early_stop = early_stop
        self._trace = OpTrace() if debug else None  # NOTE [debug trace]
        flat, self._spec = flatten(args, kwargs)
        self._tensor_pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        tensors = [flat[i] for i in self._tensor_pos]
        outer = _packers.stack[-1] if _packers.stack else None
        if _packers.trackers:
            _packers.trackers[-1].nested = True  # NOTE [plain re-run]
        # NOTE [nesting]: inputs go through the enclosing region's pack.
        self._forward_flat: list[Any] | None = list(flat)  # dropped after the forward
        # The forward gets the very arguments (a list it appends to is the caller's);
        # a re-run gets them rebuilt from the leaves.
        self._forward_args: tuple[tuple[Any, ...], dict[str, Any]] | None = (args, kwargs)
        self._flat = list(flat)
        # NOTE [arguments that change]: re-runs start from a copy made before the forward.
        self._changing = changing(flat, self._spec)
        for i in self._changing:
            self._flat[i] = copy_structure(flat[i])
        for i in self._tensor_pos:
            if outer is None:
                continue
            stored = outer(flat[i])
            # NOTE [nested grad]: in a re-run that keeps its graph (create_graph), the
            # input itself, whose history second derivatives must flow through.
            self._flat[i] = flat[i] if outer in _packers.keeping_graph else stored
        self._versions: list[int] = [t._version for t in tensors]
        self._devices: list[torch.device] = []  # NOTE [fast path]: found by run_forward
        self._rng: RNGState | None = None
        self._default_device = default_device()
        self._meta: list[tuple[tuple[int, ...], torch.dtype, torch.device]] = []
        self._live: dict[int, weakref.ref[Slot]] = {}
        self._made_keys: dict[int, StorageKey] = {}
        self._rebuilt: dict[int, torch.Tensor] = {}
        self._pre_forward: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._write_only: list[torch.Tensor] = []
        # NOTE [early stop]: the op position pending at each pack, and the positions of
        # the ops that write into an argument (whose kernel must finish before a stop).
        self._pack_positions: list[int] = []
        self._writers: frozenset[int] = frozenset()
        self._plain_rerun = False
        #: True while ``func``'s forward runs, on either path (NOTE [whole re-run]).
        self._in_forward = False

    def forward_inputs(self) -> list[torch.Tensor]:
        """The tensors among the call's arguments, flattened; empty once the forward ran
        (the region keeps its inputs only as NOTE [nesting] says)."""
        flat = self._forward_flat or ()
        return [flat[i] for i in self._tensor_pos] if flat else []

    # -- forward -------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Slot:
        index = len(self._meta)
        self._meta.append((t.shape, t.dtype, t.device))  # `saved_meta`, inlined
        action = None
        tracker = self._tracker
        self._pack_positions.append(tracker.position if tracker is not None else -1)
        # `storage_key`, its common case inlined (one call less per saved tensor), with
        # the storage it reads handed on.
        storage = t.untyped_storage() if type(t) in PLAIN_TYPES else None
        key = (t.device, storage.data_ptr()) if storage is not None else storage_key(t)
        if tracker is not None and (tracker.kept_storages or tracker.drawn_storages):
            action = tracker.kept_storages.get(key)
            if action is not None:
                tracker.packed.add(key)  # NOTE [unneeded kept outputs]
            elif (drawn := tracker.drawn_storages.get(key)) is not None:
                tracker.packed_draws.add(drawn)  # NOTE [kept draws]
        slot: Slot
        if action is None and external(t, key):
            slot = self._external_slot(t, index, key, storage)
        elif action is None or self._tracker is None:
            slot = self._made_slot(t, index, key, storage)
        elif action is Action.OFFLOAD and t.device.type != "cpu":
            with hidden():
                slot = KeptSlot(self, index, offload(t))
            self._offloaded.append(weakref.ref(slot))
        else:
            if action is Action.OFFLOAD:
                warn_cpu_once()
            slot = self._kept_slot(t, index, key, storage)
        self._live[index] = weakref.ref(slot)
        return slot

    def _kept_slot(
        self, t: torch.Tensor, index: int, key: StorageKey, storage: torch.UntypedStorage | None
    ) -> Slot:
        """The slot of a saved tensor the region's policy keeps (``key`` and ``storage``
        as `_external_slot` has them)."""
        return KeptSlot(self, index, detached(t))

    def _external_slot(
        self, t: torch.Tensor, index: int, key: StorageKey, storage: torch.UntypedStorage | None
    ) -> KeptSlot:
        """The slot of a saved tensor no running region made (NOTE [external tensors]).

        ``key`` is its `storage_key`; ``storage`` the storage that key was read from,
        or ``None`` (a subclass: `storage_of` tells)."""
        # NOTE [saved identity]: the very object, history and all.
        return KeptSlot(self, index, t, version=t._version)

    def _made_slot(
        self, t: torch.Tensor, index: int, key: StorageKey, storage: torch.UntypedStorage | None
    ) -> Slot:
        """The slot of a saved tensor the region made and keeps not: its re-run rebuilds it
        (``key`` and ``storage`` as `_external_slot` has them)."""
        self._made_keys[index] = key  # `rebuilt_bytes` counts a storage once
        return Slot(self, index)

    def prefetch_offloaded(self) -> None:
        """Start bringing back every offloaded tensor of the region (NOTE [offload])."""
        if self._prefetched:
            return
        self._prefetched = True
        for ref in self._offloaded:
            slot = ref()
            if slot is not None and isinstance(slot, KeptSlot):
                value = slot.value
                if isinstance(value, Offloaded):
                    value.prefetch()

    def run_forward(self) -> Any:
        """Run ``func`` once with grad, keeping no activation; return its output."""
        flat = self._forward_flat
        if flat is None:
            raise RuntimeError("forget: a Region runs its forward once.")
        self._forward_flat = None
        assert self._forward_args is not None
        args, kwargs = self._forward_args
        self._forward_args = None
        exact = self.policy is not None or self._trace is not None
        site = None if exact else site_of(self.func)
        guard = Guard(site, self.func, flat) if site is not None and site.fast else None
        if guard is not None and not guard.matches:
            assert site is not None
            site.fast = guard = None  # the training flags changed: learn again
        if guard is not None:
            self._devices = guard.devices
        else:
            self._devices = devices_of(self.func, [flat[i] for i in self._tensor_pos])
        self._autocast = AutocastState.capture(d.type for d in self._devices)
        # NOTE [re-run in the forward]: a grad inside the forward may re-run the
        # region midway; it replays the draws from here, as the backward's re-run will.
        rng = RNGState.capture(self._devices) if self.preserve_rng_state else None
        self._rng = rng
        if guard is not None:
            assert site is not None
            return self._run_fast(site, guard, flat, args, kwargs)
        tracker = StateTracker(decide=self.policy.decide if self.policy is not None else None)
        self._tracker = tracker
        grad_fns = [getattr(self._flat[i], "grad_fn", None) for i in self._tensor_pos]
        _packers.stack.append(self._pack)
        _packers.trackers.append(tracker)
        self._in_forward = True
        try:
            with (
                region_hooks(self._pack, _unpack),
                tracker,
                self._trace.recording_forward() if self._trace is not None else nullcontext(),
            ):
                out = self.func(*args, **kwargs)
        finally:
            _packers.stack.pop()
            _packers.trackers.pop()
            self._tracker = None
            self._in_forward = False
        mark_outputs(out)
        if tracker.used_rng:
            # Also when every draw is kept: under create_graph the re-run draws again.
            tracker.prune_draw_states()
        else:
            self._rng = None
        self._generators = tracker.generators
        self._writers = frozenset(tracker.writers)
        # NOTE [plain re-run]
        self._plain_rerun = self.policy is None and not tracker.nested
        last = self._pack_positions[-1] if self._pack_positions else None
        tracker.drop_unneeded_kept(stop=stop_position(last, self._writers))
        self._kept_ops = offload_kept(tracker.kept)
        self._draw_states = tracker.draw_states
        # Values before the forward's first write, so the re-run starts where it did.
        # NOTE [write-only state]; running statistics are written only, too.
        self._write_only = tracker.split_write_only() + tracker.statistics
        # NOTE [arguments written in place]
        self._pre_forward = cut_written(self._flat, self._tensor_pos, grad_fns, tracker.snapshots)
        self._versions = [flat[i]._version for i in self._tensor_pos]
        if site is not None and site.fast is None:
            site.learn(
                self.func,
                flat,
                eligible=not tracker.generators,
                written=[t for t, _ in self._pre_forward],
                write_only=self._write_only,
                drew=tracker.used_rng,
                meta=self._meta,
                positions=self._pack_positions,
                writers=self._writers,
            )
        return out

    def _run_fast(
        self,
        site: Site,
        guard: Guard,
        flat: list[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The forward with saved-tensor hooks only, under a guard (NOTE [fast path])."""
        fast = FastTracker(guard.external)
        _packers.stack.append(self._pack)
        _packers.trackers.append(fast)
        self._in_forward = True
        try:
            with region_hooks(self._pack, _unpack):
                out = self.func(*args, **kwargs)
        finally:
            _packers.stack.pop()
            _packers.trackers.pop()
            self._in_forward = False
        mark_outputs(out)
        self._pre_forward, self._write_only = guard.written(self.func)
        self._plain_rerun = not fast.nested
        if self._rng is not None and not site.drew and self._rng.unchanged():
            self._rng = None  # as the exact path keeps none for a region that drew none
        if self._meta == site.meta:
            self._pack_positions, self._writers = list(site.positions), site.writers
        else:
            self.early_stop = False  # the learned positions are not this call's
        self._versions = [flat[i]._version for i in self._tensor_pos]
        return out

    # -- backward ------------------------------------------------------------
    def unpack(self, index: int) -> torch.Tensor:
        """Return the tensor saved at ``index``, recomputing the region if needed."""
        if index not in self._rebuilt:
            self._recompute()
        return resolve(self._rebuilt.pop(index))  # NOTE [regenerate in a re-run]

    def _recompute(self) -> None:
        keep_graph = torch.is_grad_enabled()
        self._live = {i: ref for i, ref in self._live.items() if ref() is not None}
        needed = {
            i
            for i, ref in self._live.items()
            if i not in self._rebuilt and (slot := ref()) is not None and slot.rebuilt(keep_graph)
        }
        # Each input slot of an enclosing region is unpacked once per re-run.
        name = region_name(self.func)
        flat = [
            v.get(keep_graph, name) if type(v) is WrittenArgument else _unpack(v)
            for v in self._flat
        ]
        self._check_versions(flat)
        for i in self._changing:  # NOTE [arguments that change]: each re-run its own
            flat[i] = copy_structure(flat[i])
        args, kwargs = unflatten(flat, self._spec)
        count = 0
        # NOTE [policy replay]: kept op outputs stand in for their ops, except under
        # create_graph, where the ops run again so their outputs carry history.
        # NOTE [plain re-run]: a region with no policy that wrote no outside state and
        # started no region re-runs without a dispatch mode.
        tracker = (
            None
            if self._plain_rerun
            else StateTracker(
                replay=None if keep_graph else fetch_kept(self._kept_ops),
                recomputing=True,
                skip=self._write_only,
                replay_states=None if keep_graph else self._draw_states,
            )
        )
        positions = self._pack_positions
        past: list[int] = []  # without a tracker: stop at the first pack after this op

        # The re-run's graph holds this hook (in C++, out of the garbage collector's
        # sight) and, under create_graph, the region holds that graph through the
        # rebuilt tensors; so the hook reaches the region only through a weak reference.
        region_ref = weakref.ref(self)
        # ``collect`` names itself through this list, emptied once the re-run is over:
        # a closure that held itself would be a reference cycle, and everything the
        # closure holds (the tracker's kept tensors) would wait for the collector.
        this: list[Callable[[torch.Tensor], torch.Tensor]] = []
        meta, check = self._meta, self.check
        writers, early_stop = self._writers, self.early_stop

        def collect(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            index = count
            count += 1
            region = region_ref()
            if region is None or not needed:
                if past and index < len(positions) and positions[index] > past[0]:
                    raise StopRecomputation
                unneeded = detached(t)
                if t.requires_grad:
                    # NOTE [nested grad]: a region the rest of this re-run starts stores
                    # its inputs here; without requires_grad its own re-run saves nothing.
                    unneeded.requires_grad_()
                return unneeded
            if index >= len(meta):
                raise RecomputationMismatchError(
                    f"forget: the recomputation of {name} saved more tensors for "
                    f"backward than its forward ({len(meta)}); the function must run the "
                    "same ops both times (is it branching on global state or on "
                    "in_recomputing()?)."
                )
            if check and saved_meta(t) != meta[index]:
                shape, dtype, device = meta[index]
                raise RecomputationMismatchError(
                    f"forget: the {ordinal(index + 1)} tensor saved by the recomputation of "
                    f"{name} differs from the forward's: forward saved "
                    f"shape={list(shape)} dtype={dtype} device={device}, recomputation saved "
                    f"shape={list(t.shape)} dtype={t.dtype} device={t.device}; the function "
                    "must compute the same thing both times."
                )
            # What the re-run's own graph keeps: a detached alias. The tensor itself
            # would, for an op's output, make a cycle through its grad_fn that the
            # garbage collector cannot see (it runs through C++), leaking the region.
            alias: Any = detached(t)  # NOTE [hidden aliases]
            if t.requires_grad:
                # A nested region re-run from it must save for backward as its forward
                # did (NOTE [nested grad]). The re-run's graph, dropped with it (or, under
                # create_graph, held through the rebuilt tensors), may hold the alias.
                alias.requires_grad_()
            if index in needed:
                if keep_graph:
                    region._rebuilt[index] = t
                else:
                    regenerate = rerun_pack(this[0])  # NOTE [regenerate in a re-run]
                    if regenerate is not None:
                        with hidden():
                            packed = regenerate(t)
                        if packed is not t:
                            alias = packed  # the re-run's graph holds it too, not t
                    region._rebuilt[index] = alias
                needed.discard(index)
                if not needed and early_stop:
                    if tracker is not None:
                        tracker.stop_at(stop_position(tracker.position, writers))
                    elif stop_position(positions[index], writers) == positions[index]:
                        raise StopRecomputation  # from inside the pack: the op does not run
                    else:
                        past.append(positions[index])
            return alias

        this.append(collect)
        # Versions of kept external tensors before the re-run: its own in-place writes
        # (restored afterwards) must not read as the user's (NOTE [external tensors]).
        external = [
            slot
            for ref in self._live.values()
            if isinstance(slot := ref(), KeptSlot) and slot.version is not None
        ]
        versions_before = [
            slot.value._version for slot in external if isinstance(slot.value, torch.Tensor)
        ]
        after_forward = current_values(self._pre_forward)
        # NOTE [plain re-run]: write-only state a re-run without a tracker updates again.
        put_back = (
            write_only_put_back(self.func, flat, self._write_only)
            if tracker is None and self._write_only
            else nullcontext()
        )
        restore(self._pre_forward)
        rng = self._rng.replayed() if self._rng is not None else nullcontext()
        generators = generators_replayed(self._generators)
        extra = self.recompute_context() if self.recompute_context is not None else nullcontext()
        _packers.stack.append(collect)
        if keep_graph:
            _packers.keeping_graph.add(collect)
        if tracker is not None:
            _packers.trackers.append(tracker)
        try:
            with (
                recomputing(),
                torch.enable_grad(),
                rng,
                generators,
                self._autocast.replayed(),
                default_device_replayed(self._default_device),
                extra,
                region_hooks(collect, resolve),
                tracker if tracker is not None else put_back,
                self._trace.recording_rerun() if self._trace is not None else nullcontext(),
            ):
                self.func(*args, **kwargs)
        except StopRecomputation:
            pass
        except RecomputationMismatchError as error:
            if self._trace is not None:
                self._trace.explain(error)  # NOTE [debug trace]
            raise
        finally:
            this.clear()
            _packers.stack.pop()
            _packers.keeping_graph.discard(collect)
            if tracker is not None:
                _packers.trackers.pop()
                restore(tracker.snapshots)
            restore(after_forward)
            for slot, before in zip(external, versions_before, strict=True):
                assert slot.version is not None and isinstance(slot.value, torch.Tensor)
                slot.version += slot.value._version - before
        # NOTE [whole re-run]
        whole = not early_stop and not self._in_forward
        if needed or (whole and count != len(self._meta)):
            mismatch = RecomputationMismatchError(
                f"forget: the recomputation of {region_name(self.func)} saved {count} tensors for "
                f"backward, its forward saved {len(self._meta)}; the function must run the same "
                "ops both times."
            )
            if self._trace is not None:
                self._trace.explain(mismatch)
            raise mismatch
        self._versions = [flat[i]._version for i in self._tensor_pos]

    def rebuilt_bytes(self) -> tuple[int, int, int]:
        """What its backward holds beyond what is alive anyway (NOTE [regions heard]).

        The bytes of the forward's saved tensors it keeps not, which its re-run
        rebuilds (each storage once, at its largest saved view), the largest of
        them, and the bytes of the kept tensors that require grad (each storage
        once): parameters and inputs, which get a gradient as its backward runs.
        """
        made: dict[Any, int] = {}
        grads: dict[Any, int] = {}
        for index, ref in self._live.items():
            slot = ref()
            if type(slot) is Slot:
                shape, dtype, _ = self._meta[index]
                key = self._made_keys.get(index, index)
                made[key] = max(made.get(key, 0), math.prod(shape) * dtype.itemsize)
            elif isinstance(slot, KeptSlot) and isinstance(slot.value, torch.Tensor):
                value = slot.value
                if value.requires_grad and (storage := storage_of(value)) is not None:
                    grads[storage_key(value)] = storage.nbytes()
        return sum(made.values()), max(made.values(), default=0), sum(grads.values())

    def kept_arguments(self) -> list[torch.Tensor]:
        """The argument tensors held for the re-run (an enclosing region's slots are not)."""
        return held_tensors(self._flat)

    def _check_versions(self, flat: list[Any]) -> None:
        for k, i in enumerate(self._tensor_pos):
            if isinstance(self._flat[i], Slot):
                continue  # rebuilt by the enclosing region, which checks its own inputs
            t = flat[i]
            if t._version != self._versions[k]:
                raise ForgetError(
                    f"forget: the {ordinal(k + 1)} tensor input of {region_name(self.func)} was "
                    f"modified in place after the forward (version {self._versions[k]} -> "
                    f"{t._version}); the recomputation would see other values and give wrong "
                    "gradients. Clone the tensor before modifying it, or modify it after "
                    "backward."
                )
