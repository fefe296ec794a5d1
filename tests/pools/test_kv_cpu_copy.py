"""Host copy (retract) and restore into DIFFERENT indices, for every pool with storage;
chunking; cross-layout portability of copies; validation (typed error, nothing written)."""

import pytest
import torch
from testenv import DEVICE

from kvxfer.kernels.errors import (
    IndexOutOfRange,
    InvalidArgument,
    ShapeMismatch,
    UnsupportedOperation,
)
from kvxfer.pools.cpu_copy import KvCpuCopy
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.mla import MLATokenToKVPool
from kvxfer.pools.noop import MHATokenToKOnlyPool, NoOpMHATokenToKVPool
from kvxfer.pools.page_major import PageMajorMHATokenToKVPool

pytestmark = pytest.mark.timeout(60)

FP8 = getattr(torch, "float8_e4m3fn", None)
DTYPES = [torch.bfloat16, torch.float16, torch.float32] + ([FP8] if FP8 is not None else [])
SIZE, PS, H, D, DV, L = 12, 4, 2, 4, 3, 2
KINDS = ["nhd", "hnd", "page_major", "mla", "k_only"]


def make(kind, dtype, **kw):
    if kind in ("nhd", "hnd"):
        return MHATokenToKVPool(SIZE, PS, dtype, H, D, L, DEVICE, v_head_dim=DV, layout=kind, **kw)
    if kind == "page_major":
        return PageMajorMHATokenToKVPool(SIZE, PS, dtype, H, D, L, DEVICE, v_head_dim=DV, **kw)
    if kind == "mla":
        return MLATokenToKVPool(SIZE, PS, dtype, 6, 2, L, DEVICE, **kw)
    return MHATokenToKOnlyPool(SIZE, PS, dtype, H, D, L, DEVICE, **kw)


def fill(pool, loc, seed):
    """Write distinct random rows at ``loc`` in every layer."""
    g = torch.Generator().manual_seed(seed)
    loc = torch.as_tensor(loc, device=DEVICE)
    n = loc.numel()
    for layer in range(L):
        if isinstance(pool, MLATokenToKVPool):
            pool.set_mla_kv_buffer(
                layer,
                loc,
                torch.randn(n, 1, 6, generator=g).to(pool.dtype),
                torch.randn(n, 1, 2, generator=g).to(pool.dtype),
            )
        elif isinstance(pool, MHATokenToKOnlyPool):
            pool.set_kv_buffer(layer, loc, torch.randn(n, H, D, generator=g).to(pool.dtype), None)
        else:
            pool.set_kv_buffer(
                layer,
                loc,
                torch.randn(n, H, D, generator=g).to(pool.dtype),
                torch.randn(n, H, DV, generator=g).to(pool.dtype),
            )


