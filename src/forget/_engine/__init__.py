"""The engine: forgotten regions and what makes their re-run exact.

- `_region`: a region's slots, pack/unpack, re-run, early stop and nesting.
- `_forget`: the entry points `forget`, `run_region`, `compiled_region`;
  `_chunked`: `chunked`, a function on slices, each a region (NOTE [chunked regions]).
- `_replay`: the `in_recomputing` flag, RNG and autocast state replayed.
- `_state`: outside state a region writes (NOTE [state tracking]), through a
  dispatch mode that runs only where a region needs it; `_ops`: what it asks
  of each aten op (NOTE [op info]).
- `_selective`: a policy's replay: kept op outputs and kept draws.
- `_offload`, `_regenerate`: saved tensors moved to the host, or rebuilt.
- `_debug`: ``debug=True``'s op traces of forward and re-run (NOTE [debug trace]).
- `_sites`: call sites learned once, then run on hooks alone (NOTE [fast path]).
- `_slots`: what autograd holds in place of a saved tensor; `_hooks`: the region's
  saved-tensor hooks, which torch's selective checkpoint sees through (NOTE
  [checkpoint-internal hooks]).
- `_droppable`: a region keeping what it saves in slots a runtime empties
  (NOTE [droppable regions]; `forget.cap`).
- `_arguments`: a region's arguments flattened and rebuilt, and copies of those
  it may change (NOTE [arguments that change]).
- `_storage`: storage identity; `_in_turn`: callables run in turn;
  `_local`: per-thread state (running regions, hidden ops).

Other packages import the names below, never the underscore modules.
"""

from ._arguments import copy_structure as copy_structure
from ._arguments import may_change as may_change
from ._arguments import tensors_in as tensors_in
from ._chunked import chunked as chunked
from ._droppable import DroppableRegion as DroppableRegion
from ._forget import compiled_region as compiled_region
from ._forget import forget as forget
from ._forget import forgotten_regions as forgotten_regions
from ._forget import run_region as run_region
from ._in_turn import InTurn as InTurn
from ._regenerate import regenerating as regenerating
from ._region import Region as Region
from ._replay import in_recomputing as in_recomputing
from ._sites import fast_path as fast_path
from ._slots import ordinal as ordinal
from ._storage import StorageKey as StorageKey
from ._storage import storage_key as storage_key
from ._storage import storage_keys as storage_keys
from ._storage import storage_of as storage_of
from ._storage import view_key as view_key
from ._walk import ModuleWalks as ModuleWalks

__all__ = [
    "DroppableRegion",
    "InTurn",
    "ModuleWalks",
    "Region",
    "StorageKey",
    "chunked",
    "compiled_region",
    "copy_structure",
    "fast_path",
    "forget",
    "forgotten_regions",
    "in_recomputing",
    "may_change",
    "ordinal",
    "regenerating",
    "run_region",
    "storage_key",
    "storage_keys",
    "storage_of",
    "tensors_in",
    "view_key",
]
