"""forget: train deep networks in less memory.

Inside a region marked with `forget`, the forward pass keeps none of its
intermediate activations; the backward pass recomputes them, exactly.

Importing ``forget`` imports no torch: the public names load their modules
on first use, so ``import forget.plan`` (the pure planners) stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import BudgetInfeasibleError as BudgetInfeasibleError
from ._errors import ForgetError as ForgetError
from ._errors import RecomputationMismatchError as RecomputationMismatchError

if TYPE_CHECKING:
    from . import models as models
    from . import plan as plan
    from . import policies as policies
    from ._apply import apply_forget as apply_forget
    from ._checkpoint import checkpoint as checkpoint
    from ._core import forget as forget
    from ._measure import MemoryReport as MemoryReport
    from ._measure import SavedReport as SavedReport
    from ._measure import measure as measure
    from ._measure import saved as saved
    from ._planning import Plan as Plan
    from ._planning import profile_chain as profile_chain
    from ._regen import regenerating as regenerating
    from ._state import in_recomputing as in_recomputing
    from .nn import Forget as Forget
    from .nn import ForgetSequential as ForgetSequential
    from .nn import forget_sequential as forget_sequential

__version__ = "0.1.0"

# public name -> module that defines it, imported on first access (PEP 562).
_LAZY: dict[str, str] = {
    "forget": "._core",
    "in_recomputing": "._state",
    "checkpoint": "._checkpoint",
    "Forget": ".nn",
    "ForgetSequential": ".nn",
    "forget_sequential": ".nn",
    "measure": "._measure",
    "saved": "._measure",
    "MemoryReport": "._measure",
    "SavedReport": "._measure",
    "Plan": "._planning",
    "profile_chain": "._planning",
    "apply_forget": "._apply",
    "regenerating": "._regen",
}

# Public submodules, imported on first access; ``plan`` and ``policies`` import no torch.
_SUBMODULES = ("models", "plan", "policies")

__all__ = [
    "BudgetInfeasibleError",
    "Forget",
    "ForgetError",
    "ForgetSequential",
    "MemoryReport",
    "Plan",
    "RecomputationMismatchError",
    "SavedReport",
    "__version__",
    "apply_forget",
    "checkpoint",
    "forget",
    "forget_sequential",
    "in_recomputing",
    "measure",
    "models",
    "plan",
    "policies",
    "profile_chain",
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
