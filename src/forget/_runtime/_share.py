"""A cap's budget: bytes, or a share of each shape's plain peak, predicted on fake tensors.

NOTE [a share of the cap]: a share means what it means to `forget.plan`, a share
of the plain step's peak (NOTE [one budget] in `forget._memory`); but the cap
runs no planning, and its steps vary in shape. So at the first step of each
shape (the key of NOTE [steps of known shapes]) the plain step is run once on
fake tensors (`forget._memory.fake_step_peak`: nothing allocated, the ledger
sees every storage) before the real step begins, and the cap for that shape is
the share of that ledger peak: the figure the cap bounds (NOTE [the cap's
count]). The cap cannot see the loss, so the fake step differentiates the
output's ``.loss``, or the sum of its floating tensors: a loss reduces what it
is given, and holds little beside it. A step whose shapes give no key is
predicted each time; one that cannot run on fake tensors (an op whose output
depends on the data) has no prediction, and a share then raises: give bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._errors import ForgetError
from .._memory import budget_bytes as read_budget
from .._memory import fake_step_peak
from ..schedules import budget_share
from ._outputs import tensors_in

__all__ = ["CapBudget"]


class CapBudget:
    """A cap's budget as given, and its bytes for the step about to run.

    Attributes:
        given: the budget as `cap` or `Cap.set_budget` took it.
        share: the share of the plain peak it names, or None (bytes).
        bytes: the cap in bytes: for a share, of the latest shape's plain peak
            (0 before any).
        predicting: whether the fake plain step runs now: every forward is plain.
    """

    def __init__(self, budget: int | float | str, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None
        self.plain_peaks: dict[tuple[Any, ...], int] = {}  # per key, predicted
        self.plain_peak: int | None = None  # the latest shape's
        self.predicting = False
        self.set(budget)

    def set(self, budget: int | float | str) -> None:
        """Take ``budget`` from the next step on; a share at once of the latest shape's peak."""
        share = budget_share(budget)
        if share is None:
            self.bytes = read_budget(budget, None, self.cuda)
        else:
            read_budget(budget, 1 << 40, None)  # a share outside (0, 1] raises here
        self.given, self.share = budget, share
        if share is not None:
            self.bytes = 0 if self.plain_peak is None else self._of(self.plain_peak)

    def for_step(
        self,
        model: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: tuple[Any, ...] | None,
    ) -> int:
        """The cap of a step of these inputs (NOTE [a share of the cap])."""
        if self.share is None:
            return self.bytes
        plain = self.plain_peaks.get(key) if key is not None else None
        if plain is None:
            plain = self._predict(model, args, kwargs)
            if key is not None:
                self.plain_peaks[key] = plain
        self.plain_peak = plain
        self.bytes = self._of(plain)
        return self.bytes

    def check_predicted(self, why: str) -> None:
        """Raise where a share has no plain peak yet to be a share of."""
        if self.share is not None and self.plain_peak is None:
            raise ForgetError(
                f"forget: the cap {self.given!r} is a share of the plain step's peak, which "
                f"the cap predicts when the model's forward is called, and {why}; call the "
                "model, or give the cap in bytes (NOTE [a share of the cap])"
            )

    def _of(self, plain_peak_bytes: int) -> int:
        return read_budget(self.given, max(1, plain_peak_bytes), None)

    def _predict(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        self.predicting = True
        try:
            return fake_step_peak(model, args, kwargs, _plain_loss)
        except ForgetError:
            raise
        except RuntimeError as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            failed = f"{type(exc).__name__}: {first}"
        finally:
            self.predicting = False
        raise ForgetError(
            f"forget: the cap {self.given!r} is a share of the plain step's peak, predicted "
            f"on fake tensors, and {type(model).__name__}'s step does not run on them "
            f"({failed}); give the cap in bytes, e.g. forget.cap(model, '2GiB') (NOTE [a "
            "share of the cap])"
        )


def _plain_loss(output: Any) -> torch.Tensor:
    """What the fake plain step differentiates (NOTE [a share of the cap])."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    leaves = [t for t in tensors_in(output) if t.requires_grad and t.is_floating_point()]
    if not leaves:
        raise ForgetError(
            "forget: a cap given as a share predicts the plain step's peak, differentiating "
            "the model's output, and the output holds no floating tensor that requires grad "
            "(NOTE [a share of the cap]); give the cap in bytes, e.g. forget.cap(model, '2GiB')"
        )
    return sum((t.sum() for t in leaves[1:]), leaves[0].sum())
