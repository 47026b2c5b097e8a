"""Call sites of regions: learned once on the exact path, then run on saved-tensor hooks alone.

NOTE [fast path]: the dispatch mode of NOTE [state tracking] costs a call into
Python per op, and what it learns is, for most regions, the same at every call
(which outside state is written, whether an explicit generator is drawn from,
at which op each saved tensor is packed). So a *site* (the module, bound method,
function or callable object run as a region) runs its first call on the exact
path and learns from the tracker; later calls run on saved-tensor hooks alone,
as torch's checkpoint does, under a guard with no per-op work. The guard takes
every tensor the callable reaches (`_replay.devices_of`; NOTE [cached walks]) as
outside; compares versions, and on the CPU copies of small or once-written
buffers (batch norm updates its statistics without bumping a version), to put
written state back before the re-run; always captures the RNG; and places the
early stop from the learned pack positions when the saved tensors agree. A write
it cannot undo raises `ForgetError` and sends the site back to the exact path.
A policy, ``debug=True``, an explicit ``generator=`` or a write into anything but
a reached buffer keep a site exact; code the guard cannot see (a global written,
a large or device buffer written without a version bump) needs
``forget._engine.fast_path(False)``.
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .._errors import ForgetError
from ._in_turn import InTurn
from ._local import hidden
from ._replay import devices_among, modules_reachable
from ._slots import region_name
from ._state import current_values, restore
from ._storage import StorageKey, storage_key, storage_keys
from ._walk import ModuleWalks

__all__ = [
    "SMALL_BUFFER_BYTES",
    "FastTracker",
    "Guard",
    "Site",
    "fast_path",
    "site_of",
    "write_only_put_back",
]

#: Buffers up to this size are copied before every fast forward (NOTE [fast path]).
SMALL_BUFFER_BYTES = 64 * 1024


class _Enabled(threading.local):
    on = True


_enabled = _Enabled()


@contextmanager
def fast_path(enabled: bool = True) -> Iterator[None]:
    """Let regions run on the fast path (NOTE [fast path]), or make every call exact.

    Regions started inside the ``with`` block (forward and, for their re-run, the
    flag is read at the forward) follow ``enabled``; the previous setting comes
    back at its end. Per thread.

    Example:
        >>> import torch, forget
        >>> from forget._engine import fast_path
        >>> with fast_path(False):
        ...     y = forget.checkpoint(torch.nn.Linear(2, 2), torch.ones(1, 2))
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"forget: fast_path takes a bool, got {type(enabled).__name__}")
    before = _enabled.on
    _enabled.on = enabled
    try:
        yield
    finally:
        _enabled.on = before


class Site:
    """What the exact forward of a call site learned (NOTE [fast path]).

    Attributes:
        fast: ``None`` until learned; then whether later calls may run fast.
        flags: the ``training`` flag of each module the call reaches.
        meta: shape, dtype and device of each tensor the learned forward saved.
        positions: the op position pending at each of its packs.
        writers: positions of its ops that write into an argument.
        written: buffers it read and wrote, copied before every fast forward.
        write_only: buffers it only wrote (NOTE [write-only state], running
            statistics), copied at the re-run only, to be put back after it.
        drew: whether it drew random numbers.
    """

    __slots__ = (
        "drew",
        "fast",
        "flags",
        "meta",
        "positions",
        "walks",
        "write_only",
        "writers",
        "written",
    )

    def __init__(self) -> None:
        self.fast: bool | None = None
        self.drew = True
        self.flags: list[bool] = []
        self.meta: list[Any] = []
        self.positions: list[int] = []
        self.writers: frozenset[int] = frozenset()
        self.written = _TensorSet(())
        self.write_only = _TensorSet(())
        # NOTE [cached walks]: the modules the calls reach, walked again when they change.
        self.walks = ModuleWalks()

    def learn(
        self,
        func: Any,
        flat: Sequence[Any],
        *,
        eligible: bool,
        written: Sequence[torch.Tensor],
        write_only: Sequence[torch.Tensor],
        meta: list[Any],
        positions: list[int],
        writers: frozenset[int],
        drew: bool,
    ) -> None:
        """Learn from an exact forward: fast only if every write was into a buffer."""
        subs, _, reached_buffers = self.walks.walk(_roots(func, flat))
        buffers = {storage_key(b): b for b in reached_buffers}
        read_written = [buffers.get(storage_key(t)) for t in written]
        only_written = [buffers.get(storage_key(t)) for t in write_only]
        self.fast = eligible and None not in read_written and None not in only_written
        if not self.fast:
            return
        self.flags = [m.training for m in subs]
        self.meta, self.positions, self.writers = list(meta), list(positions), writers
        self.drew = drew
        self.written = _TensorSet(b for b in read_written if b is not None)
        self.write_only = _TensorSet(b for b in only_written if b is not None)


class _TensorSet:
    """Tensors by identity, held weakly (a ``WeakSet`` compares tensors with ``==``)."""

    __slots__ = ("_refs",)

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self._refs = {id(t): weakref.ref(t) for t in tensors}

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t

    def __bool__(self) -> bool:
        return bool(self._refs)


