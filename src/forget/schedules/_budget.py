"""Memory budgets as users write them: bytes, ``"512MiB"``, ``"2GB"``, or a fraction."""

from __future__ import annotations

import math
import numbers
import re

__all__ = ["budget_share", "parse_budget"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")
# NOTE [a bare number]: a string budget with no unit that reads as a share as well.
_BARE = re.compile(r"^\s*(100|[1-9][0-9]?)\s*$")


def parse_budget(budget: object, reference_bytes: int | None = None) -> int:
    """Turn a budget into exact bytes.

    Args:
        budget: an ``int`` number of bytes; a string with a unit (``"512MiB"``,
            ``"2GB"``, ``"1.5 GiB"``, ``"1000"``; decimal units are powers of
            1000, binary ones of 1024; NOTE [a bare number]); a ``float`` in ``(0, 1]``, a string
            ``"50%"``, or a number string with a decimal point and no unit
            (``"0.6"``, read as the float), meaning that share of
            ``reference_bytes``.
        reference_bytes: what a fraction is a fraction of (the plain run's peak).

    Returns:
        The budget in bytes, rounded down to a whole byte.

    Raises:
        TypeError: a budget of another type (``bool`` included).
        ValueError: an unknown unit, a non-positive budget, a fraction outside
            ``(0, 1]``, a fraction without ``reference_bytes``, or a whole number
            from 1 to 100 with no unit (``"50"``: NOTE [a bare number]).

    Example:
        >>> parse_budget("512MiB"), parse_budget("2GB"), parse_budget(0.5, 1000)
        (536870912, 2000000000, 500)
        >>> parse_budget("0.6", 1000), parse_budget("60%", 1000), parse_budget("600", 1000)
        (600, 600, 600)
    """
    share = budget_share(budget)
    if share is not None:
        return _fraction(share, budget, reference_bytes)
    if isinstance(budget, numbers.Integral):
        return _positive(int(budget), budget)
    size = _SIZE.match(str(budget))  # a str: budget_share refused every other type
    if size is not None and _BARE.match(str(budget)):
        n = size.group(1)
        raise ValueError(
            f"forget: the budget {budget!r} is a number with no unit, which would be {n} "
            f"bytes, and no training step fits in {n} bytes (NOTE [a bare number]); write "
            f"'{n}%' for a share of the plain step's peak, or '{n}B' (or the int {n}) for "
            "bytes"
        )
    if size is None or size.group(2).lower() not in _UNITS:
        raise ValueError(
            f"forget: cannot read the budget {budget!r}; write bytes with a unit "
            f"({', '.join(u for u in ('B', 'KB', 'MB', 'GB', 'KiB', 'MiB', 'GiB'))}), "
            "e.g. '512MiB', or a share of the plain peak, e.g. '50%'"
        )
    value = float(size.group(1)) * _UNITS[size.group(2).lower()]
    return _positive(math.floor(value), budget)


# NOTE [a bare number]: a string with no unit is bytes (``"1000"``, as a command
# line gives a byte count), but a whole number from 1 to 100 reads as a share just
# as well (``"50"`` for ``"50%"``), and read as bytes it is a budget no step fits:
# the planner would profile the model to say so, a cap would stop at its first
# step. So such a string is refused at once, naming both ways to say it. An int
# stays bytes whatever its size: a Python int is a count, not a string typed in
# a hurry, and `forget.schedules` solvers take small byte counts in their tests.
def budget_share(budget: object) -> float | None:
    """The share of the plain peak ``budget`` names (``0.5``, ``"50%"``, ``"0.5"``); None: bytes.

    Raises:
        TypeError: a budget of another type (``bool`` included).
    """
    if isinstance(budget, bool):
        raise TypeError("forget: a budget is bytes (int), a size string or a fraction, not a bool")
    if isinstance(budget, numbers.Integral):
        return None
    if isinstance(budget, numbers.Real):
        return float(budget)
    if not isinstance(budget, str):
        raise TypeError(
            "forget: a budget is bytes (int), a size string such as '512MiB' or a fraction "
            f"of the plain peak such as 0.5, got {type(budget).__name__}"
        )
    percent = _PERCENT.match(budget)
    if percent is not None:
        return float(percent.group(1)) / 100
    size = _SIZE.match(budget)
    if size is not None and not size.group(2) and "." in size.group(1):
        # "0.6" from a command line means what 0.6 means to the Python API: a share.
        return float(size.group(1))
    return None


def _positive(value: int, given: object) -> int:
    if value <= 0:
        raise ValueError(f"forget: a budget must be positive, got {given!r}")
    return value


def _fraction(share: float, given: object, reference_bytes: int | None) -> int:
    if not math.isfinite(share) or not 0 < share <= 1:
        raise ValueError(
            f"forget: a budget given as a fraction must lie in (0, 1] (a share of the plain "
            f"run's peak), got {given!r}; give bytes as an int or a string such as '512MiB', "
            "or a share such as 0.6 or '60%'"
        )
    if reference_bytes is None:
        raise ValueError(
            f"forget: the budget {given!r} is a share of the plain run's peak, which is "
            "not known here; give bytes instead"
        )
    return _positive(math.floor(share * reference_bytes), given)
