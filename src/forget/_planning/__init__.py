"""The torch side of planning: turn a model into plain numbers, solve, apply, measure.

One room per planner, and what both use beside them:

- `_chain`, the planner of a chain of blocks: `profile` (`profile_chain`, a
  `forget.schedules.Chain` of exact bytes and median times), `plan` (`Plan`, a
  schedule over blocks with its measured figures; it runs, saves and loads),
  `planner` (`plan` and the `Planner` behind it, NOTE [measured, not
  predicted]; a model that is no chain goes to the tree's room).
- `_tree`, the planner of any module tree: `step`, `profile` (with `alone`,
  a module alone on real inputs): the step of any module and its candidate
  regions' figures as a `forget.schedules.Tree` (NOTE [tree figures]);
  `apply`: a plan's choices on the regions' instance forwards; `plan`:
  `TreePlan`; `planner`: `TreePlanner` (NOTE [tree plans measured]).
- From `forget._regions`, below this package and the cap: the candidates
  (NOTE [tree candidates]), `DEFAULT_OPTIONS` and the one region wrapper
  (NOTE [instance forward]).
- Shared: `_targets` (what a plan runs: a model or blocks as a chain of
  stages, one loss; the stages a block offers; options checked), `_timing`
  (callables timed in interleaved rounds, medians of paired rounds, a
  region's fixed cost), `_clock` (the clock times are read on, passed as
  a parameter: `WallClock`, or a test's `FixedClock`), `_guard` (NOTE
  [guarded steps]) and `_json`.

The rooms import the shared modules and, where the chain planner hands a
module tree over, each other's modules; they are all this package's own.
The pure algorithms live in `forget.schedules`, which imports no torch. Other
packages import the names below, never the underscore modules.
"""

# The model tree's candidates the planner takes as its default (`forget._regions`).
from .._regions import find_candidates as find_candidates
from ._chain.plan import Plan as Plan
from ._chain.plan import PlannedSequential as PlannedSequential
from ._chain.plan import run_items as run_items
from ._chain.planner import Planner as Planner
from ._chain.planner import plan as plan
from ._chain.profile import profile_chain as profile_chain
from ._clock import Clock as Clock
from ._clock import FixedClock as FixedClock
from ._clock import WallClock as WallClock
from ._targets import untouched as untouched
from ._targets import zero_grads as zero_grads
from ._timing import paired_overheads as paired_overheads
from ._timing import ratio_range as ratio_range
from ._timing import time_calls as time_calls
from ._timing import time_rounds as time_rounds
from ._timing import time_side_by_side as time_side_by_side
from ._tree.apply import is_wrapped as is_wrapped
from ._tree.plan import TreePlan as TreePlan
from ._tree.planner import TreePlanner as TreePlanner

__all__ = [
    "Clock",
    "FixedClock",
    "Plan",
    "PlannedSequential",
    "Planner",
    "TreePlan",
    "TreePlanner",
    "WallClock",
    "find_candidates",
    "is_wrapped",
    "paired_overheads",
    "plan",
    "profile_chain",
    "ratio_range",
    "run_items",
    "time_calls",
    "time_rounds",
    "time_side_by_side",
    "untouched",
    "zero_grads",
]
