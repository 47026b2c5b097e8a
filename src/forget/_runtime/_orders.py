"""Which region a cap evicts next: the orders it may take, by name.

NOTE [eviction order]: a region may be evicted once its forward has returned,
and one with candidates inside only once they are all evicted (its slots hold
their inputs). Among those the runtime evicts the one that frees the most bytes
(storages nothing else holds), the first run on a tie: repeated blocks go from
the first, which backward needs last, when the least is held. At the forward's
end only a region before backward's modelled peak is worth evicting: backward
meets it after the peak. Regions a re-run starts are plain forgotten ones, so a
re-run holds its own slots and one region inside it at a time.
Why not DTR's heuristic (Kirisame et al., ICLR 2021: least cost / (memory x
staleness); still ``eviction="dtr"``): side by side, the largest first evicted
no more regions and re-ran no more FLOPs, and it depends on bytes alone, so the
same steps evict the same regions on every run, where DTR's timed cost moves
with the machine's load (benchmarks/measured.md, "Eviction orders side by
side"). Known inefficiency: it ignores cost per byte where regions differ; a
counted cost (FLOPs) would keep DTR's order repeatable.

NOTE [partial evictions]: with ``partial=`` (a policy that keeps op outputs,
``"selective"`` by default), every candidate with none inside runs, at shapes
seen before, as a droppable region with that policy (NOTE [partial drops]), and
is evicted in two stages: in part (the kept outputs stay; its re-run replays
them), then whole; every region in part goes before any goes whole. A region
goes in part only where its policy keeps at most `PART` of what it holds; one
seen to keep more lets its kept outputs go as it returns
(`DroppableRegion.release_kept`), and its class runs without the policy from
then on: a re-run in part pays where the ops not kept hold most of the region
(attention scores), not where they are many small ops around kept matmuls.
Repeated at known shapes, a region in part runs as a policy region from the
start (NOTE [steps of known shapes]). Figures: benchmarks/measured.md, "Partial
evictions" and "Partial evictions by default".

NOTE [partial at shapes seen]: a region under the policy holds, until it
returns, outputs plain autograd lets go at once, which a first step's reserve
does not foresee, and finer evictions land closer to the estimate, leaving less
room for what the count misses (benchmarks/measured.md, "Partial evictions").
So the first step of a shape evicts whole regions, the next goes in part, later
ones repeat it; on CPU a shape whose first step was not read (NOTE [forward
reaches]) is read at its second and goes in part from its third: one profiled
step per shape that comes back. At shapes read, the reserve past a
boundary is the forward's reach, read with regions whole, plus what the next
region's policy keeps beyond its slots (the share its kind was seen to keep, or
at most `BOUND` of what the region last held whole, past which an op's output
is recomputed and the region keeps too much). On CUDA, whose counters miss
nothing, the next step of a shape goes in part with the forward's reserve.
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
