"""`forget.plan`: one pipeline for every model, a module tree planned within a budget.

A chain is a module tree too: an ``nn.Sequential``'s candidates are its
children, runs of them (NOTE [segments]) and what the default finds inside
them; an ``nn.ModuleList`` or list of blocks is planned as the
``nn.Sequential`` of the same modules, run in turn (without runs: its blocks
run in the user's own loop). Every model goes through `TreePlanner` (NOTE [tree plans
measured] in `._tree.planner`): candidates, figures, the pure tree solve,
guarded measures, then the few best timed side by side.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from .._errors import BudgetInfeasibleError
from .._memory import frozen_heap
from .._regions import CHUNKED, CandidateSpec, head_hint, structure
from ..policies import Policy
from ._tree.plan import Plan
from ._tree.planner import plan_tree
from ._tree.step import TreeLossFn

__all__ = ["plan"]


@frozen_heap()  # NOTE [frozen heap] in forget._measure
def plan(
    model: nn.Module | Sequence[nn.Module],
    *args: Any,
    budget: int | float | str | None = None,
    loss_fn: TreeLossFn | None = None,
    options: Mapping[str, Policy | bool] | None = None,
    candidates: CandidateSpec | None = None,
    samples: Sequence[Any] | None = None,
    repeats: int = 3,
    **kwargs: Any,
) -> Plan:
    """Fit the training step ``loss_fn(model(*args, **kwargs)).backward()`` into ``budget``.

    The step is planned over the model's module tree (`TreePlanner`, NOTE
    [tree plans measured]): the candidate submodules become forgotten regions
    (re-run in backward), policy regions or regenerating modules, whichever
    fits the budget at the least extra time, measured. The plain step never
    runs (NOTE [planning within the budget]), and the model is left as it was.

    Args:
        model: any ``nn.Module``; an ``nn.ModuleList`` or a list of modules is
            planned as the ``nn.Sequential`` of the same blocks (each takes the
            one before's output), and its plan applies to the ``nn.ModuleList``.
        *args: the model's positional inputs (a chain: the first block's input).
        budget: bytes (``int``), a string (``"512MiB"``, ``"2GB"``, ``"50%"``),
            or a fraction in ``(0, 1]`` of the plain step's predicted peak. On
            CUDA, ``"free"`` (the default there): what the device has free now,
            less a margin (NOTE [one budget] in `forget._memory`).
        loss_fn: output -> scalar loss (default: ``output.loss`` when the
            output has one, else the sum of a tensor output).
        options: name -> policy, the leaf options of the innermost candidates;
            default `forget.policies.DEFAULT_OPTIONS` (``{}``: keep and forget alone).
        candidates: the submodules that may be regions, by name pattern
            (``"*.layers.*"``) or type, or a list of them (NOTE [tree
            candidates]); default: repeated blocks and the modules above (an
            ``nn.Sequential``'s children too).
        samples: batches to plan for (each a dict of keyword inputs, a tuple of
            positional inputs or a tensor) instead of the inputs; the largest is
            measured, and a larger input warns.
        repeats: timing repeats per profiled figure.
        **kwargs: the model's keyword inputs. plan's own names above are
            taken by plan (NOTE [plan's keywords]).

    Returns:
        A `Plan`; ``print(plan)`` shows it, ``plan.apply(model)`` runs it, in place.

    Raises:
        BudgetInfeasibleError: no plan fits the budget; the error names one at
            which planning works (``min_feasible_bytes``, NOTE [an infeasible
            budget named]).
        TypeError: a model that is no ``nn.Module`` nor a list of them; an
            output with no loss and no ``loss_fn``.

    Example:
        >>> import torch, forget
        >>> def layer():
        ...     return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
        ...                                torch.nn.Linear(256, 64))
        >>> net = torch.nn.Sequential(*[layer() for _ in range(6)])
        >>> p = forget.plan(net, torch.randn(256, 64), budget="60%", repeats=1)
        >>> p.measured_peak_bytes <= p.budget_bytes
        True
    """
    planned, applied_to = _as_module(model)
    _check_gone(planned, kwargs)
    plan_it = functools.partial(
        plan_tree,
        planned,
        args,
        kwargs,
        budget=budget,
        loss_fn=loss_fn,
        candidates=candidates,
        options=options,
        repeats=repeats,
        samples=samples,
        segments=applied_to is planned,  # NOTE [segments]: they run in the Sequential's forward
    )
    try:
        result = _with_head_chunks(planned, plan_it)
    except BudgetInfeasibleError as exc:  # NOTE [the head's floor]
        gap = exc.min_feasible_bytes - exc.budget_bytes
        hint = head_hint(planned, [kwargs, *(samples or ())], gap)
        if not hint:
            raise
        message = str(exc).rstrip()
        raise BudgetInfeasibleError(
            message + ("" if message.endswith(".") else ".") + hint,
            budget_bytes=exc.budget_bytes,
            min_feasible_bytes=exc.min_feasible_bytes,
        ) from None
    if applied_to is not planned:
        result = dataclasses.replace(result, structure=tuple(structure(applied_to)))
    return result


def _as_module(model: object) -> tuple[nn.Module, nn.Module]:
    """The module planned, and the one its plan applies to (a list: its ``nn.ModuleList``)."""
    if isinstance(model, nn.ModuleList):
        return nn.Sequential(*model), model
    if isinstance(model, nn.Module):
        return model, model
    if isinstance(model, Sequence) and not isinstance(model, str | bytes):
        blocks = list(model)
        for i, block in enumerate(blocks):
            if not isinstance(block, nn.Module):
                raise TypeError(
                    f"forget: plan runs a plan's regions on modules; block {i} of the list is "
                    f"{type(block).__name__}: make it an nn.Module"
                )
        return nn.Sequential(*blocks), nn.ModuleList(blocks)
    raise TypeError(
        f"forget: plan takes an nn.Module, or an nn.ModuleList or list of module blocks, "
        f"got {type(model).__name__}"
    )


# Keywords of the chain planner that planned chains before the one planner did.
_GONE = ("algorithm", "chain", "split")


def _check_gone(model: nn.Module, kwargs: Mapping[str, Any]) -> None:
    """Refuse a former keyword of plan's that the model's forward does not take either."""
    gone = [name for name in _GONE if name in kwargs]
    if not gone:
        return
    params = inspect.signature(model.forward).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    gone = [name for name in gone if name not in params]
    if gone:
        names = ", ".join(f"{name}=" for name in gone)
        raise TypeError(
            f"forget: plan takes no {names} any more, and {type(model).__name__}'s forward "
            f"takes no {gone[0]!r} either (plan hands the model the keywords it does not "
            "take): one planner plans every model over its module tree, a chain's children "
            "its candidates; drop it (the chain algorithms are in forget.schedules)"
        )


# Times a chunked head's count is doubled at most (NOTE [chunks by the budget]).
_MORE_CHUNKS = 3
# Tokens a slice of a chunked head keeps at least, when the planner raises the count.
_MIN_SLICE_TOKENS = 8


def _with_head_chunks(model: nn.Module, plan_it: Callable[[], Plan]) -> Plan:
    """``plan_it()``, raising a chunked head's count where no plan fits.

    NOTE [chunks by the budget]: a head chunked at the default count
    (`chunk_loss` without ``chunks=``) is the planner's to raise: more slices
    hold less of the logits at once, for more calls of the head. So where no
    plan fits the budget, `plan` plans again at twice the count, up to
    `_MORE_CHUNKS` times while the least feasible budget falls, and pins on the
    handle the count whose plan fits; only as many slices as the budget needs.
    A count the user gave is kept, and a plan that cannot fit leaves the
    handle as it was.
    """
    head = model.__dict__.get(CHUNKED)
    if head is None or head.chunks is not None:
        return plan_it()
    try:
        return plan_it()
    except BudgetInfeasibleError as exc:
        error = exc
    try:
        for _ in range(_MORE_CHUNKS):
            count, tokens = head.last_chunks, head.last_tokens
            if count is None or 2 * count * _MIN_SLICE_TOKENS > tokens:
                break
            head.chunks = 2 * count
            try:
                fitted = plan_it()
            except BudgetInfeasibleError as exc:
                if exc.min_feasible_bytes >= error.min_feasible_bytes:
                    break  # more slices lower it no more
                error = exc
                continue
            head = None  # the count that fits stays pinned
            return fitted
        raise error
    finally:
        if head is not None:
            head.chunks = None
