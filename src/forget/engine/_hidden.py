"""Ops the engine runs for itself, hidden from the state tracker and the op count."""

from __future__ import annotations

import threading


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
