"""Pure planning algorithms (no torch): fit a chain of stages into a memory budget.

Describe a model as a `Chain` of `Stage` figures (times in seconds, sizes in
bytes), then `solve` it for a budget: the result is a `Schedule`, a tree of
`Keep` and nested forget `Region` items with its predicted peak and time.
The memory model is documented in `simulate`'s module, ``forget.schedules._schedule``.
A model seen as a module tree (`Tree` of `TreeNode`, regions nesting along it)
is planned by `solve_tree`, in the model of ``forget.schedules._tree``.

Example:
    >>> from forget.schedules import Chain, Stage, solve
    >>> chain = Chain(tuple(Stage(f"l{i}", 1.0, 0.8, 2.0, 100, 100, 400) for i in range(8)))
    >>> schedule = solve(chain, 2000)
    >>> schedule.predicted_peak_bytes <= 2000
    True
"""

from ._baselines import forget_each_items as forget_each_items
from ._baselines import on_sub_stages as on_sub_stages
from ._baselines import sqrt_segments as sqrt_segments
from ._baselines import store_all_items as store_all_items
from ._baselines import uniform_items as uniform_items
from ._budget import budget_share as budget_share
from ._budget import parse_budget as parse_budget
from ._chain import Chain as Chain
from ._chain import Stage as Stage
from ._chain import StageOption as StageOption
from ._revolve import revolve_forward_steps as revolve_forward_steps
from ._schedule import Keep as Keep
from ._schedule import Op as Op
from ._schedule import Region as Region
from ._schedule import Schedule as Schedule
from ._schedule import StageDecision as StageDecision
from ._schedule import evaluate as evaluate
from ._schedule import simulate as simulate
from ._solve import ALGORITHMS as ALGORITHMS
from ._solve import Algorithm as Algorithm
from ._solve import ParetoPoint as ParetoPoint
from ._solve import get_algorithm as get_algorithm
from ._solve import min_feasible_bytes as min_feasible_bytes
from ._solve import pareto as pareto
from ._solve import solve as solve
from ._tree import Tree as Tree
from ._tree import TreeFigures as TreeFigures
from ._tree import TreeNode as TreeNode
from ._tree import TreeOption as TreeOption
from ._tree import tree_figures as tree_figures
from ._tree_solve import TreeSchedule as TreeSchedule
from ._tree_solve import solve_tree as solve_tree
from ._tree_solve import tree_frontier as tree_frontier
from ._tree_solve import tree_min_feasible_bytes as tree_min_feasible_bytes
from ._units import MIB as MIB
from ._units import format_bytes as format_bytes

__all__ = [
    "ALGORITHMS",
    "MIB",
    "Algorithm",
    "Chain",
    "Keep",
    "Op",
    "ParetoPoint",
    "Region",
    "Schedule",
    "Stage",
    "StageDecision",
    "StageOption",
    "Tree",
    "TreeFigures",
    "TreeNode",
    "TreeOption",
    "TreeSchedule",
    "budget_share",
    "evaluate",
    "forget_each_items",
    "format_bytes",
    "get_algorithm",
    "min_feasible_bytes",
    "on_sub_stages",
    "pareto",
    "parse_budget",
    "revolve_forward_steps",
    "simulate",
    "solve",
    "solve_tree",
    "sqrt_segments",
    "store_all_items",
    "tree_figures",
    "tree_frontier",
    "tree_min_feasible_bytes",
    "uniform_items",
]
