"""Which region a cap evicts next: the orders it may take, by name.

NOTE [eviction order]: a region may be evicted once its forward has returned,
and a region with candidate regions inside only once they are all evicted (its
slots hold their inputs: evicting it first would re-run them all to rebuild
them). Among those, the runtime evicts the one whose eviction frees the most
bytes (storages no other region or input holds), the one the forward ran first
on a tie. Repeated blocks thus go from the first one on: backward needs them
last, when the least memory is held, while those the forward ran last would be
re-run at once, at backward's peak. At the forward's end only a region that
lies before backward's modelled peak (in forward order) is worth evicting:
backward meets it after the peak, and at the peak it then holds less; within
its own span it is held again, rebuilt. So an enclosing region, whose slots
hold the inputs of the regions inside, is evicted only when the peak falls
after it. The regions a re-run starts in backward are plain forgotten regions
(keeping nothing), so a re-run holds its own slots and, in turn, one region
inside it.

Why the largest first, and not DTR's heuristic (Kirisame et al., ICLR 2021,
"Dynamic Tensor Rematerialization": evict the least cost / (memory x
staleness)), the anchor this began from and still ``eviction="dtr"``: side by
side on four models at two caps, the largest first evicted no more regions
than any other order and re-ran no more forward FLOPs than DTR's typical run
(fewer where regions differ most, a ResNet with a nested stem); and its
choice depends on bytes alone, so the same steps evict the same regions on
every run. DTR's cost is a region's forward time, measured as the step runs:
on a loaded machine it moves, and with it which region goes (runs of the same
steps evicted different sets, now cheaper, now dearer).
Whole regions of one model mostly cost alike per byte (repeated blocks), so
the cost adds little but noise. Known inefficiency: where regions do differ in
cost per byte, the largest first ignores it; a cost counted rather than timed
(FLOPs) would let DTR's order stay repeatable. `EVICTIONS` holds the orders
measured (benchmarks/measured.md, "eviction orders").

NOTE [partial evictions]: with ``partial=`` (a policy that keeps op outputs,
``"selective"`` by name and by default), every candidate with none inside
runs, at shapes seen before (on CPU, read by a record: NOTE [forward
reaches]), as a droppable region with that policy (NOTE [partial drops]): what
the policy keeps is counted with the rest of its held bytes. A region is then
evicted in two stages: in part (the policy's kept outputs stay, the rest goes;
its re-run replays them), then whole. Every region in part goes before any
goes whole, each stage in the eviction order by what it frees. A decision
repeated at known shapes runs a region evicted in part as a policy region from
the start (NOTE [steps of known shapes]).

A region goes in part only where its policy keeps at most a quarter of what it
holds (`PART`). One seen to keep more lets what its policy kept go as it
returns (`DroppableRegion.release_kept`: it is then as if run without it), and
the regions of its kind (its class) run without the policy from then on. A
re-run in part runs the ops the policy did not keep, each through the policy's
dispatch mode: it pays where they hold most of the region (an attention's T x
T scores, probabilities and masks), not where they are the many small ops
around kept matmuls (norms, rotary embeddings, activations). At 50 % and 512
tokens against the plan: GPT-2's and BERT's layers keep 7 % in part, and in
part ran at 0.97 to 1.09 of the plan's step (six runs) where whole at 1.03 to
1.19 (five); Llama's keep 41 %, and in part ran at 1.08 to 1.15 where whole at
1.01 to 1.07.

Why only at shapes seen, and on CPU read: a region under the policy holds,
until it returns, the outputs its policy keeps that plain autograd lets go at
once (a matmul's output that only a ReLU or a residual sum reads). A first
step's reserve, guessed from the regions before, does not foresee them: the
tests' net with a 1024-wide head passed a cap at 80 % of its plain peak by 5 %
on its first step under the policy (tests/test_cap.py,
`test_a_large_last_region_is_within_the_cap_by_the_ledger`). And evicting in
finer steps, the cap lands closer to its estimate, leaving less room for what
its count misses where nothing was read: timm's ConvNeXt-Atto at 75 % peaked
at 1.001 of the cap at a batch size no record read, where whole at 0.980. At
shapes read, the reserve past each boundary is the allocator's own reach, read
with the regions whole, plus what the next region's policy keeps beyond its
slots: the share a region of its kind was seen to keep, or, before any was,
the most its keep may hold. For a region's policy keeps at most `BOUND` (half)
of what the region held when it last ran, whole: past that, an op's output is
recomputed and the region counts as keeping too much. Unbounded, a head
summing six matmuls' outputs (each kept, none saved) passed a cap at 85 % by
56 % the first time it ran under the policy (tests/test_cap.py,
`test_a_region_that_keeps_too_much_under_the_policy_holds_the_cap`). So the
first step of a shape evicts whole regions, the next goes in part, and the one
after repeats that; at a shape whose first step was not read (no larger than
one read before), the second is read and the third goes in part: one profiled
step per shape that comes back, none for one that never does. On CUDA, whose
counters miss nothing, the next step of a shape goes in part with the
forward's reserve and that share. Figures: benchmarks/measured.md, "Partial
evictions" and "Partial evictions by default".
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["BOUND", "EVICTIONS", "PART"]

#: The most of its held bytes a region evicted in part may keep (NOTE [partial evictions]).
PART = 0.25
#: The most a region's policy may keep as it runs, of the bytes it held whole: room for
#: outputs kept, then let go as no re-run reads them (NOTE [partial evictions]).
BOUND = 2 * PART


def _dtr(freed_bytes: int, staleness: int, cost_s: float, index: int) -> float:
    return freed_bytes * staleness / max(cost_s, 1e-9)


def _largest(freed_bytes: int, staleness: int, cost_s: float, index: int) -> float:
    return freed_bytes


def _first_run(freed_bytes: int, staleness: int, cost_s: float, index: int) -> float:
    return -index


def _cheapest_per_byte(freed_bytes: int, staleness: int, cost_s: float, index: int) -> float:
    return freed_bytes / max(cost_s, 1e-9)


#: Eviction orders by name (NOTE [eviction order]): each scores an evictable region
#: from the bytes evicting it frees, its staleness in region boundaries, its forward
#: time and its position in the forward; the highest score goes first, the earliest
#: region on a tie.
EVICTIONS: dict[str, Callable[[int, int, float, int], float]] = {
    "largest": _largest,
    "dtr": _dtr,
    "first_run": _first_run,
    "cheapest_per_byte": _cheapest_per_byte,
}
