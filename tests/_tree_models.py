"""Models and helpers shared by the tests of forget.plan on module trees (tests/test_tree_plan*.py).

Built from tiny configs (no downloads): a nested model of our own (an encoder stack
whose layers take a keyword argument), Hugging Face's Llama, BERT (dropout on) and
ResNet (BatchNorm), and a stack of gated layers sharing a mask; with the step run
and measured, and a snapshot of what planning must leave as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import forget

# ------------------------------------------------------------------ models


class Block(nn.Module):
    """A pre-norm residual MLP block; ``scale`` comes by keyword, as HF layers' arguments do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        return x + scale * self.drop(self.mlp(self.norm(x)))


class Encoder(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, scale=scale)
        return self.norm(x)


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.encoder = Encoder(width, depth)
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x), scale=scale))


def _net(depth: int = 4) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    return Net(depth=depth).train(), {"x": torch.randn(32, 16, 8), "scale": 0.5}


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def _llama(layers: int = 2) -> tuple[nn.Module, dict[str, Any]]:
    tf = _transformers()
    config = tf.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 32))
    return tf.LlamaForCausalLM(config).train(), {"input_ids": ids, "labels": ids}


def _gpt2(layers: int = 3) -> tuple[nn.Module, dict[str, Any]]:
    """GPT-2 from its config's defaults but its sizes: dropout 0.1, and ``use_cache``
    on, so that every attention layer appends to the one key/value cache of the step."""
    tf = _transformers()
    config = tf.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, n_positions=64)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 64))
    return tf.GPT2LMHeadModel(config).train(), {"input_ids": ids, "labels": ids}


def _bert() -> tuple[nn.Module, dict[str, Any]]:
    tf = _transformers()
    config = tf.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        vocab_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )  # hidden and attention dropout 0.1: replayed exactly
    torch.manual_seed(0)
    ids = torch.randint(1, 64, (4, 64))
    return tf.BertForMaskedLM(config).train(), {"input_ids": ids, "labels": ids}


def _resnet() -> tuple[nn.Module, dict[str, Any]]:
    tf = _transformers()
    config = tf.ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[2, 2],
        layer_type="basic",
        num_labels=3,
    )
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    return tf.ResNetForImageClassification(config).train(), {
        "pixel_values": x,
        "labels": torch.arange(8) % 3,
    }


MODELS: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "net": _net,
    "llama": _llama,
    "bert": _bert,
    "resnet": _resnet,
}


def _loss(output: Any) -> torch.Tensor:
    return output.loss if hasattr(output, "loss") else output.sum()


def _step(model: nn.Module, inputs: dict[str, Any], seed: int = 3) -> tuple[Any, ...]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = _loss(model(**inputs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss.detach(), grads, buffers


def _allocator_peak(model: nn.Module, inputs: dict[str, Any]) -> int:
    model.zero_grad(set_to_none=True)
    return forget.measure(lambda: _loss(model(**inputs)).backward(), probe="profiler").peak_bytes


# ------------------------------------------------------------------ a gated stack


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * mask


class _GatedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Gated() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(x, 0.5)  # made in the step, read by every layer
        for layer in self.layers:
            x = layer(x, mask=mask)
        return x


# ------------------------------------------------------------------ the model untouched


def _snapshot(model: nn.Module) -> tuple[Any, ...]:
    """What planning must leave as it was: values, grads, instance forwards, hooks, modes."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    hooks = [
        (
            m.__dict__.get("forward"),
            m.training,
            *map(dict, (m._forward_pre_hooks, m._forward_hooks)),
        )
        for m in model.modules()
    ]
    return state, grads, hooks


def _assert_untouched(model: nn.Module, before: tuple[Any, ...]) -> None:
    state, grads, hooks = _snapshot(model)
    assert state.keys() == before[0].keys()
    assert all(torch.equal(state[k], before[0][k]) for k in state)
    assert grads.keys() == before[1].keys()
    for name, grad in grads.items():
        assert grad is None if before[1][name] is None else torch.equal(grad, before[1][name])
    assert hooks == before[2]


def _with_grads(model: nn.Module) -> nn.Module:
    for p in model.parameters():  # a step the user ran before planning: its grads stay
        p.grad = torch.randn_like(p)
    return model
