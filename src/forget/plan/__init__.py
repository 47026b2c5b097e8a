"""Pure planning algorithms (no torch): fit a chain of stages into a memory budget."""

from ._chain import Chain as Chain
from ._chain import Stage as Stage
from ._chain import StageOption as StageOption
from ._schedule import Keep as Keep
from ._schedule import Op as Op
from ._schedule import Region as Region
from ._schedule import Schedule as Schedule
from ._schedule import StageDecision as StageDecision
from ._schedule import evaluate as evaluate
from ._schedule import simulate as simulate

__all__ = [
    "Chain",
    "Keep",
    "Op",
    "Region",
    "Schedule",
    "Stage",
    "StageDecision",
    "StageOption",
    "evaluate",
    "simulate",
]
