"""``KVWriteLoc``: the write target(s) of one ``set_kv_buffer`` call.

An attention backend resolves its write locations once per forward and hands the bundle to
whatever pool it talks to, so it can make one call regardless of the pool type:

* ``loc``      -- the generic per-token write location (the allocator's token ids);
* ``swa_loc``  -- optional, already translated into a sliding-window sub-pool's slots;
* ``full_loc`` -- optional, already translated into a full-attention sub-pool's slots.

Plain pools (MHA, MLA, FP4, DSA, MiniMax) write at ``loc`` and ignore the other two; pools
with sub-pools pick the one that matches. The pool never translates locations itself.

Invariant: ``swa_loc`` / ``full_loc``, when given, are 1-D and hold at least ``len(loc)``
entries; longer ones are cut to ``len(loc)`` (callers narrow ``loc`` per layer for padded
batches while the translated locations were computed for the full batch, same token order).
Shorter ones raise :class:`ShapeMismatch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch

__all__ = ["KVWriteLoc", "unwrap_write_loc"]


def _check_loc(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"KVWriteLoc.{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ShapeMismatch(f"KVWriteLoc.{name} must be 1-D, got shape {tuple(t.shape)}")


@dataclass
class KVWriteLoc:
    """Write locations for ``set_kv_buffer`` (see module docstring)."""

    loc: torch.Tensor
    swa_loc: Optional[torch.Tensor] = None
    full_loc: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        _check_loc("loc", self.loc)
        n = self.loc.shape[0]
        for name in ("swa_loc", "full_loc"):
            t = getattr(self, name)
            if t is None:
                continue
            _check_loc(name, t)
            if t.shape[0] < n:
                raise ShapeMismatch(f"KVWriteLoc.{name} has {t.shape[0]} entries, loc has {n}")
            if t.shape[0] > n:
                setattr(self, name, t[:n])

    def __len__(self) -> int:
        return int(self.loc.shape[0])


def unwrap_write_loc(loc_info) -> tuple:
    """``(loc, swa_loc, full_loc)`` from a :class:`KVWriteLoc`, or ``(loc_info, None, None)``
    for a bare location (tensor or sequence of ints)."""
    if isinstance(loc_info, KVWriteLoc):
        return loc_info.loc, loc_info.swa_loc, loc_info.full_loc
    return loc_info, None, None
