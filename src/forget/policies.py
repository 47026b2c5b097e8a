"""Per-op policies inside a forgotten region: save, recompute, or offload.

Forgetting a whole block recomputes everything in it, matmuls included.
Selective recomputation (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models") keeps the outputs of the
expensive ops and recomputes only the cheap, large ones (softmax, dropout,
activations). A policy is a small frozen value that, for each op output in a
region, answers one of three `Action` s. In the spirit of JAX's
``jax.checkpoint_policies`` the factories read like sentences::

    forget.checkpoint(block, x, policy=policies.save_outputs_of(*policies.MATMUL))

The engine asks a policy once per op of the forward whose outputs are new
memory (views and in-place results follow their base), with the op's name
(``"aten.mm"``) and the bytes of its outputs. An output a policy saves is
kept (memory) and the op is *not* re-run in backward: its kept output is
replayed; ``offload`` keeps it in host memory instead of on the device.
A policy may keep a random draw too (`DROPOUT`: dropout's masks): the re-run
writes the kept values back instead of drawing, and sets the generator to the
state the draw left, so every later draw is the forward's. A ``bernoulli_``
mask is kept as bits, 1/32 of its float32 bytes. Draws a policy does not
keep are drawn again from the replayed RNG state.

This module imports no torch: policies are plain values, usable by the
planner (`forget.plan`) as per-stage options.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "ATTENTION",
    "CONV",
    "DEFAULT_OPTIONS",
    "DROPOUT",
    "LINEAR",
    "MATMUL",
    "REGENERABLE",
    "Action",
    "Policy",
    "as_policy",
    "either",
    "offload_everything",
    "offload_outputs_of",
    "regenerate",
    "save_all_but",
    "save_everything",
    "save_larger_than",
    "save_nothing",
    "save_outputs_of",
    "save_smaller_than",
]


class Action(enum.Enum):
    """What to do with one op output of a region."""

    SAVE = "save"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


# Names of aten ops (the level the engine sees), grouped as users think of them.
MATMUL: tuple[str, ...] = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten._addmm_activation",
)
# The matmuls of linear layers only: not ``bmm``, which in attention computes the
# T x T scores that selective recomputation (Korthikanti et al.) drops and recomputes.
LINEAR: tuple[str, ...] = ("aten.mm", "aten.addmm", "aten._addmm_activation")
CONV: tuple[str, ...] = ("aten.convolution", "aten._convolution", "aten.mkldnn_convolution")
# The random masks of dropout: drawn in place by bernoulli_ (CPU, and the math
# path of scaled_dot_product_attention), by native_dropout on CUDA. Kept, they
# spare the re-run the draw (on CPU the costliest op of a recomputed attention core).
DROPOUT: tuple[str, ...] = ("aten.bernoulli_", "aten.native_dropout")
ATTENTION: tuple[str, ...] = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_fused_attention_overrideable",
)


@functools.lru_cache(maxsize=4096)  # asked once per op output in a region
def _normalize(name: str) -> str:
    """``"mm"`` / ``"aten::mm"`` / ``"aten.mm.default"`` -> ``"aten.mm"``."""
    name = name.replace("::", ".")
    if not name.startswith("aten."):
        name = "aten." + name
    parts = name.split(".")
    return ".".join(parts[:2])


@dataclass(frozen=True)
class Policy:
    """A rule from (op name, output bytes) to an `Action`.

    Build one with the factories of this module; combine with `either` or ``|``.

    Attributes:
        description: how the policy reads, shown in reports.
    """

    rule: Callable[[str, int], Action] = field(repr=False, compare=False)
    description: str
    #: Ops whose saved outputs are rebuilt in backward instead of kept, outside
    #: any region (`regenerate`); empty for a region's policy.
    regenerate: frozenset[str] = frozenset()

    def decide(self, op: str, nbytes: int) -> Action:
        """Return the action for one op output of ``nbytes`` bytes made by ``op``."""
        return self.rule(_normalize(op), nbytes)

    def __or__(self, other: Policy | bool) -> Policy:
        return either(self, as_policy(other))

    def __str__(self) -> str:
        return self.description

    @property
    def saves_nothing(self) -> bool:
        """True for the plain forget policy (nothing kept, nothing offloaded)."""
        # By the rule's identity, which a copy of the policy keeps (functions copy as
        # themselves), so a policy that merely reads "save nothing" does not count.
        return self.rule is _recompute_every_op

    @property
    def saves_everything(self) -> bool:
        """True for `save_everything`: a region under it is plain autograd."""
        return self.rule is _save_every_op


def _recompute_every_op(op: str, nbytes: int) -> Action:
    return Action.RECOMPUTE


def _save_every_op(op: str, nbytes: int) -> Action:
    return Action.SAVE


def _offload_every_op(op: str, nbytes: int) -> Action:
    return Action.OFFLOAD


save_nothing: Policy = Policy(_recompute_every_op, "save nothing")
"""Recompute everything: plain forget."""

save_everything: Policy = Policy(_save_every_op, "save everything")
"""Keep every output: no recomputation, plain autograd's memory."""

offload_everything: Policy = Policy(_offload_every_op, "offload everything")
"""Keep every output in host memory."""


def _op_set(ops: Iterable[str]) -> frozenset[str]:
    names = frozenset(_normalize(o) for o in ops)
    if not names:
        raise ValueError("forget: name at least one op, e.g. save_outputs_of(*policies.MATMUL).")
    return names


