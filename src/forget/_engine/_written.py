"""A region's argument that its own forward wrote into: held without its new history.

NOTE [arguments written in place]: a region keeps its arguments for the re-run.
When its function writes into one in place with grad on (an ``inplace=True``
ReLU first in a block), that argument's ``grad_fn`` becomes a node made inside
the region, whose saved tensors go through the region's hooks and slots, which
hold the region: a cycle through C++ the garbage collector cannot see, leaking
the region when no backward runs. So such an argument is held weakly, beside a
detached alias (same storage and version counter, no history) that the region's
put-back pairs hold too. A re-run takes the argument while the caller holds it,
else the alias (a non-leaf that requires grad when the argument did), which
reads and writes the same memory. Only ``create_graph`` needs the argument's
history (NOTE [double backward]); there a dropped argument cannot be rebuilt,
and the re-run says so.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .._errors import ForgetError


class _NonLeafAlias(torch.autograd.Function):
    """The identity, whose output is a non-leaf on the same storage as its input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class WrittenArgument:
    """An argument its region wrote into with grad on (NOTE [arguments written in place])."""

    __slots__ = ("alias", "ref", "requires_grad")

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)
        self.alias = t.detach()
        self.requires_grad = t.requires_grad

    def get(self, keep_graph: bool, name: str) -> torch.Tensor:
        """The argument for a re-run: itself if alive, else an alias of its storage.

        Raises:
            ForgetError: under ``create_graph`` (``keep_graph``), when the argument is
                gone: its history, which second derivatives flow through, went with it.
        """
        t = self.ref()
        if t is not None:
            return t
        if not self.requires_grad:
            return self.alias
        if keep_graph:
            raise ForgetError(
                f"forget: {name} wrote in place into an argument that requires grad, "
                "and that argument is no longer alive; under create_graph its re-run "
                "needs the argument's history. Keep a reference to the argument until "
                "backward, or make the write out of place."
            )
        leaf = self.alias.detach().requires_grad_()
        with torch.enable_grad():  # a re-run is called from backward, where grad is off
            return _NonLeafAlias.apply(leaf)


def cut_written(
    flat: list[Any],
    positions: list[int],
    grad_fns: list[Any],
    pre_forward: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Hold weakly the arguments the forward gave new history (NOTE [arguments written in place]).

    ``flat`` (the region's stored arguments) is changed in place at ``positions``,
    whose tensors had ``grad_fns`` before the forward; returns ``pre_forward`` with
    those arguments replaced by their aliases.
    """
    if not pre_forward:
        return pre_forward
    written = {id(t) for t, _ in pre_forward}
    aliases: dict[int, torch.Tensor] = {}
    for i, before in zip(positions, grad_fns, strict=True):
        t = flat[i]
        if not isinstance(t, torch.Tensor):
            continue  # an enclosing region's slot (NOTE [nesting])
        if id(t) in written and t.grad_fn is not None and t.grad_fn is not before:
            held = WrittenArgument(t)
            aliases[id(t)] = held.alias
            flat[i] = held
    if not aliases:
        return pre_forward
    return [(aliases.get(id(t), t), value) for t, value in pre_forward]


def held_tensors(flat: list[Any]) -> list[torch.Tensor]:
    """The tensors a region's stored arguments hold: the aliases of written ones."""
    held = [v.alias if type(v) is WrittenArgument else v for v in flat]
    return [v for v in held if isinstance(v, torch.Tensor)]
