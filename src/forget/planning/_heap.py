"""While planning, glibc's malloc hands large freed blocks back to the system (Linux).

NOTE [freed heap]: planning must raise the process's resident memory by about
the budget, not only hold the budget by the ledger. glibc's malloc serves a
block below its mmap threshold from its heap, whose freed pages stay resident,
and the threshold rises to each larger mapped block freed (to 32 MiB), so each
measured step, allocating in another pattern, grows the heap by the holes the
steps before left (figures: benchmarks/measured.md, "Planning's resident set
with glibc's mmap threshold fixed"). So while planning the threshold is
`_PLANNING_THRESHOLD_BYTES` and the heap is trimmed: a larger block is mapped
for itself. Afterwards glibc, which has no getter and stops the rising at any
setting, is set where the rising stops (`_AFTER_THRESHOLD_BYTES`) and trimmed.
A threshold the user set is kept; off glibc nothing is called, and under a
preloaded malloc (jemalloc) glibc's ``mallopt`` is harmless.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["heap_returned"]

_M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
# Blocks from 64 KiB up are mapped for themselves while planning (a tensor of 16,384
# float32 values; smaller ones are Python objects and small tensors).
_PLANNING_THRESHOLD_BYTES = 64 << 10
# glibc's ceiling for the rising threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
_AFTER_THRESHOLD_BYTES = 32 << 20


@contextlib.contextmanager
def heap_returned() -> Iterator[None]:
    """Map large blocks for themselves inside the block, on glibc (NOTE [freed heap])."""
    libc = _glibc()
    if libc is None or user_set_threshold(os.environ):
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _PLANNING_THRESHOLD_BYTES)
    # glibc serves a block from its heap's free top before it maps one: trimmed, the
    # top is too small for a large block, which is then mapped.
    libc.malloc_trim(0)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _AFTER_THRESHOLD_BYTES)
        libc.malloc_trim(0)


def user_set_threshold(environ: Any) -> bool:
    """Whether the process was started with glibc's mmap threshold set (NOTE [freed heap])."""
    tunables = str(environ.get("GLIBC_TUNABLES", ""))
    return "MALLOC_MMAP_THRESHOLD_" in environ or "glibc.malloc.mmap_threshold" in tunables


@functools.cache
def _glibc() -> Any:
    """The process's C library where it is glibc on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):  # musl, or no symbol table to read
        return None
    return libc
