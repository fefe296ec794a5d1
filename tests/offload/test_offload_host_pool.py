"""The bounded host pool: geometry, bounds, all-or-nothing allocation, pinning on CUDA."""

import pytest
import torch
from offload_helpers import is_page_locked
from testenv import DEVICE

from kvxfer.kernels.errors import InvalidArgument, OutOfMemory
from kvxfer.pools.offload import HostPool

pytestmark = pytest.mark.timeout(60)


def test_views_partition_one_allocation():
    hp = HostPool([16, 8, 24], 5, state_item_lens=[12, 4], num_slots=3)
    assert hp.page_bytes == 48 and hp.slot_bytes == 16
    assert hp.capacity_bytes == 5 * 48 + 3 * 16
    assert [tuple(v.shape) for v in hp.page_views] == [(5, 16), (5, 8), (5, 24)]
    assert [tuple(v.shape) for v in hp.slot_views] == [(3, 12), (3, 4)]
    # every byte of the allocation belongs to exactly one view row
    for i, v in enumerate(hp.page_views + hp.slot_views):
        v.fill_(i + 1)
    counts = torch.bincount(hp._buffer.long(), minlength=6)
    assert counts[0] == 0
    assert counts[1:].tolist() == [80, 40, 120, 36, 12]


def test_alloc_is_bounded_and_all_or_nothing():
    hp = HostPool([8], 4, state_item_lens=[4], num_slots=2)
    a = hp.alloc(3, 1)
    assert (a.num_pages, a.num_slots) == (3, 1) and hp.used_bytes == 3 * 8 + 4
    with pytest.raises(OutOfMemory, match="2 pages / 0 slots"):
        hp.alloc(2, 0)
    with pytest.raises(OutOfMemory):
        hp.alloc(1, 2)  # pages fit, slots do not: nothing taken
    assert (hp.used_pages, hp.used_slots) == (3, 1)
    hp.free(a)
    assert hp.is_empty and a.num_pages == 0
    b = hp.alloc(4, 2)
    assert b.pages == [(0, 4)] and b.slots == [(0, 2)]  # memory is reused
    hp.check_invariants()


def test_sizing_by_capacity_bytes_and_bad_arguments():
    kv = [torch.zeros(9, 100, dtype=torch.uint8), torch.zeros(9, 28, dtype=torch.uint8)]
    st = [torch.zeros(4, 10, dtype=torch.uint8)]
    hp = HostPool.for_views(kv, st, capacity_bytes=1000, num_slots=2)
    assert hp.num_pages == (1000 - 20) // 128 and hp.capacity_bytes <= 1000
    with pytest.raises(InvalidArgument):
        HostPool.for_views(kv, st, capacity_bytes=10, num_slots=2)
    with pytest.raises(InvalidArgument):
        HostPool.for_views(kv, num_pages=3, capacity_bytes=100)
    with pytest.raises(InvalidArgument, match="kv_item_lens"):
        HostPool([8, 0], 2)
    with pytest.raises(InvalidArgument):
        HostPool([8], -1)
    with pytest.raises(InvalidArgument):
        HostPool([8], 2, num_slots=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinning_without_cuda_is_a_typed_error():
    from kvxfer.kernels.errors import UnsupportedOperation

    with pytest.raises(UnsupportedOperation, match="pinned"):
        HostPool([8], 2, pin_memory=True)


@pytest.mark.skipif(DEVICE != "cuda", reason="pinning needs CUDA")
def test_pinned_on_cuda():
    hp = HostPool([4096], 64, pin_memory=True)
    assert hp.pinned and is_page_locked(hp.page_views[0])
    # registered at its exact size (torch's pinned allocator would round up to 2**k)
    assert hp._registered_ptr == hp._buffer.data_ptr() and hp._buffer.numel() == 64 * 4096
    # small pools that could share an OS page with each other still register cleanly
    small = [HostPool([24], 3, pin_memory=True) for _ in range(8)]
    assert all(p._registered_ptr is not None and is_page_locked(p.page_views[0]) for p in small)
    for p in small + [hp]:
        p.close()
