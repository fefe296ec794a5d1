"""Checks shared by the FP4 / DSA / MiniMax pool tests (imported by name; pytest puts this
folder on sys.path). The device comes from KVXFER_TEST_DEVICE (default cpu)."""

from __future__ import annotations

import msgpack
import testenv
import torch

DEVICE = torch.device(testenv.DEVICE)
# Out-of-range indices: off CUDA they raise IndexOutOfRange before anything is written; on
# CUDA (no host sync) the kernels never write those rows and the other rows are written as
# usual, and reads of out-of-range positions return zeros. Tests branch on this flag.
ON_CUDA = DEVICE.type == "cuda"
REQUIRED_KEYS = {
    "kind",
    "dtype",
    "page_size",
    "layer_num",
    "head_num",
    "head_dim",
    "v_head_dim",
    "layout",
    "item_lens",
}


def loc(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64, device=DEVICE)


def check_registration(pool) -> list[torch.Tensor]:
    """Descriptor invariants of the contract; returns the item views."""
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert len(ptrs) == len(lens) == len(items) > 0
    views = pool.get_item_views()
    assert len(views) == len(ptrs)
    for v, p, n, it in zip(views, ptrs, lens, items):
        assert n % it == 0
        assert v.dtype == torch.uint8 and tuple(v.shape) == (n // it, it)
        assert v.data_ptr() == p and v.is_contiguous()
    d = pool.describe()
    assert REQUIRED_KEYS <= set(d) and d["item_lens"] == items
    assert msgpack.unpackb(msgpack.packb(d)) == d  # plain values only
    return views


def views_snapshot(views) -> list[torch.Tensor]:
    return [v.clone() for v in views]


def assert_same_views(got, want) -> None:
    """Every byte of every item view in ``got`` equals ``want`` (lists of views/snapshots)."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"item view {i} differs"


def item_rows(view: torch.Tensor, page: int) -> torch.Tensor:
    return view[page]
