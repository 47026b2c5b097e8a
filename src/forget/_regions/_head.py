"""A language model's head: the module whose logits are tokens x vocabulary.

NOTE [the head's floor]: every layer forgotten, a language model's step still
holds its logits, upcast to float for the loss, and their gradient; no choice
of regions goes below them while they exist whole. So where a budget is out of
reach by no more than those bytes, the planner's error names the head and the
fix (`chunk_loss`, which computes the loss chunk by chunk), unless the head is
chunked already. The head is the model's output embeddings (transformers'
``get_output_embeddings``), or a linear submodule named ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["CHUNKED", "HEAD", "head_hint", "logits_head"]

# The attribute `chunk_loss` sets on a model whose head it chunks, and the owner of the
# forward it wraps (`RegionForward.owner`: no plan's, so a plan or cap may go on top).
CHUNKED = "_forget_chunked_loss"
HEAD = "chunk_loss"


def logits_head(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """The model's head, by its dotted name, or ``None`` where it has none."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return None
    name = next((n for n, m in model.named_modules() if m is head), None)
    return None if name is None else (name, head)


def head_hint(model: nn.Module, inputs: Iterable[Any], gap_bytes: int) -> str:
    """What the planner's error adds about the head (NOTE [the head's floor]), or ``""``.

    Args:
        model: the model planned.
        inputs: the step's keyword inputs (dicts) whose ``input_ids`` or
            ``labels`` count the tokens; the largest counts.
        gap_bytes: how far the least feasible budget is above the one given.
    """
    found = logits_head(model)
    if found is None or model.__dict__.get(CHUNKED) is not None:
        return ""
    tokens = max((_tokens(given) for given in inputs), default=0)
    name, head = found
    logits_bytes = tokens * head.out_features * 4
    if tokens == 0 or 2 * logits_bytes < gap_bytes:
        return ""
    return (
        f" {type(model).__name__}.{name}'s logits are {tokens:,} tokens x "
        f"{head.out_features:,} = {logits_bytes:,} B in float, and as much again for their "
        "gradient: no plan goes below them while they exist whole. "
        "forget.integrations.transformers.chunk_loss(model) computes the loss chunk by "
        "chunk so that they never do (docs/head.md); for a model of your own, run its "
        "head and loss through forget.chunked."
    )


def _tokens(given: Any) -> int:
    if not isinstance(given, dict):
        return 0
    for key in ("input_ids", "labels"):
        value = given.get(key)
        if isinstance(value, torch.Tensor):
            return value.numel()
    return 0
