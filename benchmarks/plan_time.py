"""Issue 30's target "planning time at most 30 plain steps", by CPU time.

    python benchmarks/plan_time.py [--models llama,gpt2,bert,resnet]
        [--budgets 75%,50%,least] [--repeats 5]

The models of benchmarks/tree_targets.py (its ``MODELS``), one torch thread;
by name only, ``resnet18`` (`LARGER`): the same ResNet at a real model's size.
Per model: the plain step's CPU time (`time.process_time`, the mean of
``--repeats`` steps after two warm-up steps), then per budget a fresh
`forget._planning.TreePlanner` (what `forget.plan` runs, with the default
options, the heap frozen and the budget given to the profile as it gives them)
planned for it, and its CPU time from construction to plan over 30 plain
steps'. CPU time, not wall time: on a shared machine the wall clock
charges a process for its neighbours. Also per row: the assignments measured
(guarded steps run, stopped ones included) and the plan's peak over the budget.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

import forget
from forget._memory import frozen_heap
from forget._planning import TreePlanner
from forget.policies import DEFAULT_OPTIONS
from tree_targets import MODELS


def _resnet18(quick: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A ResNet-18 of transformers' (widths 64 to 512, two blocks a stage), 16 images of
    224 x 224: the small ResNet's planning at a real model's size (by name only)."""
    import transformers as tf

    sizes: dict[str, Any] = dict(
        num_channels=3, embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
        layer_type="basic", num_labels=10,
    )  # fmt: skip
    config = tf.ResNetConfig(**sizes)
    inputs = {"pixel_values": torch.randn(16, 3, 224, 224), "labels": torch.arange(16) % 10}
    return tf.ResNetForImageClassification(config).train(), inputs


#: Models run by name only, not by default.
LARGER = {"resnet18": (_resnet18, "")}


def plain_step_s(model: torch.nn.Module, inputs: dict[str, object], repeats: int) -> float:
    """The CPU seconds of one plain step (forward and backward), averaged."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()

    for _ in range(2):
        step()
    start = time.process_time()
    for _ in range(repeats):
        step()
    model.zero_grad(set_to_none=True)
    return (time.process_time() - start) / repeats


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", default="75%,50%,least")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    print("| model | budget | plan s | 30 plain steps s | ratio | assignments | peak / budget |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        factory, _ = {**MODELS, **LARGER}[name]
        torch.manual_seed(0)
        model, inputs = factory(False)
        thirty = 30 * plain_step_s(model, inputs, args.repeats)
        for budget in args.budgets.split(","):
            start = time.process_time()
            # As `forget.plan` plans: the heap frozen, the budget given to the profile.
            with frozen_heap():
                given = None if budget == "least" else budget
                planner = TreePlanner(model, (), inputs, options=DEFAULT_OPTIONS, budget=given)
                try:
                    plan = planner.plan(planner.least() if budget == "least" else budget)
                    fit = f"{plan.measured_peak_bytes / plan.budget_bytes:.3f}"
                except forget.BudgetInfeasibleError:
                    fit = "infeasible"
            spent = time.process_time() - start
            tried = len(planner.measured) + len(planner.stopped)
            print(
                f"| {name} | {budget} | {spent:.2f} | {thirty:.2f} | {spent / thirty:.2f} "
                f"| {tried} | {fit} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
