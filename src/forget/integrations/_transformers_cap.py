"""`enable(model, cap=...)`: a runtime cap on a Hugging Face model (`forget.cap`).

NOTE [cap in force]: with ``cap=``, `enable` puts a `forget.cap` on the model
(regions evicted at run time to keep each step under the cap, whatever its
shapes; no planning run) and is otherwise as with a plan: transformers' own
checkpointing is off and stays off, and the door keeps the cap through
``Trainer(gradient_checkpointing=True)`` and raises for what it would lose.
`enable` without ``cap`` or ``budget`` removes it; `disable` removes it.
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
    others: dict[str, Any],
    partial: Any = "selective",
) -> None:
    """`enable` with ``cap``: transformers' checkpointing off, a cap in (NOTE [cap in force]).

    ``door`` is the model's `_ForgetDoor` (new or found), ``found`` transformers'
    checkpointing as it is now and ``put_back`` what restores it; ``others`` the
    other arguments of `enable`, which must be ``None``; ``partial`` `enable`'s
    ``policy``, what a region evicted in part keeps (`forget.cap`'s ``partial``).
    """
    from ..runtime import cap

    if given := [name for name, value in others.items() if value is not None]:
        raise TypeError(
            f"forget: {given} do not go with cap=: a cap checkpoints no layers and plans "
            "nothing; it decides at run time which regions to re-run (NOTE [cap in force]). "
            "Leave them out, or use budget= and inputs= for a plan instead."
        )
    undo = cleared(door, found, put_back)
    try:
        door.cap = cap(door.model, budget, candidates=candidates, partial=partial)
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
    that was in force in again.
    """
    from ..runtime import Cap

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
            door.cap = Cap(model, list(capped.names), capped.budget, capped.eviction)

    return undo
