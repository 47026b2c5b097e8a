"""Which submodules of a model may become forgotten regions, and the model's structure.

A candidate must run exactly once per step: a region wraps the module's
forward, so a module called twice (a shared block) would be two regions, which
the cost model does not describe, and one never called holds nothing. Such
modules are dropped; a ``candidates=`` that matches no other raises. The model
itself is never a candidate: forgotten, it would re-run as soon as backward
starts, buying no memory at the peak for the cost of its re-run.

NOTE [tree candidates]: any submodule may be a region, but a tree of every
module gives the solver thousands of nodes whose regions cost more in fixed
overhead than they free. By default the candidates are the repeated blocks and
what lies above them: children of an ``nn.ModuleList`` or ``nn.Sequential``
that have submodules and share their type with a sibling (or, in a ModuleList
inside no such block, with a child of another such ModuleList: a UNet's down
blocks, which the up blocks repeat), the stack itself where it runs, every
module above a stack short of the model, and the children with parameters of
those modules and of the model (stems and heads, which can hold as much as a
layer). Regions nest along the tree, so "the encoder forgotten, a region per
layer inside" is one assignment. ``candidates=`` replaces the default with
modules matching `fnmatch` patterns (``*`` crosses dots) or types.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

#: The name of the model itself in a candidate tree (a dotted path is never this).
ROOT = "<model>"

CandidateSpec = str | type | Iterable[str | type]


def find_candidates(model: nn.Module, candidates: CandidateSpec | None = None) -> list[str]:
    """The dotted names of the submodules that may become regions (NOTE [tree candidates]).

    Args:
        model: the module planned.
        candidates: ``None`` for the default (repeated blocks and the subtrees
            above them); else a name pattern, a module type, or an iterable of
            them: the submodules matching any.

    Returns:
        Names in ``named_modules`` order; never ``""`` (the model itself).

    Raises:
        TypeError: ``candidates`` of another type.
        ValueError: a ``candidates`` that matches no submodule.
    """
    named = [(name, module) for name, module in model.named_modules() if name]
    if candidates is None:
        found = _default_candidates(model)
        return [name for name, _ in named if name in found]
    patterns, types = _spec(candidates)
    picked = [
        name
        for name, module in named
        if any(fnmatch.fnmatchcase(name, p) for p in patterns)
        or (types and isinstance(module, types))
    ]
    if not picked:
        some = ", ".join(repr(name) for name, _ in named[:6])
        raise ValueError(
            f"forget: candidates={candidates!r} matches no submodule of "
            f"{type(model).__name__}; patterns match dotted names such as {some}, types "
            "match with isinstance"
        )
    return picked


def _spec(candidates: CandidateSpec) -> tuple[list[str], tuple[type, ...]]:
    items: list[Any] = (
        [candidates] if isinstance(candidates, str | type) else list(candidates)  # type: ignore[arg-type]
    )
    patterns = [c for c in items if isinstance(c, str)]
    types = tuple(c for c in items if isinstance(c, type))
    bad = [c for c in items if not isinstance(c, str | type)]
    if bad or not items:
        raise TypeError(
            "forget: candidates is a name pattern ('*.layers.*'), an nn.Module type, or a "
            f"list of them; got {bad[0] if bad else candidates!r}"
        )
    return patterns, types


def _default_candidates(model: nn.Module) -> set[str]:
    """Repeated blocks, runnable stacks, the modules above a stack and their stems and heads."""
    found: set[str] = set()
    above: set[str] = set()
    stacks = [
        # Blocks have submodules: two Linears of an MLP's Sequential are no stack.
        (name, module, [(n, c) for n, c in module.named_children() if next(c.children(), None)])
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList | nn.Sequential)
    ]
    # A block repeats among its siblings; or, in a ModuleList outside every such
    # block, with the children of every such ModuleList (a UNet's down blocks hold
    # one residual block each, the up blocks more). Inside a repeated block (a T5
    # block's sublayers) and in a Sequential (a sequence of different layers) only
    # siblings count: regions within the blocks multiply them for little.
    siblings = {name: Counter(type(c) for _, c in children) for name, _, children in stacks}
    repeated_among_siblings = {
        f"{name}.{n}" if name else n
        for name, _, children in stacks
        for n, c in children
        if siblings[name][type(c)] > 1
    }

    def free(name: str) -> bool:
        return not any(name == r or name.startswith(f"{r}.") for r in repeated_among_siblings)

    lists = {name for name, module, _ in stacks if isinstance(module, nn.ModuleList) and free(name)}
    kinds = Counter(type(c) for name, _, children in stacks if name in lists for _, c in children)
    for name, module, children in stacks:
        prefix = f"{name}." if name else ""
        repeated = [
            (n, c)
            for n, c in children
            if prefix + n in repeated_among_siblings or (name in lists and kinds[type(c)] > 1)
        ]
        if not repeated:
            continue
        found |= {prefix + child for child, _ in repeated}
        if name and isinstance(module, nn.Sequential):
            found.add(name)
        parts = name.split(".") if name else []
        above |= {".".join(parts[:k]) for k in range(len(parts))}
    modules = dict(model.named_modules())
    for name in above:
        prefix = f"{name}." if name else ""
        found |= {
            prefix + child
            for child, module in modules[name].named_children()
            if next(module.parameters(), None) is not None
        }
    return (found | above) - {""}


def parents(names: Sequence[str]) -> dict[str, str]:
    """Each candidate's nearest candidate ancestor by dotted path, or `ROOT`."""
    known = set(names)
    out: dict[str, str] = {}
    for name in names:
        parts = name.split(".")
        out[name] = next(
            (
                ".".join(parts[:k])
                for k in range(len(parts) - 1, 0, -1)
                if ".".join(parts[:k]) in known
            ),
            ROOT,
        )
    return out


def ancestors(name: str, parent: Mapping[str, str]) -> list[str]:
    """``name``'s candidate ancestors, nearest first, `ROOT` last."""
    out = []
    while name != ROOT:
        name = parent[name]
        out.append(name)
    return out


# ----------------------------------------------------------------- structure


def structure(model: nn.Module) -> list[tuple[str, str]]:
    """``(dotted path, type)`` of every module, in ``named_modules`` order (``""``: the model)."""
    return [(name, _type_name(module)) for name, module in model.named_modules()]


def _type_name(module: nn.Module) -> str:
    kind = type(module)
    return f"{kind.__module__}.{kind.__qualname__}"


def first_difference(
    planned: Sequence[tuple[str, str]], model: nn.Module
) -> tuple[str, str, str] | None:
    """Where ``model``'s structure first departs from ``planned``: (path, planned, found).

    ``planned`` and ``found`` are type names, or ``"nothing"`` where one side
    has no module at that place; ``None`` when the two agree.
    """
    found = structure(model)
    for (p_name, p_type), (m_name, m_type) in zip(planned, found, strict=False):
        if p_name != m_name:
            # A module one side has and the other has not, at this place in the order.
            if p_name in dict(found):
                return m_name, "nothing", m_type
            return p_name, p_type, "nothing"
        if p_type != m_type:
            return p_name, p_type, m_type
    if len(planned) > len(found):
        return planned[len(found)][0], planned[len(found)][1], "nothing"
    if len(found) > len(planned):
        return found[len(planned)][0], "nothing", found[len(planned)][1]
    return None
