"""Wall time of `forget.schedules.solve` on synthetic chains of 25 to 200 stages.

The tests check what a solve returns (tests/test_plan_algorithms.py, the
100-stage case); how long it takes is printed here, never asserted:

    python benchmarks/solve_time.py [--stages 25,50,100,200] [--repeats 3]

The chains are those of the tests' ``big_chain``: activations of 1 to 8 MiB,
seeded, the budget a third of the way from the least feasible to the
store-all peak. Times are medians over ``--repeats`` solves, on this machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from forget.schedules import Chain, Stage, min_feasible_bytes, solve


def big_chain(n: int, seed: int = 0, prefix: str = "l") -> Chain:
    """The tests' ``big_chain``; ``prefix`` names the stages, so that equal figures
    under another prefix are another chain to the solver's caches (its tables are
    cached per chain: a repeated solve of one chain measures a dictionary lookup)."""
    rng = random.Random(seed)
    a = [rng.randint(1, 8) * 2**20 for _ in range(n + 1)]
    return Chain(
        tuple(
            Stage(f"{prefix}{i}", 1e-3, 8e-4, 2e-3, a[i], a[i + 1], 4 * a[i], 2**19, 2**19)
            for i in range(n)
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="25,50,100,200")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'stages':>6} {'solve (median)':>15} {'min feasible':>13} {'overhead':>10}")
    print("(overhead: the solved schedule's predicted re-run time)")
    for n in (int(s) for s in args.stages.split(",")):
        chain = big_chain(n, seed=1)
        start = time.perf_counter()
        lowest = min_feasible_bytes(chain)
        lowest_s = time.perf_counter() - start
        top = solve(chain, 10**15).predicted_peak_bytes
        budget = (lowest + top) // 3
        times = []
        for r in range(args.repeats):
            fresh = big_chain(n, seed=1, prefix=f"r{r}.")  # the same figures, uncached
            start = time.perf_counter()
            schedule = solve(fresh, budget)
            times.append(time.perf_counter() - start)
        print(
            f"{n:>6} {statistics.median(times):>13.3f} s {lowest_s:>11.3f} s "
            f"{schedule.predicted_overhead_s * 1e3:>7.1f} ms"
        )


if __name__ == "__main__":
    main()
