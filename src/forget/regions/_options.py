"""The leaf options a region may run under when none are given: facts of the model tree."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ..policies import ATTENTION, DROPOUT, LINEAR, Policy, regenerate, save_outputs_of

__all__ = ["DEFAULT_OPTIONS"]

#: The leaf options a module tree is planned with when ``options`` is not given
#: (NOTE [default options] in `forget.planning`'s tree planner), and what a cap's
#: ``partial="selective"`` keeps: ``"selective"`` keeps the outputs of the matmuls,
#: attention and dropout of a region and re-runs the rest (norms, activations,
#: residual sums); ``"regenerate"`` keeps the module and rebuilds its activation,
#: norm and dropout outputs in backward (`forget.policies.regenerate`).
DEFAULT_OPTIONS: Mapping[str, Policy] = MappingProxyType(
    {
        "selective": save_outputs_of(*LINEAR, *ATTENTION, *DROPOUT),
        "regenerate": regenerate(),
    }
)
