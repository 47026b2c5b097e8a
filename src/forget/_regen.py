"""Regenerate: drop the saved outputs of cheap ops and rebuild them in backward.

NOTE [regenerate]: an activation such as GELU saves its *input* for its own
backward, and the next op (the MLP's second Linear) saves its *output*: two
tensors of the hidden width, one of which is a pure function of the other.
Under `regenerating`, saved-tensor hooks look at every tensor autograd saves;
one that is the output of a listed op (or a view of it, as ``F.linear`` saves
a 3-d input flattened) is not kept: what is kept is a reference to the op's
backward node, whose own saved input rebuilds it (``aten.gelu`` on the same
input, with the same ``approximate``: the same kernel on the same values, so
the rebuilt tensor is bitwise the one the forward made). The op runs again
once per unpack, in backward, before the node's own backward frees its input
(a consumer's backward always runs before its producer's). No dispatch mode
and no re-run of anything else: on the reference GPT's MLP half it spares the
GELU output (1 MiB of 2.5 MiB) for one GELU, where a policy region's per-op
bookkeeping costs more than the ops it spares (NOTE [plain re-run] in
``_core``).

It works outside forget regions only: inside one, the region's own hooks save
nothing anyway, and these hooks, entered there, would keep what the region
means to forget. A tensor still alive at unpack is returned as it is, after
the version check autograd would make.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._errors import ForgetError
from .policies import REGENERABLE, Policy

__all__ = ["regenerating"]

# Backward node -> (the op it is the backward of, how to rebuild the op's output).
_RULES: dict[str, tuple[str, Callable[[Any], torch.Tensor]]] = {
    "GeluBackward0": (
        "aten.gelu",
        lambda node: torch.ops.aten.gelu(node._saved_self, approximate=node._saved_approximate),
    ),
    "SiluBackward0": ("aten.silu", lambda node: torch.ops.aten.silu(node._saved_self)),
}
assert {op for op, _ in _RULES.values()} == set(REGENERABLE)


class _Regenerated:
    """What is saved in place of a dropped output: how to rebuild it."""

    __slots__ = ("base_stride", "layout", "node", "ref", "rule", "version", "view")

    def __init__(
        self, t: torch.Tensor, node: Any, rule: Callable[[Any], torch.Tensor], view: bool
    ) -> None:
        self.node = node
        self.rule = rule
        self.ref = weakref.ref(t)
        self.version = t._version
        self.view = view
        self.layout = (t.shape, t.stride(), t.storage_offset(), t.dtype)
        base = t._base if view else t
        assert base is not None
        self.base_stride = base.stride()

    def get(self) -> torch.Tensor:
        live = self.ref()
        if live is not None:
            if live._version != self.version:
                raise RuntimeError(
                    "forget: a tensor saved for backward under regenerating() was modified "
                    f"in place after it was saved (version {self.version} -> "
                    f"{live._version}); the gradient would be computed from other values."
                )
            return live
        out = self.rule(self.node)
        shape, stride, offset, dtype = self.layout
        if self.view and out.stride() == self.base_stride and not out.storage_offset():
            out = out.as_strided(shape, stride, offset)
        if out.shape != shape or out.stride() != stride or out.dtype != dtype:
            raise ForgetError(
                "forget: a regenerated tensor came back with another layout "
                f"(shape {list(out.shape)}, stride {out.stride()}, {out.dtype}) than the "
                f"one saved (shape {list(shape)}, stride {stride}, {dtype})."
            )
        return out


def _unpack(saved: Any) -> Any:
    return saved.get() if isinstance(saved, _Regenerated) else saved


@contextlib.contextmanager
def regenerating(policy: Policy) -> Iterator[None]:
    """Run autograd with the outputs of ``policy.regenerate`` ops rebuilt in backward.

    NOTE [regenerate]. Gradients are bitwise those of the plain run; what the
    listed ops' outputs would hold while saved is spared, for one run of
    each op per unpack in backward.

    Args:
        policy: a `forget.policies.regenerate` policy.

    Raises:
        TypeError: ``policy`` regenerates nothing.
        ForgetError: entered inside a forget region's forward.
    """
    from ._core import _packers

    if not isinstance(policy, Policy) or not policy.regenerate:
        raise TypeError(
            f"forget: regenerating() takes a forget.policies.regenerate(...) policy, got {policy!r}"
        )
    if _packers.stack:
        raise ForgetError(
            "forget: regenerating() inside a forget region: the region saves nothing for "
            "backward already; use it around plain (kept) code."
        )
    names = {name for name, (op, _) in _RULES.items() if op in policy.regenerate}

    def pack(t: torch.Tensor) -> Any:
        base = t if t._base is None else t._base
        node = base.grad_fn
        if node is None or type(node).__name__ not in names:
            return t
        return _Regenerated(t, node, _RULES[type(node).__name__][1], base is not t)

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        yield
