"""`python -m forget demo`: train a small model plain, with forget, and with torch's checkpoint.

The demo is the README's first command. It trains an MLP with BatchNorm and
dropout for a few steps three times from the same initial weights and seeds,
and prints what a user wants to know before adopting forget: the bytes kept
for backward and the peak (exact tensor-storage bytes), whether losses,
gradients and BatchNorm buffers are identical to the plain run, and the time
ratios, measured side by side.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
from collections.abc import Callable, Sequence

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import forget
from forget._planning import time_calls
from forget.schedules import MIB

Wrap = Callable[[nn.Module, torch.Tensor], torch.Tensor]

VARIANTS: dict[str, Wrap] = {
    "plain": lambda block, h: block(h),
    "torch_checkpoint": lambda block, h: torch_checkpoint.checkpoint(block, h, use_reentrant=False),
    "forget": lambda block, h: forget.checkpoint(block, h),
}


class DemoNet(nn.Module):
    """An MLP of ``depth`` blocks Linear-BatchNorm-ReLU-Dropout and a classifier."""

    def __init__(self, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.1)
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, wrap: Wrap) -> torch.Tensor:
        """Run every block through ``wrap`` (plain call, or a checkpointing function)."""
        for block in self.blocks:
            x = wrap(block, x)
        out: torch.Tensor = self.head(x)
        return out


def _step(net: DemoNet, wrap: Wrap, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(net(x, wrap), y)
    loss.backward()
    return loss.detach()


def _identical(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def _known(n: int | None) -> int:
    if n is None:  # only the CUDA probe leaves phases unknown; the demo uses the ledger
        raise RuntimeError("forget: the ledger reported no saved bytes")
    return n


def _mib(n: int) -> str:
    return f"{n / MIB:8.2f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the exit status (1 if forget diverged from the plain run)."""
    parser = argparse.ArgumentParser(
        prog="forget demo",
        description=(
            "Train an MLP of Linear-BatchNorm-ReLU-Dropout blocks for a few SGD steps three "
            "times from the same weights and seeds: plain, with torch.utils.checkpoint and "
            "with forget.checkpoint per block. Print the bytes kept for backward and the "
            "peak (exact storage bytes), step-time ratios timed side by side, and whether "
            "losses, gradients, BatchNorm buffers and parameters match the plain run."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--width", type=int, default=512, help="features of every block")
    parser.add_argument("--depth", type=int, default=8, help="number of blocks")
    parser.add_argument("--batch", type=int, default=256, help="samples per step")
    parser.add_argument("--steps", type=int, default=5, help="SGD steps each variant trains")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per variant")
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse exits on --help and on errors
        return exc.code if isinstance(exc.code, int) else 2
    bad = [
        f"--{k}" for k in ("width", "depth", "batch", "steps", "repeats") if getattr(args, k) < 1
    ]
    if bad:
        print(f"forget: {', '.join(bad)} must be at least 1", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    pristine = DemoNet(args.width, args.depth, classes=10)
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(args.batch, args.width, generator=g),
            torch.randint(0, 10, (args.batch,), generator=g),
        )
        for _ in range(args.steps)
    ]
    print(
        f"forget demo: MLP of {args.depth} blocks (Linear-BatchNorm-ReLU-Dropout), width "
        f"{args.width}, batch {args.batch}, {args.steps} SGD steps, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )

    # 1. Train each variant from the same weights and seeds; compare everything.
    losses: dict[str, list[torch.Tensor]] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    nets: dict[str, DemoNet] = {}
    for name, wrap in VARIANTS.items():
        net = copy.deepcopy(pristine)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        losses[name], grads[name] = [], []
        for step, (x, y) in enumerate(data):
            torch.manual_seed(100 + step)
            opt.zero_grad(set_to_none=True)
            losses[name].append(_step(net, wrap, x, y))
            grads[name] += [p.grad.clone() for p in net.parameters() if p.grad is not None]
            opt.step()
        nets[name] = net

    def buffers(net: nn.Module) -> list[torch.Tensor]:
        return list(net.buffers())

    # 2. Exact bytes of one step, from tensor storages (forget.measure).
    x, y = data[0]
    reports = {}
    for name, wrap in VARIANTS.items():
        net = copy.deepcopy(pristine)
        torch.manual_seed(100)
        reports[name] = forget.measure(_step, net, wrap, x, y)

    # 3. Time, side by side: variants interleaved after a warm-up, median of the repeats.
    timed = {name: copy.deepcopy(pristine) for name in VARIANTS}

    def prepare(name: str) -> None:
        timed[name].zero_grad(set_to_none=True)
        torch.manual_seed(100)

    calls = {
        name: functools.partial(_step, timed[name], wrap, x, y) for name, wrap in VARIANTS.items()
    }
    times = time_calls(calls, args.repeats, prepare=prepare)
    step_s = {name: statistics.median(ts) for name, ts in times.items()}

    saved = {name: _known(rep.saved_bytes) for name, rep in reports.items()}
    print()
    print(f"{'variant':<18}{'saved for backward':>20}{'peak':>16}{'step':>12}")
    for name in VARIANTS:
        rep = reports[name]
        print(
            f"{name:<18}{_mib(saved[name]):>20}{_mib(rep.peak_bytes):>16}"
            f"{step_s[name] * 1e3:>9.1f} ms"
        )
    plain, ours, theirs = reports["plain"], reports["forget"], reports["torch_checkpoint"]
    print()
    rows = [
        # Variant over baseline, as every ratio of the CLI: below 1 is less.
        ("bytes saved for backward, forget / plain", saved["forget"], saved["plain"]),
        ("peak bytes, forget / plain", ours.peak_bytes, plain.peak_bytes),
        ("peak bytes, forget / torch_checkpoint", ours.peak_bytes, theirs.peak_bytes),
    ]
    for label, num, den in rows:
        print(f"{label + ':':<44}{num / max(den, 1):6.2f}x  ({num:,} B / {den:,} B)")
    for base in ("plain", "torch_checkpoint"):
        label = f"step time, forget / {base}:"
        print(f"{label:<44}{step_s['forget'] / step_s[base]:6.2f}x")
    print()
    same = {
        "losses": _identical(losses["plain"], losses["forget"]),
        "gradients": _identical(grads["plain"], grads["forget"]),
        "BatchNorm buffers": _identical(buffers(nets["plain"]), buffers(nets["forget"])),
        "parameters": _identical(
            list(nets["plain"].parameters()), list(nets["forget"].parameters())
        ),
    }
    for what, ok in same.items():
        print(f"forget vs plain, {what + ':':<19} {'identical' if ok else 'DIFFERENT'}")
    torch_bn = _identical(buffers(nets["plain"]), buffers(nets["torch_checkpoint"]))
    first_bn = next(m for m in nets["torch_checkpoint"].modules() if isinstance(m, nn.BatchNorm1d))
    counted = int(first_bn.state_dict()["num_batches_tracked"])
    print(
        f"torch_checkpoint vs plain, BatchNorm buffers: {'identical' if torch_bn else 'DIFFERENT'}"
        f" (num_batches_tracked {counted} after {args.steps} steps: BatchNorm ran twice a step)"
    )
    return 0 if all(same.values()) else 1
