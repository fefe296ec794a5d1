"""HybridReqToTokenPool (ping-pong, donation, no leaks) and HybridLinearKVPool."""

import random

import pytest
import torch
from testenv import DEVICE

from kvxfer.pools.errors import DoubleFree, IndexOutOfRange, InvalidArgument, ShapeMismatch
from kvxfer.pools.hybrid import (
    HybridCpuCopy,
    HybridLinearKVPool,
    HybridReqState,
    HybridReqToTokenPool,
)
from kvxfer.pools.mamba import MambaPool, MambaStateSpec
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.mla import MLATokenToKVPool
from kvxfer.pools.page_major import PageMajorMHATokenToKVPool
from kvxfer.pools.quantized import MHATokenToKVPoolFP4
from kvxfer.pools.write_loc import KVWriteLoc

pytestmark = pytest.mark.timeout(90)

MAMBA_IDS = (0, 2, 3)
FULL_IDS = (1, 4)
SPEC = MambaStateSpec([(3, 1), (4, 3)], (2, 2, 2), torch.bfloat16, torch.float32, MAMBA_IDS)


def make_req_pool(
    mamba_size=8, size=4, *, extra=False, lazy=False, overlap=True, layout="per_layer"
):
    mp = MambaPool(mamba_size, SPEC, DEVICE, layout=layout)
    return HybridReqToTokenPool(
        size,
        16,
        mp,
        DEVICE,
        enable_mamba_extra_buffer=extra,
        enable_mamba_extra_buffer_lazy=lazy,
        enable_overlap_schedule=overlap,
    )


# ---------------------------------------------------------------------------- req pool
def test_alloc_assigns_mamba_slots_and_mapping():
    pool = make_req_pool()
    reqs = [HybridReqState(), HybridReqState()]
    sel = pool.alloc(reqs)
    assert sel == [1, 2]
    assert [r.mamba_pool_idx for r in reqs] == [1, 2] and all(r.mamba_needs_clear for r in reqs)
    assert pool.get_mamba_indices(torch.tensor(sel, device=DEVICE)).tolist() == [1, 2]
    # a continuing chunk keeps both slots
    assert pool.alloc([reqs[0]]) == [1]
    assert pool.mamba_allocator.available_size() == 6
    with pytest.raises(InvalidArgument):
        pool.alloc(2)


def test_alloc_is_all_or_nothing():
    pool = make_req_pool(mamba_size=3, size=4, extra=True)  # 3 slots per request needed
    r0 = HybridReqState()
    assert pool.alloc([r0]) == [1]
    assert pool.mamba_allocator.available_size() == 0
    r1 = HybridReqState()
    assert pool.alloc([r1]) is None  # mamba short: request slot must not be taken either
    assert pool.available_size() == 3 and r1.req_pool_idx is None and r1.mamba_pool_idx is None
    pool2 = make_req_pool(mamba_size=8, size=1)
    assert pool2.alloc([HybridReqState(), HybridReqState()]) is None  # request slots short
    assert pool2.mamba_allocator.available_size() == 8


def test_free_mamba_cache_normal_ping_pong_keep_and_double_free():
    pool = make_req_pool(extra=True)
    r = HybridReqState()
    pool.alloc([r])
    work = r.mamba_pool_idx
    buf = list(r.mamba_ping_pong_track_buffer)
    assert len(buf) == 2 and -1 not in buf and work not in buf
    assert pool.req_index_to_mamba_ping_pong_track_buffer_mapping[r.req_pool_idx].tolist() == buf
    with pytest.raises(IndexOutOfRange):
        pool.free_mamba_cache(r, 2)
    kept = pool.free_mamba_cache(r, 1)
    assert kept == buf[1]
    assert pool.mamba_allocator.available_size() == 8 - 1  # only the kept slot is still held
    assert r.mamba_pool_idx is None and r.mamba_ping_pong_track_buffer is None
    with pytest.raises(DoubleFree):
        pool.free_mamba_cache(r)
    pool.mamba_allocator.free([kept])  # the caller (radix cache) releases what it kept
    pool.free_req(r)
    assert pool.mamba_allocator.available_size() == 8 and pool.available_size() == 4


