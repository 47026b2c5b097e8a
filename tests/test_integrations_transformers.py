"""forget.integrations.transformers on tiny Hugging Face models built from configs.

No downloads: every model is made from a config with 2 layers, hidden size 32
and a vocabulary of 100, in train mode with its dropout on. Each step reseeds
before the forward, so the plain run, forget's and transformers' own
(torch.utils.checkpoint) draw the same dropout masks; on CPU loss and every
parameter gradient must be bitwise equal.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import forget
from forget.integrations import transformers as forget_hf

transformers = pytest.importorskip("transformers")

VOCAB = 100
LAYERS = 2


def _gpt2(layers: int = LAYERS) -> Any:
    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )  # resid/embd/attn dropout 0.1 by default
    return transformers.GPT2LMHeadModel(config)


def _llama() -> Any:
    config = transformers.LlamaConfig(
        num_hidden_layers=LAYERS,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_dropout=0.1,  # Llama has no dropout unless asked
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def _bert() -> Any:
    config = transformers.BertConfig(
        num_hidden_layers=LAYERS,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
        use_cache=False,
    )  # hidden and attention dropout 0.1 by default
    return transformers.BertForMaskedLM(config)


MODELS: dict[str, Callable[[], Any]] = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}


def _make(name: str) -> Any:
    torch.manual_seed(0)
    return MODELS[name]().train()


IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))

Step = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _loss(model: Any, seed: int = 3) -> torch.Tensor:
    torch.manual_seed(seed)
    return model(input_ids=IDS, labels=IDS).loss


def _step(model: Any, seed: int = 3, call: Any = None) -> Step:
    """Zero grads, one forward (through ``call``, e.g. the compiled model) and backward."""
    model.zero_grad(set_to_none=True)
    loss = _loss(model if call is None else call, seed)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_equal(a: Step, b: Step) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def _layers(model: Any) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, transformers.GradientCheckpointingLayer)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_equal_plain_and_transformers_checkpointing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _make(name)
    plain = _step(model)
    assert not torch.equal(plain[0], _step(model, seed=4)[0])  # dropout is on

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    theirs = _step(model)
    model.activation_checkpointing_disable()
    _assert_equal(plain, theirs)

    calls: list[int] = []

    def counting(function: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forget.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(forget_hf, "checkpoint", counting)
    assert forget_hf.enable(model) is model
    assert forget_hf.is_enabled(model)
    seen: list[bool] = []
    # transformers checkpoints a layer's forward, not its __call__: hook its first child.
    for layer in _layers(model):
        first = next(iter(layer.children()))
        first.register_forward_pre_hook(lambda m, a: seen.append(forget.in_recomputing()))
    ours = _step(model)
    _assert_equal(plain, ours)
    assert len(calls) == LAYERS  # every layer went through forget.checkpoint
    # forward once per layer, then forget's recomputation of each layer in backward
    assert seen == [False] * LAYERS + [True] * LAYERS

    forget_hf.disable(model)
    assert not forget_hf.is_enabled(model)
    seen.clear()
    _assert_equal(plain, _step(model))
    assert len(calls) == LAYERS and seen == [False] * LAYERS


@pytest.mark.parametrize("name", sorted(MODELS))
def test_saves_less_memory(name: str) -> None:
    model = _make(name)

    def train_step() -> None:
        _loss(model).backward()

    plain = forget.measure(train_step)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    theirs = forget.measure(train_step)
    forget_hf.enable(model)
    ours = forget.measure(train_step)
    print(
        f"{name}: saved bytes plain {plain.saved_bytes} / transformers+torch checkpoint "
        f"{theirs.saved_bytes} / forget {ours.saved_bytes}; peak bytes plain "
        f"{plain.peak_bytes} / torch {theirs.peak_bytes} / forget {ours.peak_bytes}"
    )
    assert ours.saved_bytes < plain.saved_bytes
    assert ours.peak_bytes < plain.peak_bytes
    assert ours.saved_bytes <= theirs.saved_bytes


def test_policy_reaches_every_layer() -> None:
    model = _make("gpt2")
    plain = _step(model)
    forget_hf.enable(model)
    nothing = forget.measure(lambda: _loss(model).backward())
    policy = forget.policies.save_outputs_of(*forget.policies.MATMUL)
    forget_hf.enable(model, policy=policy)
    _assert_equal(plain, _step(model))
    some = forget.measure(lambda: _loss(model).backward())
    assert some.saved_bytes > nothing.saved_bytes  # the matmul outputs are kept
    funcs = {id(layer._gradient_checkpointing_func) for layer in _layers(model)}
    assert len(funcs) == 1
    assert _layers(model)[0]._gradient_checkpointing_func.keywords["policy"] == policy


def test_eval_mode_does_not_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counting(function: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forget.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(forget_hf, "checkpoint", counting)
    model = forget_hf.enable(_make("llama")).eval()
    with torch.no_grad():
        model(input_ids=IDS)
    assert calls == []


def test_errors() -> None:
    with pytest.raises(TypeError, match=r"forget: .*PreTrainedModel"):
        forget_hf.enable(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="forget: "):
        forget_hf.disable(object())


def test_missing_transformers_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"forget: .*pip install"):
        forget_hf.enable(object())


# Dynamo itself reads .grad of a non-leaf while tracing GPT-2's loss (also without forget).
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_torch_compile_of_enabled_model_matches_eager(name: str) -> None:
    # Under compile the layers run as torch's checkpoint (docs/compile.md); with
    # aot_eager on CPU loss and gradients stay bitwise those of the plain eager step.
    model = _make(name)
    plain = _step(model)
    forget_hf.enable(model)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager")
        _assert_equal(plain, _step(model, call=compiled))
    finally:
        torch._dynamo.reset()


# NOTE [budget by layers]


def _peak(model: Any) -> int:
    model.zero_grad(set_to_none=True)
    report = forget.measure(lambda: _loss(model).backward())
    model.zero_grad(set_to_none=True)
    return report.peak_bytes


def _deep_gpt2() -> Any:
    torch.manual_seed(0)
    return _gpt2(layers=6).train()


def test_budget_checkpoints_the_fewest_layers_that_fit() -> None:
    inputs = {"input_ids": IDS, "labels": IDS}
    model = _deep_gpt2()
    plain_peak = _peak(model)
    forget_hf.enable(model)
    least = _peak(model)
    names = [f"transformer.h.{i}" for i in range(6)]
    assert forget_hf.checkpointed_layers(model) == names
    chosen = []
    for share in (1.0, 0.85, 0.7, 0.55):
        forget_hf.enable(model, budget=share, inputs=inputs)
        layers = forget_hf.checkpointed_layers(model)
        assert layers == names[: len(layers)]  # the first ones
        assert _peak(model) <= int(share * plain_peak)
        chosen.append(len(layers))
    assert chosen[0] == 0 and chosen == sorted(chosen) and chosen[-1] < 6
    # one fewer layer would not fit: the choice is the least
    k = chosen[-1]
    for i, layer in enumerate(_layers(model)):
        layer.gradient_checkpointing = i < k - 1
    assert _peak(model) > int(0.55 * plain_peak)
    assert least < _peak(model)
    # grads and loss still those of the plain model
    forget_hf.enable(model, budget="60%", inputs=inputs)
    plain = _deep_gpt2()
    _assert_equal(_step(plain), _step(model))


def test_budget_below_all_layers_checkpointed_raises_with_the_least() -> None:
    model = _deep_gpt2()
    forget_hf.enable(model)
    least = _peak(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    with pytest.raises(forget.BudgetInfeasibleError, match="smallest feasible") as error:
        forget_hf.enable(model, budget=least - 1, inputs={"input_ids": IDS, "labels": IDS})
    assert error.value.min_feasible_bytes == least
    assert forget_hf.checkpointed_layers(model) == [f"transformer.h.{i}" for i in range(6)]
    forget_hf.enable(model, budget=least, inputs={"input_ids": IDS, "labels": IDS})
    assert torch.equal(rng, torch.get_rng_state())  # probing leaves the RNG alone
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_budget_needs_inputs() -> None:
    with pytest.raises(TypeError, match="needs their inputs"):
        forget_hf.enable(_deep_gpt2(), budget="50%")
