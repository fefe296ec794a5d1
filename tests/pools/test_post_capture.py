"""KV pools with post-capture backing (issue 4): reserve -> back page 0 -> write/read page 0 ->
finalize -> full use -> release_beyond -> close, for every pool kind, on the test device
(host mmap on CPU, CUDA VMM with KVXFER_TEST_DEVICE=cuda).

Each post-capture pool is checked against an ordinary pool of the final size receiving the
same operations (host copies of every valid id must agree), and its descriptors against the
descriptor arithmetic. Out-of-span ids must raise IndexOutOfRange before anything is touched
(on the host, touching them would be a SIGSEGV).
"""

from types import SimpleNamespace

import pytest
import torch
from testenv import DEVICE

from kvxfer.kernels import dispatch
from kvxfer.kernels.errors import (
    BackingError,
    IndexOutOfRange,
    InvalidArgument,
    UnsupportedOperation,
)
from kvxfer.pools.backing import make_provider
from kvxfer.pools.backing.base import round_up
from kvxfer.pools.hybrid import HybridLinearKVPool
from kvxfer.pools.mamba import MambaPool, MambaStateSpec
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.mla import MLATokenToKVPool
from kvxfer.pools.page_major import PageMajorMHATokenToKVPool

pytestmark = pytest.mark.timeout(90)

PS = 16
H, D = 2, 16  # bf16 NHD row = 64 bytes
LAYERS = 2
GRANULES = 4  # each per-layer buffer spans this many allocation granules
KINDS = ["mha_nhd", "mha_hnd", "page_major", "mla", "hybrid"]


@pytest.fixture(scope="module")
def granularity():
    p = make_provider(DEVICE)
    g = p.granularity
    p.close()
    return g


def _reserved_size(g: int) -> int:
    rows = GRANULES * g // (H * D * 2)
    return rows - PS


def _build(kind: str, size: int, *, post_capture: bool, g: int, **kw):
    if post_capture:
        kw.update(post_capture_active=True, backing_options={"max_extent_bytes": g})
    common = dict(size=size, page_size=PS, dtype=torch.bfloat16, layer_num=LAYERS, device=DEVICE)
    if kind == "mla":
        # R + Dr = 32 bf16 elements = the same 64-byte row as the MHA pools
        return MLATokenToKVPool(kv_lora_rank=24, qk_rope_head_dim=8, **common, **kw)
    if kind == "page_major":
        return PageMajorMHATokenToKVPool(head_num=H, head_dim=D, **common, **kw)
    layout = "hnd" if kind == "mha_hnd" else "nhd"
    inner = MHATokenToKVPool(head_num=H, head_dim=D, layout=layout, **common, **kw)
    if kind != "hybrid":
        return inner
    spec = MambaStateSpec([(3, 1)], (2, 2), torch.bfloat16, torch.float32, (0, 2))
    return HybridLinearKVPool(
        inner, MambaPool(4, spec, DEVICE), (1, 3), post_capture_active=post_capture
    )


def _layer_ids(pool):
    if isinstance(pool, HybridLinearKVPool):
        return list(pool.full_attention_layer_ids)
    return list(range(pool.start_layer, pool.start_layer + pool.layer_num))


