"""Byte units: one MiB constant and one formatter for every figure the package prints."""

from __future__ import annotations

#: Bytes in a mebibyte (2**20); every "MiB" the package prints divides by it.
MIB = 1 << 20

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n_bytes: int | float) -> str:
    """Format a byte count in the largest binary unit that keeps it at 1 or more.

    Whole bytes below 1 KiB, two decimals above: for prose and headers; tables with a
    fixed unit divide by `MIB` instead.

    Example:
        >>> format_bytes(512), format_bytes(1536), format_bytes(7_561_776)
        ('512 B', '1.50 KiB', '7.21 MiB')
    """
    value = float(n_bytes)
    for unit in _UNITS[:-1]:
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} {_UNITS[-1]}"
