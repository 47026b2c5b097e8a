"""The optimal persistent schedule: a dynamic program over stage ranges and memory.

This follows the recurrence of Beaumont, Eyraud-Dubois, Herrmann, Joly and
Shilova (2019), "Optimal checkpointing for heterogeneous chains: how to train
deep neural networks with limited memory" (the Rotor persistent DP), written
for the memory model in `._schedule` and for trees of `Keep` / `Region`:
to back-propagate range ``[s, t)`` within memory ``m``, either keep stage
``s`` (``F_all(s)``, then solve ``[s+1, t)`` with ``m`` minus ``x_s`` and
``h_s``, then ``B(s)``), or forget ``[s, k)`` (``F_ck(s)``, ``F_n`` up to
``k-1``, solve ``[k, t)`` with ``m`` minus ``x_s``, then re-run and solve
``[s, k)`` with ``m``). A stage with `StageOption` values offers each option
as one more kind of keep: at the top level, and inside a region where the
option allows it (NOTE [options in regions] in `._chain`). The top level
differs otherwise only in that ``x_L`` and ``δ_L`` are not alive before the
forward reaches them.

Memory is discretized into units of ``unit_bytes``, every size rounded *up*, so
a schedule that fits the discretized budget fits the real one; one whose exact
peak fits but rounded peak does not is missed, at most what one unit per buffer
buys. The minimum feasible budget comes from a second, exact program on integer
bytes, and its schedule is always a candidate, so every budget at or above it is
served. Cost: ``O(L^3 M)`` time and ``O(L^2 M)`` memory for ``L`` stages and
``M`` units, vectorized with numpy over the memory axis and the split point. The
rows are stored in a frame where every read is a slice (NOTE [gradient frame] in
`_Tables`), and only optimal times are tabulated, not choices, which beats a
gather per split point and an ``argmin`` per entry (benchmarks/measured.md,
"Planner"). The frame widens a row by the largest activation plus history and by
the chain's parameter gradients, each at most the store-all peak.

NOTE [options at the top level]: an option that is a policy region keeps the
policy's outputs from its forward until its backward. Inside a forgotten region
the stage's first forward must keep nothing (``F_n``) and only the region's
re-run may keep (``F_all``); a policy region run there keeps its outputs from
the first forward on, which the model cannot see, so the real peak exceeds the
predicted one (benchmarks/measured.md, "Single measurements behind the NOTEs").
So inside a region a stage is kept whole or under an option with ``in_regions``
(``regenerate``, which keeps nothing in the first forward), and `Schedule`
rejects any other option there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ._chain import Chain
from ._schedule import Item, Keep, Region

__all__ = ["DEFAULT_MEMORY_UNITS", "min_peak_items", "optimal_items", "unit_bytes_for"]

DEFAULT_MEMORY_UNITS = 1000
# Cells of the (L+1) x (L+1) x (M+1) tables; above it the unit gets coarser.
_MAX_CELLS = 24_000_000

# A peak no schedule reaches: marks a choice that is not allowed.
_NEVER = np.iinfo(np.int64).max // 4

_Floats = npt.NDArray[np.float64]
_Ints = npt.NDArray[np.int64]


@dataclass(frozen=True)
class _Variant:
    """One way to keep a stage: the full keep (option None) or a `StageOption`."""

    option: str | None
    saved_bytes: int
    time_s: float
    backward_overhead_bytes: int
    in_regions: bool


def _variants(chain: Chain) -> list[list[_Variant]]:
    out = []
    for stage in chain.stages:
        row = [
            _Variant(
                None,
                stage.saved_bytes,
                stage.forward_s + stage.backward_s,
                stage.backward_overhead_bytes,
                True,
            )
        ]
        for option in stage.options:
            row.append(
                _Variant(
                    option.name,
                    option.saved_bytes,
                    stage.forward_s + stage.backward_s + option.recompute_s,
                    stage.backward_overhead_bytes + option.backward_overhead_bytes,
                    option.in_regions,
                )
            )
        out.append(row)
    return out


def store_all_peak_bytes(chain: Chain) -> int:
    """Return the exact peak of the plain (all-keep) schedule."""
    a = chain.activation_bytes
    n = len(chain)
    # Forward peaks are dominated by the running total; backward by each B.
    held = a[0]
    peak = a[0]
    for i, stage in enumerate(chain.stages):
        peak = max(peak, held + a[i + 1] + stage.saved_bytes + stage.forward_overhead_bytes)
        held += a[i + 1] + stage.saved_bytes
    held += a[n]  # Loss writes δ_L
    peak = max(peak, held)
    for i in reversed(range(n)):
        stage = chain.stages[i]
        g = stage.param_grad_bytes  # NOTE [parameter gradients]
        peak = max(peak, held + a[i] + g + stage.backward_overhead_bytes)
        held += a[i] + g - a[i + 1] - stage.saved_bytes - a[i + 1]
    return peak


def unit_bytes_for(chain: Chain, memory_units: int = DEFAULT_MEMORY_UNITS) -> int:
    """Return the memory unit the optimal DP uses for ``chain``.

    The unit depends on the chain only (not on the budget), so the planned
    time never increases as the budget grows: ``memory_units`` units span the
    store-all peak (the largest budget worth planning for), made coarser when
    the tables would exceed ~24 million cells.

    Args:
        chain: the chain.
        memory_units: the number of units across the store-all peak.

    Returns:
        The unit, in bytes (at least 1).
    """
    n = len(chain)
    units = max(1, min(memory_units, _MAX_CELLS // ((n + 1) ** 2) - 1))
    return max(1, math.ceil(store_all_peak_bytes(chain) / units))


def _forward_peaks(a: list[int], fo: list[int]) -> list[list[int]]:
    """G[s][k]: peak above the context of the no-grad pass over [s, k) (x_k not alive)."""
    n = len(fo)
    g = [[0] * (n + 1) for _ in range(n + 1)]
    for s in range(n):
        best = 0
        for k in range(s + 1, n + 1):
            j = k - 1
            best = max(best, a[s] + (a[j] if j > s else 0) + a[k] + fo[j])
            g[s][k] = best
    return g


class _Tables:
    """The discretized DP tables for one chain, unit and memory size.

    Only the optimal times are tabulated; the choice behind an entry is worked
    out again, from the same candidate rows, for the few entries a rebuild
    visits (`_choice`): an ``argmin`` over every split point at every memory
    size cost four times the ``min``, and the choices of all other entries are
    never read.
    """

    def __init__(self, chain: Chain, unit: int, m_max: int) -> None:
        n = len(chain)
        self.n = n
        self.m_max = m_max

        def up(x: int) -> int:
            return -(-x // unit)

        self.a = a = [up(x) for x in chain.activation_bytes]
        self.fo = [up(s.forward_overhead_bytes) for s in chain.stages]
        # NOTE [parameter gradients]: each stage's rounded up; pg[t] - pg[s] for [s, t).
        self.gs = [up(s.param_grad_bytes) for s in chain.stages]
        self.pg = pg = np.concatenate(([0], np.cumsum(self.gs, dtype=np.int64)))
        self.variants = _variants(chain)
        self.rv = [
            [(up(v.saved_bytes), v.time_s, up(v.backward_overhead_bytes)) for v in row]
            for row in self.variants
        ]
        self.nograd = np.concatenate(
            ([0.0], np.cumsum([s.forward_nograd_s for s in chain.stages], dtype=np.float64))
        )
        self.region_s = chain.region_overhead_s
        self.g = np.array(_forward_peaks(a, self.fo), dtype=np.int64)
        self.size = size = m_max + 1
        self.shift_pad = 2 * max(a)  # the largest shift `_penalty` is read at
        self.m_index = np.arange(size)
        # NOTE [gradient frame]: row (x, y) of the table, P[x, y][m], is stored shifted
        # right by off[y] = pad + pg[n] - pg[y]: r[x, y, j] = P[x, y][j - off[y]], inf
        # where j < off[y]. A region [s, k) solved before [k, t)'s backward gets the memory
        # minus the gradients of [k, t), pg[t] - pg[k], so its row is read shifted by a
        # different amount for every k; in this frame that is one slice for all k,
        # r[s, s+1:t, off[t]:][:size], with no gather.
        # Both tables also start with ``pad`` columns of inf, so that a row read
        # shifted by up to ``pad`` (an activation and a history) is a slice, not a copy.
        total = int(pg[n])
        self.pad = pad = min(size, max(a[s] + h for s in range(n) for h, _, _ in self.rv[s]))
        self.off = off = [pad + total - int(x) for x in pg]
        self.r = r = np.full((n + 1, n + 1, pad + size + total), np.inf)
        self.q = q = np.full((n + 1, pad + size), np.inf)
        q[n, pad:] = 0.0
        # [s, t) needs [k, t) for k > s and [s, k) for k < t: s from the end, t upwards,
        # so that `_penalty` builds its rows once per s.
        self._penalties: tuple[int, _Floats] | None = None
        for s in reversed(range(n)):
            for t in range(s + 1, n + 1):
                r[s, t, off[t] : off[t] + size] = self._best(s, t)
        for s in reversed(range(n)):
            q[s, pad:] = self._best(s, None)
        self._penalties = None

    def _read(self, rows: _Floats, offset: int, d: int, lo: int, hi: int) -> _Floats:
        """``rows[..., offset + m - d]`` for m in [lo, hi), inf where that index is < 0.

        Within the padding, a view of the table: the caller must not write into it.
        """
        start, width = offset - d + lo, hi - lo
        if start >= 0:
            return rows[..., start : start + width]
        out = np.full((*rows.shape[:-1], width), np.inf)
        if width + start > 0:
            out[..., -start:] = rows[..., : width + start]
        return out

    def _candidates(
        self, s: int, t: int | None, lo: int, hi: int
    ) -> tuple[_Floats, _Floats | None]:
        """Times of every choice for ``[s, t)`` (``t`` None: the top level) within m in [lo, hi).

        Returns the keeps (one row per variant of stage ``s``) and the regions
        ``[s, k)`` for k = s+1, ... (one row each; None when there is none).
        """
        a, fo, gs, pg, off, r, q = self.a, self.fo, self.gs, self.pg, self.off, self.r, self.q
        top = t is None
        end = self.n if t is None else t
        ms = self.m_index[lo:hi]
        keeps = np.full((len(self.rv[s]), hi - lo), np.inf)
        for v, (h, time_s, bo) in enumerate(self.rv[s]):
            if not top and not self.variants[s][v].in_regions:  # NOTE [options at the top level]
                continue
            if s + 1 == end:
                tail = a[s] + a[end] + h if top else a[s] + 2 * a[end] + h
                thr = tail + max(fo[s], (a[end] if top else 0) + a[s] + bo + gs[s])
                keeps[v] = np.where(ms >= thr, time_s, np.inf)
                continue
            thr = max(
                a[s] + a[s + 1] + h + fo[s] + (0 if top else 2 * a[end]),
                2 * a[s] + 2 * a[s + 1] + h + bo + int(pg[end] - pg[s]),
            )
            if top:
                rest = self._read(q[s + 1], self.pad, a[s] + h, lo, hi) + time_s
            else:
                rest = self._read(r[s + 1, end], off[end], a[s] + h, lo, hi) + time_s
            rest[ms < thr] = np.inf
            keeps[v] = rest
        last = end + 1 if top else end  # at the top level a region may end the chain
        if last - s < 2:
            return keeps, None
        # Re-run [s, k) after [k, end): its input kept, then the rest, then its own.
        if top:
            rerun = self._read(q[s + 1 :], self.pad, a[s], lo, hi)
        else:
            rerun = self._read(r[s + 1 : end, end], off[end], a[s], lo, hi)
        cost = rerun + r[s, s + 1 : last, off[end] + lo : off[end] + hi]
        cost += self._penalty(s, last, 0 if top else 2 * a[end], lo, hi)
        return keeps, cost

    def _penalty(self, s: int, last: int, shift: int, lo: int, hi: int) -> _Floats:
        """Rows k = s+1 .. last-1: the re-run's time of ``[s, k)``, inf where m < g[s, k] + shift.

        The full pass builds these rows once per ``s``, for every k and every
        m - shift down to -2 max(a), and slices them (an add instead of an add, a
        comparison and a masked write); a single entry (`_choice`) computes its own.
        """
        if hi - lo == self.size:
            if self._penalties is None or self._penalties[0] != s:
                every, j = np.arange(s + 1, self.n + 1), np.arange(-self.shift_pad, self.size)
                self._penalties = (s, self._penalty_rows(s, every, j))
            start = self.shift_pad - shift + lo
            return self._penalties[1][: last - s - 1, start : start + hi - lo]
        return self._penalty_rows(s, np.arange(s + 1, last), self.m_index[lo:hi] - shift)

    def _penalty_rows(self, s: int, ks: _Ints, j: _Ints) -> _Floats:
        """A row per k in ``ks``: inf where ``j < g[s, k]``, else the re-run time of ``[s, k)``."""
        time_k = self.nograd[ks] - self.nograd[s] + self.region_s
        return np.where(j[None, :] < self.g[s, ks][:, None], np.inf, time_k[:, None])

    def _best(self, s: int, t: int | None) -> _Floats:
        """The least time of ``[s, t)`` at every memory size."""
        keeps, cost = self._candidates(s, t, 0, self.size)
        best = keeps.min(axis=0)
        return best if cost is None else np.minimum(best, cost.min(axis=0))

    def _choice(self, s: int, t: int | None, m: int) -> int:
        """Which choice gives `_best` at ``m``: a variant index, or variants + (k - s - 1).

        The first of equal times, as the keeps come before the regions.
        """
        keeps, cost = self._candidates(s, t, m, m + 1)
        times = keeps[:, 0] if cost is None else np.concatenate([keeps[:, 0], cost[:, 0]])
        return int(np.argmin(times))

    def items(self, m: int) -> tuple[Item, ...] | None:
        """Return the optimal items within ``m`` units, or None if none fits."""
        if not math.isfinite(self.q[0, self.pad + m]):
            return None
        return _rebuild(
            self.n,
            self._choice,
            lambda s, mm: self._choice(s, None, mm),
            [len(v) for v in self.variants],
            [[v.option for v in row] for row in self.variants],
            lambda s, v: self.a[s] + self.rv[s][v][0],
            lambda s: self.a[s],
            lambda k, end: int(self.pg[end] - self.pg[k]),
            m,
        )


def _rebuild(
    n: int,
    p_choice: Callable[[int, int, int], int],
    q_choice: Callable[[int, int], int],
    n_variants: list[int],
    option_names: list[list[str | None]],
    keep_used: Callable[[int, int], int],
    region_used: Callable[[int], int],
    grads_after: Callable[[int, int], int],
    m: int,
) -> tuple[Item, ...]:
    """Turn a DP's choices back into a tree (choice < variants: keep; else region end)."""

    def solve_range(s: int, t: int | None, m: int) -> tuple[Item, ...]:
        out: list[Item] = []
        while True:
            code = p_choice(s, t, m) if t is not None else q_choice(s, m)
            end = n if t is None else t
            if code < n_variants[s]:
                out.append(Keep(s, option_names[s][code]))
                if s + 1 == end:
                    return tuple(out)
                m -= keep_used(s, code)
                s += 1
            else:
                k = s + 1 + code - n_variants[s]
                # NOTE [parameter gradients]: the re-run comes after [k, end)'s backward.
                out.append(Region(solve_range(s, k, m - grads_after(k, end))))
                if k == end:
                    return tuple(out)
                m -= region_used(s)
                s = k

    return solve_range(0, None, m)


