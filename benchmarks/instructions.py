"""Count the CPU instructions of one training step, per variant, under callgrind.

Wall-clock ratios on a shared 2-core machine move by 15 % from run to run;
instruction counts repeat to within a few thousand. This runs one step of a
reference model plain, with ``torch.utils.checkpoint`` per block, with
``forget.checkpoint`` per block (its sites learned, then fast), the same on
the exact path alone (``exact``: ``fast_path(False)``, the dispatch mode at
every call) and with a selective policy per block, each in
its own ``valgrind --tool=callgrind`` process, one thread, after two warm-up
steps, counting only the measured step (``callgrind_control`` switches the
counting on and off). It reports instructions and ratios: what each variant's
Python bookkeeping and recomputation cost, independent of machine noise.
Instructions are not time (a cache miss costs more than an add), so read them
beside the bench's side-by-side times, not instead of them.

Usage (from a checkout, valgrind installed; about a minute per variant)::

    python benchmarks/instructions.py --model tiny_gpt --size quick
    python benchmarks/instructions.py --model residual_mlp --variants plain,forget
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

VARIANTS = ("plain", "torch", "forget", "exact", "selective")


def _step(model_name: str, size: str, variant: str) -> None:
    """Run inside valgrind: warm up, then count one step."""
    import gc

    import torch
    import torch.utils.checkpoint as torch_checkpoint

    import forget
    from forget import policies
    from forget._cli._models import build_model
    from forget._engine import fast_path

    def exact(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        with fast_path(False):  # every call on the exact path (NOTE [fast path])
            return forget.checkpoint(block, h)

    torch.set_num_threads(1)
    model = build_model(model_name, size, seed=0)
    x, target = model.example_input(generator=torch.Generator().manual_seed(0))
    keep = policies.save_outputs_of(
        *policies.LINEAR, *policies.CONV, *policies.ATTENTION, *policies.DROPOUT
    )
    wraps = {
        "plain": None,
        "torch": lambda b, h: torch_checkpoint.checkpoint(b, h, use_reentrant=False),
        "forget": lambda b, h: forget.checkpoint(b, h),
        "exact": exact,
        "selective": lambda b, h: forget.checkpoint(b, h, policy=keep),
    }
    wrap = wraps[variant]
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model.step(x, target, wrap)
    model.zero_grad(set_to_none=True)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # no collection inside the counted step; put back after (a test runs it)
    try:
        control = ["callgrind_control", "-i"]
        subprocess.run([*control, "on", str(os.getpid())], check=True, capture_output=True)
        model.step(x, target, wrap)
        subprocess.run([*control, "off", str(os.getpid())], check=True, capture_output=True)
    finally:
        if enabled:
            gc.enable()


def _count(model_name: str, size: str, variant: str) -> int:
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--inside",
        "--model",
        model_name,
        "--size",
        size,
        "--variants",
        variant,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in done.stderr.splitlines():
        if "Collected :" in line:
            return int(line.rsplit(":", 1)[1].strip())
    raise RuntimeError(f"callgrind gave no count for {variant}:\n{done.stderr[-2000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny_gpt")
    p.add_argument("--size", default="quick")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; expected some of {', '.join(VARIANTS)}")
    if args.inside:
        _step(args.model, args.size, variants[0])
        return 0
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is not installed (Debian: apt-get install valgrind)")
    counts = {v: _count(args.model, args.size, v) for v in variants}
    print(f"{args.model} ({args.size}), one training step, instructions (callgrind):")
    for v, n in counts.items():
        ratios = []
        if "plain" in counts:
            ratios.append(f"{n / counts['plain']:.3f}x plain")
        if "torch" in counts:
            ratios.append(f"{n / counts['torch']:.3f}x torch")
        print(f"  {v:10s} {n:>14,}  {'  '.join(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
