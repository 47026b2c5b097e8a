"""`integrations.transformers.chunk_loss`: a causal LM's loss chunk by chunk, differential.

Models are transformers' own, built from their configs' defaults (``use_cache``
on) at small sizes with a vocabulary 60 times the hidden size, and the loss is
the one the model computes itself, with and without the chunked head.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import forget
from forget._regions import CHUNKED
from forget.integrations import transformers as forget_hf
from forget.integrations._transformers_head import MIN_ROWS, default_chunks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fixed_clock")

VOCAB, WIDTH = 2000, 32
SMALL = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def _llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(hidden_size=WIDTH, intermediate_size=64, vocab_size=VOCAB, **SMALL)
    )


def _gpt2():  # its lm_head is tied to the input embedding
    config = transformers.GPT2Config(
        n_embd=WIDTH, n_layer=2, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _qwen2():
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(hidden_size=WIDTH, intermediate_size=64, vocab_size=VOCAB, **SMALL)
    )


def _mistral():
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(
            hidden_size=WIDTH, intermediate_size=64, vocab_size=VOCAB, **SMALL
        )
    )


def _gemma():
    return transformers.GemmaForCausalLM(
        transformers.GemmaConfig(
            hidden_size=WIDTH, intermediate_size=64, vocab_size=VOCAB, head_dim=8, **SMALL
        )
    )


def _gemma2():  # soft-caps its logits (final_logit_softcapping, on by default)
    return transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            hidden_size=WIDTH, intermediate_size=64, vocab_size=VOCAB, head_dim=8, **SMALL
        )
    )


MODELS = {
    "llama": _llama,
    "gpt2": _gpt2,
    "qwen2": _qwen2,
    "mistral": _mistral,
    "gemma": _gemma,
    "gemma2": _gemma2,
}


def _batch(tokens=24, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # padding: ignored
    return ids, labels


def _step(model, seed=1, **inputs):
    """One step: the loss and every parameter's gradient (the same dropout masks)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("chunks", [None, 1, 5], ids=["default", "one", "five"])
def test_the_loss_and_gradients_are_the_models_own(kind, chunks):
    model = MODELS[kind]().train()
    ids, labels = _batch()
    plain = _step(copy.deepcopy(model), input_ids=ids, labels=labels)
    handle = forget_hf.chunk_loss(model, chunks=chunks)
    chunked = _step(model, input_ids=ids, labels=labels)
    _assert_same(chunked, plain)
    assert chunked[0].logits is None and plain[0].logits is not None
    expected = chunks or default_chunks(ids.numel(), WIDTH, VOCAB, 4)
    assert handle.last_chunks == expected
    if kind == "gpt2":  # tied: one parameter, one gradient from both uses
        assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_num_items_in_batch_ignore_index_and_shift_labels_as_transformers_has_them(kind):
    model = MODELS[kind]().train()
    ids, labels = _batch()
    plain = copy.deepcopy(model)
    forget_hf.chunk_loss(model, chunks=3)
    count = torch.tensor(51)  # as Trainer passes it under gradient accumulation
    sevens = torch.where(labels == -100, 7, labels)  # 7 ignored instead of -100
    for extra in (
        {"num_items_in_batch": count},
        {"ignore_index": 7, "labels": sevens},
        {"shift_labels": torch.roll(labels, -1, dims=1)},
    ):
        inputs = {"input_ids": ids, "labels": labels, **extra}
        _assert_same(_step(model, **inputs), _step(plain, **inputs))


def test_without_labels_the_model_runs_as_before():
    model = _llama().train()
    ids, _ = _batch()
    torch.manual_seed(0)
    before = model(input_ids=ids)
    forget_hf.chunk_loss(model)
    torch.manual_seed(0)
    after = model(input_ids=ids)
    assert after.loss is None and torch.equal(after.logits, before.logits)
    assert after.past_key_values is not None  # use_cache left on, as the config has it


