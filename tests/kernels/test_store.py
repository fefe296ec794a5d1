"""store_kv / masked store / prefix-valid store: Triton vs the torch reference."""

import pytest
import torch
from _kernels_testlib import DEVICE, DTYPE_IDS, DTYPES, ON_CUDA, distinct, gen, guarded, rand, raw

from kvxfer.kernels import store
from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch

pytestmark = pytest.mark.timeout(60)


def _pair(shape_k, shape_v, dtype, g):
    kc, vc = rand(shape_k, dtype, g), rand(shape_v, dtype, g)
    return (kc, vc), (kc.clone(), vc.clone())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads,dim,n", [(1, 3, 1), (2, 5, 7), (4, 16, 33)])
def test_store_matches_reference(dtype, heads, dim, n):
    g = gen(n)
    rows, dv = 40, dim + 2
    (kc, vc), (kr, vr) = _pair((rows, heads, dim), (rows, heads, dv), dtype, g)
    loc = distinct(n, rows, g, torch.int32)
    k, v = rand((n, heads, dim), dtype, g), rand((n, heads, dv), dtype, g)
    store.store_kv(kc, vc, loc, k, v, backend="triton")
    store.store_kv(kr, vr, loc, k, v, backend="torch")
    assert torch.equal(raw(kc), raw(kr)) and torch.equal(raw(vc), raw(vr))
    assert torch.equal(raw(kc[loc.long()]), raw(k))  # the reference really wrote


def test_store_strided_rows_and_sources():
    """Cache rows padded apart (stride > row) and K/V sliced out of a fused QKV tensor."""
    g = gen(1)
    rows, heads, dim, n = 24, 2, 8, 9
    backing = rand((rows, heads * dim + 6), torch.float16, g)
    kc = backing[:, : heads * dim].unflatten(1, (heads, dim))
    vc = rand((rows, heads, dim), torch.float16, g)
    ref_backing, ref_vc = backing.clone(), vc.clone()
    qkv = rand((n, 3, heads, dim), torch.float16, g)
    k, v = qkv[:, 1], qkv[:, 2]
    loc = distinct(n, rows, g)
    store.store_kv(kc, vc, loc, k, v, backend="triton")
    store.store_kv(
        ref_backing[:, : heads * dim].unflatten(1, (heads, dim)), ref_vc, loc, k, v, backend="torch"
    )
    assert torch.equal(raw(backing), raw(ref_backing)) and torch.equal(raw(vc), raw(ref_vc))


def test_store_k_only_and_fp8_source():
    g = gen(2)
    kc = rand((16, 1, 6), torch.uint8, g)
    kr = kc.clone()
    k = rand((5, 1, 6), torch.uint8, g)
    loc = distinct(5, 16, g)
    k8 = k.view(torch.float8_e4m3fn)  # fp8 data, uint8 store dtype: bytes copied verbatim
    store.store_kv(kc, None, loc, k8, None, backend="triton")
    store.store_kv(kr, None, loc, k, None, backend="torch")
    assert torch.equal(kc, kr) and torch.equal(kc[loc], k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "u8"])
