"""The one budget reader of `plan`, `cap`, `enable` and the command line: bytes, sizes,
shares of the plain step's peak, and ``"free"`` on CUDA.

NOTE [one budget]: a budget means the same thing wherever forget takes one.
Bytes are an ``int``; a size counts decimal units in powers of 1000 (``"2GB"``)
and binary ones in powers of 1024 (``"512MiB"``), as the units say
(`forget.schedules.parse_budget`, the pure part, which has no torch); a string
from ``"1"`` to ``"100"`` with no unit is refused, naming ``"50%"`` and ``"50B"``
(NOTE [a bare number] in `forget.schedules`). A share
(``"50%"``, ``0.5``) is of the plain step's peak, predicted, since the plain step
is what does not fit: for `plan` and `enable` the planner's prediction, for
`cap` its own, per shape (NOTE [a share of the cap]); each by the figure the
tool bounds (the allocator's for a plan, the cap's count for a cap).
``"free"`` is what the CUDA device has free, less one margin (NOTE [free
budget]). A share of free memory would be a second meaning, so there is none:
``"free"`` already says "what the device has".

NOTE [free budget]: ``budget="free"`` is what the CUDA device has free now
(``torch.cuda.mem_get_info``: other processes and this one's CUDA context
already taken off), less a margin for what this process will take outside the
bytes a step allocates: the caching allocator rounds blocks up and splits them,
and libraries allocate outside it on first use (cuBLAS and cuDNN handles and
workspaces). The margin is a twentieth of the device's memory, and at least
256 MiB; the same margin for a plan and a cap.
"""

from __future__ import annotations

import torch

from .. import schedules as P

__all__ = ["budget_bytes"]

_FREE_MARGIN_SHARE = 0.05
_FREE_MARGIN_MIN_BYTES = 256 << 20


def budget_bytes(
    budget: int | float | str | None,
    reference_bytes: int | None,
    cuda: torch.device | None,
) -> int:
    """A budget in bytes (NOTE [one budget]).

    Args:
        budget: bytes, a size (``"512MiB"``), a share of the plain peak
            (``"60%"``, ``0.6``), ``"free"`` (CUDA only), or ``None``, which
            is ``"free"`` on CUDA.
        reference_bytes: the plain step's peak (predicted) a share is of; None
            where it is not known (a share then raises).
        cuda: the CUDA device whose free memory ``"free"`` reads; None off CUDA.

    Raises:
        TypeError, ValueError: as `forget.schedules.parse_budget`; ``"free"``
            or no budget off CUDA; no memory free past the margin.
    """
    if budget is None or budget == "free":
        if cuda is None:
            what = "no budget" if budget is None else "budget='free'"
            raise ValueError(
                f"forget: {what} means what the CUDA device has free, and this step runs on "
                "CPU; give budget= as bytes (an int), a size ('512MiB') or a share of the "
                "plain step's peak ('60%')"
            )
        free, total = torch.cuda.mem_get_info(cuda)
        margin = max(_FREE_MARGIN_MIN_BYTES, int(total * _FREE_MARGIN_SHARE))
        if free <= margin:
            raise ValueError(
                f"forget: budget='free' is what the device has free, {free:,} B, less a "
                f"margin of {margin:,} B for the allocator's rounding and the libraries' "
                "workspaces, and nothing is left; free memory (del tensors, "
                "torch.cuda.empty_cache()) or give a budget in bytes"
            )
        return free - margin
    return P.parse_budget(budget, reference_bytes)