_sites: weakref.WeakKeyDictionary[Any, dict[Any, Site]] = weakref.WeakKeyDictionary()


def site_of(func: Any) -> Site | None:
    """The site of ``func`` (created unlearned), or ``None`` when it is not enabled or
    ``func`` cannot be told apart from one call to the next (NOTE [fast path])."""
    if not _enabled.on:
        return None
    owner, part = _site_key(func)
    if owner is None:
        return None
    try:
        table = _sites.get(owner)
        if table is None:
            table = _sites[owner] = {}
    except TypeError:  # not weakly referenceable
        return None
    site = table.get(part)
    if site is None:
        site = table[part] = Site()
    return site


def _site_key(func: Any, depth: int = 0) -> tuple[Any, Any]:
    """(an object that lives as long as the site, what else tells it apart)."""
    if depth > 3:
        return None, None
    if isinstance(func, functools.partial):
        # A partial is made per call (Hugging Face's layers): its function is the site.
        owner, part = _site_key(func.func, depth + 1)
        return owner, ("partial", part, len(func.args), tuple(sorted(func.keywords)))
    if isinstance(func, types.MethodType):
        return func.__self__, func.__func__
    if isinstance(func, InTurn) and func.parts:
        # Made per call (`ForgetSequential`, a plan's regions): its parts are the site.
        owner, part = _site_key(func.parts[0], depth + 1)
        return owner, ("in_turn", part, tuple((id(p), type(p)) for p in func.parts))
    return func, None


class FastTracker:
    """Stands for a fast forward among the running regions' trackers (`_local._packers`).

    A tensor is the region's own unless its storage is one of ``external``'s;
    ``nested`` is set by a region started inside (NOTE [plain re-run]).
    """

    __slots__ = ("external", "nested")

    def __init__(self, external: set[StorageKey]) -> None:
        self.external = external
        self.nested = False

    def made(self, key: StorageKey) -> bool:
        return key not in self.external


#: What a tensor a fast forward watches is to it, in the order `Guard` asks.
_KINDS = ("argument", "tensor the function reaches", "parameter")


class Guard:
    """Versions and copies of what a fast forward reaches (NOTE [fast path]).

    Args:
        site: the learned site.
        func: the region's callable.
        flat: the call's arguments, flattened.

    Attributes:
        matches: whether the reached modules' ``training`` flags are the learned
            ones; if not, nothing else is set up and the call runs the exact path.
        external: storage keys of every watched tensor.
        devices: their devices other than the CPU (`_replay.devices_among`).
    """

    __slots__ = (
        "_copies",
        "_kinds",
        "_site",
        "_versions",
        "_watched",
        "devices",
        "external",
        "matches",
    )

    def __init__(self, site: Site, func: Any, flat: Sequence[Any]) -> None:
        self._site = site
        # NOTE [cached walks]: the reached modules, walked only when they changed.
        subs, parameters, reached_buffers = site.walks.walk(_roots(func, flat))
        self.matches = [m.training for m in subs] == site.flags
        if not self.matches:
            return
        args = [t for t in flat if isinstance(t, torch.Tensor)]
        reached = _reached_tensors(func)
        given = [*args, *reached]
        front = [*given, *parameters]
        watched = dict(zip(map(id, front), front, strict=True))
        buffers = [b for b in reached_buffers if id(b) not in watched]
        watched.update(zip(map(id, buffers), buffers, strict=True))
        self._watched = list(watched.values())
        self._kinds = (args, reached, parameters)  # as `_KINDS` names them
        self._versions = [t._version for t in self._watched]
        written, write_only = site.written, site.write_only
        copied = [
            b
            for b in buffers
            if b in written or (_nbytes(b) <= SMALL_BUFFER_BYTES and b not in write_only)
        ]
        self._copies: dict[int, torch.Tensor] = {}
        if copied:  # most calls copy nothing: no context entered for them
            with hidden(), torch.no_grad():
                self._copies = {id(b): b.detach().clone() for b in copied}
        # NOTE [cached walks]: the reached parameters' and buffers' keys kept too.
        self.external = site.walks.keys.keys([*parameters, *reached_buffers]) | storage_keys(given)
        self.devices = devices_among(self._watched)

    def _kind(self, t: torch.Tensor) -> str:
        """What ``t`` is to the call, for a message: the first of the kinds it is."""
        for kind, among in zip(_KINDS, self._kinds, strict=True):
            if any(x is t for x in among):
                return kind
        return "buffer"

    def written(
        self, func: Any
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        """What the forward wrote: (tensor, value before it) pairs, and write-only buffers.

        Raises:
            ForgetError: it wrote into a tensor it has no copy of and did not learn to
                be write-only; the site goes back to the exact path.
        """
        copies, only = self._copies, self._site.write_only
        any_only = bool(only)
        if not copies and not any_only and [t._version for t in self._watched] == self._versions:
            return [], []  # the common call: nothing written, nothing to compare
        pairs, write_only = [], []
        for t, before in zip(self._watched, self._versions, strict=True):
            copy = copies.get(id(t)) if copies else None
            if copy is None and any_only and t in only:
                write_only.append(t)  # batch norm's statistics: written, version or not
                continue
            if t._version == before and (copy is None or _equal(copy, t)):
                continue
            if copy is None:
                self._site.fast = False
                raise ForgetError(
                    f"forget: this call of {region_name(func)} wrote in place into a "
                    f"{self._kind(t)} of shape {list(t.shape)} that its first call did "
                    "not write into, so its value before the forward was not kept and the "
                    "recomputation cannot be exact (NOTE [fast path]). Later calls of it "
                    "run the exact path; run this step again, or wrap the first call in "
                    "forget._engine.fast_path(False)."
                )
            pairs.append((t, copy))
        return pairs, write_only


@contextmanager
def write_only_put_back(
    func: Any, flat: Sequence[Any], write_only: Sequence[torch.Tensor]
) -> Iterator[None]:
    """Put write-only state back after a re-run without a tracker updates it again.

    NOTE [plain re-run]: a batch norm in training updates its running statistics
    and counter again in a re-run; the values from before the re-run come back.
    Each tensor is copied when the module that owns it starts its forward and
    put back when that forward ends (a forward hook that runs on an early stop
    too), so a copy lives only while its module runs, not over the whole re-run
    whose peak it would raise; tensors no reached module owns are copied for the
    whole re-run.

    NOTE [hooks of the region's own module]: a module's hooks run around its
    ``__call__`` only. A region whose function is a module's bound method (its
    ``forward``, as `forget.checkpoint(bn.forward, x)` and a tree plan's instance
    forward run it, NOTE [instance forward]) runs that module's code with no hook
    of it around: the module's own tensors are copied for the whole re-run, as
    those no module owns (`_run_outside_call`). Known limit: code inside the
    region that calls a module as ``m.forward(x)``, not ``m(x)``, runs it without
    its hooks, and a re-run without a tracker updates its write-only state again.
    """
    owned: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    modules: dict[int, torch.nn.Module] = {}
    left = {id(t): t for t in write_only}
    outside = {id(m) for m in _run_outside_call(func)}
    for sub in _submodules(func, flat):
        if id(sub) in outside:
            continue  # no hook of it runs: its tensors stay in ``left``
        for b in sub._buffers.values():
            if b is not None and id(b) in left:
                owned.setdefault(id(sub), []).append((b, b))
                modules[id(sub)] = sub
                del left[id(b)]
    stash: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def before(module: torch.nn.Module, args: Any) -> None:
        with hidden():
            stash.append(current_values(owned[id(module)]))

    def after(module: torch.nn.Module, args: Any, out: Any) -> None:
        if stash:
            restore(stash.pop())

    handles = []
    for module in modules.values():
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after, always_call=True))
    with hidden():
        whole = current_values([(t, t) for t in left.values()])
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while stash:
            restore(stash.pop())
        restore(whole)