def test_masked_store(dtype):
    g = gen(3)
    rows, n = 30, 33
    (kc, vc), (kr, vr) = _pair((rows, 2, 5), (rows, 2, 3), dtype, g)
    mask = torch.rand(n, generator=g) < 0.5
    loc = torch.full((n,), -1, dtype=torch.int64)  # masked-off rows hold garbage
    loc[mask] = torch.randperm(rows, generator=g)[: int(mask.sum())]
    loc, mask = loc.to(DEVICE), mask.to(DEVICE)
    k, v = rand((n, 2, 5), dtype, g), rand((n, 2, 3), dtype, g)
    before = raw(kc).clone()
    store.store_kv(kc, vc, loc, k, v, mask=mask, backend="triton")
    store.store_kv(kr, vr, loc, k, v, mask=mask, backend="torch")
    assert torch.equal(raw(kc), raw(kr)) and torch.equal(raw(vc), raw(vr))
    untouched = torch.ones(rows, dtype=torch.bool, device=DEVICE)
    untouched[loc[mask]] = False
    assert torch.equal(raw(kc)[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_prefix_valid_store(dtype):
    g = gen(4)
    rows, B, T = 40, 4, 5
    (kc, vc), (kr, vr) = _pair((rows, 1, 7), (rows, 1, 7), dtype, g)
    commit = torch.tensor([0, 3, 5, 9], dtype=torch.int32)  # 9 > T: clamps to T
    valid = torch.arange(T)[None, :] < commit[:, None].long()
    loc_2d = torch.full((B, T), -7, dtype=torch.int64)
    loc_2d[valid] = torch.randperm(rows, generator=g)[: int(valid.sum())]
    loc_2d, commit = loc_2d.to(DEVICE), commit.to(DEVICE)
    k, v = rand((B * T, 1, 7), dtype, g), rand((B * T, 1, 7), dtype, g)
    store.store_kv_prefix_valid(kc, vc, loc_2d, commit, k, v, backend="triton")
    store.store_kv_prefix_valid(kr, vr, loc_2d, commit, k, v, backend="torch")
    assert torch.equal(raw(kc), raw(kr)) and torch.equal(raw(vc), raw(vr))
    flat = valid.reshape(-1).to(DEVICE)
    assert torch.equal(raw(kc[loc_2d.reshape(-1)[flat]]), raw(k[flat]))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_inputs_are_noops(backend):
    g = gen(5)
    kc, vc = rand((8, 2, 3), torch.float16, g), rand((8, 2, 3), torch.float16, g)
    before = raw(kc).clone(), raw(vc).clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    kv = torch.empty(0, 2, 3, dtype=torch.float16, device=DEVICE)
    store.store_kv(kc, vc, empty, kv, kv, backend=backend)
    store.store_kv(kc, vc, empty, kv, kv, mask=empty.bool(), backend=backend)
    store.store_kv_prefix_valid(kc, vc, empty.view(0, 4), empty, kv, kv, backend=backend)
    store.store_kv_prefix_valid(
        kc,
        vc,
        empty.view(3, 0),
        torch.ones(3, dtype=torch.int64, device=DEVICE),
        kv,
        kv,
        backend=backend,
    )
    assert torch.equal(raw(kc), before[0]) and torch.equal(raw(vc), before[1])


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("bad", [-1, 12, 1000])
def test_out_of_range_raises_or_is_never_written(backend, bad):
    g = gen(6)
    full, kc = guarded((12, 1, 4), torch.float32, g)
    vfull, vc = guarded((12, 1, 4), torch.float32, g)
    before, vbefore = raw(full).clone(), raw(vfull).clone()
    loc = torch.tensor([3, bad, 5], device=DEVICE)
    k, v = rand((3, 1, 4), torch.float32, g), rand((3, 1, 4), torch.float32, g)
    if ON_CUDA and backend == "triton":
        store.store_kv(kc, vc, loc, k, v, backend=backend)  # no host check: masked in-kernel
        torch.cuda.synchronize()
        expect = before.view(full.shape[0], -1).clone()
        expect[[4 + 3, 4 + 5]] = raw(k)[[0, 2]].view(2, -1)
        assert torch.equal(raw(full).view(full.shape[0], -1), expect)
        return
    with pytest.raises(IndexOutOfRange, match=str(bad)):
        store.store_kv(kc, vc, loc, k, v, backend=backend)
    assert torch.equal(raw(full), before) and torch.equal(raw(vfull), vbefore)


def test_out_of_range_masked_in_kernel():
    """The kernel itself drops out-of-range rows (the host check is bypassed here)."""
    g = gen(7)
    full, kc = guarded((10, 2, 3), torch.bfloat16, g)
    vfull, vc = guarded((10, 2, 3), torch.bfloat16, g)
    loc = torch.tensor([-3, -1, 2, 10, 11, 9], device=DEVICE)
    k, v = rand((6, 2, 3), torch.bfloat16, g), rand((6, 2, 3), torch.bfloat16, g)
    expect, vexpect = raw(full).clone(), raw(vfull).clone()
    expect.view(18, -1)[[4 + 2, 4 + 9]] = raw(k).view(6, -1)[[2, 5]]
    vexpect.view(18, -1)[[4 + 2, 4 + 9]] = raw(v).view(6, -1)[[2, 5]]
    store._launch(kc, vc, loc, k, v, None, store._MODE_PLAIN)
    assert torch.equal(raw(full), expect) and torch.equal(raw(vfull), vexpect)


def test_bounds_checked_only_where_written():
    g = gen(8)
    kc = rand((6, 1, 2), torch.float16, g)
    loc = torch.tensor([1, 99], device=DEVICE)
    k = rand((2, 1, 2), torch.float16, g)
    mask = torch.tensor([True, False], device=DEVICE)
    store.store_kv(kc, None, loc, k, None, mask=mask, backend="torch")  # 99 is masked off
    with pytest.raises(IndexOutOfRange, match="99"):
        store.store_kv(kc, None, loc, k, None, mask=~mask, backend="torch")


def test_invalid_arguments():
    g = gen(9)
    kc, vc = rand((6, 2, 4), torch.float16, g), rand((6, 2, 4), torch.float16, g)
    k = rand((2, 2, 4), torch.float16, g)
    loc = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(InvalidArgument, match="int32 or int64"):
        store.store_kv(kc, vc, loc.float(), k, k)
    with pytest.raises(ShapeMismatch, match="shape"):
        store.store_kv(kc, vc, loc, k[:, :1], k)
    with pytest.raises(ShapeMismatch, match="dtype"):
        store.store_kv(kc, vc, loc, k.float(), k)
    with pytest.raises(ShapeMismatch, match="rows"):
        store.store_kv(kc, vc[:5], loc, k, k)
    with pytest.raises(InvalidArgument, match="contiguous"):
        store.store_kv(kc.transpose(1, 2), vc, loc, k, k)
    with pytest.raises(InvalidArgument, match="v_cache is None"):
        store.store_kv(kc, None, loc, k, k)
    with pytest.raises(ShapeMismatch, match="mask"):
        store.store_kv(kc, vc, loc, k, k, mask=torch.ones(3, dtype=torch.bool, device=DEVICE))
    with pytest.raises(InvalidArgument, match="backend"):
        store.store_kv(kc, vc, loc, k, k, backend="cuda")
    with pytest.raises(ShapeMismatch, match="commit_lens"):
        store.store_kv_prefix_valid(kc, vc, loc.view(1, 2), loc, k, k)
    if ON_CUDA:
        with pytest.raises(InvalidArgument, match="cpu"):
            store.store_kv(kc, vc, loc.cpu(), k, k)
