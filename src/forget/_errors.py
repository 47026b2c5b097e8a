"""The error tree of forget: one root, `ForgetError`, a `RuntimeError`."""

from __future__ import annotations

__all__ = ["BudgetInfeasibleError", "ForgetError", "RecomputationMismatchError"]


class ForgetError(RuntimeError):
    """Root of every error forget raises for a broken contract (not plain misuse).

    Plain misuse (a non-callable, a wrong argument type) raises `TypeError` or
    `ValueError` instead. Every message starts with ``forget:``.
    """


class RecomputationMismatchError(ForgetError):
    """The recomputation in backward did not rebuild what the forward saved."""


class BudgetInfeasibleError(ForgetError):
    """No schedule fits the memory budget.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_feasible_bytes: the smallest budget for which a schedule exists.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
