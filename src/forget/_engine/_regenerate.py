"""Regenerate: drop the saved outputs of cheap ops and rebuild them in backward.

NOTE [regenerate]: some saved tensors are pure functions of others autograd
keeps anyway: GELU saves its input, and the next Linear saves GELU's output.
Under `regenerating`, the pack hook keeps, for the output (or a view of it) of a
listed op, only a reference to the op's backward node; at unpack the op runs
again on that node's saved input (same kernel, same values: bitwise the
forward's tensor), before the node's own backward frees it, since a consumer's
backward runs before its producer's. No dispatch mode and no re-run of anything
else, so it is cheaper than a policy region where the ops spared are small
(figures: benchmarks/measured.md, "Single measurements behind the NOTEs").
LayerNorm outputs, products and CPU dropout masks are rebuilt the same way
(NOTE [regenerate a layer norm], [regenerate a product], [two-valued masks]).
Inside a forget region it installs nothing: the re-run drops the listed outputs
instead (NOTE [regenerate in a re-run]). A tensor still alive at unpack is
returned as it is, after autograd's version check.

NOTE [regenerate in a re-run]: `regenerating` entered while a region runs
records its pack function against the innermost region's own pack (a
thread-local stack). The region's first forward ignores it; the re-run's
``collect`` (``_region``) asks `rerun_pack` whether a regenerating() was
entered directly under it and, if so, stores the `_Regenerated` it returns
instead of the tensor, and gives the re-run's graph the same small object,
so that nothing holds the tensor once the re-run's op has consumed it. The
rules' checks at pack time run unseen by the re-run's dispatch mode (they are
not the region's ops). The rebuild closures read the re-run graph's nodes,
which keep only tensors the region holds anyway until those nodes' own
backward, which comes later. A region nested in the regenerating() block
is not covered: its stages are regenerated only by a regenerating() entered
inside its own body, as at the top level.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._errors import ForgetError
from ..policies import REGENERABLE, Policy

__all__ = ["regenerating"]

Rebuild = Callable[[], torch.Tensor]


def _gelu(node: Any, out: torch.Tensor) -> Rebuild | None:
    return lambda: torch.ops.aten.gelu(node._saved_self, approximate=node._saved_approximate)


def _silu(node: Any, out: torch.Tensor) -> Rebuild | None:
    return lambda: torch.ops.aten.silu(node._saved_self)


# NOTE [region outputs]: the key a forget region sets in the metadata of its
# outputs' nodes (``_region``). Such a node saved forget slots, not tensors:
# reading one (a rule's check, or a rebuild) would re-run the region then, in the
# forward or ahead of its own backward, and hold what the re-run rebuilds until
# then, which raises the peak. The rules leave their outputs alone.
REGION_OUTPUT = "forget.region_output"


def _in_region(node: Any) -> bool:
    """Whether ``node`` was recorded inside a forget region (its saved tensors are slots)."""
    return REGION_OUTPUT in node.metadata


def mark_outputs(out: Any) -> None:
    """Mark the nodes of a region's outputs (and of their bases) as the region's.

    NOTE [region outputs]: those nodes saved slots, which
    `regenerating` must not read.
    """
    for o in (out,) if isinstance(out, torch.Tensor) else pytree.tree_leaves(out):
        if isinstance(o, torch.Tensor):
            for u in (o, o._base):
                if u is not None and u.grad_fn is not None:
                    metadata: dict[str, Any] = u.grad_fn.metadata  # type: ignore[assignment]
                    metadata[REGION_OUTPUT] = True


def _operand(node: Any, i: int, saved: str) -> Callable[[], torch.Tensor] | None:
    """How to get operand ``i`` of a binary op back in backward, or None.

    NOTE [regenerate a product]: ``MulBackward0`` keeps ``other`` when ``self``
    needs a gradient and ``self`` when ``other`` does (the next function of an
    operand without one is None). An operand it does not keep may still be kept
    by the op that made it, as its result (softmax, exp, tanh, sigmoid keep
    theirs): that result *is* the operand, whose own grad_fn is that node.
    """
    other = node.next_functions[1 - i][0]
    if other is not None:
        return lambda: getattr(node, saved)
    producer, output = node.next_functions[i]
    if (
        producer is not None
        and output == 0
        and hasattr(producer, "_saved_result")
        and not _in_region(producer)
    ):
        return lambda: producer._saved_result
    return None


def _mul(node: Any, out: torch.Tensor) -> Rebuild | None:
    a, b = _operand(node, 0, "_saved_self"), _operand(node, 1, "_saved_other")
    if a is None or b is None:
        return None
    return lambda: torch.ops.aten.mul(a(), b())


# NOTE [regenerate a layer norm]: the epsilons tried, the last one that worked first.
_EPSILONS = [1e-5, 1e-6, 1e-12]
_EPSILONS_LOCK = threading.Lock()


def _layer_norm(node: Any, out: torch.Tensor) -> Rebuild | None:
    """LayerNorm's output from the input, weight and bias its backward keeps.

    NOTE [regenerate a layer norm]: ``NativeLayerNormBackward0`` keeps all the
    op's inputs but ``eps``. So the rebuild is tried at pack time with the
    usual epsilons (the last one that worked first; ``nn.LayerNorm``'s 1e-5
    until one has) and kept only if it gives the output's very bits: one
    LayerNorm forward in the forward pass and one in backward, for the
    output's bytes.
    """
    if out.output_nr != 0 or not out.requires_grad:
        return None
    bits = _cpu_bits(out)
    if bits is None:
        return None
    x, shape = node._saved_input, node._saved_normalized_shape
    weight, bias = node._saved_weight, node._saved_bias

    with _EPSILONS_LOCK:
        epsilons = list(_EPSILONS)
    for eps in epsilons:
        with torch.no_grad():
            again = torch.ops.aten.native_layer_norm(x, shape, weight, bias, eps)[0]
        if again.stride() == out.stride() and torch.equal(again.view(bits), out.view(bits)):
            if eps != epsilons[0]:
                with _EPSILONS_LOCK:
                    _EPSILONS.sort(key=lambda e: e != eps)  # stable: eps first
            return lambda: torch.ops.aten.native_layer_norm(
                node._saved_input,
                node._saved_normalized_shape,
                node._saved_weight,
                node._saved_bias,
                eps,
            )[0]
    return None


# Backward node -> (the op it is the backward of, how to rebuild the op's output,
# given the node and that output, or None where it cannot).
_RULES: dict[str, tuple[str, Callable[[Any, torch.Tensor], Rebuild | None]]] = {
    "GeluBackward0": ("aten.gelu", _gelu),
    "SiluBackward0": ("aten.silu", _silu),
    "MulBackward0": ("aten.mul", _mul),
    "NativeLayerNormBackward0": ("aten.native_layer_norm", _layer_norm),
}
# NOTE [two-valued masks]: not an op's output rebuilt, a tensor stored smaller.
_MASKS = "aten.bernoulli_"
assert {op for op, _ in _RULES.values()} | {_MASKS} == set(REGENERABLE)
_MIN_MASK_NUMEL = 1024
_SAME_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}
_SAME_BITS.update({torch.float16: torch.int16, torch.bfloat16: torch.int16})


def _cpu_bits(t: torch.Tensor) -> torch.dtype | None:
    """The integer dtype whose view of ``t`` compares its bits, for a CPU float tensor.

    None elsewhere: the rules that compare bits at pack time (a mask's values, a
    rebuilt LayerNorm) would wait for a CUDA device on every saved tensor.
    """
    return _SAME_BITS.get(t.dtype) if t.device.type == "cpu" else None


def _two_valued(t: torch.Tensor) -> Rebuild | None:
    """A rebuild of ``t`` from a bool mask and one value, if ``t`` is exactly that.

    NOTE [two-valued masks]: dropout on CPU draws its mask as a float tensor
    (``empty_like(x).bernoulli_(1 - p).div_(1 - p)``) and the product's backward
    keeps it: a float per element for one bit. A saved tensor without a grad_fn that
    was written in place (version not 0) is checked: if ``t != 0`` and its largest
    value rebuild the same bits, a bool mask and that value are kept instead. The
    check costs a few reductions, only for such tensors; the rebuild, one pass. CPU
    only: CUDA's fused dropout keeps a bool mask already, and the check would wait
    for the device.
    """
    bits = _cpu_bits(t)
    if (
        bits is None
        or t.grad_fn is not None
        or t.requires_grad
        or not t._version
        or t.numel() < _MIN_MASK_NUMEL
        or t._base is not None
        or not t.is_contiguous()
        or t.is_sparse
    ):
        return None
    # Exact, in three passes over the bits (as integers): none is negative (no
    # sign bit), the largest is V > 0, and they sum to V times the number of
    # nonzero ones; so each nonzero one is V, and every other one is +0.
    as_bits = t.view(bits)
    low, high = torch.aminmax(as_bits)
    if low < 0 or high <= 0:
        return None
    mask = as_bits != 0
    if as_bits.sum() != torch.count_nonzero(mask) * high.to(torch.int64):
        return None
    value = high.view(t.dtype)
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    return lambda: torch.where(mask, value, zero)


class _Regenerated:
    """What is saved in place of a dropped tensor: how to rebuild it."""

    __slots__ = ("base_stride", "layout", "rebuild", "ref", "version", "view")

    def __init__(self, t: torch.Tensor, rebuild: Rebuild, view: bool) -> None:
        self.rebuild = rebuild
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
        out = self.rebuild()
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


def _kept(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a pack keeps it: detached where it has a graph (NOTE [kept outputs]).

    NOTE [kept outputs]: a pack that returns a tensor with a ``grad_fn`` keeps that
    tensor, so where the tensor is an output its own node saves, the node holds
    the tensor that holds the node: a cycle through C++ that Python's collector
    cannot see. Backward breaks it as it frees the saved values; a forward whose
    backward never runs (a step the planner's guard stopped) leaked its whole
    graph. The detached tensor shares the storage and the version counter, so
    what backward reads, and the in-place check, are the same.
    """
    return t.detach() if t.grad_fn is not None else t


