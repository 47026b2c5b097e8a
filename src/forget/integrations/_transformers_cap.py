"""`cap(model, budget)`: a runtime cap on a Hugging Face model (`forget.cap`).

NOTE [cap in force]: `cap` puts a `forget.cap` on the model (regions evicted
at run time to keep each step under the cap, whatever its shapes; no planning
run) and is otherwise as `enable` with a budget: transformers' own
checkpointing is off and stays off, and the door keeps the cap through
``TrainingArguments(activation_checkpointing=True)`` (``gradient_checkpointing``
before transformers 5) and raises for what it would lose.
`enable` removes it (and checkpoints layers or plans); `disable` removes it.
Should putting in a cap or a plan fail, the cap that was in force comes back
as it was, the very handle with its settings and what it learned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["cleared", "enable_cap"]


def enable_cap(
    door: Any,
    found: list[tuple[Any, Any]],
    put_back: Callable[[list[tuple[Any, Any]]], None],
    budget: int | float | str,
    candidates: Any,
) -> None:
    """`cap`: transformers' checkpointing off, a cap in (NOTE [cap in force]).

    ``door`` is the model's `_ForgetDoor` (new or found), ``found`` transformers'
    checkpointing as it is now and ``put_back`` what restores it.
    """
    from .._runtime import cap

    undo = cleared(door, found, put_back)
    try:
        door.cap = cap(door.model, budget, candidates=candidates)
    except BaseException:
        undo()
        raise
    door.install()


def cleared(
    door: Any,
    found: list[tuple[Any, Any]],
    put_back: Callable[[list[tuple[Any, Any]]], None],
) -> Callable[[], None]:
    """Take ``door``'s plan or cap, and transformers' checkpointing, off; return the undo.

    `enable` with a budget or a cap clears the model first; should what it puts
    in fail, the undo leaves the model as it was: ``found`` (transformers'
    checkpointing as it is now) put back by ``put_back``, and the plan or the cap
    that was in force in again: the very plan, or the very cap with its settings
    and what it learned (NOTE [cap in force]).
    """
    model, plan, capped = door.model, door.plan, door.cap
    door.remove_plan()
    for module, _ in found:
        if module.gradient_checkpointing:
            module.gradient_checkpointing = False

    def undo() -> None:
        put_back(found)
        if plan is not None:
            plan.apply(model)
            door.plan = plan
        elif capped is not None:
            capped.apply()
            door.cap = capped

    return undo