def test_keep_idx_lazy_vs_normal_and_ensure_slot():
    normal = make_req_pool(extra=True)
    lazy = make_req_pool(extra=True, lazy=True)
    rn, rl = HybridReqState(), HybridReqState()
    normal.alloc([rn])
    lazy.alloc([rl])
    assert rl.mamba_ping_pong_track_buffer[1] == -1
    assert lazy.mamba_allocator.available_size() == 6
    assert normal.get_mamba_ping_pong_keep_idx(rn) == 1  # next_track_idx 0 → state at "other"
    assert lazy.get_mamba_ping_pong_keep_idx(rl) == 0
    rl.mamba_next_track_idx = 1
    with pytest.raises(InvalidArgument, match="no tracked mamba state"):
        lazy.donate_mamba_ping_pong_slot(rl, lazy.mamba_allocator.alloc(1))
    s = lazy.ensure_ping_pong_slot(rl, 1)
    assert s is not None and rl.mamba_ping_pong_track_buffer[1] == s
    assert lazy.ensure_ping_pong_slot(rl, 1) == s  # idempotent
    assert lazy.req_index_to_mamba_ping_pong_track_buffer_mapping[rl.req_pool_idx, 1].item() == s
    no_pp = make_req_pool(extra=True, overlap=False)
    r1 = HybridReqState()
    no_pp.alloc([r1])
    assert len(r1.mamba_ping_pong_track_buffer) == 1
    assert no_pp.get_mamba_ping_pong_keep_idx(r1) == 0
    assert no_pp.free_mamba_cache(r1, 0) is not None


def test_donate_validates_replacement():
    pool = make_req_pool(extra=True)
    r = HybridReqState()
    pool.alloc([r])
    with pytest.raises(InvalidArgument, match="not an allocated"):
        pool.donate_mamba_ping_pong_slot(r, 8)
    with pytest.raises(InvalidArgument, match="already used"):
        pool.donate_mamba_ping_pong_slot(r, r.mamba_pool_idx)
    before = list(r.mamba_ping_pong_track_buffer)
    new = pool.mamba_allocator.alloc(1)
    old = pool.donate_mamba_ping_pong_slot(r, torch.tensor(new))
    assert old == before[1] and r.mamba_ping_pong_track_buffer == [before[0], new[0]]
    assert pool.req_index_to_mamba_ping_pong_track_buffer_mapping[r.req_pool_idx].tolist() == [
        before[0],
        new[0],
    ]


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_ping_pong_donation_free_sequences_return_every_slot(lazy, seed):
    """Random alloc / track / donate / free sequences against a model radix cache."""
    rng = random.Random(seed)
    M = 24
    pool = make_req_pool(mamba_size=M, size=6, extra=True, lazy=lazy)
    live, radix = [], []  # radix holds donated / kept slots (owned by the "cache")
    for _ in range(200):
        op = rng.random()
        if op < 0.3:
            r = HybridReqState()
            if pool.alloc([r]) is not None:
                live.append(r)
        elif op < 0.5 and live:
            r = rng.choice(live)
            idx = r.mamba_next_track_idx
            if lazy and pool.ensure_ping_pong_slot(r, idx) is None:
                continue
            if not lazy:
                r.mamba_next_track_idx = pool.get_mamba_ping_pong_other_idx(idx)  # eager swap
        elif op < 0.65 and live:
            r = rng.choice(live)
            keep = pool.get_mamba_ping_pong_keep_idx(r)
            if r.mamba_ping_pong_track_buffer[keep] == -1:
                continue
            new = pool.mamba_allocator.alloc(1)
            if new is None:
                continue
            radix.append(pool.donate_mamba_ping_pong_slot(r, new))
        elif op < 0.85 and live:
            r = live.pop(rng.randrange(len(live)))
            keep = rng.choice([None, pool.get_mamba_ping_pong_keep_idx(r)])
            kept = pool.free_mamba_cache(r, keep)
            if kept is not None:
                radix.append(kept)
            pool.free_req(r)
        elif radix:
            pool.mamba_allocator.free([radix.pop(rng.randrange(len(radix)))])
        # ownership invariant: every slot is free, live-owned or radix-owned, exactly once
        owned = []
        for r in live:
            owned.append(r.mamba_pool_idx)
            owned += [s for s in r.mamba_ping_pong_track_buffer if s != -1]
        owned += radix
        assert len(owned) == len(set(owned)), "a mamba slot is owned twice"
        assert pool.mamba_allocator.available_size() + len(owned) == M
    for r in live:
        pool.free_mamba_cache(r)
        pool.free_req(r)
    pool.mamba_allocator.free(radix)
    assert pool.mamba_allocator.available_size() == M and pool.available_size() == 6
    pool.clear()
    assert pool.mamba_allocator.available_size() == M


