"""Reference models: shapes, determinism, and checkpointed blocks equal to plain."""

from __future__ import annotations

import copy
import doctest

import pytest
import torch
import torch.utils.checkpoint

import forget
import forget._cli._models
from forget._cli._models import (
    MODEL_NAMES,
    SIZES,
    BlockModel,
    ResidualMLP,
    SmallCNN,
    TinyGPT,
    build_model,
    model_settings,
    residual_mlp,
    small_cnn,
    tiny_gpt,
)


def _torch_ckpt(block, h):
    return torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)


def _forget_ckpt(block, h):
    return forget.checkpoint(block, h)


WRAPS = {"torch_checkpoint": _torch_ckpt, "forget": _forget_ckpt}


def _batch(model: BlockModel, n: int = 3, seed: int = 0):
    return model.example_input(n, generator=torch.Generator().manual_seed(seed))


def _step(model: BlockModel, x, target, wrap=None, seed: int = 1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in every run
    loss = model.step(x, target, wrap)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss, grads


@pytest.mark.parametrize(
    ("name", "cls", "out_shape"),
    [
        ("residual_mlp", ResidualMLP, (3, 10)),
        ("small_cnn", SmallCNN, (3, 10)),
        ("tiny_gpt", TinyGPT, (3, 8, 32)),
    ],
    ids=["residual_mlp", "small_cnn", "tiny_gpt"],
)
def test_tiny_forward_shapes_and_loss(name, cls, out_shape):
    model = build_model(name, "tiny")
    assert isinstance(model, cls)
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) >= 2
    x, target = _batch(model)
    out = model(x)
    assert out.shape == out_shape
    loss = model.loss(out, target)
    assert loss.shape == ()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_default_batch_size_is_used(name):
    model = build_model(name, "tiny", batch_size=5)
    x, target = model.example_input(generator=torch.Generator().manual_seed(0))
    assert x.shape[0] == target.shape[0] == 5


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_seed_same_model_and_global_rng_untouched(name):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_model(name, "tiny", seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = build_model(name, "tiny", seed=7)
    c = build_model(name, "tiny", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_example_input_deterministic_given_generator(name):
    model = build_model(name, "tiny")
    (x1, t1), (x2, t2) = _batch(model, seed=3), _batch(model, seed=3)
    assert torch.equal(x1, x2)
    assert torch.equal(t1, t2)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_wrap_runs_every_block_once(name):
    model = build_model(name, "tiny")
    seen = []

    def wrap(block, h):
        seen.append(block)
        return block(h)

    x, _ = _batch(model)
    model(x, wrap)
    assert seen == list(model.blocks)


@pytest.mark.parametrize("variant", list(WRAPS))
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_checkpointed_blocks_equal_plain_bitwise(name, variant):
    # Dropout stays on in TinyGPT: both checkpoints replay the forward's RNG.
    pristine = build_model(name, "tiny")
    plain, wrapped = copy.deepcopy(pristine), copy.deepcopy(pristine)
    x, target = _batch(pristine)
    loss_p, grads_p = _step(plain, x, target)
    loss_w, grads_w = _step(wrapped, x, target, WRAPS[variant])
    assert torch.equal(loss_p, loss_w)
    assert grads_p.keys() == grads_w.keys()
    for key in grads_p:
        assert torch.equal(grads_p[key], grads_w[key]), key


def test_tiny_gpt_dropout_off_is_deterministic_across_seeds():
    model = tiny_gpt(width=16, depth=2, heads=2, context=8, vocab_size=32, dropout=0.0)
    x, target = _batch(model)
    loss_a, _ = _step(model, x, target, seed=1)
    loss_b, _ = _step(model, x, target, seed=2)
    assert torch.equal(loss_a, loss_b)


def test_forget_keeps_batchnorm_buffers_as_plain_torch_does_not():
    pristine = small_cnn(channels=4, depth=3, image_size=8, batch_size=4)
    runs = {v: copy.deepcopy(pristine) for v in ("plain", "torch_checkpoint", "forget")}
    x, target = _batch(pristine)
    _step(runs["plain"], x, target)
    _step(runs["torch_checkpoint"], x, target, _torch_ckpt)
    _step(runs["forget"], x, target, _forget_ckpt)
    plain = dict(runs["plain"].named_buffers())
    assert all(torch.equal(b, plain[n]) for n, b in runs["forget"].named_buffers())
    # torch.utils.checkpoint runs BatchNorm twice (DESIGN.md, "Stateful layers").
    tracked = dict(runs["torch_checkpoint"].named_buffers())["blocks.0.bn.num_batches_tracked"]
    assert int(tracked) == 2 * int(plain["blocks.0.bn.num_batches_tracked"])


def test_factories_take_size_arguments():
    mlp = residual_mlp(width=8, depth=5, hidden=12, in_features=3, num_classes=4, batch_size=2)
    assert len(mlp.blocks) == 5
    assert mlp(mlp.example_input()[0]).shape == (2, 4)
    cnn = small_cnn(channels=2, depth=1, image_size=4, batch_size=2)
    assert len(cnn.blocks) == 1
    assert cnn(cnn.example_input()[0]).shape == (2, 10)


def test_unknown_name_or_size_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown model 'resnet'.*residual_mlp, small_cnn"):
        build_model("resnet")
    with pytest.raises(ValueError, match=r"unknown size 'huge'.*tiny, quick, default"):
        build_model("tiny_gpt", "huge")
    assert SIZES == ("tiny", "quick", "default")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_settings_are_what_build_model_passes(name):
    settings = model_settings(name, "tiny")
    built = build_model(name, "tiny", seed=3)
    again = {"residual_mlp": residual_mlp, "small_cnn": small_cnn, "tiny_gpt": tiny_gpt}[name](
        seed=3, **settings
    )
    assert "seed" not in settings
    assert repr(built) == repr(again)
    assert all(
        torch.equal(a, b) for a, b in zip(built.parameters(), again.parameters(), strict=True)
    )
    with pytest.raises(ValueError, match="unknown size"):
        model_settings(name, "huge")


def test_model_settings_fill_in_the_factory_defaults():
    assert model_settings("tiny_gpt", "tiny")["dropout"] == 0.1  # not in the tiny preset
    assert model_settings("tiny_gpt", "default")["context"] == 64


def test_bad_shapes_raise_value_error():
    with pytest.raises(ValueError, match="divisible"):
        tiny_gpt(width=10, heads=3)
    with pytest.raises(ValueError, match="depth >= 1"):
        small_cnn(depth=0)


def test_docstring_example_runs():
    result = doctest.testmod(forget._cli._models)
    assert result.attempted > 0
    assert result.failed == 0
