"""A pool's item views and its byte-layout fingerprint, as the offload manager sees them.

``pool.get_item_views()`` gives uint8 ``[num_pages, item_len]`` views (row p = page p) per
KV buffer and ``pool.get_state_item_views()`` (where the pool has recurrent state) the same
per state buffer (row s = slot s). :func:`pool_geometry` says what one page / slot means,
byte for byte, so a restore can refuse a pool whose layout differs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvxfer.kernels.errors import InvalidArgument

__all__ = ["pool_views", "pool_geometry"]

# describe() keys that depend on capacity, not on the byte layout of one page/slot.
_SIZE_KEYS = frozenset(
    {"size", "num_pages", "num_slots", "capacity", "lens", "ptrs", "device", "max_size"}
)


def _check_view(v: torch.Tensor, what: str) -> None:
    if v.dtype != torch.uint8 or v.dim() != 2 or v.stride(1) != 1 or v.stride(0) != v.shape[1]:
        raise InvalidArgument(
            f"{what} must be a row-contiguous uint8 [items, item_len] view, got "
            f"{v.dtype} shape {tuple(v.shape)} strides {v.stride()}"
        )


def pool_views(pool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(kv item views, state item views)`` of a pool; either list may be empty."""
    kv = list(pool.get_item_views()) if hasattr(pool, "get_item_views") else []
    st = list(pool.get_state_item_views()) if hasattr(pool, "get_state_item_views") else []
    for i, v in enumerate(kv):
        _check_view(v, f"item view {i}")
    for i, v in enumerate(st):
        _check_view(v, f"state item view {i}")
    if not kv and not st:
        raise InvalidArgument(f"{type(pool).__name__} exposes no item views to offload")
    return kv, st


def _layout_only(value):
    """``describe()`` output without capacity-dependent keys (recursively), canonical order."""
    if isinstance(value, dict):
        return tuple(
            sorted((str(k), _layout_only(v)) for k, v in value.items() if k not in _SIZE_KEYS)
        )
    if isinstance(value, (list, tuple)):
        return tuple(_layout_only(v) for v in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def pool_geometry(pool, kv: Sequence[torch.Tensor], st: Sequence[torch.Tensor]) -> tuple:
    """A hashable fingerprint of what one page / slot of this pool means, byte for byte:
    the item lengths of every view plus ``describe()`` minus capacity-dependent keys."""
    desc = pool.describe() if hasattr(pool, "describe") else {}
    return (
        tuple(int(v.shape[1]) for v in kv),
        tuple(int(v.shape[1]) for v in st),
        _layout_only(desc),
    )