class _LargestWithVocab(TorchDispatchMode):
    """The most elements of any op's output whose last dimension is the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            # The head's weight and its gradient (width x vocabulary) are no logits.
            head = t.shape in ((VOCAB, WIDTH), (WIDTH, VOCAB)) if isinstance(t, torch.Tensor) else 0
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == VOCAB and not head:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2"])
def test_the_logits_never_exist_whole_in_forward_or_backward(kind):
    model = MODELS[kind]().train()
    ids, labels = _batch(tokens=32)
    tokens = ids.numel()
    forget_hf.chunk_loss(model, chunks=4)
    watch = _LargestWithVocab()
    with watch:
        model(input_ids=ids, labels=labels).loss.backward()
    assert watch.largest == tokens // 4 * VOCAB  # one slice's logits at a time
    model.zero_grad(set_to_none=True)
    plain = _LargestWithVocab()
    with plain:  # the same check sees them whole without the chunked head
        MODELS[kind]().train()(input_ids=ids, labels=labels).loss.backward()
    assert plain.largest == tokens * VOCAB


def test_the_peak_falls_by_the_logits():
    model = _llama().train()
    ids, labels = _batch(tokens=64, batch=4)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()

    plain = forget.measure(step).peak_bytes
    forget_hf.chunk_loss(model, chunks=8)
    chunked = forget.measure(step).peak_bytes
    logits_bytes = ids.numel() * VOCAB * 4
    assert plain - chunked >= logits_bytes  # the logits and their gradient, less a slice's


def test_state_dict_keys_do_not_change_and_remove_restores_the_model():
    model = _llama().train()
    keys = list(model.state_dict())
    ids, labels = _batch()
    handle = forget_hf.chunk_loss(model)
    assert list(model.state_dict()) == keys
    assert forget_hf.chunk_loss(model, chunks=3) is handle and handle.chunks == 3
    assert forget_hf.chunked_loss_of(model) is handle
    handle.remove()
    assert "forward" not in model.__dict__ and CHUNKED not in model.__dict__
    assert forget_hf.chunked_loss_of(model) is None
    assert model(input_ids=ids, labels=labels).logits is not None
    handle.remove()  # twice: nothing more to do


def test_with_enable_every_layer_forgotten():
    model = _llama().train()
    ids, labels = _batch()
    plain = _step(copy.deepcopy(model), input_ids=ids, labels=labels)
    forget_hf.chunk_loss(model, chunks=4)
    forget_hf.enable(model)
    _assert_same(_step(model, input_ids=ids, labels=labels), plain)
    forget_hf.disable(model)


# peft reads transformers' deprecated is_gradient_checkpointing in get_peft_model.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_peft_model():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    wrapped = peft.get_peft_model(_llama().train(), config)
    ids, labels = _batch()
    plain = _step(copy.deepcopy(wrapped), input_ids=ids, labels=labels)
    handle = forget_hf.chunk_loss(wrapped, chunks=4)
    assert handle.model is wrapped.get_base_model()
    _assert_same(_step(wrapped, input_ids=ids, labels=labels), plain)


def test_trainer_with_gradient_accumulation(tmp_path):
    ids, labels = _batch(tokens=16, batch=4)
    rows = [{"input_ids": i, "labels": label} for i, label in zip(ids, labels, strict=True)]

    def trained(chunk):
        torch.manual_seed(0)
        model = _llama().train()
        if chunk:
            forget_hf.chunk_loss(model, chunks=3)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(chunk)),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=1,
            learning_rate=1e-2,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            optim="sgd",  # a step proportional to the gradients (Adam's divides them)
        )
        transformers.Trainer(model=model, args=args, train_dataset=rows).train()
        return dict(model.named_parameters())

    plain, chunked = trained(False), trained(True)
    for name, p in plain.items():
        torch.testing.assert_close(chunked[name], p, rtol=1e-4, atol=1e-6)


def test_a_plan_counts_the_chunked_head_and_fits_below_the_logits():
    model = _llama().train()
    ids, labels = _batch(tokens=64, batch=4)
    forget_hf.chunk_loss(model, chunks=8)
    with pytest.raises(forget.BudgetInfeasibleError) as error:
        forget.plan(model, budget=1024, input_ids=ids, labels=labels)
    least = error.value.min_feasible_bytes  # a budget at which planning works
    plan = forget.plan(model, budget=least, input_ids=ids, labels=labels)
    assert plan.measured_peak_bytes <= plan.budget_bytes == least
    # Below the logits: without the chunked head, they alone would pass that budget.
    assert ids.numel() * VOCAB * 4 > least
    # The prediction counts the chunked head: the plain step with it, as measured, or a
    # little more (the fake run's count is an upper bound).
    model.zero_grad(set_to_none=True)
    plain = forget.measure(lambda: model(input_ids=ids, labels=labels).loss.backward())
    assert plain.peak_bytes <= plan.plain_ledger_peak_bytes <= 1.15 * plain.peak_bytes


def test_a_budget_only_the_logits_forbid_names_the_head_and_chunk_loss():
    model = _llama().train()
    ids, labels = _batch(tokens=64, batch=4)
    with pytest.raises(forget.BudgetInfeasibleError) as error:
        forget.plan(model, budget="30%", input_ids=ids, labels=labels)
    message = str(error.value)
    logits_bytes = ids.numel() * VOCAB * 4
    assert "LlamaForCausalLM.lm_head's logits" in message
    assert f"{logits_bytes:,} B" in message and "chunk_loss" in message
    forget_hf.chunk_loss(model, chunks=8)
    with pytest.raises(forget.BudgetInfeasibleError) as chunked:
        forget.plan(model, budget=1024, input_ids=ids, labels=labels)
    assert "lm_head" not in str(chunked.value)  # chunked: the head is not the floor


def test_a_cap_hears_the_chunked_head_and_holds_every_step():
    model = _llama().train()

    def step(tokens):
        ids, labels = _batch(tokens=tokens, batch=4)
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()

    plain = forget.measure(step, 64, probe="profiler").peak_bytes
    forget_hf.chunk_loss(model, chunks=8)
    handle = forget.cap(model, int(0.6 * plain))
    for tokens in (32, 64, 48, 64):
        peak = forget.measure(step, tokens, probe="profiler").peak_bytes
        assert peak <= handle.budget_bytes, (tokens, peak, handle.budget_bytes)
    handle.remove()


@pytest.mark.parametrize(
    "chunks", [0, -2, 1.5, True, "4"], ids=["zero", "negative", "float", "bool", "str"]
)
def test_bad_chunks_raise_and_change_nothing(chunks):
    model = _llama()
    with pytest.raises(ValueError, match=r"^forget: chunks"):
        forget_hf.chunk_loss(model, chunks=chunks)
    assert "forward" not in model.__dict__ and CHUNKED not in model.__dict__


class _ScaledLlama(transformers.LlamaForCausalLM):
    """A causal LM whose forward does more than its head: its logits are doubled."""

    def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        out = super().forward(input_ids, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        out.logits = out.logits * 2
        return out


def _custom_loss():
    model = _llama()
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.mean()
    return model


@pytest.mark.parametrize(
    "build, needs",
    [
        (lambda: torch.nn.Linear(4, 4), "PreTrainedModel"),
        (lambda: transformers.LlamaModel(_llama().config), "lm_head"),
        (_custom_loss, "ForCausalLMLoss"),
    ],
    ids=["no-transformers-model", "no-head", "custom-loss"],
)
def test_a_model_it_cannot_serve_is_refused_unchanged(build, needs):
    model = build()
    with pytest.raises(TypeError, match=needs):
        forget_hf.chunk_loss(model)
    assert "forward" not in model.__dict__ and CHUNKED not in model.__dict__


def test_a_forward_that_changes_the_logits_is_refused_at_its_first_call():
    model = _ScaledLlama(_llama().config).train()
    ids, labels = _batch()
    forget_hf.chunk_loss(model)
    with pytest.raises(TypeError, match="own logits differ"):
        model(input_ids=ids, labels=labels)


def test_calls_it_cannot_honour_raise():
    model = _llama().train()
    ids, labels = _batch()
    forget_hf.chunk_loss(model)
    with pytest.raises(ValueError, match="return_dict"):
        model(input_ids=ids, labels=labels, return_dict=False)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=labels, logits_to_keep=3)


def test_after_a_cap_it_is_refused_and_a_cap_after_it_blocks_remove():
    model = _llama().train()
    handle = forget.cap(model, "100MB")
    with pytest.raises(ValueError, match="call chunk_loss first"):
        forget_hf.chunk_loss(model)
    handle.remove()
    chunked = forget_hf.chunk_loss(model)
    handle = forget.cap(model, "100MB")
    with pytest.raises(ValueError, match="remove that first"):
        chunked.remove()
    handle.remove()
    chunked.remove()
    assert "forward" not in model.__dict__


def test_the_default_count_bounds_a_slice_by_the_hidden_states_and_min_rows():
    # A slice's float logits no larger than the hidden states ...
    assert default_chunks(tokens=1 << 20, hidden_size=64, vocab_size=640, hidden_itemsize=4) == 10
    # ... but no slice under MIN_ROWS tokens, and at least one slice.
    assert default_chunks(4 * MIN_ROWS, 64, 64_000, 4) == 4
    assert default_chunks(MIN_ROWS // 2, 64, 64_000, 4) == 1
    assert default_chunks(1 << 20, 4096, 4096, 2) == 2  # bf16 hidden states, float logits


def test_a_plan_raises_a_default_chunk_count_only_as_far_as_the_budget_needs():
    # NOTE [chunks by the budget]
    model = _llama().train()
    ids, labels = _batch(tokens=64, batch=4)
    handle = forget_hf.chunk_loss(model, chunks=32)
    with pytest.raises(forget.BudgetInfeasibleError) as error:
        forget.plan(model, budget=1024, input_ids=ids, labels=labels)
    at_32 = error.value.min_feasible_bytes  # feasible with 32 slices of 8 tokens
    handle.chunks = None  # the default count: 4 slices of 64 tokens
    plan = forget.plan(model, budget=at_32, input_ids=ids, labels=labels)
    assert plan.measured_peak_bytes <= at_32
    assert handle.chunks is not None and 4 < handle.chunks <= 32  # pinned, raised
    assert handle.last_chunks == handle.chunks
    # A count the user gave is kept, and a budget nothing fits leaves the default.
    handle.chunks = None
    with pytest.raises(forget.BudgetInfeasibleError):
        forget.plan(model, budget=1024, input_ids=ids, labels=labels)
    assert handle.chunks is None
    handle.chunks = 4
    with pytest.raises(forget.BudgetInfeasibleError):
        forget.plan(model, budget=at_32, input_ids=ids, labels=labels)
    assert handle.chunks == 4


def test_a_training_call_with_labels_builds_no_cache_unless_asked():
    # NOTE [no cache in a training step]
    model = _llama().train()
    ids, labels = _batch()
    forget_hf.chunk_loss(model)
    assert model(input_ids=ids, labels=labels).past_key_values is None
    assert model(input_ids=ids, labels=labels, use_cache=True).past_key_values is not None
    assert model.eval()(input_ids=ids, labels=labels).past_key_values is not None
