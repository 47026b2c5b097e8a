"""Runs of a chain's children as candidates: segments of an ``nn.Sequential``.

NOTE [segments]: a candidate is one module, so on an ``nn.Sequential`` of
single layers (``Linear, Tanh, ...``) a forgotten layer holds its input anyway
and forgetting buys little; a run of children forgotten holds the first one's
input alone. So when the planned model is itself an ``nn.Sequential`` (its
class's forward, each child run once, in order), runs of its children become
nodes of the tree (no own bytes, the first child's input when forgotten, the
children's times), nested, for the tree solver to pick as it picks modules.
Which runs: the regions of the chain solver's schedules (`forget.schedules`,
contiguous segments cut anywhere) of the children's figures, at its least
budget first, then half way to its plain peak; then halves of halves where
they cross none taken, so the family stays nested. Rule: the chain solver
proposes, the tree solver and the measure decide. Reason: fixed halves cut at
fixed places and miss the chain's least; the chain's figures (no backward
work, inputs and outputs held to their backward) are rougher than the tree's,
good for where to cut, not for what fits. A plan that forgets a run wraps the
Sequential's forward (NOTE [instance forward]) to run each forgotten run as
one region.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import nn

from ... import schedules as P
from ..._engine import run_region
from ..._regions import ROOT, find_candidates

__all__ = ["chain_candidates", "is_segment", "segments_call", "with_segments"]


def chain_candidates(chain: nn.Sequential) -> list[str] | None:
    """A chain's default candidates: the default ones and every child (a chain is a module
    tree whose candidates are its children); None for an empty chain."""
    children = [name for name, _ in chain.named_children()]
    return [*dict.fromkeys([*find_candidates(chain), *children])] if children else None


def is_segment(name: str) -> bool:
    """Whether ``name`` is a run of the planned Sequential's children (``"[2:4]"``)."""
    return name.startswith("[")


def with_segments(tree: P.Tree, model: nn.Module) -> P.Tree:
    """``tree`` with the runs of ``model``'s children as nodes, where it is a chain."""
    children = tree.root.children
    if (
        type(model).forward is not nn.Sequential.forward
        or [c.name for c in children] != list(model._modules)
        or len(children) < 3
    ):
        return tree
    n = len(children)
    spans: set[tuple[int, int]] = set()
    for span in [*_chain_spans(children), *_halves(0, n)]:
        if not any(_cross(span, taken) for taken in spans):
            spans.add(span)

    def run(lo: int, hi: int) -> tuple[P.TreeNode, ...]:
        """The nodes that cover ``lo`` to ``hi``: its outermost spans, the children between."""
        nodes: list[P.TreeNode] = []
        i = lo
        while i < hi:
            inside = (t for s, t in spans if s == i and t <= hi and (s, t) != (lo, hi))
            stop = max(inside, default=0)
            if stop <= i + 1:
                nodes.append(children[i])
                i += 1
                continue
            parts = run(i, stop)
            nodes.append(
                P.TreeNode(
                    f"[{i}:{stop}]",
                    parts,
                    input_bytes=children[i].input_bytes,
                    forward_s=sum(p.forward_s for p in parts),
                )
            )
            i = stop
        return tuple(nodes)

    root = P.TreeNode(
        ROOT,
        run(0, n),
        own_bytes=tree.root.own_bytes,
        input_bytes=tree.root.input_bytes,
        forward_s=tree.root.forward_s,
        options=tree.root.options,
        can_forget=tree.root.can_forget,
        work_bytes=tree.root.work_bytes,
        tail_bytes=tree.root.tail_bytes,
    )
    return P.Tree(root, base_bytes=tree.base_bytes, floor_bytes=tree.floor_bytes)


# Budgets the chain is solved at: its least and these shares of the way up to its plain peak.
_SHARES = (0.5,)
# The chain solver's resolution: coarse, since only where its regions fall is used.
_UNITS = 100


def _chain_spans(children: tuple[P.TreeNode, ...]) -> list[tuple[int, int]]:
    """The regions of the chain solver's schedules of ``children``, the least's first."""
    chain = _chain(children)
    least = P.min_feasible_bytes(chain)
    top = P.Schedule.from_items(chain, P.store_all_items(len(chain))).predicted_peak_bytes
    spans: list[tuple[int, int]] = []
    for budget in dict.fromkeys([least, *(int(least + s * (top - least)) for s in _SHARES)]):
        spans.extend(_regions(P.solve(chain, budget, memory_units=_UNITS).items))
    return [span for span in dict.fromkeys(spans) if span != (0, len(children))]


def _chain(children: tuple[P.TreeNode, ...]) -> P.Chain:
    """The children as a chain of stages: a stage's input is the child's, its history
    its saved bytes less that input (NOTE [segments]: no backward work)."""
    inputs = [c.input_bytes for c in children]
    return P.Chain(
        tuple(
            P.Stage(
                c.name,
                forward_s=c.forward_s,
                forward_nograd_s=c.forward_s,
                backward_s=2 * c.forward_s,
                input_bytes=inputs[i],
                output_bytes=inputs[i + 1] if i + 1 < len(inputs) else 0,
                saved_bytes=max(0, c.own_bytes - inputs[i]),
            )
            for i, c in enumerate(children)
        )
    )


def _regions(items: tuple[P.Keep | P.Region, ...]) -> list[tuple[int, int]]:
    """The spans of every `Region` in ``items``, outer ones first."""
    out: list[tuple[int, int]] = []
    for item in items:
        if isinstance(item, P.Region):
            out.append((item.start, item.stop))
            out.extend(_regions(item.items))
    return out


def _halves(lo: int, hi: int) -> list[tuple[int, int]]:
    """Halves of halves of ``lo`` to ``hi``, outer ones first."""
    if hi - lo < 2:
        return []
    mid = (lo + hi) // 2
    return [(lo, mid), (mid, hi), *_halves(lo, mid), *_halves(mid, hi)]


def _cross(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether spans ``a`` and ``b`` overlap without one holding the other."""
    return a[0] < b[0] < a[1] < b[1] or b[0] < a[0] < b[1] < a[1]


def segments_call(model: nn.Module, names: list[str]) -> Any:
    """The forward call (`forget._regions.wrap_forward`) running ``names`` forgotten."""
    spans = sorted((_span(name) for name in names), key=lambda s: (s[0], -s[1]))
    return functools.partial(_run_segments, model, tuple(spans))


def _span(name: str) -> tuple[int, int]:
    lo, hi = name[1:-1].split(":")
    return int(lo), int(hi)


def _run_segments(
    model: nn.Module,
    spans: tuple[tuple[int, int], ...],
    forward: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Any:
    (x,) = args
    layers = list(model._modules.values())
    return _run(layers, spans, 0, len(layers), x)


def _run(layers: list[Any], spans: tuple[tuple[int, int], ...], lo: int, hi: int, x: Any) -> Any:
    """Layers ``lo`` to ``hi`` in turn, each outermost span of ``spans`` inside as a region."""
    i = lo
    while i < hi:
        span = next((s for s in spans if s[0] == i and s[1] <= hi and s != (lo, hi)), None)
        if span is None:
            x = layers[i](x)
            i += 1
            continue
        inner = tuple(s for s in spans if span[0] <= s[0] and s[1] <= span[1] and s != span)
        body = functools.partial(_run, layers, inner, span[0], span[1])
        x = run_region(body, (x,), {})
        i = span[1]
    return x
