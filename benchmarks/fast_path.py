"""forget's fast path against torch's checkpoint and forget's exact path, side by side.

Each reference model of `forget._cli._models` (default size) runs training steps with
every block through ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``,
through ``forget.checkpoint`` (its sites learned on the first call, then fast:
NOTE [fast path]) and through ``forget.checkpoint`` under
``forget._engine.fast_path(False)`` (every call exact); variants in shuffled order each
round, the median of the per-round ratios to torch printed. Figures go in
benchmarks/measured.md.

    python benchmarks/fast_path.py [rounds]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import Tensor

import forget
from forget._cli._models import MODEL_NAMES, build_model
from forget._engine import fast_path


def _torch(block: Callable[[Tensor], Tensor], h: Tensor) -> Tensor:
    return torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)


def _forget(block: Callable[[Tensor], Tensor], h: Tensor) -> Tensor:
    return forget.checkpoint(block, h)


def ratios(name: str, rounds: int) -> dict[str, float]:
    """Median per-round step-time ratio to torch's checkpoint, of fast and exact."""
    model = build_model(name, "default", seed=0)
    model.train()
    x, target = model.example_input(generator=torch.Generator().manual_seed(0))
    models = {v: copy.deepcopy(model) for v in ("torch", "fast", "exact")}

    def step(variant: str) -> None:
        m = models[variant]
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        if variant == "exact":
            with fast_path(False):
                m.step(x, target, _forget)
        else:
            m.step(x, target, _torch if variant == "torch" else _forget)

    for variant in models:
        step(variant)
        step(variant)
    times: dict[str, list[float]] = {v: [] for v in models}
    order = random.Random(0)
    for _ in range(rounds):
        variants = list(models)
        order.shuffle(variants)
        for variant in variants:
            start = time.perf_counter()
            step(variant)
            times[variant].append(time.perf_counter() - start)
    return {
        v: statistics.median(a / b for a, b in zip(times[v], times["torch"], strict=True))
        for v in ("fast", "exact")
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("rounds", nargs="?", type=int, default=30, help="rounds (default 30)")
    rounds = parser.parse_args(argv).rounds
    for name in MODEL_NAMES:
        r = ratios(name, rounds)
        print(f"{name:13s} fast/torch {r['fast']:.3f}  exact/torch {r['exact']:.3f}")


if __name__ == "__main__":
    main()
