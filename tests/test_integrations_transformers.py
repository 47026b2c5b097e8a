"""forget.integrations.transformers on tiny Hugging Face models built from configs.

No downloads: every model is made from a config with 2 layers, hidden size 32
and a vocabulary of 100, in train mode with its dropout on. Each step reseeds
before the forward, so the plain run, forget's and transformers' own
(torch.utils.checkpoint) draw the same dropout masks; on CPU loss and every
parameter gradient must be bitwise equal.
"""

from __future__ import annotations

import copy
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


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the layers run through forget.checkpoint (installed by enable from now on)."""
    calls: list[int] = []

    def counting(function: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forget.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(forget_hf, "checkpoint", counting)
    return calls


def _seen_recomputing(model: Any) -> list[bool]:
    """``in_recomputing()`` at each run of a layer's first child (forward and re-run).

    transformers checkpoints a layer's forward, not its ``__call__``: its first child is hooked.
    """
    seen: list[bool] = []
    for layer in _layers(model):
        first = next(iter(layer.children()))
        first.register_forward_pre_hook(lambda m, a: seen.append(forget.in_recomputing()))
    return seen


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

    calls = _counting(monkeypatch)
    assert forget_hf.enable(model) is model
    assert forget_hf.is_enabled(model)
    seen = _seen_recomputing(model)
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
    calls = _counting(monkeypatch)
    model = forget_hf.enable(_make("llama")).eval()
    with torch.no_grad():
        model(input_ids=IDS)
    assert calls == []


def test_errors() -> None:
    with pytest.raises(TypeError, match=r"forget: .*PreTrainedModel"):
        forget_hf.enable(torch.nn.Linear(2, 2))
    model = _make("llama")
    for wrong in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"forget: every_n_layers must be .* at least 1"):
            forget_hf.enable(model, every_n_layers=wrong)
    assert not hasattr(
        model, "_gradient_checkpointing_func"
    ) and "activation_checkpointing_enable" not in vars(model)
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


# The four leaks of issue 25, item 5: Trainer, PEFT, settings kept, hooks left alone.


def _embedding_hooks(model: Any) -> int:
    return len(model.get_input_embeddings()._forward_hooks)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_input_embedding_hooks_are_left_as_found(name: str) -> None:
    model = _make(name)
    assert _embedding_hooks(model) == 0
    forget_hf.enable(model)
    assert _embedding_hooks(model) == 0
    forget_hf.enable(model)
    forget_hf.enable(model, every_n_layers=1)
    model.activation_checkpointing_enable()  # as Trainer does
    assert _embedding_hooks(model) == 0
    forget_hf.disable(model)
    assert _embedding_hooks(model) == 0 and not hasattr(model, "_require_grads_hooks")
    # Hooks of the user's (or PEFT's) stay, listed where transformers lists them.
    model.enable_input_require_grads()
    listed = list(model._require_grads_hooks)
    for _ in range(3):
        forget_hf.enable(model)
    forget_hf.disable(model)
    assert _embedding_hooks(model) == 1 and model._require_grads_hooks == listed
    assert model._require_grads_hook is listed[0]


def test_enable_keeps_the_layers_and_keyword_arguments_transformers_was_given() -> None:
    model = _gpt2(layers=4).train()
    checkpoint_kwargs = {"use_reentrant": False, "determinism_check": "none"}
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={**checkpoint_kwargs, "preserve_rng_state": False},
        every_n_layers=2,
    )
    every_other = ["transformer.h.0", "transformer.h.2"]
    assert forget_hf.checkpointed_layers(model) == every_other
    forget_hf.enable(model)
    assert forget_hf.is_enabled(model) and forget_hf.checkpointed_layers(model) == every_other
    func = _layers(model)[0]._gradient_checkpointing_func
    assert func.keywords["determinism_check"] == "none"
    assert func.keywords["preserve_rng_state"] is False
    policy = forget.policies.save_outputs_of(*forget.policies.MATMUL)
    forget_hf.enable(model, policy=policy, preserve_rng_state=True)  # a new policy: same layers
    func = _layers(model)[0]._gradient_checkpointing_func
    assert forget_hf.checkpointed_layers(model) == every_other
    assert func.keywords["policy"] == policy and func.keywords["preserve_rng_state"] is True
    assert func.keywords["determinism_check"] == "none"
    forget_hf.enable(model, every_n_layers=1)  # asked: switched again
    assert len(forget_hf.checkpointed_layers(model)) == 4
    forget_hf.enable(model, every_n_layers=3, policy=policy)
    assert forget_hf.checkpointed_layers(model) == ["transformer.h.0", "transformer.h.3"]
    # later calls of transformers' enable go through forget, with their arguments
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"early_stop": False}, every_n_layers=2
    )
    assert forget_hf.is_enabled(model) and forget_hf.checkpointed_layers(model) == every_other
    func = _layers(model)[0]._gradient_checkpointing_func
    assert func.keywords["early_stop"] is False and func.keywords["policy"] == policy
    copied = copy.deepcopy(model)  # e.g. a reference model: forget's door is its own
    copied.activation_checkpointing_enable(every_n_layers=1)
    assert len(forget_hf.checkpointed_layers(copied)) == 4 and forget_hf.is_enabled(copied)
    assert forget_hf.checkpointed_layers(model) == every_other
    forget_hf.disable(model)
    assert "activation_checkpointing_enable" not in vars(model)
    model.activation_checkpointing_enable()  # transformers' own again
    assert not forget_hf.is_enabled(model) and len(forget_hf.checkpointed_layers(model)) == 4


def test_what_forget_cannot_keep_is_said_not_dropped() -> None:
    model = _make("llama")
    model.activation_checkpointing_enable(offload=True)
    before = _layers(model)[0]._gradient_checkpointing_func
    with pytest.raises(
        ValueError, match=r"forget: .*offload=True.*activation_checkpointing_disable"
    ):
        forget_hf.enable(model)
    assert _layers(model)[0]._gradient_checkpointing_func is before  # untouched
    assert "activation_checkpointing_enable" not in vars(model)
    model.activation_checkpointing_disable()
    forget_hf.enable(model)
    with pytest.raises(ValueError, match=r"forget: .*offload=True.*host memory"):
        model.activation_checkpointing_enable(offload=True)
    assert forget_hf.is_enabled(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    assert forget_hf.is_enabled(model)
    with pytest.warns(UserWarning, match="forget: use_reentrant=True is ignored"):
        _step(model)
    # a checkpoint function of the user's own is not replaced without a word either
    model = _make("gpt2")
    model.activation_checkpointing_enable()
    for layer in _layers(model):
        layer._gradient_checkpointing_func = lambda function, *args: function(*args)
    with pytest.raises(ValueError, match=r"forget: .* not by torch.utils.checkpoint.checkpoint"):
        forget_hf.enable(model)


# Trainer: two steps on a tiny Llama (attention dropout on), against a plain Trainer run.

TRAIN_IDS = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(2))
TRAIN_DATA = [{"input_ids": row, "labels": row} for row in TRAIN_IDS]

Run = tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _train(model: Any, output_dir: Any, **arguments: Any) -> Run:
    """Two steps of ``Trainer.train()``: each step's loss, gradients, and the parameters after."""
    losses: list[torch.Tensor] = []
    grads: list[dict[str, torch.Tensor]] = []

    class Recording(transformers.Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            losses.append(loss.detach().clone())
            return loss

    class Gradients(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            named = kw["model"].named_parameters()
            grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})

    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        **arguments,
    )
    trainer = Recording(model=model, args=args, train_dataset=TRAIN_DATA, callbacks=[Gradients()])
    trainer.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, grads, params


