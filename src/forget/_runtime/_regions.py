"""Which regions a cap runs, and how: finer regions inside one-of-a-kind ones, the
policy of partial evictions."""

from __future__ import annotations

from torch import nn

from ..policies import DEFAULT_OPTIONS, Action, Policy
from ._orders import BOUND

__all__ = ["BoundedKeep", "Partial", "leaf_names", "partial_policy", "with_finer"]


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

    NOTE [finer regions]: a repeated block holds a share of the step that falls as
    the stack grows; a stem or a head is one of a kind and may hold as much as many
    blocks. Evicted whole, its re-run rebuilds all of it at once, beside its largest
    gradients and every parameter's gradient (a stem meets backward last), more than
    a tight cap leaves. So a default candidate with no candidate inside, whose type
    no other candidate has, gets its children (two or more) as regions inside it:
    they are evicted first, each re-run holds one child's activations, and the
    region, evicted after them, still frees the tensors between them. The price is
    paid only when the cap evicts. The choice is made from the module tree when the
    cap is made, so the first step has it too. Repeated blocks stay whole: regions
    inside each would multiply the regions' overhead, and a block evicted after its
    children re-runs twice. Figures: benchmarks/measured.md, "forget.cap".
    """
    leaves = set(leaf_names(names))
    kinds = [type(model.get_submodule(name)) for name in names]
    out = list(names)
    for name, kind in zip(names, kinds, strict=True):
        if kinds.count(kind) > 1 or name not in leaves:
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


def leaf_names(names: list[str]) -> list[str]:
    """Those of ``names`` (dotted module names) with none of the others inside them."""
    return [name for name in names if not any(o.startswith(f"{name}.") for o in names)]


class Partial:
    """What a cap's partial evictions keep, and have learned, per kind of region (its
    class): NOTE [partial evictions].

    Args:
        policy: what a region evicted in part keeps.
        kinds: the class of each region that may run under it (those with none inside).
    """

    def __init__(self, policy: Policy, kinds: dict[str, type]) -> None:
        self.policy = policy
        self._kinds = kinds
        self._too_much: set[type] = set()  # kinds seen keeping too much to go in part
        self._shares: dict[type, float] = {}  # what each keeps beyond its slots, per bytes

    def runs(self, name: str) -> bool:
        """Whether region ``name`` runs under the policy."""
        kind = self._kinds.get(name)
        return kind is not None and kind not in self._too_much

    def share(self, name: str) -> float:
        """What region ``name`` (one that `runs`) keeps beyond its slots, per its bytes: the
        most a region of its kind was seen to, or `BOUND`, the most its keep may hold."""
        return self._shares.get(self._kinds[name], BOUND)

    def learn(self, name: str, share: float, too_much: bool) -> None:
        """A region ran under the policy and kept ``share`` beyond its slots; ``too_much``:
        too much to go in part (`worth_a_part`), or its bound refused a keep."""
        kind = self._kinds[name]
        if too_much:
            self._too_much.add(kind)
        else:
            self._shares[kind] = max(self._shares.get(kind, 0.0), share)


class BoundedKeep:
    """A policy's keeps in one region run, up to ``limit`` bytes (NOTE [partial
    evictions]): past it, the op is recomputed and ``refused`` says so.

    Attributes:
        policy: the policy the region runs with.
        refused: whether an op output the policy keeps was refused.
    """

    def __init__(self, policy: Policy, limit: int) -> None:
        self._inner, self._limit, self._kept = policy, limit, 0
        self.refused = False
        self.policy = Policy(self._rule, f"{policy}, up to {limit:,} B")

    def _rule(self, op: str, nbytes: int) -> Action:
        action = self._inner.rule(op, nbytes)  # ``op`` is normalized by `Policy.decide`
        if action is Action.SAVE:
            if op == "aten.bernoulli_":  # kept as bits (NOTE [kept draws]): an eighth at most
                nbytes //= 8
            if self._kept + nbytes > self._limit:
                self.refused = True
                return Action.RECOMPUTE
            self._kept += nbytes
        return action
