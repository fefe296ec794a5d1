"""Id-array helpers shared by every package (torch-free, NumPy only).

NumPy >= 2.3 computes ``np.unique`` with a hash table: for arrays of *distinct* ids — a
request's pages, the usual case on the transfer and release paths — that takes about ten
times as long as sorting them (bench/results/unique-cpu.md). :func:`sorted_unique` is the
sort-based unique those paths use instead.
"""

from __future__ import annotations

import numpy as np

__all__ = ["sorted_unique"]


def sorted_unique(ids: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D array, ascending: ``np.unique(ids)`` by sorting. Always
    a new array (never ``ids`` itself)."""
    s = np.sort(ids)
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s if keep.all() else s[keep]