def resolve(saved: Any) -> Any:
    """What a saved value stands for: a `_Regenerated` rebuilt, anything else as it is.

    The unpack of `regenerating`'s hooks, and what ``_region`` calls on a value a
    re-run stored (NOTE [regenerate in a re-run]).
    """
    return saved.get() if isinstance(saved, _Regenerated) else saved


class _InRegions(threading.local):
    stack: list[tuple[object, Callable[[torch.Tensor], Any]]]

    def __init__(self) -> None:
        self.stack = []


# NOTE [regenerate in a re-run]: (the region pack it was entered under, its pack).
_in_regions = _InRegions()


def rerun_pack(owner: object) -> Callable[[torch.Tensor], Any] | None:
    """The pack of a `regenerating` entered directly under the region pack ``owner``, or None."""
    stack = _in_regions.stack
    if stack and stack[-1][0] is owner:
        return stack[-1][1]
    return None


@contextlib.contextmanager
def regenerating(policy: Policy) -> Iterator[None]:
    """Run autograd with the outputs of ``policy.regenerate`` ops rebuilt in backward.

    NOTE [regenerate]. Gradients are bitwise those of the plain run; what the
    listed ops' outputs would hold while saved is spared, for one run of
    each op per unpack in backward. Inside a forget region's function it
    applies to the region's re-run (NOTE [regenerate in a re-run]): the
    re-run holds, until backward reaches them, only what it cannot rebuild.

    Args:
        policy: a `forget.policies.regenerate` policy.

    Raises:
        TypeError: ``policy`` regenerates nothing.
    """
    from ._local import _packers

    if not isinstance(policy, Policy) or not policy.regenerate:
        raise TypeError(
            f"forget: regenerating() takes a forget.policies.regenerate(...) policy, got {policy!r}"
        )
    rules = {name: rule for name, (op, rule) in _RULES.items() if op in policy.regenerate}
    masks = _MASKS in policy.regenerate

    def pack(t: torch.Tensor) -> Any:
        base = t if t._base is None else t._base
        node = base.grad_fn
        if node is None:
            rebuild = _two_valued(t) if masks else None
            return t if rebuild is None else _Regenerated(t, rebuild, False)
        rule = rules.get(type(node).__name__)
        if rule is None or _in_region(node):  # NOTE [region outputs]
            return _kept(t)
        rebuild = rule(node, base)
        return _kept(t) if rebuild is None else _Regenerated(t, rebuild, base is not t)

    if _packers.stack:  # NOTE [regenerate in a re-run]
        entry = (_packers.stack[-1], pack)
        _in_regions.stack.append(entry)
        try:
            yield
        finally:
            _in_regions.stack.remove(entry)
        return
    with torch.autograd.graph.saved_tensors_hooks(pack, resolve):
        yield