def rows_at(pool, loc):
    """Every token buffer's rows at ``loc`` (store dtype), via plain torch indexing."""
    loc = torch.as_tensor(loc, device=DEVICE).long()
    out = []
    for buf, how in pool._token_buffers():
        if how == "rows":
            out.append(buf[loc].clone())
        elif how == "paged":
            out.append(buf[loc // PS, loc % PS].clone())
        else:
            out.append(buf[loc // PS, :, loc % PS].clone())
    return out


def snapshot(pool):
    return [b.clone() for b, _ in pool._token_buffers()]


def assert_unchanged(pool, before):
    for (b, _), want in zip(pool._token_buffers(), before):
        assert torch.equal(b, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_copy_then_restore_into_new_indices(kind, dtype):
    pool = make(kind, dtype, cpu_copy_chunk_tokens=3)  # several chunks per buffer
    src = [4, 5, 6, 7, 9, 10, 11]
    fill(pool, src, seed=1)
    want = rows_at(pool, src)
    copy = pool.get_cpu_copy(torch.tensor(src, device=DEVICE))
    assert isinstance(copy, KvCpuCopy) and copy.num_tokens == len(src)
    assert all(t.device.type == "cpu" for t in copy.tensors)
    assert copy.nbytes == sum(w.numel() * w.element_size() for w in want)
    # the source slots are reused by someone else; the request comes back elsewhere
    fill(pool, src, seed=2)
    others = rows_at(pool, src)
    dst = [13, 1, 14, 15, 2, 3, 12]
    pool.load_cpu_copy(copy, dst)
    for w, g in zip(want, rows_at(pool, dst)):
        assert torch.equal(w, g)
    for w, g in zip(others, rows_at(pool, src)):  # the slots we did not restore into: untouched
        assert torch.equal(w, g)
    # a second, fresh pool (another worker) restores the same copy
    fresh = make(kind, dtype)
    fresh.load_cpu_copy(copy, torch.tensor(dst[::-1], device=DEVICE), chunk_tokens=2)
    for w, g in zip(want, rows_at(fresh, dst[::-1])):
        assert torch.equal(w, g)


def test_copies_are_portable_between_mha_layouts():
    """A copy is dense token rows, so NHD, HND and page-major pools share copies."""
    pools = {k: make(k, torch.bfloat16) for k in ("nhd", "hnd", "page_major")}
    src, dst = [4, 5, 8, 15], [9, 10, 11, 1]
    fill(pools["nhd"], src, seed=3)
    want = rows_at(pools["nhd"], src)
    copy = pools["nhd"].get_cpu_copy(src)
    for k in ("hnd", "page_major"):
        pools[k].load_cpu_copy(copy, dst)
        for w, g in zip(want, rows_at(pools[k], dst)):
            assert torch.equal(w, g), k
        back = pools[k].get_cpu_copy(dst)
        for a, b in zip(copy.tensors, back.tensors):
            assert torch.equal(a, b), k


def test_empty_copy_round_trips():
    pool = make("page_major", torch.float16)
    copy = pool.get_cpu_copy([])
    assert copy.num_tokens == 0 and copy.nbytes == 0
    before = snapshot(pool)
    pool.load_cpu_copy(copy, [])
    assert_unchanged(pool, before)


@pytest.mark.parametrize("kind", ["nhd", "page_major", "mla"])
def test_restore_validation_writes_nothing(kind):
    pool = make(kind, torch.float16)
    fill(pool, [4, 5, 6], seed=4)
    copy = pool.get_cpu_copy([4, 5, 6])
    before = snapshot(pool)
    with pytest.raises(ShapeMismatch, match="3 tokens, got 2"):
        pool.load_cpu_copy(copy, [1, 2])
    with pytest.raises(IndexOutOfRange, match=str(SIZE + PS)):
        pool.load_cpu_copy(copy, [1, 2, SIZE + PS])
    with pytest.raises(IndexOutOfRange, match="-1"):
        pool.load_cpu_copy(copy, [-1, 2, 3])
    with pytest.raises(InvalidArgument):
        pool.load_cpu_copy({"k": copy.tensors}, [1, 2, 3])
    with pytest.raises(InvalidArgument):
        pool.load_cpu_copy(copy, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ShapeMismatch):
        pool.load_cpu_copy(copy, torch.tensor([[1, 2, 3]]))
    other_dtype = make(kind, torch.bfloat16)
    with pytest.raises(ShapeMismatch, match="dtype"):
        other_dtype.load_cpu_copy(copy, [1, 2, 3])
    bad = KvCpuCopy(
        tensors=copy.tensors[:-1],
        num_tokens=3,
        store_dtype=copy.store_dtype,
        row_shapes=copy.row_shapes[:-1],
    )
    with pytest.raises(ShapeMismatch, match="buffers"):
        pool.load_cpu_copy(bad, [1, 2, 3])
    truncated = KvCpuCopy(
        tensors=[t[:2] for t in copy.tensors],
        num_tokens=3,
        store_dtype=copy.store_dtype,
        row_shapes=copy.row_shapes,
    )
    with pytest.raises(ShapeMismatch, match="shape"):
        pool.load_cpu_copy(truncated, [1, 2, 3])
    assert_unchanged(pool, before)


def test_restore_into_a_pool_of_other_geometry_is_refused():
    a = make("nhd", torch.float16)
    b = MHATokenToKVPool(SIZE, PS, torch.float16, H, D, L, DEVICE, v_head_dim=D)  # Dv differs
    copy = a.get_cpu_copy([1, 2])
    before = snapshot(b)
    with pytest.raises(ShapeMismatch):
        b.load_cpu_copy(copy, [3, 4])
    assert_unchanged(b, before)


def test_copy_bounds_and_arguments():
    pool = make("hnd", torch.float16)
    with pytest.raises(IndexOutOfRange, match=str(SIZE + PS)):
        pool.get_cpu_copy([1, SIZE + PS])
    with pytest.raises(InvalidArgument):
        pool.get_cpu_copy([1, 2], chunk_tokens=-1)
    with pytest.raises(InvalidArgument):
        pool.get_cpu_copy(["a"])


def test_noop_pool_refuses_copies():
    pool = NoOpMHATokenToKVPool(SIZE, PS, torch.float16, H, D, L, DEVICE)
    with pytest.raises(UnsupportedOperation):
        pool.get_cpu_copy([1])
    with pytest.raises(UnsupportedOperation):
        pool.load_cpu_copy(None, [1])
