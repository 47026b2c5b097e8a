"""The capped rows of ``forget bench``: `forget.cap` over a run of varying shapes.

Per reference model, one training step after another under one cap, each at
another shape: the GPT at context lengths, the MLP and the CNN at batch
sizes, as fractions of the preset (`FRACTIONS`: the largest second, a small
one first, so the first step has learned nothing). The cap is a share of the
plain step's peak at the largest shape (``--cap 75%``; `SHARE` by default).
Beside the run, at the largest shape and the same budget, the baselines a
user would otherwise reach for:

- ``plan``: `forget.plan` at the cap's budget, made at the largest shape
  (its planning time is not counted; a plan fits the shapes it measured);
- ``torch_checkpoint`` and ``forget``: every block checkpointed, as the main
  table's variants (layer checkpointing).

Per row: the step's peak (exact storage bytes, `forget.measure`) and its
share of the cap, for the cap's steps the regions evicted of those run
(`forget._runtime.StepReport`), and the step time, a median over interleaved
rounds (`forget._planning.time_calls`) with the median of each round's ratio
to the plain step at the same shape. In the rounds the capped model sees the
shapes in a shuffled order, as a run of varying shapes would; each shape comes
back, so from its third step the cap repeats its decision with no count (NOTE
[steps of known shapes]) and the times are mostly those of such steps, while
the peak and evicted columns are of the first, capped step. A capped step's
loss and gradients must equal the plain step's bit for bit (CPU), and a step
the cap cannot hold is a row that says so (`forget.ForgetError`), not a crash.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import forget

from .._planning import time_calls
from ._common import BLOCK_WRAPPERS, chain_step, mib
from ._models import BlockModel, build_model

__all__ = ["FRACTIONS", "SHARE", "CapRow", "CapRows", "format_rows", "parse_share", "run"]

#: The cap, as a share of the plain step's peak at the largest shape.
SHARE = 0.5
#: The run's shapes, as fractions of the preset's batch (the GPT: its context).
FRACTIONS: tuple[float, ...] = (0.5, 1.0, 0.25, 0.75)
BASELINES: tuple[str, ...] = ("plan", "torch_checkpoint", "forget")


@dataclass(frozen=True)
class CapRow:
    """One step of the capped run, or a baseline at the largest shape.

    ``peak_bytes`` is ``None`` where the step did not run: the cap could not
    hold it, or no plan fits the budget (``note`` says which).
    """

    variant: str
    shape: str
    peak_bytes: int | None
    regions: int | None = None
    evicted: int | None = None
    step_s: float | None = None
    time_vs_plain: float | None = None
    grads_equal_to_plain: bool | None = None
    note: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if value is not None}


@dataclass(frozen=True)
class CapRows:
    """The capped run of one model and its baselines."""

    model: str
    share: float
    budget_bytes: int
    plain_peak_bytes: int
    largest: str
    rows: tuple[CapRow, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "share": self.share,
            "budget_bytes": self.budget_bytes,
            "plain_peak_bytes": self.plain_peak_bytes,
            "largest": self.largest,
            "rows": [row.as_json() for row in self.rows],
        }

    def problems(self) -> list[str]:
        """One line per capped step whose loss or gradients are not the plain step's."""
        return [
            f"cap: {self.model} at {row.shape}: loss or gradients differ from plain"
            for row in self.rows
            if row.grads_equal_to_plain is False
        ]


def _shapes(name: str, model: BlockModel, seed: int) -> list[tuple[str, Tensor, Tensor]]:
    """The run's ``(label, input, target)``: the GPT's context, the others' batch, cut."""
    x, target = model.example_input(generator=torch.Generator().manual_seed(seed))
    axis, what = (1, "context") if name == "tiny_gpt" else (0, "batch")
    shapes = []
    for fraction in FRACTIONS:
        size = max(1, round(x.shape[axis] * fraction))
        cut = (slice(None),) * axis + (slice(0, size),)
        shapes.append((f"{what} {size}", x[cut].contiguous(), target[cut].contiguous()))
    return shapes


def parse_share(text: str) -> float:
    """``--cap``'s share of the plain peak: ``"50%"`` or ``"0.5"``, above 0 and at most 1."""
    spec = text.strip()
    try:
        share = float(spec[:-1]) / 100 if spec.endswith("%") else float(spec)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise ValueError(
            f"forget: --cap takes a share of the plain step's peak, such as 50% or 0.5, "
            f"got {text!r}; a cap above the plain peak would evict nothing."
        )
    return share