def save_outputs_of(*ops: str) -> Policy:
    """Save the outputs of the named ops (``"mm"``, ``"aten.addmm"``); recompute the rest."""
    names = _op_set(ops)
    return Policy(
        lambda op, nbytes: Action.SAVE if op in names else Action.RECOMPUTE,
        f"save outputs of {', '.join(sorted(names))}",
    )


def save_all_but(*ops: str) -> Policy:
    """Save every output except those of the named ops, which are recomputed."""
    names = _op_set(ops)
    return Policy(
        lambda op, nbytes: Action.RECOMPUTE if op in names else Action.SAVE,
        f"save all but {', '.join(sorted(names))}",
    )


def offload_outputs_of(*ops: str) -> Policy:
    """Offload the outputs of the named ops to host memory; recompute the rest."""
    names = _op_set(ops)
    return Policy(
        lambda op, nbytes: Action.OFFLOAD if op in names else Action.RECOMPUTE,
        f"offload outputs of {', '.join(sorted(names))}",
    )


REGENERABLE: tuple[str, ...] = (
    "aten.gelu",
    "aten.silu",
    "aten.native_layer_norm",
    "aten.mul",
    "aten.bernoulli_",
)
"""What `regenerate` can rebuild: the outputs of GELU and SiLU (their backward
keeps their input), of LayerNorm (its backward keeps every input but ``eps``,
which is found by trying the usual ones, kept only where the output's bits
come out again), of a product whose operands are kept anyway (a dropout's
masked output: its backward keeps the mask, softmax keeps its result), and the
0-or-scale masks that ``aten.bernoulli_`` fills for a CPU dropout, kept as one
byte per element (NOTE [two-valued masks] in ``forget._engine._regenerate``)."""


def regenerate(*ops: str) -> Policy:
    """Keep the stage, but rebuild the saved outputs of cheap ``ops`` in backward.

    Not a region's policy: the stage runs once, as plain autograd, and each
    tensor saved for backward that is the output of one of ``ops`` (or a view
    of it) is rebuilt from the input the op's own backward keeps (NOTE
    [regenerate] in ``forget._engine._regenerate``): GELU's output, which the next Linear
    saves, costs one GELU in backward instead of its bytes. Gradients are
    bitwise the plain run's. With no ``ops``, every entry of `REGENERABLE`.
    Use it as a stage option of `forget.plan` (``options={"regen":
    regenerate()}``) or around plain code with ``forget.regenerating``.

    Raises:
        ValueError: an op that cannot be rebuilt this way.
    """
    names = _op_set(ops or REGENERABLE)
    unknown = sorted(names - set(REGENERABLE))
    if unknown:
        raise ValueError(
            f"forget: regenerate cannot rebuild {', '.join(unknown)}; it rebuilds "
            f"{', '.join(REGENERABLE)} (ops whose backward keeps their input)."
        )
    return Policy(
        lambda op, nbytes: Action.SAVE,
        f"regenerate outputs of {', '.join(sorted(names))}",
        regenerate=names,
    )


def _check_bytes(nbytes: int) -> int:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"forget: a byte threshold must be an int >= 0, got {nbytes!r}.")
    return nbytes


def save_larger_than(nbytes: int) -> Policy:
    """Save outputs of more than ``nbytes`` bytes; recompute the small ones."""
    limit = _check_bytes(nbytes)
    return Policy(
        lambda op, n: Action.SAVE if n > limit else Action.RECOMPUTE,
        f"save outputs larger than {limit} bytes",
    )


def save_smaller_than(nbytes: int) -> Policy:
    """Save outputs of fewer than ``nbytes`` bytes; recompute the large ones."""
    limit = _check_bytes(nbytes)
    return Policy(
        lambda op, n: Action.SAVE if n < limit else Action.RECOMPUTE,
        f"save outputs smaller than {limit} bytes",
    )


_RANK = {Action.RECOMPUTE: 0, Action.OFFLOAD: 1, Action.SAVE: 2}


def either(first: Policy, second: Policy) -> Policy:
    """Keep what either policy keeps: save beats offload beats recompute.

    Raises:
        ValueError: either is a `regenerate` policy, which is no region's policy.
    """
    if first.regenerate or second.regenerate:
        raise ValueError(
            "forget: a regenerate policy runs a stage plainly and does not combine with a "
            "region's policy; give them as separate options."
        )

    def rule(op: str, nbytes: int) -> Action:
        a, b = first.rule(op, nbytes), second.rule(op, nbytes)
        return a if _RANK[a] >= _RANK[b] else b

    return Policy(rule, f"({first.description}) or ({second.description})")


def as_policy(value: Policy | bool | None) -> Policy:
    """Normalize a policy argument: ``None``/``False`` save nothing, ``True`` saves everything."""
    if value is None or value is False:
        return save_nothing
    if value is True:
        return save_everything
    if isinstance(value, Policy):
        return value
    raise TypeError(
        f"forget: a policy is a forget.policies.Policy or a bool, got {type(value).__name__}; "
        "build one with e.g. forget.policies.save_outputs_of('mm')."
    )


#: The leaf options a module tree is planned with when ``options`` is not given,
#: and what a cap's partial keeps: ``"selective"`` keeps the outputs of a region's
#: matmuls, attention and dropout and re-runs the rest (norms, activations,
#: residual sums); ``"regenerate"`` keeps the module and rebuilds its activation,
#: norm and dropout outputs in backward (`regenerate`).
DEFAULT_OPTIONS: Mapping[str, Policy] = MappingProxyType(
    {
        "selective": save_outputs_of(*LINEAR, *ATTENTION, *DROPOUT),
        "regenerate": regenerate(),
    }
)
