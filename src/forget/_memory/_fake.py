"""A model's step on fake tensors: its bytes by the ledger, with no memory behind them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ._ledger import Ledger, watch

__all__ = ["fake_step_peak", "faked"]


@contextlib.contextmanager
def faked(model: nn.Module, args: Any, kwargs: Any) -> Iterator[tuple[dict[str, Tensor], Any, Any]]:
    """``model``'s parameters and buffers and the inputs as fake tensors, inside torch's
    ``FakeTensorMode``: every op runs on shapes alone and allocates nothing, while a
    ``Ledger(fake=True)`` still sees each storage an op makes, with its bytes.

    Yields the state (name -> fake tensor, for ``functional_call``) and the inputs.
    Parameters and buffers are faked too, so the real model's gradients and buffers
    are not touched; neither is any random generator.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        state: dict[str, Tensor] = {}
        for name, p in model.named_parameters():
            state[name] = mode.from_tensor(p.detach()).requires_grad_(p.requires_grad)
        for name, b in model.named_buffers():
            state[name] = mode.from_tensor(b)
        fake_args, fake_kwargs = pytree.tree_map_only(Tensor, mode.from_tensor, (args, kwargs))
        yield state, fake_args, fake_kwargs


def fake_step_peak(
    model: nn.Module, args: Any, kwargs: Any, loss_of: Callable[[Any], Tensor]
) -> int:
    """The ledger's peak of ``loss_of(model(*args, **kwargs)).backward()`` on fake tensors.

    Raises:
        RuntimeError: an op fake tensors cannot run (one whose output depends on
            the data), as torch raises it.
    """
    with faked(model, args, kwargs) as (state, fake_args, fake_kwargs):
        ledger = Ledger(fake=True)
        try:
            with watch(ledger):
                loss = loss_of(functional_call(model, state, fake_args, fake_kwargs))
                loss.backward()
                del loss
            return ledger.peak
        finally:
            ledger.close()