@functools.lru_cache(maxsize=4)
def _tables(chain: Chain, unit: int, m_max: int) -> _Tables:
    return _Tables(chain, unit, m_max)


def _store_all_units(chain: Chain, unit: int) -> int:
    """Units past which more memory buys nothing: the store-all peak, plus rounding slack.

    Every buffer's size is rounded up to whole units, so the rounded store-all
    peak exceeds the exact one by at most a unit per buffer: three per stage
    (its activation, history and parameter gradients) and two more.
    """
    return -(-store_all_peak_bytes(chain) // unit) + 3 * len(chain) + 2


def optimal_items(chain: Chain, budget_bytes: int, unit: int) -> tuple[Item, ...] | None:
    """Return the fastest items whose rounded peak fits ``budget_bytes``, or None."""
    m = min(budget_bytes // unit, _store_all_units(chain, unit))
    return _tables(chain, unit, m).items(m)


def optimal_tables_items(
    chain: Chain, budgets_bytes: list[int], unit: int
) -> list[tuple[Item, ...] | None]:
    """Return `optimal_items` for several budgets from one set of tables."""
    if not budgets_bytes:
        return []
    ms = [min(b // unit, _store_all_units(chain, unit)) for b in budgets_bytes]
    tables = _tables(chain, unit, max(ms))
    return [tables.items(m) for m in ms]


@functools.lru_cache(maxsize=16)
def min_peak_items(chain: Chain) -> tuple[int, tuple[Item, ...]]:
    """Return the smallest exact peak over all schedules, and a schedule reaching it.

    Same recurrence as the optimal DP, on exact integer bytes and minimizing
    the peak (ties broken by time, which is not guaranteed optimal among
    minimum-peak schedules).

    Returns:
        ``(peak_bytes, items)``.
    """
    n = len(chain)
    a = list(chain.activation_bytes)
    fo = [s.forward_overhead_bytes for s in chain.stages]
    variants = _variants(chain)
    g = np.array(_forward_peaks(a, fo), dtype=np.int64)
    gs = [s.param_grad_bytes for s in chain.stages]  # NOTE [parameter gradients]
    pg = np.array(chain.param_grad_prefix, dtype=np.int64)
    nograd = np.concatenate(
        ([0.0], np.cumsum([s.forward_nograd_s for s in chain.stages], dtype=np.float64))
    )
    pm = np.zeros((n + 1, n + 1), dtype=np.int64)
    pt = np.zeros((n + 1, n + 1))
    pc = np.zeros((n + 1, n + 1), dtype=np.int64)

    def pick(peaks: _Ints, times: _Floats) -> int:
        low = peaks.min()
        return int(np.argmin(np.where(peaks == low, times, np.inf)))

    for length in range(1, n + 1):
        for s in range(n - length + 1):
            t = s + length
            peaks: list[int] = []
            times: list[float] = []
            for v in variants[s]:
                h, bo = v.saved_bytes, v.backward_overhead_bytes
                if not v.in_regions:  # NOTE [options at the top level]
                    peaks.append(_NEVER)
                    times.append(math.inf)
                    continue
                if length == 1:
                    peaks.append(a[s] + 2 * a[t] + h + max(fo[s], a[s] + bo + gs[s]))
                    times.append(v.time_s)
                else:
                    peaks.append(
                        max(
                            a[s] + a[s + 1] + h + fo[s] + 2 * a[t],
                            a[s] + h + int(pm[s + 1, t]),
                            2 * a[s] + 2 * a[s + 1] + h + bo + int(pg[t] - pg[s]),
                        )
                    )
                    times.append(v.time_s + float(pt[s + 1, t]))
            kp = np.array(peaks, dtype=np.int64)
            kt = np.array(times)
            if length >= 2:
                ks = np.arange(s + 1, t)
                rp = np.maximum(
                    np.maximum(g[s, s + 1 : t] + 2 * a[t], a[s] + pm[s + 1 : t, t]),
                    pm[s, s + 1 : t] + pg[t] - pg[ks],
                )
                rt = (
                    pt[s + 1 : t, t]
                    + pt[s, s + 1 : t]
                    + nograd[ks]
                    - nograd[s]
                    + chain.region_overhead_s
                )
                kp, kt = np.concatenate([kp, rp]), np.concatenate([kt, rt])
            best = pick(kp, kt)
            pm[s, t], pt[s, t], pc[s, t] = kp[best], kt[best], best
    qm = np.zeros(n + 1, dtype=np.int64)
    qt = np.zeros(n + 1)
    qc = np.zeros(n + 1, dtype=np.int64)
    for s in reversed(range(n)):
        peaks = []
        times = []
        for v in variants[s]:
            h, bo = v.saved_bytes, v.backward_overhead_bytes
            if s == n - 1:
                peaks.append(a[s] + a[n] + h + max(fo[s], a[n] + a[s] + bo + gs[s]))
                times.append(v.time_s)
            else:
                peaks.append(
                    max(
                        a[s] + a[s + 1] + h + fo[s],
                        a[s] + h + int(qm[s + 1]),
                        2 * a[s] + 2 * a[s + 1] + h + bo + int(pg[n] - pg[s]),
                    )
                )
                times.append(v.time_s + float(qt[s + 1]))
        ks = np.arange(s + 1, n + 1)
        rp = np.maximum(
            np.maximum(g[s, s + 1 :], a[s] + qm[s + 1 :]), pm[s, s + 1 :] + pg[n] - pg[ks]
        )
        rt = qt[s + 1 :] + pt[s, s + 1 :] + nograd[ks] - nograd[s] + chain.region_overhead_s
        kp = np.concatenate([np.array(peaks, dtype=np.int64), rp])
        kt = np.concatenate([np.array(times), rt])
        best = pick(kp, kt)
        qm[s], qt[s], qc[s] = kp[best], kt[best], best
    items = _rebuild(
        n,
        lambda s, t, _m: int(pc[s, t]),
        lambda s, _m: int(qc[s]),
        [len(v) for v in variants],
        [[v.option for v in row] for row in variants],
        lambda s, v: 0,
        lambda s: 0,
        lambda k, end: 0,
        0,
    )
    return int(qm[0]), items