def test_req_pool_layer_cache_and_state_infos():
    pool = make_req_pool(layout="envelope")
    waits = []

    class Counter:
        def wait_until(self, i):
            waits.append(i)

    pool.register_layer_transfer_counter(Counter())
    lc = pool.mamba_layer_cache(3)
    assert tuple(lc.temporal.shape) == (9, 2, 2, 2) and waits == [3]
    with pytest.raises(IndexOutOfRange, match="layer id 1"):
        pool.mamba_layer_cache(1)
    assert waits == [3]
    assert len(pool.get_state_buf_infos()[0]) == 1 and pool.get_state_dim_per_tensor() == [None]
    assert len(pool.get_state_item_views()) == 1


# ---------------------------------------------------------------------------- hybrid KV pool
def make_hybrid(kind, mamba_layout, page_size=2):
    kw = dict(
        size=16,
        page_size=page_size,
        dtype=torch.float16,
        head_num=2,
        head_dim=4,
        layer_num=len(FULL_IDS),
        device=DEVICE,
    )
    if kind == "page_major":
        kv = PageMajorMHATokenToKVPool(**kw)
    else:
        kv = MHATokenToKVPool(**kw, layout=kind)
    mp = MambaPool(5, SPEC, DEVICE, layout=mamba_layout)
    return HybridLinearKVPool(kv, mp, FULL_IDS)


KV_KINDS = ["nhd", "hnd", "page_major"]


@pytest.mark.parametrize("kind", KV_KINDS)
@pytest.mark.parametrize("mamba_layout", ["per_layer", "envelope"])
def test_hybrid_layer_translation_and_descriptors(kind, mamba_layout):
    pool = make_hybrid(kind, mamba_layout)
    assert pool.layer_num == 2 and pool.page_size == 2 and pool.dtype == torch.float16
    loc = torch.tensor([3, 6, 7], device=DEVICE)
    k = torch.randn(3, 2, 4).to(DEVICE, torch.float16)
    v = torch.randn(3, 2, 4).to(DEVICE, torch.float16)

    class Layer:
        layer_id = 4

    pool.set_kv_buffer(Layer(), loc, k, v)
    inner = pool.kv_pool
    got_k = inner.get_key_buffer(1)
    got_v = pool.get_value_buffer(4)
    if kind == "nhd":
        assert torch.equal(got_k[loc], k) and torch.equal(got_v[loc], v)
    else:  # read back through the inner pool's host copy (layout-independent rows)
        c = inner.get_cpu_copy(loc)
        assert torch.equal(c.tensors[1].view(torch.float16), k.cpu())  # k of inner layer 1
    assert not pool.get_key_buffer(1).any()  # model layer 1 = inner layer 0, untouched
    for bad in (0, 2, 5, 99):  # mamba layers and unknown ids are not KV layers
        with pytest.raises(IndexOutOfRange, match=f"layer id {bad}"):
            pool.get_key_buffer(bad)
        with pytest.raises(IndexOutOfRange):
            pool.set_kv_buffer(bad, loc, k, v)
    assert pool.get_contiguous_buf_infos() == inner.get_contiguous_buf_infos()
    assert [x.data_ptr() for x in pool.get_item_views()] == [
        x.data_ptr() for x in inner.get_item_views()
    ]
    assert pool.get_state_buf_infos() == pool.mamba_pool.get_state_buf_infos()
    assert pool.get_state_dim_per_tensor() == pool.mamba_pool.get_state_dim_per_tensor()
    if kind == "page_major":
        assert len(pool.get_contiguous_buf_infos()[0]) == 1
    d = pool.describe()
    assert d["kind"] == "hybrid_linear" and d["mamba"]["layout"] == mamba_layout
    assert d["item_lens"] == inner.describe()["item_lens"] and d["full_attention_layer_ids"] == [
        1,
        4,
    ]
    mlc = pool.mamba_layer_cache(2)
    assert len(mlc.conv) == 2


