"""The runtime: a memory cap that each step keeps, with no plan (`forget.cap`).

- `_cap`: `cap` and the `Cap` handle; the model's and the regions' forwards
  wrapped (NOTE [a cap, not a plan]).
- `_steps`: one step's count of bytes and its evictions (NOTE [the cap's count],
  NOTE [eviction order]).
- `_report`: `StepReport`, what the cap did in one step; `_orders`: the eviction
  orders by name; `_reads`: what a step read from the allocator teaches (NOTE
  [what the count misses]); `_outputs`: the tensors of a step's inputs and outputs.

The regions themselves are the engine's (`forget._engine.DroppableRegion`); which
modules are candidates, the default options and the wrapper of a module's
forward are the model tree's (`forget._regions`), shared with the planner, of
which this package imports nothing. Other packages import the names below,
never the underscore modules.
"""

from ._cap import Cap as Cap
from ._cap import cap as cap
from ._orders import EVICTIONS as EVICTIONS
from ._report import StepReport as StepReport

__all__ = ["EVICTIONS", "Cap", "StepReport", "cap"]
