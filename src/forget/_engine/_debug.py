"""``debug=True``: the ops of a region's forward and re-run, shown when they disagree.

NOTE [debug trace]: a `RecomputationMismatchError` says which saved tensor
differs, but not which op made the re-run go another way. With ``debug`` a
region records, under a dispatch mode, every op its forward runs and every op
its re-run runs: the op's name, its outputs' dtypes and shapes, and the user's
source line that called it (the innermost Python frame outside forget and
torch). On a mismatch the error then shows both sequences around their first
difference. The mode costs a Python call and a walk up the stack per op, so a
region records only when ``debug`` is on; without it nothing here runs.
"""

from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._errors import RecomputationMismatchError
from ._local import _hiding

__all__ = ["OpTrace"]

_CONTEXT_OPS = 3  # ops shown on either side of the first difference


@dataclass(frozen=True)
class _Op:
    """One op as run: its name, what it returned, and the user's line that called it."""

    name: str
    outputs: str
    where: str

    def same(self, other: _Op) -> bool:
        return self.name == other.name and self.outputs == other.outputs


class OpTrace:
    """The ops of one region's forward and of its latest re-run (NOTE [debug trace])."""

    def __init__(self) -> None:
        self.forward: list[_Op] = []
        self.rerun: list[_Op] = []

    def recording_forward(self) -> _Recorder:
        """A dispatch mode that records the forward's ops (a context manager)."""
        self.forward = []
        return _Recorder(self.forward)

    def recording_rerun(self) -> _Recorder:
        """A dispatch mode that records a re-run's ops, replacing an earlier re-run's."""
        self.rerun = []
        return _Recorder(self.rerun)

    def explain(self, error: RecomputationMismatchError) -> None:
        """Append both op sequences around their first difference to ``error``'s message."""
        error.args = (_explain(str(error), self),)


def _explain(message: str, trace: OpTrace) -> str:
    forward, rerun = trace.forward, trace.rerun
    first = next(
        (i for i, (a, b) in enumerate(zip(forward, rerun, strict=False)) if not a.same(b)),
        min(len(forward), len(rerun)),
    )
    lo, hi = max(0, first - _CONTEXT_OPS), first + _CONTEXT_OPS + 1
    if first < min(len(forward), len(rerun)):
        head = (
            f"debug: the first op that differs is op {first + 1}: the forward ran "
            f"{forward[first].name}, the re-run {rerun[first].name}"
        )
    else:
        head = (
            f"debug: the forward ran {len(forward)} ops and the re-run {len(rerun)} before "
            f"the error, the same up to op {first}"
        )
    lines = [message, "", head + " ('>' marks it; ops of both runs in order):"]
    for title, ops in (("forward", forward), ("re-run", rerun)):
        lines.append(f"  {title}:")
        shown = ops[lo:hi]
        if lo:
            lines.append("      ...")
        for i, op in enumerate(shown, start=lo):
            mark = ">" if i == first else " "
            lines.append(f"    {mark} {i + 1:>4}  {op.name} -> {op.outputs}{op.where}")
        if first >= len(ops):
            lines.append(f"    > {first + 1:>4}  (no op: the {title} stopped here)")
        elif hi < len(ops):
            lines.append("      ...")
    return "\n".join(lines)


class _Recorder(TorchDispatchMode):
    """Append each op run under it (not the engine's hidden ones) to a list."""

    def __init__(self, ops: list[_Op]) -> None:
        super().__init__()
        self._ops = ops

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not _hiding.depth:
            self._ops.append(_Op(str(func), _outputs(out), _user_line()))
        return out


def _outputs(out: Any) -> str:
    parts = [
        f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor)
    ]
    return ", ".join(parts) or "()"


_SKIPPED = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (torch, sys.modules[__package__.rpartition(".")[0]])
    if m.__file__ is not None
)


def _user_line() -> str:
    """``  at file:line in function: source`` for the innermost frame outside forget and torch."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return ""
    path, line = frame.f_code.co_filename, frame.f_lineno
    source = linecache.getline(path, line).strip()
    where = f"  at {os.path.basename(path)}:{line} in {frame.f_code.co_name}"
    return f"{where}: {source}" if source else where
