"""A region whose argument is an object it changes (a key/value cache): re-run on a copy.

NOTE [arguments that change] (forget/_engine/_arguments.py): a region keeps, for its
re-runs, a copy of such an argument made before its forward, its tensors shared, and
each re-run gets a copy of that: the caller's object is changed once, as by the plain
step, the re-run computes what the forward did, and the object, which holds the
region's outputs, does not keep the region alive.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch
from torch import nn

import forget
from forget._engine import Region, copy_structure, may_change


class _Log:
    """An object a function appends to and reads whole, as a key/value cache is."""

    def __init__(self, first: torch.Tensor) -> None:
        self.items = [first]


def _step(x: torch.Tensor, log: _Log) -> torch.Tensor:
    log.items.append(x.sin())
    return torch.stack(log.items).exp().sum()


def _regions_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, Region))


def test_the_re_run_starts_from_the_object_as_the_forward_found_it():
    x0 = torch.randn(4, requires_grad=True)
    plain_log, log = _Log(torch.ones(4)), _Log(torch.ones(4))
    _step(x0, plain_log).backward()
    x = x0.detach().clone().requires_grad_()
    forget.forget(_step, x, log).backward()
    assert torch.equal(x.grad, x0.grad)
    assert len(log.items) == len(plain_log.items) == 2  # appended once, by the forward
    assert all(torch.equal(a, b) for a, b in zip(log.items, plain_log.items, strict=True))


def test_a_forward_no_backward_follows_frees_the_region():
    before = _regions_alive()
    x = torch.randn(4, requires_grad=True)
    log = _Log(torch.ones(4))
    y = forget.forget(_step, x, log)
    del y, log  # the log holds the region's outputs, the region a copy of the log
    assert _regions_alive() == before


def test_copies_share_tensors_and_modules_and_take_what_cannot_be_copied():
    linear = nn.Linear(2, 2)
    log = _Log(torch.ones(3))
    log.layer = linear  # type: ignore[attr-defined]
    copied = copy_structure(log)
    assert copied is not log and copied.items is not log.items
    assert copied.items[0] is log.items[0] and copied.layer is linear
    lock = threading.Lock()
    assert copy_structure(lock) is lock  # cannot be copied: taken as it is
    assert may_change(log) and may_change([1]) and may_change({})
    # no state of its own (a lock's is not Python's; a sentinel has none): as itself
    assert not may_change(lock) and not may_change(object())
    assert not any(map(may_change, (None, 3, "x", torch.float32, linear, print, _Log)))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_gpt2_with_its_cache_on_forgets_exactly(attention: str) -> None:
    # Its config's defaults but the sizes: the cache on, dropout 0.1.
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    config = tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64,
        attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = tf.GPT2LMHeadModel(config).train()
    model = tf.GPT2LMHeadModel(config).train()
    model.load_state_dict(plain.state_dict())
    forget.apply_forget(model, tf.models.gpt2.modeling_gpt2.GPT2Block)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    caches: list[Any] = []
    for net in (plain, model):
        torch.manual_seed(3)
        out = net(input_ids=ids, labels=ids)
        out.loss.backward()
        caches.append(out.past_key_values)
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    before = _regions_alive()
    model(input_ids=ids, labels=ids)  # a forward with grad, and no backward
    assert _regions_alive() == before
