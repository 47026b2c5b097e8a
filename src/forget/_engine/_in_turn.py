"""Call parts one after another on one value: the body of a region over several layers.

One helper for one concept: `ForgetSequential`'s segments, a planned region's
items and the stages a plan joins at a dead cut all run their parts in turn
through `InTurn`. It is a plain callable, not a module, so wrapping layers in
it adds no ``state_dict`` keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["InTurn"]


class InTurn:
    """Call ``parts`` in turn, each on the previous one's result.

    Args:
        parts: callables taking and returning one value.
        name: the ``__qualname__`` errors and the ledger name the region by;
            by default the parts' type names.
    """

    def __init__(self, parts: Iterable[Callable[[Any], Any]], name: str | None = None) -> None:
        self.parts = tuple(parts)
        self.__qualname__ = name or "in_turn(" + ", ".join(_name(p) for p in self.parts) + ")"

    def __call__(self, x: Any) -> Any:
        for part in self.parts:
            x = part(x)
        return x

    def __repr__(self) -> str:
        return self.__qualname__


def _name(part: Any) -> str:
    return getattr(part, "__qualname__", None) or type(part).__name__
