"""What the engine keeps per thread: the regions running now, and its own hidden ops."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class _Hiding(threading.local):
    depth = 0


_hiding = _Hiding()


class _Hidden:
    """`hidden`'s context manager: a plain class, cheaper to enter than a generator's."""

    __slots__ = ()

    def __enter__(self) -> None:
        _hiding.depth += 1

    def __exit__(self, *exc: object) -> None:
        _hiding.depth -= 1


_HIDDEN = _Hidden()


def hidden() -> _Hidden:
    """Let ops run unseen by every tracker of this thread (a context manager).

    The engine's own bookkeeping (detaching a saved tensor in a hook) must not
    shift the op positions that policy replay relies on.
    """
    return _HIDDEN


class _Packers(threading.local):
    stack: list[Callable[[torch.Tensor], Any]]
    trackers: list[Any]  # their StateTrackers (a type import would be circular)
    keeping_graph: set[Callable[[torch.Tensor], Any]]

    def __init__(self) -> None:
        self.stack = []
        self.trackers = []
        self.keeping_graph = set()


# The pack functions of the regions being run (forward or recomputation) in this
# thread, innermost last; a nested region stores its inputs through the innermost
# (NOTE [nesting]). And their trackers, which know what memory the regions made;
# and which of the packs are re-runs that keep their graph (NOTE [nested grad]).
_packers = _Packers()


class _Watchers(threading.local):
    def __init__(self) -> None:
        self.calls: list[Callable[[Any], None]] = []


# Who hears of each forgotten region run in this thread (`forgotten_regions`).
_watchers = _Watchers()
