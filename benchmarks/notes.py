"""The machine-dependent figures behind the engine's and planner's NOTE blocks.

The NOTEs in ``src/forget`` give the reasoning; the figures they rest on depend
on the machine, so they are printed here, and recorded with their date in
``benchmarks/measured.md``. Each figure is a median over interleaved rounds.

Usage (from a checkout)::

    python benchmarks/notes.py            # all figures, about a minute on 2 CPU cores
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forget._engine._state import StateTracker
from forget._planning import time_calls

OPS = 300  # small elementwise ops per call: the per-op cost dominates


def _median_s(fns: dict[str, Callable[[], object]], rounds: int = 15) -> dict[str, float]:
    """Median seconds per call of each callable, timed in interleaved rounds (`time_calls`)."""
    return {k: statistics.median(v) for k, v in time_calls(fns, rounds).items()}


class _Nothing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def per_op_us() -> dict[str, float]:
    """NOTE [plain re-run]: what a dispatch mode costs per op, over a plain op."""
    x = torch.randn(16)

    def chain() -> None:
        h = x
        for _ in range(OPS):
            h = h.sin()

    def under(mode: Callable[[], TorchDispatchMode]) -> Callable[[], None]:
        def run() -> None:
            with mode():
                chain()

        return run

    t = _median_s({"plain": chain, "mode": under(_Nothing), "tracker": under(StateTracker)})
    return {
        "python dispatch (a mode that does nothing)": (t["mode"] - t["plain"]) / OPS * 1e6,
        "StateTracker": (t["tracker"] - t["plain"]) / OPS * 1e6,
    }


def detach_us() -> dict[str, float]:
    """NOTE [hidden aliases]: ``detach`` under a mode, and with Python dispatch off."""
    x = torch.randn(16)

    def under_mode() -> None:
        with _Nothing():
            for _ in range(OPS):
                x.detach()

    def dispatch_off() -> None:
        with _Nothing(), torch._C._DisableTorchDispatch():
            for _ in range(OPS):
                x.detach()

    t = _median_s({"mode": under_mode, "off": dispatch_off})
    return {
        "detach under a mode": t["mode"] / OPS * 1e6,
        "detach, dispatch off": t["off"] / OPS * 1e6,
    }


def full_collection() -> dict[str, float]:
    """NOTE [frozen heap]: one full ``gc.collect()`` with torch's compiler imported."""
    import torch._dynamo  # noqa: F401  (the first dispatch mode imports it)

    t = _median_s({"collect": gc.collect}, rounds=7)
    return {"objects tracked": float(len(gc.get_objects())), "full collection s": t["collect"]}


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for figures in (per_op_us(), detach_us(), full_collection()):
        for name, value in figures.items():
            print(f"  {name:45s} {value:12.3f}")


if __name__ == "__main__":
    main()
