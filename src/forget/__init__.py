"""forget: train deep networks in less memory.

Inside a region marked with `forget`, the forward pass keeps none of its
intermediate activations; the backward pass recomputes them, exactly.

Importing ``forget`` imports no torch: the public names load their modules
on first use, so ``import forget.schedules`` (the pure planners) stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import BudgetInfeasibleError as BudgetInfeasibleError
from .errors import ForgetError as ForgetError
from .errors import RecomputationMismatchError as RecomputationMismatchError

if TYPE_CHECKING:
    from . import models as models
    from . import policies as policies
    from . import schedules as schedules
    from ._apply import apply_forget as apply_forget
    from ._checkpoint import checkpoint as checkpoint
    from .engine import chunked as chunked
    from .engine import fast_path as fast_path
    from .engine import forget as forget
    from .engine import in_recomputing as in_recomputing
    from .engine import regenerating as regenerating
    from .memory import MemoryReport as MemoryReport
    from .memory import SavedReport as SavedReport
    from .memory import measure as measure
    from .memory import saved as saved
    from .nn import Forget as Forget
    from .nn import ForgetSequential as ForgetSequential
    from .nn import forget_sequential as forget_sequential
    from .planning import Plan as Plan
    from .planning import TreePlan as TreePlan
    from .planning import plan as plan
    from .planning import profile_chain as profile_chain
    from .runtime import Cap as Cap
    from .runtime import cap as cap

__version__ = "0.1.0"

# public name -> module that defines it, imported on first access (PEP 562).
_LAZY: dict[str, str] = {
    "forget": ".engine",
    "chunked": ".engine",
    "fast_path": ".engine",
    "in_recomputing": ".engine",
    "regenerating": ".engine",
    "checkpoint": "._checkpoint",
    "apply_forget": "._apply",
    "Forget": ".nn",
    "ForgetSequential": ".nn",
    "forget_sequential": ".nn",
    "measure": ".memory",
    "saved": ".memory",
    "MemoryReport": ".memory",
    "SavedReport": ".memory",
    "plan": ".planning",
    "Plan": ".planning",
    "TreePlan": ".planning",
    "profile_chain": ".planning",
    "cap": ".runtime",
    "Cap": ".runtime",
}

# Public submodules, imported on first access; ``schedules`` and ``policies`` import no torch.
_SUBMODULES = ("models", "policies", "schedules")

__all__ = [
    "BudgetInfeasibleError",
    "Cap",
    "Forget",
    "ForgetError",
    "ForgetSequential",
    "MemoryReport",
    "Plan",
    "RecomputationMismatchError",
    "SavedReport",
    "TreePlan",
    "__version__",
    "apply_forget",
    "cap",
    "checkpoint",
    "chunked",
    "fast_path",
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
    "schedules",
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