def run(
    name: str, *, share: float = SHARE, size: str = "default", repeats: int = 5, seed: int = 0
) -> CapRows:
    """Measure and time the capped run of ``name`` and its baselines (module docstring)."""
    pristine = build_model(name, size, seed=seed).train()
    shapes = _shapes(name, pristine, seed)
    label, big_x, big_t = max(shapes, key=lambda s: s[1].numel())
    models = {v: copy.deepcopy(pristine) for v in ("plain", "cap", *BASELINES)}

    def step(variant: str, x: Tensor, t: Tensor) -> Tensor:
        models[variant].zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        return models[variant].step(x, t, BLOCK_WRAPPERS.get(variant))

    probe = copy.deepcopy(pristine)
    plain_peak = forget.measure(lambda: probe.step(big_x, big_t)).peak_bytes
    budget = int(plain_peak * share)
    handle = forget.cap(models["cap"], budget)
    rows: dict[tuple[str, str], CapRow] = {}
    calls: dict[tuple[str, str], Callable[[], object]] = {}
    for shape, x, t in shapes:
        loss = step("plain", x, t)
        grads = [p.grad for p in models["plain"].parameters()]
        try:
            report = forget.measure(step, "cap", x, t)
        except forget.ForgetError as error:
            rows["cap", shape] = CapRow("cap", shape, None, note=_first_clause(error))
            continue
        last = handle.last_step
        assert last is not None  # the step ran under the cap
        same = torch.equal(loss, report.result) and all(
            _same_grad(g, p.grad) for g, p in zip(grads, models["cap"].parameters(), strict=True)
        )
        rows["cap", shape] = CapRow(
            "cap", shape, report.peak_bytes, len(last.regions), len(last.evicted),
            grads_equal_to_plain=same,
        )  # fmt: skip
        calls["cap", shape] = _bound(step, "cap", x, t)
        calls["plain", shape] = _bound(step, "plain", x, t)
    calls["plain", label] = _bound(step, "plain", big_x, big_t)
    try:
        planned_step = chain_step(models["plan"], (big_x, big_t))
        planned = forget.plan(
            planned_step.model, *planned_step.args, budget=budget, loss_fn=planned_step.loss_fn
        )
        planned.apply(models["plan"])
    except forget.ForgetError as error:
        rows["plan", label] = CapRow("plan", label, None, note=_first_clause(error))
    for variant in BASELINES:
        if ("plan", label) in rows and variant == "plan":
            continue
        peak = forget.measure(step, variant, big_x, big_t).peak_bytes
        rows[variant, label] = CapRow(variant, label, peak)
        calls[variant, label] = _bound(step, variant, big_x, big_t)
    times = time_calls(calls, repeats)
    for key, row in rows.items():
        if key in times:
            rows[key] = CapRow(
                **{
                    **row.__dict__,
                    "step_s": statistics.median(times[key]),
                    "time_vs_plain": statistics.median(
                        a / b for a, b in zip(times[key], times["plain", key[1]], strict=True)
                    ),
                }
            )
    order = [("cap", s) for s, _, _ in shapes] + [(v, label) for v in BASELINES]
    return CapRows(name, share, budget, plain_peak, label, tuple(rows[key] for key in order))


def _bound(step: Callable[[str, Tensor, Tensor], Tensor], *args: Any) -> Callable[[], object]:
    return lambda: step(*args)


def _same_grad(a: Tensor | None, b: Tensor | None) -> bool:
    return a is b if a is None or b is None else torch.equal(a, b)


def _first_clause(error: BaseException) -> str:
    """The error's first clause: ``the cap of 72,632 B cannot hold this step``."""
    text = str(error).removeprefix("forget: ")
    return min((text.split(mark)[0] for mark in (":", " (", ";")), key=len)


def format_rows(result: CapRows) -> str:
    """The run as a fixed-width table under a title, as the bench's other rows."""
    header = ("variant", "shape", "peak MiB", "peak/cap", "evicted", "step ms", "time/plain")
    cells: list[tuple[str, ...]] = []
    for row in result.rows:
        if row.peak_bytes is None:
            cells.append((row.variant, row.shape, f"({row.note})"))
            continue
        cells.append(
            (
                row.variant,
                row.shape,
                mib(row.peak_bytes),
                f"{row.peak_bytes / result.budget_bytes:.2f}",
                "" if row.evicted is None else f"{row.evicted}/{row.regions}",
                "" if row.step_s is None else f"{row.step_s * 1e3:.1f}",
                "" if row.time_vs_plain is None else f"{row.time_vs_plain:.2f}x",
            )
        )
    full = [header, *(c for c in cells if len(c) == len(header))]
    widths = [max(len(c[i]) for c in full) for i in range(len(header))]
    widths[:2] = [max(widths[i], *(len(c[i]) for c in cells)) for i in range(2)]

    def line(row: Sequence[str]) -> str:
        first = [f"{c:<{w}}" for c, w in zip(row[:2], widths, strict=False)]
        rest = [f"{c:>{w}}" for c, w in zip(row[2:], widths[2:], strict=False)]
        if len(row) < len(header):  # a step that did not run: its reason
            rest = list(row[2:])
        return "  ".join(first + rest).rstrip()

    title = (
        f"forget.cap on {result.model}, shapes varying step to step: the cap at "
        f"{result.share:.0%} of the plain peak at {result.largest} ({result.budget_bytes:,} B); "
        f"beside it at {result.largest}, the plan at that budget and every block checkpointed"
    )
    return "\n".join(
        [title, line(header), line(["-" * w for w in widths])] + [line(c) for c in cells]
    )
