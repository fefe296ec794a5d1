"""Byte runs of a group: what the shape planners (:mod:`kvxfer.disagg.page_map`,
:mod:`kvxfer.disagg.tp_plan`) hand to the engine as one :class:`~kvxfer.engine.types.RawWrite`.

Torch-free. Invariant of :func:`run_starts`: a run starts wherever it does not continue the
previous one on both sides (same descriptor, source and destination both right after it), so
merging keeps the order and the bytes and only drops op boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


def run_starts(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, desc: Optional[np.ndarray] = None
) -> np.ndarray:
    """Indices of the runs that do not continue the previous one (see the module docstring)."""
    cont = np.zeros(src.size, dtype=bool)
    cont[1:] = (src[1:] == src[:-1] + nbytes[:-1]) & (dst[1:] == dst[:-1] + nbytes[:-1])
    if desc is not None:
        cont[1:] &= desc[1:] == desc[:-1]
    return np.flatnonzero(~cont)


@dataclass(frozen=True)
class Runs:
    """Byte runs per descriptor (equal-length int64 arrays, one entry per PUT)."""

    desc: np.ndarray
    src_off: np.ndarray
    dst_off: np.ndarray
    nbytes: np.ndarray

    @classmethod
    def empty(cls) -> "Runs":
        return cls(_EMPTY, _EMPTY, _EMPTY, _EMPTY)

    @classmethod
    def merged(
        cls, desc: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
    ) -> "Runs":
        """The runs with every run that continues the previous one merged into it."""
        first = run_starts(src, dst, nbytes, desc)
        if first.size == src.size:
            return cls(desc, src, dst, nbytes)
        return cls(desc[first], src[first], dst[first], np.add.reduceat(nbytes, first))

    def __len__(self) -> int:
        return int(self.nbytes.size)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def raw_write(self, group: str) -> Any:
        """The engine's :class:`~kvxfer.engine.types.RawWrite` of these runs."""
        from kvxfer.engine.types import RawWrite

        return RawWrite(group, self.src_off, self.dst_off, self.nbytes, self.desc)
