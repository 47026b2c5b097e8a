"""The gradients backward holds at each region of a capped step.

NOTE [gradients as they come]: backward makes a parameter's gradient when it
reaches the parameter's last use (in the forward's order), so at the regions
backward meets first most gradients do not exist yet; counted all at once they
made the estimate far exceed what a plan at the same cap measured
(benchmarks/measured.md, "Models nobody here wrote"). So, where the estimate
with every gradient passes the cap, each gradient is counted from the first
region backward meets among those that use it: the last entry of the innermost
candidate holding every owner of the parameter (a tied weight has two), or of
a region that saved it, if later. A parameter owned or saved outside every
region counts throughout, and past the last region every gradient does. Not
seen: a parameter another region's op uses without saving it (a bias added
functionally), whose gradient may come earlier than counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .._engine import StorageKey, storage_key


class _Entry(Protocol):
    name: str
    index: int


def gradients_by_entry(
    model: nn.Module,
    entries: Sequence[_Entry],
    new_grads: Sequence[tuple[torch.Tensor, int]],
    holders: Mapping[StorageKey, Sequence[Any]],
    outside: Mapping[StorageKey, int],
) -> tuple[int, list[int]]:
    """The gradient bytes backward holds throughout, and per entry those made once
    backward has reached it (NOTE [gradients as they come]).

    Args:
        model: the capped model (its modules own the parameters).
        entries: the regions the forward ran, in order (their names and indices).
        new_grads: the parameters whose gradient the step makes, with its bytes.
        holders: storage key -> the entries that hold or keep it (a parameter an
            op of theirs saved).
        outside: the storages saved outside every region.
    """
    # A candidate's span: the last entry (in the forward's order) of it or inside it.
    span: dict[str, int] = {}
    for entry in entries:
        parts = entry.name.split(".")
        for cut in range(1, len(parts) + 1):
            span[".".join(parts[:cut])] = entry.index
    known = {e.name for e in entries}
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(name)
    always, made_at = 0, [0] * len(entries)
    for p, nbytes in new_grads:
        key = storage_key(p)
        at = _made_at(owners.get(id(p), []), known, span)
        if at is None or key in outside:
            always += nbytes
            continue
        for holder in holders.get(key, ()):
            at = max(at, holder.index)
        made_at[at] += nbytes
    # Backward meets the entries last to first: at entry i it holds what entries i
    # and later made.
    later = [0] * len(entries)
    total = 0
    for i in range(len(entries) - 1, -1, -1):
        total += made_at[i]
        later[i] = total
    return always, later


def _made_at(owners: list[str], known: set[str], span: dict[str, int]) -> int | None:
    """The last entry of the innermost candidate region that holds every module owning
    a parameter; None where no region holds them all."""
    if not owners:
        return None
    parts = owners[0].split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if name in known and all(o == name or o.startswith(f"{name}.") for o in owners):
            return span[name]
    return None