def _rows(pool, n: int, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if isinstance(pool, MLATokenToKVPool):
        k = torch.randn(n, 1, pool.kv_cache_dim, generator=g)
        return k.to(device=DEVICE, dtype=torch.bfloat16), None
    k = torch.randn(n, H, D, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(n, H, D, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    return k, v


def _write(pools, ids, seed: int) -> None:
    """The same rows at the same ids of every layer, in every pool."""
    loc = torch.as_tensor(ids, dtype=torch.int64, device=DEVICE)
    for i, layer in enumerate(_layer_ids(pools[0])):
        k, v = _rows(pools[0], len(ids), seed + i)
        for p in pools:
            p.set_kv_buffer(layer, loc, k, v)


def _assert_same(a, b, ids) -> None:
    ca, cb = a.get_cpu_copy(ids), b.get_cpu_copy(ids)
    ca, cb = getattr(ca, "kv", ca), getattr(cb, "kv", cb)
    assert len(ca.tensors) == len(cb.tensors) > 0
    for x, y in zip(ca.tensors, cb.tensors):
        assert torch.equal(x, y)


def _assert_rejected(pool, bad: int) -> None:
    """Every id-taking API raises IndexOutOfRange for ``bad`` (host-checked path)."""
    layer = _layer_ids(pool)[0]
    k, v = _rows(pool, 1, 99)
    loc = torch.tensor([bad], device=DEVICE)
    ok = torch.tensor([1], device=DEVICE)
    with dispatch.force_backend("torch"):
        with pytest.raises(IndexOutOfRange):
            pool.set_kv_buffer(layer, loc, k, v)
        with pytest.raises(IndexOutOfRange):
            pool.move_kv_cache(loc, ok)
        with pytest.raises(IndexOutOfRange):
            pool.move_kv_cache(ok, loc)
        if hasattr(pool, "set_kv_buffer_prefix_valid") and not isinstance(pool, MLATokenToKVPool):
            with pytest.raises(IndexOutOfRange):
                pool.set_kv_buffer_prefix_valid(
                    layer, loc.view(1, 1), torch.ones(1, device=DEVICE, dtype=torch.int64), k, v
                )
        if isinstance(pool, MLATokenToKVPool):
            with pytest.raises(IndexOutOfRange):
                pool.get_mla_kv_buffer(layer, loc)
    with pytest.raises(IndexOutOfRange):
        pool.get_cpu_copy([bad])
    copy = pool.get_cpu_copy([1])
    with pytest.raises(IndexOutOfRange):
        pool.load_cpu_copy(copy, [bad])


def _spans(pool, n: int):
    return [d.final_span_bytes(n, PS) for d in pool.get_buffer_descs()]


@pytest.mark.parametrize("kind", KINDS)
def test_lifecycle(kind, granularity):
    g = granularity
    reserved = _reserved_size(g)
    pool = _build(kind, reserved - 5, post_capture=True, g=g)  # rounded up to whole pages
    try:
        assert pool.post_capture_active and pool.size == reserved
        descs = pool.get_buffer_descs()
        page0 = [d.prefix_span_bytes(PS, PS) for d in descs]
        assert pool.post_capture_backed_bytes == sum(round_up(s, g) for s in page0)
        assert pool.token_limit == PS
        ptrs, lens, items = pool.get_contiguous_buf_infos()
        assert lens == page0 == items  # page 0 only
        assert [v.shape[0] for v in pool.get_item_views()] == [1] * len(descs)
        key0 = pool.get_key_buffer(_layer_ids(pool)[0])
        full_shape = tuple(key0.shape)

        # page 0: write and read back (what graph capture does), nothing else is reachable
        n = reserved - 3 * PS
        ref = _build(kind, n, post_capture=False, g=g)
        _write([pool, ref], list(range(PS)), seed=1)
        _assert_same(pool, ref, list(range(PS)))
        _assert_rejected(pool, PS)

        # finalize: addresses and shapes stay, descriptors follow the backed span
        pool.finalize_backing(n)
        assert pool.size == n and pool.token_limit == n + PS
        p2, lens2, items2 = pool.get_contiguous_buf_infos()
        assert p2 == ptrs and items2 == items and lens2 == _spans(pool, n)
        assert tuple(pool.get_key_buffer(_layer_ids(pool)[0]).shape) == full_shape
        assert pool.post_capture_backed_bytes == sum(round_up(s, g) for s in lens2)
        assert pool.get_kv_size_bytes() == sum(lens2)
        assert [v.shape[0] * v.shape[1] for v in pool.get_item_views()] == lens2
        _assert_same(pool, ref, list(range(PS)))  # page 0 survived
        _assert_same(pool, ref, list(range(PS, n + PS)))  # fresh memory reads 0

        # full use: every valid id, moves, host copy and restore
        _write([pool, ref], list(range(PS, n + PS)), seed=2)
        src = torch.arange(PS, PS + 8, device=DEVICE)
        tgt = torch.arange(n + PS - 8, n + PS, device=DEVICE)
        for p in (pool, ref):
            p.move_kv_cache(tgt, src)
        copies = [p.get_cpu_copy(list(range(2 * PS, 3 * PS))) for p in (pool, ref)]
        for p, c in zip((pool, ref), copies):
            p.load_cpu_copy(c, list(range(n, n + PS)))
        _assert_same(pool, ref, list(range(n + PS)))
        _assert_rejected(pool, n + PS)

        # release_beyond: memory goes back, the kept prefix keeps its bytes
        before = pool.post_capture_backed_bytes
        m = 2 * PS
        freed = pool.release_beyond(m)
        assert freed > 0 and pool.post_capture_backed_bytes == before - freed
        assert pool.size == m and pool.token_limit == m + PS
        p3, lens3, _ = pool.get_contiguous_buf_infos()
        assert p3 == ptrs and lens3 == _spans(pool, m)
        _assert_same(pool, ref, list(range(m + PS)))
        _assert_rejected(pool, m + PS)
    finally:
        pool.close()
    pool.close()  # idempotent
    assert pool.closed and pool.post_capture_backed_bytes == 0 and pool.token_limit == 0
    with pytest.raises(BackingError):
        pool.get_contiguous_buf_infos()
    with pytest.raises(BackingError):
        pool.set_kv_buffer(_layer_ids(pool)[0], [0], *_rows(pool, 1, 5))
    with pytest.raises(BackingError):
        pool.move_kv_cache([0], [1])
    with pytest.raises(BackingError):
        pool.get_cpu_copy([0])


def test_finalize_checks_before_committing(granularity):
    g = granularity
    reserved = _reserved_size(g)
    pool = _build("mha_nhd", reserved, post_capture=True, g=g)
    try:
        backed = pool.post_capture_backed_bytes
        for bad in (reserved + 1, -1, 1.5, "64", True):
            with pytest.raises(InvalidArgument):
                pool.finalize_backing(bad)
            assert pool.post_capture_backed_bytes == backed and pool.size == reserved
            assert pool.token_limit == PS
        with pytest.raises(BackingError):
            pool.release_beyond(PS)  # before finalize
        pool.finalize_backing(SimpleNamespace(max_total_num_tokens=4 * PS))  # engine config
        assert pool.size == 4 * PS and pool.token_limit == 5 * PS
        with pytest.raises(InvalidArgument):
            pool.release_beyond(5 * PS)  # beyond the finalized
        pool.finalize_backing(reserved)  # grow again: whole range
        assert pool.token_limit == reserved + PS
        assert pool.get_contiguous_buf_infos()[1] == _spans(pool, reserved)
        # an unaligned count: the NHD span is exact, ids past it are rejected
        pool.finalize_backing(3 * PS + 5)
        assert pool.token_limit == 4 * PS + 5
        _assert_rejected(pool, 4 * PS + 5)
    finally:
        pool.close()


def test_ordinary_and_unsupported_pools(granularity):
    g = granularity
    plain = _build("mha_nhd", 64, post_capture=False, g=g)
    assert not plain.post_capture_active and plain.backing is None
    assert plain.token_limit == plain.num_slots and plain.post_capture_backed_bytes == 0
    with pytest.raises(UnsupportedOperation):
        plain.finalize_backing(32)
    with pytest.raises(UnsupportedOperation):
        plain.release_beyond(32)
    plain.close()  # no-op
    plain.set_kv_buffer(0, [1], *_rows(plain, 1, 3))
    with pytest.raises(InvalidArgument):
        MHATokenToKVPool(64, PS, torch.bfloat16, H, D, 0, DEVICE, post_capture_active=True)
    with pytest.raises(InvalidArgument):
        MHATokenToKVPool(
            64, PS, torch.bfloat16, H, D, 1, DEVICE, backing_options={"max_extent_bytes": g}
        )
    with pytest.raises(InvalidArgument):
        MHATokenToKVPool(
            64,
            PS,
            torch.bfloat16,
            H,
            D,
            1,
            DEVICE,
            post_capture_active=True,
            backing_options={"bogus": 1},
        )
    from kvxfer.pools.quantized import MHATokenToKVPoolFP4

    with pytest.raises(UnsupportedOperation):
        MHATokenToKVPoolFP4(64, PS, torch.bfloat16, H, D, 1, DEVICE, post_capture_active=True)
    spec = MambaStateSpec([(3, 1)], (2, 2), torch.bfloat16, torch.float32, (0, 2))
    with pytest.raises(InvalidArgument):  # flag must match inner
        HybridLinearKVPool(plain, MambaPool(2, spec, DEVICE), (1, 3), post_capture_active=True)


def test_triton_path_limits_to_backed_span(granularity):
    """The Triton kernels (interpreter on CPU) get the backed span as their row limit."""
    g = granularity
    pool = _build("page_major", _reserved_size(g), post_capture=True, g=g, kernel_backend="triton")
    ref = _build("page_major", 2 * PS, post_capture=False, g=g, kernel_backend="triton")
    try:
        loc = list(range(0, PS, 3))
        _write([pool, ref], loc, seed=7)
        if DEVICE == "cpu":
            with pytest.raises(IndexOutOfRange):
                _write([pool], [PS], seed=8)
        pool.finalize_backing(2 * PS)
        ids = [PS + 1, 2 * PS + 7, 3 * PS - 1]
        _write([pool, ref], ids, seed=9)
        for p in (pool, ref):
            p.move_kv_cache(
                torch.tensor([PS + 2], device=DEVICE), torch.tensor([PS + 1], device=DEVICE)
            )
        _assert_same(pool, ref, list(range(3 * PS)))
        if DEVICE == "cpu":
            with pytest.raises(IndexOutOfRange):
                _write([pool], [3 * PS], seed=10)
    finally:
        pool.close()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs and device masking need CUDA")
def test_cuda_graph_captured_before_finalize_replays_after(granularity):
    """The engine's order on CUDA: capture with dummy writes to page 0, finalize, replay with
    real ids far beyond page 0; eager writes past the backed span are dropped, never faulting."""
    g = granularity
    reserved = _reserved_size(g)
    pool = _build("mha_nhd", reserved, post_capture=True, g=g)
    try:
        B = 8
        loc = torch.zeros(B, dtype=torch.int64, device=DEVICE)
        k, v = _rows(pool, B, 11)
        layers = _layer_ids(pool)

        def step():
            for layer in layers:
                pool.set_kv_buffer(layer, loc, k, v)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        pool.finalize_backing(reserved)
        ids = torch.randperm(reserved, device=DEVICE)[:B] + PS
        loc.copy_(ids)
        k2, v2 = _rows(pool, B, 12)
        k.copy_(k2)
        v.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        for layer in layers:
            assert torch.equal(pool.get_key_buffer(layer)[ids], k2)
            assert torch.equal(pool.get_value_buffer(layer)[ids], v2)
        del graph
        # eager Triton stores mask ids beyond the backed span off (no host sync, no fault):
        # row 2*PS stays physically backed (same granule) after release_beyond(PS), so a
        # write that got through would show there
        old_k, old_v = _rows(pool, 1, 13)
        pool.set_kv_buffer(layers[0], torch.tensor([2 * PS], device=DEVICE), old_k, old_v)
        pool.release_beyond(PS)
        assert pool.token_limit == 2 * PS
        pool.set_kv_buffer(layers[0], torch.tensor([2 * PS], device=DEVICE), *_rows(pool, 1, 14))
        torch.cuda.synchronize()
        assert torch.equal(pool.get_key_buffer(layers[0])[2 * PS : 2 * PS + 1], old_k)
        assert torch.equal(pool.get_value_buffer(layers[0])[2 * PS : 2 * PS + 1], old_v)
    finally:
        pool.close()
