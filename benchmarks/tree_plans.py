"""Plan tiny models as module trees; print budgets, allocator and ledger peaks side by side.

    python benchmarks/tree_plans.py [--models net,llama,bert,resnet] [--budgets 75%,50%,least]

The models are those of tests/_tree_models.py (built from configs, no
downloads): an encoder stack of our own, Hugging Face's Llama, BERT and ResNet
(BatchNorm convolutions, whose workspaces the ledger does not see). Each is
planned once per budget on a clock that runs nothing (bytes only); every
figure is measured. ``min`` is the least feasible budget. Rows: the budget, the
plan's peak by the allocator (the one that must fit) and by the ledger, the
plain step's peaks by both, and the modules not kept.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import forget
from forget._planning import FixedClock, TreePlanner


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        return x + scale * self.mlp(self.norm(x))


class _Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, scale=scale)
        return self.head(x)


def _net() -> tuple[nn.Module, dict[str, Any]]:
    return _Net().train(), {"x": torch.randn(32, 16, 8), "scale": 0.5}


def _hf(name: str) -> tuple[nn.Module, dict[str, Any]]:
    import transformers as tf

    ids = torch.randint(1, 64, (4, 64 if name == "bert" else 32))
    text: dict[str, Any] = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                num_attention_heads=4, vocab_size=64, max_position_embeddings=64)  # fmt: skip
    config: Any
    if name == "llama":
        config = tf.LlamaConfig(**text, num_key_value_heads=2, use_cache=False)
        return tf.LlamaForCausalLM(config).train(), {"input_ids": ids, "labels": ids}
    if name == "bert":
        config = tf.BertConfig(**text, pad_token_id=0)
        return tf.BertForMaskedLM(config).train(), {"input_ids": ids, "labels": ids}
    sizes: dict[str, Any] = dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                 depths=[2, 2], layer_type="basic", num_labels=3)  # fmt: skip
    config = tf.ResNetConfig(**sizes)
    x = torch.randn(8, 3, 32, 32)
    return tf.ResNetForImageClassification(config).train(), {
        "pixel_values": x,
        "labels": torch.arange(8) % 3,
    }


MODELS: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "net": _net,
    "llama": lambda: _hf("llama"),
    "bert": lambda: _hf("bert"),
    "resnet": lambda: _hf("resnet"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", default="75%,50%,min")
    args = parser.parse_args()
    print(
        f"{'model':<7} {'budget':>7} {'budget B':>10} {'allocator':>10} {'ledger':>10} "
        f"{'plain alloc':>11} {'plain ledg':>10}  not kept"
    )
    for name in args.models.split(","):
        torch.manual_seed(0)
        model, inputs = MODELS[name]()
        planner = TreePlanner(model, (), inputs, repeats=1, clock=FixedClock())
        for budget in args.budgets.split(","):
            try:
                plan = planner.plan(planner.least() if budget == "min" else budget)
            except forget.BudgetInfeasibleError as error:
                print(f"{name:<7} {budget:>7} {error.budget_bytes:>10,} infeasible: "
                      f"least {error.min_feasible_bytes:,} B")  # fmt: skip
                continue
            print(
                f"{name:<7} {budget:>7} {plan.budget_bytes:>10,} "
                f"{plan.measured_peak_bytes:>10,} {plan.ledger_peak_bytes:>10,} "
                f"{plan.plain_peak_bytes:>11,} {plan.plain_ledger_peak_bytes:>10,}  "
                f"{', '.join(f'{k}:{v}' for k, v in plan.choices.items())}"
            )


if __name__ == "__main__":
    main()
