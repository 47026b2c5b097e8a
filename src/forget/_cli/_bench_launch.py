"""The launch-bound row of ``forget bench``: what a region costs per op when ops are cheap.

A chain of small elementwise ops (``sin``, multiply, add, in turn) on a
64-float tensor that requires grad, so that every op's time is its dispatch
and autograd bookkeeping, not its arithmetic. One step (forward, ``sum``,
backward) of the whole chain in three variants, side by side in one run:

- ``plain``: the chain called directly;
- ``torch_checkpoint``: the whole chain in one
  ``torch.utils.checkpoint.checkpoint(chain, x, use_reentrant=False)``;
- ``forget``: the whole chain in one ``forget.checkpoint(chain, x)``.

Both checkpoints keep only ``x`` and run the chain's forward again in
backward (each stops at the last op whose saved tensor backward needs), so
over plain they pay one more forward of every op plus their per-op machinery
(saved-tensor hooks, forget's state tracking); divided by the number of ops
that is the row's figure, microseconds per op. Times are medians over
interleaved rounds (`forget._planning.time_calls`); each variant's extra time
is the median of its per-round difference to plain (or to torch's
checkpoint), so that a slow stretch of the machine shared by a round divides
out (NOTE [paired rounds] in `forget._planning`). The gradient of ``x`` must
equal plain's bit for bit in both checkpointed variants.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

import forget
from forget._planning import time_calls

__all__ = [
    "NUMEL",
    "OPS",
    "ROUNDS_PER_REPEAT",
    "RUNNERS",
    "VARIANTS",
    "LaunchRow",
    "chain",
    "format_rows",
    "paired_us_per_op",
    "run",
]

VARIANTS: tuple[str, ...] = ("plain", "torch_checkpoint", "forget")
# Ops in the chain, per bench size: "tiny" is for unit tests.
OPS: dict[str, int] = {"tiny": 30, "quick": 300, "default": 300}
NUMEL = 64
# A step of the chain takes milliseconds: this many rounds per --repeats cost
# about a second at the default size and steady the medians.
ROUNDS_PER_REPEAT = 5


def chain(h: Tensor, ops: int) -> Tensor:
    """Apply ``ops`` cheap elementwise ops to ``h``: ``sin``, ``* 0.9``, ``+ 0.1``, in turn."""
    for i in range(ops):
        step = i % 3
        h = h.sin() if step == 0 else h * 0.9 if step == 1 else h + 0.1
    return h


def _plain(ops: int, x: Tensor) -> Tensor:
    return chain(x, ops)


def _torch_checkpoint(ops: int, x: Tensor) -> Tensor:
    out: Tensor = torch.utils.checkpoint.checkpoint(chain, x, ops, use_reentrant=False)
    return out


def _forget_checkpoint(ops: int, x: Tensor) -> Tensor:
    out: Tensor = forget.checkpoint(chain, x, ops)
    return out


# variant -> forward of the whole chain, ``run(ops, x)``.
RUNNERS: dict[str, Callable[[int, Tensor], Tensor]] = {
    "plain": _plain,
    "torch_checkpoint": _torch_checkpoint,
    "forget": _forget_checkpoint,
}


@dataclass(frozen=True)
class LaunchRow:
    """The row's figures: seconds per step, microseconds per op, gradient checks."""

    ops: int
    numel: int
    rounds: int
    step_s: dict[str, float]
    extra_us_per_op: dict[str, float]
    forget_over_torch_us_per_op: float
    grads_equal_to_plain: dict[str, bool]

    def as_json(self) -> dict[str, Any]:
        return {
            "ops": self.ops,
            "numel": self.numel,
            "rounds": self.rounds,
            "step_s": dict(self.step_s),
            "plain_us_per_op": self.step_s["plain"] / self.ops * 1e6,
            "extra_us_per_op": dict(self.extra_us_per_op),
            "forget_over_torch_us_per_op": self.forget_over_torch_us_per_op,
            "grads_equal_to_plain": dict(self.grads_equal_to_plain),
        }

    def problems(self) -> list[str]:
        """One line per checkpointed variant whose gradient is not plain's, bit for bit."""
        return [
            f"launch_bound: {v} gradients differ from plain"
            for v, ok in self.grads_equal_to_plain.items()
            if not ok
        ]


def run(*, size: str = "default", repeats: int = 5, seed: int = 0) -> LaunchRow:
    """Check, then time the three variants of the chain; see the module docstring."""
    ops = OPS[size]
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)).requires_grad_()

    def step(variant: str) -> Tensor:
        loss = RUNNERS[variant](ops, x).sum()
        loss.backward()
        return loss.detach()

    def prepare(_: str) -> None:
        x.grad = None

    grads = {}
    for v in VARIANTS:
        prepare(v)
        step(v)
        assert x.grad is not None  # the chain reaches x
        grads[v] = x.grad.clone()
    rounds = ROUNDS_PER_REPEAT * repeats
    times = time_calls({v: functools.partial(step, v) for v in VARIANTS}, rounds, prepare=prepare)
    return LaunchRow(
        ops=ops,
        numel=NUMEL,
        rounds=rounds,
        step_s={v: statistics.median(ts) for v, ts in times.items()},
        extra_us_per_op={v: paired_us_per_op(times[v], times["plain"], ops) for v in VARIANTS[1:]},
        forget_over_torch_us_per_op=paired_us_per_op(
            times["forget"], times["torch_checkpoint"], ops
        ),
        grads_equal_to_plain={v: torch.equal(grads["plain"], grads[v]) for v in VARIANTS[1:]},
    )


def paired_us_per_op(times: Sequence[float], base: Sequence[float], ops: int) -> float:
    """Median over rounds of ``times - base`` (same round), in microseconds per op."""
    return statistics.median(t - b for t, b in zip(times, base, strict=True)) / ops * 1e6


def format_rows(row: LaunchRow) -> str:
    """Render the row as a small fixed-width table under a one-line title."""
    header = ("variant", "step ms", "us/op", "+us/op vs plain", "+us/op vs torch", "grads")
    rows = []
    for v in VARIANTS:
        rows.append(
            (
                v,
                f"{row.step_s[v] * 1e3:.2f}",
                f"{row.step_s[v] / row.ops * 1e6:.2f}",
                "" if v == "plain" else f"{row.extra_us_per_op[v]:+.2f}",
                f"{row.forget_over_torch_us_per_op:+.2f}" if v == "forget" else "",
                "" if v == "plain" else "=plain" if row.grads_equal_to_plain[v] else "differ",
            )
        )
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first = f"{cells[0]:<{widths[0]}}"
        rest = [f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    title = (
        f"launch-bound chain: {row.ops} elementwise ops on {row.numel} floats, one region "
        f"over the chain; step = forward + backward, median of {row.rounds} rounds"
    )
    return "\n".join(
        [title, line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
    )
