"""The selective-recomputation row of ``forget bench``: policies on the GPT-style block.

On the reference TinyGPT (blocks of LayerNorm, causal attention through
``scaled_dot_product_attention``, dropout and an MLP), one training step in
each of these variants, side by side in one run:

- ``plain``: plain autograd;
- ``forget_all``: every block a forgotten region (keeps block inputs only);
- ``selective``: every block a region that keeps the outputs of its linear
  layers' matmuls and of fused attention kernels, and recomputes the rest:
  the attention core (the T x T scores, softmax and its dropout), LayerNorm,
  GELU, dropout (Korthikanti et al. 2022's selective recomputation);
- ``selective_masks``: the same, and it keeps the dropout masks too
  (`policies.DROPOUT`, as bits: NOTE [kept draws]), so the re-run draws no
  random numbers; on CPU the T x T mask's ``bernoulli_`` is the costliest op of
  the recomputed attention core;
- ``offload``: the same outputs offloaded to host memory (on CPU a no-op:
  it then equals ``selective``, and the row says so).

Reported: peak and saved-for-backward bytes (exact, `forget.measure`), the
step time median over interleaved rounds, and ratios against plain (time: the
median of the per-round ratios).
"""

from __future__ import annotations

import copy
import functools
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import forget
from forget import policies
from forget._planning import time_calls
from forget.schedules import MIB

from ._models import SIZES, build_model

__all__ = ["VARIANTS", "format_rows", "run"]

VARIANTS = ("plain", "forget_all", "selective", "selective_masks", "offload")

SELECTIVE = policies.save_outputs_of(*policies.LINEAR, *policies.ATTENTION)
SELECTIVE_MASKS = policies.save_outputs_of(*policies.LINEAR, *policies.ATTENTION, *policies.DROPOUT)
OFFLOAD = policies.offload_outputs_of(*policies.LINEAR, *policies.ATTENTION)

# Selective recomputation targets long sequences, where attention's T x T tensors
# dominate; at "default" the rows run the reference GPT at context 512, width 512 and
# 8 heads of 64 (GPT-2's head width), batch 2: each T x T tensor 16 MiB. At batch 4
# they are 32 MiB, glibc's ceiling for serving a block from the heap: each one is then
# a fresh mapping, and the page faults slow plain, which allocates the most (+12 %
# a step, 60 s of system time in a run), so forget would look cheaper than it is.
# Other sizes run as the benchmark's.
OVERRIDES: dict[str, dict[str, int]] = {
    "default": {"context": 512, "width": 512, "heads": 8, "batch_size": 2}
}


def _wrap(variant: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor] | None:
    if variant == "plain":
        return None
    policy = {
        "forget_all": None,
        "selective": SELECTIVE,
        "selective_masks": SELECTIVE_MASKS,
        "offload": OFFLOAD,
    }[variant]
    return lambda block, h: forget.checkpoint(block, h, policy=policy)


def run(
    *, size: str = "default", repeats: int = 5, seed: int = 0, **config: int
) -> dict[str, dict[str, Any]]:
    """Measure the variants; return ``{variant: {peak_bytes, saved_bytes, step_s}}``.

    ``config`` overrides the TinyGPT's preset (``width=1024, heads=16``).
    """
    config = {**OVERRIDES.get(size, {}), **config}
    pristine = build_model("tiny_gpt", size, seed=seed, **config)
    x, y = pristine.example_input(generator=torch.Generator().manual_seed(seed))
    models = {v: copy.deepcopy(pristine) for v in VARIANTS}
    out: dict[str, dict[str, Any]] = {}
    losses = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="forget: offload of CPU tensors is a no-op")
        for v in VARIANTS:
            model = copy.deepcopy(pristine)
            torch.manual_seed(seed)
            report = forget.measure(model.step, x, y, _wrap(v))
            losses[v] = report.result
            out[v] = {"peak_bytes": report.peak_bytes, "saved_bytes": report.saved_bytes}

        def prepare(v: str) -> None:
            models[v].zero_grad(set_to_none=True)
            torch.manual_seed(seed)

        # Each round runs every variant once, in a shuffled order (`time_calls`).
        calls = {v: functools.partial(models[v].step, x, y, _wrap(v)) for v in VARIANTS}
        times = time_calls(calls, repeats, prepare=prepare)
    for v in VARIANTS:
        out[v]["step_s"] = statistics.median(times[v])
        # The median of each round's ratio: a drift of the machine's speed between
        # rounds (on 2 shared cores, +-15 %) cancels within a round.
        out[v]["time_vs_plain"] = statistics.median(
            t / p for t, p in zip(times[v], times["plain"], strict=True)
        )
        out[v]["loss_equal_to_plain"] = bool(torch.equal(losses[v], losses["plain"]))
    out["offload"]["note"] = (
        "CPU: offload keeps tensors in host memory already (equals selective)"
        if x.device.type == "cpu"
        else "offloaded to pinned host memory"
    )
    return out


def format_rows(rows: dict[str, dict[str, Any]]) -> str:
    """A table of the rows, with ratios variant / plain, as the main table's."""
    plain = rows["plain"]
    lines = [
        "selective recomputation on the TinyGPT blocks (policies, forget.checkpoint per block;"
        " selective keeps linear-layer matmul outputs, recomputes attention's core)",
        f"{'variant':<16}{'peak MiB':>10}{'saved MiB':>11}{'step ms':>9}"
        f"{'peak/plain':>12}{'saved/plain':>13}{'time/plain':>12}",
    ]
    for v in VARIANTS:
        r = rows[v]
        lines.append(
            f"{v:<16}{r['peak_bytes'] / MIB:>10.2f}{r['saved_bytes'] / MIB:>11.2f}"
            f"{r['step_s'] * 1e3:>9.1f}{r['peak_bytes'] / max(plain['peak_bytes'], 1):>11.2f}x"
            f"{r['saved_bytes'] / max(plain['saved_bytes'], 1):>12.2f}x"
            f"{r['time_vs_plain']:>11.2f}x"
        )
    lines.append(f"offload: {rows['offload']['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m forget._cli._bench_selective [--width N ...]``: the rows at another shape."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m forget._cli._bench_selective")
    parser.add_argument("--size", default="default", choices=SIZES)
    parser.add_argument("--repeats", type=int, default=5)
    shape = ("width", "heads", "context", "depth", "batch_size")
    for key in shape:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"override the {key}")
    args = parser.parse_args(argv)
    config = {key: value for key in shape if (value := getattr(args, key)) is not None}
    print(format_rows(run(size=args.size, repeats=args.repeats, **config)))
    return 0


if __name__ == "__main__":  # pragma: no cover - a manual entry point
    raise SystemExit(main())
