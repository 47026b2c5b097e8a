"""How well the tree planner's cost model predicts the peaks it is then measured at.

    python benchmarks/predictions.py [--models llama,gpt2,bert,t5,vit,resnet]

The models and batches of benchmarks/plan_memory.py (transformers configs, no
downloads), one torch thread. Per model: the plain step's peak as the planner
predicts it (`forget._planning.TreePlanner.plain_peak`, the plain step never
runs in planning) and as the allocator counts it (``forget.measure(...,
probe="profiler")``, run here for the comparison); then the two assignments of
least memory (NOTE [least on demand]: the frontier's first point and every
innermost candidate forgotten), each predicted (`TreePlanner.predicted_peak`)
and measured by the allocator (`TreePlanner.measure_peak`). Every figure is
bytes and repeats to the byte for one torch version; the ratio is predicted
over measured (NOTE [backward work]).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

import forget
from forget._planning import TreePlanner
from plan_memory import MODEL_NAMES, build, warm_up


def _plain_step(model: Any, batch: dict[str, Any]) -> None:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODEL_NAMES))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| model | plan | predicted B | allocator B | predicted / allocator |")
    print("|---|---|---:|---:|---:|")
    for name in args.models.split(","):
        torch.manual_seed(0)
        model, batch = build(name, quick=False)
        warm_up(model, batch)
        planner = TreePlanner(model, (), batch)

        plain = forget.measure(_plain_step, model, batch, probe="profiler").peak_bytes
        model.zero_grad(set_to_none=True)
        rows = [("plain", planner.plain_peak, plain)]
        least = {"frontier's least": planner.choices_at(0), "every layer": planner.baseline()}
        for label, choices in least.items():
            rows.append((label, planner.predicted_peak(choices), planner.measure_peak(choices)))
        for label, predicted, measured in rows:
            ratio = predicted / measured
            print(f"| {name} | {label} | {predicted:,} | {measured:,} | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
