"""Which regions a cap runs, and how: finer regions inside one-of-a-kind ones, the
policy of partial evictions."""

from __future__ import annotations

from torch import nn

from ..planning import DEFAULT_OPTIONS
from ..policies import Policy

__all__ = ["partial_policy", "with_finer"]


def partial_policy(partial: str | Policy | None) -> Policy | None:
    """The policy ``partial=`` names (NOTE [partial evictions])."""
    if partial is None:
        return None
    if isinstance(partial, str):
        if partial != "selective":
            raise ValueError(
                f"forget: partial={partial!r} names no keep; expected 'selective', a "
                "forget.policies.Policy that keeps op outputs, or None (NOTE [partial "
                "evictions])."
            )
        return DEFAULT_OPTIONS["selective"]
    if not isinstance(partial, Policy):
        raise TypeError(
            f"forget: partial= takes 'selective', a forget.policies.Policy or None, got "
            f"{type(partial).__name__} (NOTE [partial evictions])."
        )
    if partial.regenerate or partial.saves_nothing or partial.saves_everything:
        raise ValueError(
            f"forget: partial={partial} is no partial keep (it keeps a region's every op "
            "output, none, or rebuilds a stage); give a policy that keeps some "
            "(forget.policies.save_outputs_of), or None (NOTE [partial evictions])."
        )
    return partial


def with_finer(model: nn.Module, names: list[str]) -> list[str]:
    """``names`` and, inside each one-of-a-kind region, its children (NOTE [finer regions]).

    NOTE [finer regions]: a repeated block holds a share of the step that falls
    as the stack grows; a stem or a head is one of a kind and may hold as much
    as many blocks (a CNN's stem runs at the input's resolution). Evicted whole,
    its re-run in backward rebuilds all of it at once, beside two of its largest
    gradients and every parameter's gradient (a stem meets backward last), more
    than a tight cap leaves. So a default candidate with no candidate inside it,
    whose type no other candidate has, gets its children (two or more) as
    regions inside it: the runtime evicts them first, each re-run then holds one
    child's activations, and the region itself, evicted only after them, still
    frees the tensors between the children. The price is paid only when the cap
    needs it: the region evicted, it and then each child re-run once in
    backward. The choice is made when the cap is made, from the module tree
    alone, so the first step, with nothing learned, has the finer regions too.
    Repeated blocks stay whole: regions inside each would multiply the regions,
    and their overhead, by the children per block, and a block evicted after
    its children re-runs twice. Figures: benchmarks/measured.md ("forget.cap").
    """
    known = set(names)
    kinds = [type(model.get_submodule(name)) for name in names]
    out = list(names)
    for name, kind in zip(names, kinds, strict=True):
        if kinds.count(kind) > 1 or any(other.startswith(f"{name}.") for other in known):
            continue
        children = [
            f"{name}.{child}"
            for child, module in model.get_submodule(name).named_children()
            if not isinstance(module, nn.ModuleList | nn.ModuleDict)
        ]
        if len(children) > 1:
            out += children
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(out, key=order.__getitem__)
