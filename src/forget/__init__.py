"""forget: train deep networks in less memory.

Inside a region marked with `forget`, the forward pass keeps none of its
intermediate activations; the backward pass recomputes them, exactly.

Importing ``forget`` imports no torch: the public names load their modules
on first use, so ``import forget.schedules`` (the pure planners) stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import BudgetInfeasibleError as BudgetInfeasibleError
from ._errors import ForgetError as ForgetError
from ._errors import RecomputationMismatchError as RecomputationMismatchError

if TYPE_CHECKING:
    from . import integrations as integrations
    from . import policies as policies
    from . import schedules as schedules
    from ._apply import apply_forget as apply_forget
    from ._checkpoint import checkpoint as checkpoint
    from ._engine import chunked as chunked
    from ._engine import forget as forget
    from ._engine import in_recomputing as in_recomputing
    from ._engine import regenerating as regenerating
    from ._memory import measure as measure
    from ._memory import saved as saved
    from ._nn import Forget as Forget
    from ._nn import forget_sequential as forget_sequential
    from ._planning import Plan as Plan
    from ._planning import plan as plan
    from ._runtime import cap as cap

__version__ = "0.1.0"

# NOTE [a small face]: the top level holds what a user calls, and the type a
# user loads a saved plan with (`Plan.load`); the objects the
# functions return (a cap's handle, a memory report) are
# documented where they are returned and need no name here. Whatever a name
# here teaches must keep working, so a name comes in only when a user needs it.

# public name -> module that defines it, imported on first access (PEP 562).
_LAZY: dict[str, str] = {
    "forget": "._engine",
    "chunked": "._engine",
    "in_recomputing": "._engine",
    "regenerating": "._engine",
    "checkpoint": "._checkpoint",
    "apply_forget": "._apply",
    "Forget": "._nn",
    "forget_sequential": "._nn",
    "measure": "._memory",
    "saved": "._memory",
    "plan": "._planning",
    "Plan": "._planning",
    "cap": "._runtime",
}

# Public subpackages, imported on first access; ``schedules``, ``policies`` and
# ``integrations`` import no torch (an integration imports its library when called).
_SUBMODULES = ("integrations", "policies", "schedules")

__all__ = [
    "BudgetInfeasibleError",
    "Forget",
    "ForgetError",
    "Plan",
    "RecomputationMismatchError",
    "apply_forget",
    "cap",
    "checkpoint",
    "chunked",
    "forget",
    "forget_sequential",
    "in_recomputing",
    "measure",
    "plan",
    "policies",
    "regenerating",
    "saved",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module("." + name, __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'forget' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
