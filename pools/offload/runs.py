"""Torch-free run arithmetic for offload/restore copies.

A copy moves item rows ``src[i] -> dst[i]`` for every i. Where both ``src`` and ``dst``
advance by exactly one over a stretch, that stretch is a *run* and moves as one chunk per
buffer. Everything here is vectorised numpy (no Python loop per page).

Invariants: ``runs`` returned by :func:`contiguous_runs` are ``int64 [R, 3]`` rows of
``(src_start, dst_start, length)``, in input order, lengths >= 1, summing to ``len(src)``;
concatenating ``arange(s, s+n)`` over the rows reproduces ``src`` (same for ``dst``).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument

__all__ = ["as_id_array", "check_ids", "contiguous_runs", "expand_extents", "pair_runs"]


def as_id_array(ids, what: str) -> np.ndarray:
    """Return ``ids`` (list, tuple, range, numpy array or torch tensor) as a 1-D int64 array.

    A torch tensor on an accelerator is copied to the host (that synchronises with its
    producer; callers on a hot path keep page ids on the CPU, as the allocators do).
    """
    if hasattr(ids, "detach") and hasattr(ids, "cpu"):  # torch.Tensor, without importing torch
        if ids.numel() == 0:
            return np.zeros(0, dtype=np.int64)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or str(ids.dtype) == "torch.bool":
            raise InvalidArgument(f"{what} must be integers, got dtype {ids.dtype}")
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":  # rejects bool, float, object, ...
        raise InvalidArgument(f"{what} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_ids(arr: np.ndarray, lo: int, hi: int, what: str) -> bool:
    """Raise unless every id lies in ``[lo, hi)`` and no id repeats (names the offender);
    returns whether the ids are strictly increasing (then :func:`pair_runs` needs no search)."""
    if arr.size == 0:
        return True
    if arr.min() < lo or arr.max() >= hi:
        bad = np.flatnonzero((arr < lo) | (arr >= hi))
        raise IndexOutOfRange(f"{what}[{int(bad[0])}] = {int(arr[bad[0]])} is outside [{lo}, {hi})")
    if (arr[1:] > arr[:-1]).all():  # increasing (the usual order): no repeats, no sort
        return True
    srt = np.sort(arr)
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    if dup.size:
        raise InvalidArgument(f"{what} repeats id {int(srt[dup[0]])}")
    return False


def pair_runs(ids: np.ndarray, extents: list[tuple[int, int]], increasing: bool) -> np.ndarray:
    """:func:`contiguous_runs` of ``ids[i] -> expand_extents(extents)[i]`` (ids unique,
    ``increasing`` as :func:`check_ids` answered, as many ids as the extents cover).

    The usual request (consecutive ids into one host extent) is one run found with scalar
    arithmetic, without expanding the extent or searching for breaks."""
    n = int(ids.size)
    if (
        n
        and increasing
        and len(extents) == 1
        and extents[0][1] == n
        and int(ids[-1]) - int(ids[0]) == n - 1  # strictly increasing over a span of n
    ):
        return np.array([[int(ids[0]), int(extents[0][0]), n]], dtype=np.int64)
    return contiguous_runs(ids, expand_extents(extents))


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Split the pairing ``src[i] -> dst[i]`` into maximal runs contiguous on both sides."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise InvalidArgument(f"run sides differ: {src.shape} vs {dst.shape}")
    n = src.size
    if n == 0:
        return np.zeros((0, 3), dtype=np.int64)
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    if brk.size == 0:  # the common case: one run
        return np.array([[src[0], dst[0], n]], dtype=np.int64)
    starts = np.empty(brk.size + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = brk
    lengths = np.diff(starts, append=n)
    return np.stack((src[starts], dst[starts], lengths), axis=1)


def expand_extents(extents: Iterable[tuple[int, int]]) -> np.ndarray:
    """``[(start, length), ...]`` -> the ids they cover, in order, as int64."""
    extents = list(extents)
    if len(extents) == 1:
        start, length = extents[0]
        return np.arange(start, start + length, dtype=np.int64)
    ext = np.asarray(extents, dtype=np.int64).reshape(-1, 2)
    if ext.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    lengths = ext[:, 1]
    total = int(lengths.sum())
    # ids = start_of_extent + position within extent, vectorised
    offsets = np.repeat(ext[:, 0] - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return offsets + np.arange(total, dtype=np.int64)
