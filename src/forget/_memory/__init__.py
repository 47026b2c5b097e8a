"""Exact memory figures: the ledger, the allocator probes, reports, `saved`.

- `_ledger`: the dispatch mode that counts every storage a call makes
  (NOTE [the ledger]) and `region` marks.
- `_measure`: `measure` by the ledger, the profiler's allocator events or
  CUDA's allocator (NOTE [the two probes]); `allocator_peak`, the peak alone,
  and `AllocatorRecord`, the same record left open; `frozen_heap`.
- `_budget`: `budget_bytes`, the one budget reader (NOTE [one budget]).
- `_fake`: `faked`, a model and its inputs on fake tensors, and
  `fake_step_peak`, a step's ledger peak there.
- `_saved`: `saved`, what a call keeps for backward.
- `_reports`: the frozen reports they return.

Other packages import the names below, never the underscore modules.
"""

from ._budget import budget_bytes as budget_bytes
from ._fake import fake_step_peak as fake_step_peak
from ._fake import faked as faked
from ._ledger import Ledger as Ledger
from ._ledger import StorageRecord as StorageRecord
from ._ledger import region as region
from ._ledger import watch as watch
from ._measure import PROBES as PROBES
from ._measure import AllocatorReading as AllocatorReading
from ._measure import AllocatorRecord as AllocatorRecord
from ._measure import allocator_peak as allocator_peak
from ._measure import frozen_heap as frozen_heap
from ._measure import measure as measure
from ._measure import stop_open_record as stop_open_record
from ._reports import MemoryReport as MemoryReport
from ._reports import RegionStats as RegionStats
from ._reports import SavedReport as SavedReport
from ._reports import SavedTensor as SavedTensor
from ._saved import saved as saved

__all__ = [
    "PROBES",
    "AllocatorReading",
    "AllocatorRecord",
    "Ledger",
    "MemoryReport",
    "RegionStats",
    "SavedReport",
    "SavedTensor",
    "StorageRecord",
    "allocator_peak",
    "budget_bytes",
    "fake_step_peak",
    "faked",
    "frozen_heap",
    "measure",
    "region",
    "saved",
    "stop_open_record",
    "watch",
]