def _run_outside_call(func: Any, depth: int = 0) -> list[torch.nn.Module]:
    """Modules whose own code ``func`` runs without their ``__call__``: a bound method's
    owner, through a ``functools.partial`` and `InTurn`'s parts (NOTE [hooks of the
    region's own module])."""
    if depth > 3:
        return []
    if isinstance(func, types.MethodType):
        owner = func.__self__
        return [owner] if isinstance(owner, torch.nn.Module) else []
    if isinstance(func, functools.partial):
        return _run_outside_call(func.func, depth + 1)
    if isinstance(func, InTurn):
        return [m for part in func.parts for m in _run_outside_call(part, depth + 1)]
    return []


def _equal(copy: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether a buffer still holds its copied value (batch norm's kernels update the
    running statistics without bumping their version).

    Only on the CPU: on a device the answer would wait for the stream, every call.
    There the version decides, and batch norms' writes are known from the learned
    call, whose ``training`` flags the call has (`Site.flags`).
    """
    if t.device.type != "cpu":
        return True
    with hidden(), torch.no_grad():
        return torch.equal(copy, t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _roots(func: Any, flat: Sequence[Any]) -> list[torch.nn.Module]:
    """The modules ``func`` reaches and those among the arguments: every module under
    them is the call's (`ModuleWalks.walk`)."""
    return modules_reachable(func) + [m for m in flat if isinstance(m, torch.nn.Module)]


def _submodules(func: Any, flat: Sequence[Any]) -> list[torch.nn.Module]:
    """Every module under those ``func`` reaches and those among the arguments, once."""
    found: dict[int, torch.nn.Module] = {}
    for root in _roots(func, flat):
        if id(root) not in found:
            for sub in root.modules():
                found.setdefault(id(sub), sub)
    return list(found.values())


def _reached_tensors(func: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors in a partial's arguments or a function's closure cells."""
    if depth > 3:
        return []
    if isinstance(func, functools.partial):
        found = _reached_tensors(func.func, depth + 1)
        found += [a for a in (*func.args, *func.keywords.values()) if isinstance(a, torch.Tensor)]
        return found
    found = []
    for cell in getattr(func, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.Tensor):
            found.append(value)
    return found
