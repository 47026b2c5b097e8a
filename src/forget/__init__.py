"""forget: train deep networks in less memory.

Inside a region marked with `forget`, the forward pass keeps none of its
intermediate activations; the backward pass recomputes them, exactly.
"""

from ._errors import BudgetInfeasibleError as BudgetInfeasibleError
from ._errors import ForgetError as ForgetError
from ._errors import RecomputationMismatchError as RecomputationMismatchError

__version__ = "0.1.0"

__all__ = [
    "BudgetInfeasibleError",
    "ForgetError",
    "RecomputationMismatchError",
    "__version__",
]
