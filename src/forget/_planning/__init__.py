"""The torch side of planning: turn a model into plain numbers, solve, apply, measure.

One pipeline for every model (`forget.plan`, in `_plan`): a chain is a module
tree whose candidates are its children. `_tree` holds its parts: `step`,
`profile` (with `alone`, a module alone on real inputs): the step of any
module and its candidate regions' figures as a `forget.schedules.Tree`
(NOTE [tree figures]); `apply`: a plan's choices on the regions' instance
forwards; `plan`: `Plan`; `planner`: `TreePlanner` (NOTE [tree plans
measured]); `search`: the walk over the frontier.

- From `forget._regions`, below this package and the cap: the candidates
  (NOTE [tree candidates]) and the one region wrapper (NOTE [instance forward]).
- Shared: `_targets` (what a step touches, restored after a trial; options
  checked), `_timing` (callables timed in interleaved rounds, the fastest of
  a few, a region's fixed cost), `_clock` (the clock times are read on,
  passed as a parameter: `WallClock`, or a test's `FixedClock`), `_guard`
  (NOTE [guarded steps]) and `_json`.

The pure algorithms live in `forget.schedules`, which imports no torch. Other
packages import the names below, never the underscore modules.
"""

# The model tree's candidates the planner takes as its default (`forget._regions`).
from .._regions import find_candidates as find_candidates
from ._clock import Clock as Clock
from ._clock import FixedClock as FixedClock
from ._clock import WallClock as WallClock
from ._plan import plan as plan
from ._targets import untouched as untouched
from ._targets import zero_grads as zero_grads
from ._timing import ratio_range as ratio_range
from ._timing import time_calls as time_calls
from ._tree.apply import is_wrapped as is_wrapped
from ._tree.plan import Plan as Plan
from ._tree.planner import TreePlanner as TreePlanner

__all__ = [
    "Clock",
    "FixedClock",
    "Plan",
    "TreePlanner",
    "WallClock",
    "find_candidates",
    "is_wrapped",
    "plan",
    "ratio_range",
    "time_calls",
    "untouched",
    "zero_grads",
]