def _assert_same_run(a: Run, b: Run) -> None:
    assert len(a[0]) == len(b[0]) == 2
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    for x, y in zip([*a[1], a[2]], [*b[1], b[2]], strict=True):
        assert x.keys() == y.keys() and x
        for name in x:
            assert torch.equal(x[name], y[name]), name


TRAINER_CASES = {
    "arguments-off": ({}, LAYERS),
    "activation_checkpointing": ({"activation_checkpointing": True}, LAYERS),
    "gradient_checkpointing": ({"gradient_checkpointing": True}, LAYERS),  # 5.x alias
    "every-2nd-layer": (
        {
            "activation_checkpointing": True,
            "activation_checkpointing_kwargs": {"every_n_layers": 2},
        },
        1,
    ),
}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
def test_trainer_keeps_forget_and_trains_as_plain(
    case: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("accelerate")
    arguments, checkpointed = TRAINER_CASES[case]
    plain = _train(_make("llama"), tmp_path / "plain")
    calls = _counting(monkeypatch)
    model = forget_hf.enable(_make("llama"))
    seen = _seen_recomputing(model)
    ours = _train(model, tmp_path / "forget", **arguments)
    assert forget_hf.is_enabled(model) and _embedding_hooks(model) == 0
    assert len(forget_hf.checkpointed_layers(model)) == checkpointed
    assert len(calls) == 2 * checkpointed  # two steps, each layer once through forget
    forward = [False] * LAYERS
    recompute = [True] * checkpointed
    assert seen == 2 * (forward + recompute)
    _assert_same_run(plain, ours)


def _lora(enabled_first: bool = False) -> Any:
    """A tiny Llama with LoRA adapters (dropout on); forget enabled before wrapping if asked."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1, init_lora_weights=False
    )
    torch.manual_seed(0)
    model = _llama().train()
    if enabled_first:
        forget_hf.enable(model)
    return peft.get_peft_model(model, config)


# peft reads transformers' deprecated is_gradient_checkpointing in get_peft_model.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize(
    "enabled_first", [False, True], ids=["wrap-then-enable", "enable-then-wrap"]
)
def test_peft_model_is_enabled_through_its_base_model(
    enabled_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _lora()
    before = _step(plain)
    calls = _counting(monkeypatch)
    model = _lora(enabled_first)
    base = model.get_base_model()
    hooks = _embedding_hooks(base)  # peft's own when checkpointing was on: they stay
    assert hooks == int(enabled_first)
    assert forget_hf.enable(model) is model
    assert forget_hf.is_enabled(model) and forget_hf.is_enabled(base)
    assert "activation_checkpointing_enable" in vars(base)
    assert forget_hf.checkpointed_layers(base) == ["model.layers.0", "model.layers.1"]
    _assert_equal(before, _step(model))
    assert len(calls) == LAYERS
    assert set(before[1]) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert forget_hf.disable(model) is model
    assert not forget_hf.is_enabled(model) and "activation_checkpointing_enable" not in vars(base)
    assert _embedding_hooks(base) == hooks


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_trainer_trains_lora_with_forget_as_plain(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("accelerate")
    plain = _train(_lora(), tmp_path / "plain")
    calls = _counting(monkeypatch)
    model = forget_hf.enable(_lora())
    ours = _train(model, tmp_path / "forget", activation_checkpointing=True)
    assert forget_hf.is_enabled(model) and len(calls) == 2 * LAYERS
    assert all("lora_" in n for n in ours[1][0])  # only the adapters train
    _assert_same_run(plain, ours)
