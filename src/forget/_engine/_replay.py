"""Thread-local recomputation flag, and capture/replay of RNG and autocast state.

What a recomputation must see to rebuild the forward exactly: the random
number generators of CPU and of every device the region touches, as they
were when the forward started, and the same autocast configuration.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ._in_turn import InTurn

__all__ = [
    "AutocastState",
    "RNGState",
    "default_device",
    "default_device_replayed",
    "devices_among",
    "devices_of",
    "generators_replayed",
    "in_recomputing",
    "modules_reachable",
]


class _Local(threading.local):
    depth: int = 0


_local = _Local()


def in_recomputing() -> bool:
    """Return True only while a forgotten function is being re-run in backward.

    The flag is per thread, and always restored when a recomputation ends,
    also when it raises. Layers that update internal state on every forward
    can branch on it, as Chainer's BatchNormalization did with
    ``chainer.config.in_recomputing``; forget already restores module buffers
    after recomputation, so most layers need not.

    Example:
        >>> import forget
        >>> forget.in_recomputing()
        False
    """
    return _local.depth > 0


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark the current thread as recomputing for the duration of the block."""
    _local.depth += 1
    try:
        yield
    finally:
        _local.depth -= 1


def _device_module(device_type: str) -> Any:
    return torch.get_device_module(device_type)


def devices_of(func: Callable[..., Any], tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """Return the non-CPU devices whose RNG the region may draw from.

    Looks at the input tensors and at the tensors of modules reachable from
    ``func`` (the module itself, a bound method's owner, a
    ``functools.partial``'s arguments, closure cells); see `devices_among`.
    """
    found = list(tensors)
    for module in modules_reachable(func):
        for t in module.parameters():
            found.append(t)
            break
        for b in module.buffers():
            found.append(b)
            break
    return devices_among(found)


def devices_among(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The non-CPU devices of ``tensors``, and on CUDA the current device when CUDA
    is initialised, as kernels launched by the region run there."""
    found: dict[tuple[str, int | None], torch.device] = {}
    for t in tensors:
        if t.is_cpu:
            continue  # read without making a device object: most tensors, on a CPU run
        d = t.device
        if d.type not in ("cpu", "meta"):
            found.setdefault((d.type, d.index), d)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        i = torch.cuda.current_device()
        found.setdefault(("cuda", i), torch.device("cuda", i))
    return list(found.values())


def modules_reachable(func: Any, depth: int = 0) -> list[torch.nn.Module]:
    """Modules ``func`` reaches: itself, a bound method's owner, a ``functools.partial``'s
    arguments, closure cells (and lists of modules in them), `InTurn`'s parts."""
    if depth > 3:
        return []
    if isinstance(func, torch.nn.Module):
        return [func]
    out: list[torch.nn.Module] = []
    if isinstance(func, InTurn):
        for part in func.parts:
            out += modules_reachable(part, depth + 1)
        return out
    if isinstance(func, functools.partial):
        out += modules_reachable(func.func, depth + 1)
        for a in (*func.args, *func.keywords.values()):
            out += modules_reachable(a, depth + 1)
        return out
    owner = getattr(func, "__self__", None)
    if owner is not None:
        out += modules_reachable(owner, depth + 1)
    for cell in getattr(func, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.nn.Module):
            out.append(value)
        elif isinstance(value, list | tuple):
            out += [v for v in value if isinstance(v, torch.nn.Module)]
    return out


@dataclass(frozen=True)
class RNGState:
    """The RNG states of CPU and of some devices, taken at one moment."""

    cpu: torch.Tensor
    devices: tuple[tuple[torch.device, torch.Tensor], ...]

    @classmethod
    def capture(cls, devices: Iterable[torch.device]) -> RNGState:
        """Snapshot the CPU generator and the default generator of each device."""
        states = []
        for d in devices:
            mod = _device_module(d.type)
            index = d.index if d.index is not None else mod.current_device()
            states.append((torch.device(d.type, index), mod.get_rng_state(index)))
        return cls(torch.get_rng_state(), tuple(states))

    def unchanged(self) -> bool:
        """Whether every generator is still in this state (nothing drew since)."""
        if torch._C._len_torch_dispatch_stack():
            # Under a dispatch mode (fake tensors, when a planner counts a step with
            # regions of its own) the states are compared as plain tensors, outside it.
            with _disable_current_modes():
                return self.unchanged()
        if not torch.equal(torch.get_rng_state(), self.cpu):
            return False
        return all(
            torch.equal(_device_module(d.type).get_rng_state(d.index), s) for d, s in self.devices
        )

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block from this state, then put the generators back as they were.

        The outer sequence of random numbers is untouched, so a step under forget
        draws exactly what a plain step draws.
        """
        now = RNGState.capture(d for d, _ in self.devices)
        torch.set_rng_state(self.cpu)
        for d, s in self.devices:
            _device_module(d.type).set_rng_state(s, d.index)
        try:
            yield
        finally:
            torch.set_rng_state(now.cpu)
            for d, s in now.devices:
                _device_module(d.type).set_rng_state(s, d.index)


@dataclass(frozen=True)
class AutocastState:
    """Autocast configuration per device type, taken at one moment."""

    settings: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def capture(cls, device_types: Iterable[str]) -> AutocastState:
        """Snapshot autocast enabled/dtype for CPU and the given device types."""
        kinds = dict.fromkeys(["cpu", *device_types])
        settings = tuple(
            (k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds
        )
        return cls(settings, torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block under this autocast configuration."""
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self.settings:
                stack.enter_context(
                    torch.autocast(
                        kind, dtype=dtype, enabled=enabled, cache_enabled=self.cache_enabled
                    )
                )
            yield


def default_device() -> torch.device | None:
    """The default device a ``torch.device(...)`` context or ``set_default_device`` set.

    ``None`` when tensors made without a device go to the CPU. Both set a torch
    function mode, so with none active (the common case) nothing more is read.
    """
    if not torch._C._len_torch_function_stack():
        return None
    device = torch.get_default_device()
    return None if device == torch.device("cpu") else device


def default_device_replayed(device: torch.device | None) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` the default for the block, if it is not already.

    The forward of a region may run under ``torch.device("meta")`` and its re-run
    (in backward) outside it: tensors the function makes without a device must
    land where they did in the forward.
    """
    if default_device() == device:
        return contextlib.nullcontext()
    return torch.device(device if device is not None else "cpu")


@contextlib.contextmanager
def generators_replayed(generators: list[tuple[torch.Generator, torch.Tensor]]) -> Iterator[None]:
    """Set generators to the states they had in the forward; put them back after.

    NOTE [explicit generators]: a random op given ``generator=`` draws from a
    generator the default-RNG replay does not touch. The forward notes each such
    generator's state before its first draw in the region (nothing in the
    region drew from it before), and the re-run starts it there.
    """
    now = [(g, g.get_state()) for g, _ in generators]
    for g, state in generators:
        g.set_state(state)
    try:
        yield
    finally:
        for g, state in now:
            g.set_state(state)