def _ids(values):
    return torch.tensor(values, device=DEVICE)


def _inner_pool(kind):
    kw = dict(size=32, page_size=2, dtype=torch.float16, layer_num=len(FULL_IDS), device=DEVICE)
    if kind == "mla":
        return MLATokenToKVPool(kv_lora_rank=16, qk_rope_head_dim=8, **kw)
    if kind == "fp4":
        return MHATokenToKVPoolFP4(head_num=2, head_dim=16, **kw)
    if kind == "page_major":
        return PageMajorMHATokenToKVPool(head_num=2, head_dim=16, **kw)
    return MHATokenToKVPool(head_num=2, head_dim=16, layout=kind, **kw)


@pytest.mark.parametrize("kind", KV_KINDS + ["fp4", "mla"])
def test_hybrid_writes_full_attention_layers_at_kv_write_loc_full_loc(kind):
    """A KVWriteLoc's full_loc (already translated into the full-attention pool's slots) is
    where the hybrid pool writes; loc when it has none. MLA inner pools write at loc, as the
    reference does."""
    pool = HybridLinearKVPool(_inner_pool(kind), MambaPool(5, SPEC, DEVICE), FULL_IDS)
    twin = _inner_pool(kind)  # written directly at the ids the hybrid pool must use
    g = torch.Generator().manual_seed(19)
    shape = (3, 1, 24) if kind == "mla" else (3, 2, 16)
    k, v = (torch.randn(shape, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    loc, full = _ids([5, 6, 7]), _ids([20, 21, 22])
    pool.set_kv_buffer(4, KVWriteLoc(loc, full_loc=full), k, v)  # model layer 4 = inner 1
    twin.set_kv_buffer(1, loc if kind == "mla" else full, k, v)
    pool.set_kv_buffer(1, KVWriteLoc(_ids([8, 9, 10])), k, v)  # no full_loc: at loc
    twin.set_kv_buffer(0, _ids([8, 9, 10]), k, v)
    views, want = pool.get_item_views(), twin.get_item_views()
    assert any(bool(x.any()) for x in want)
    assert all(torch.equal(a, b) for a, b in zip(views, want))


@pytest.mark.parametrize("kind", KV_KINDS)
def test_hybrid_get_kv_rows_uses_model_layer_ids(kind):
    pool = make_hybrid(kind, "envelope")
    loc = torch.tensor([5, 2, 9], device=DEVICE)
    for lid, seed in zip(FULL_IDS, (1, 2)):
        g = torch.Generator().manual_seed(seed)
        k = torch.randn((3, 2, 4), generator=g).half().to(DEVICE)
        pool.set_kv_buffer(lid, loc, k, -k)
    for lid, seed in zip(FULL_IDS, (1, 2)):
        g = torch.Generator().manual_seed(seed)
        k = torch.randn((3, 2, 4), generator=g).half().to(DEVICE)
        got_k, got_v = pool.get_kv_rows(lid, loc)
        assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    with pytest.raises(IndexOutOfRange):
        pool.get_kv_rows(MAMBA_IDS[0], loc)  # a mamba layer has no KV rows


def test_hybrid_constructor_errors():
    kv = MHATokenToKVPool(8, 1, torch.float16, 1, 4, 2, DEVICE)
    mp = MambaPool(2, SPEC, DEVICE)
    with pytest.raises(InvalidArgument, match="both full-attention and mamba"):
        HybridLinearKVPool(kv, mp, [1, 2])
    with pytest.raises(InvalidArgument, match="3 full-attention layer ids"):
        HybridLinearKVPool(kv, mp, [1, 4, 5])
    with pytest.raises(InvalidArgument):
        HybridLinearKVPool(kv, "mamba", [1, 4])


@pytest.mark.parametrize("kind", KV_KINDS)
@pytest.mark.parametrize("mamba_layout", ["per_layer", "envelope"])
def test_hybrid_cpu_copy_restore_into_new_slots(kind, mamba_layout):
    pool = make_hybrid(kind, mamba_layout)
    src_tok = torch.tensor([4, 5, 6, 7], device=DEVICE)
    for lid in FULL_IDS:
        pool.set_kv_buffer(
            lid,
            src_tok,
            torch.randn(4, 2, 4).to(DEVICE, torch.float16),
            torch.randn(4, 2, 4).to(DEVICE, torch.float16),
        )
    mp = pool.mamba_pool
    g = torch.Generator().manual_seed(3)
    for t in [*mp.conv, mp.temporal]:
        t[:, 1:] = torch.randn(t[:, 1:].shape, generator=g).to(DEVICE, t.dtype)
    before_kv = pool.kv_pool.get_cpu_copy(src_tok)
    before_m = mp.get_cpu_copy([2, 4])
    copy = pool.get_cpu_copy(src_tok, [2, 4])
    assert isinstance(copy, HybridCpuCopy) and copy.nbytes > 0
    # retract: the source slots get reused / cleared
    mp.clear_slots([2, 4])
    dst_tok = torch.tensor([10, 11, 12, 13], device=DEVICE)
    pool.load_cpu_copy(copy, dst_tok, [5, 1])
    after_kv = pool.kv_pool.get_cpu_copy(dst_tok)
    for a, b in zip(before_kv.tensors, after_kv.tensors):
        assert torch.equal(a, b)
    after_m = mp.get_cpu_copy([5, 1])
    for a, b in zip([*before_m.conv, before_m.temporal], [*after_m.conv, after_m.temporal]):
        assert torch.equal(a, b)


def test_hybrid_bad_restore_writes_nothing():
    pool = make_hybrid("nhd", "envelope")
    tok = torch.tensor([2, 3], device=DEVICE)
    pool.set_kv_buffer(
        1,
        tok,
        torch.ones(2, 2, 4, device=DEVICE, dtype=torch.float16),
        torch.ones(2, 2, 4, device=DEVICE, dtype=torch.float16),
    )
    pool.mamba_pool.temporal[:, 1] = 7.0
    good = pool.get_cpu_copy(tok, [1])
    kv_snap = [b.clone() for b in pool.kv_pool.get_item_views()]
    m_snap = [b.clone() for b in pool.mamba_pool.get_state_item_views()]

    def unchanged():
        kv = all(torch.equal(a, b) for a, b in zip(kv_snap, pool.kv_pool.get_item_views()))
        m = all(torch.equal(a, b) for a, b in zip(m_snap, pool.mamba_pool.get_state_item_views()))
        return kv and m

    other_spec = MambaStateSpec(
        [(3, 1), (4, 3)], (2, 2, 3), torch.bfloat16, torch.float32, MAMBA_IDS
    )
    foreign = HybridCpuCopy(good.kv, MambaPool(3, other_spec, DEVICE).get_cpu_copy([1]))
    with pytest.raises(ShapeMismatch):
        pool.load_cpu_copy(foreign, torch.tensor([8, 9]), [3])
    with pytest.raises(IndexOutOfRange):
        pool.load_cpu_copy(good, torch.tensor([8, 9]), [6])  # mamba slot out of range
    with pytest.raises(IndexOutOfRange):
        pool.load_cpu_copy(good, torch.tensor([8, 999]), [3])  # token id out of range
    with pytest.raises(InvalidArgument, match="mamba_indices"):
        pool.load_cpu_copy(good, torch.tensor([8, 9]))
    with pytest.raises(InvalidArgument):
        pool.load_cpu_copy(good.kv, torch.tensor([8, 9]))
    other_kv = MHATokenToKVPool(16, 2, torch.float16, 2, 8, 2, DEVICE)
    with pytest.raises(ShapeMismatch):
        pool.load_cpu_copy(
            HybridCpuCopy(other_kv.get_cpu_copy(tok), good.mamba), torch.tensor([8, 9]), [3]
        )
    assert unchanged()


def test_hybrid_layer_transfer_counter_waits_on_model_layer_ids():
    pool = make_hybrid("nhd", "per_layer")
    waits = []

    class Counter:
        def wait_until(self, i):
            waits.append(i)

    pool.register_layer_transfer_counter(Counter())
    pool.get_key_buffer(4)
    pool.mamba_layer_cache(3)
    assert waits == [4, 3]
    assert pool.kv_pool.layer_transfer_counter is None
