"""DSATokenToKVPool: indexer buffer layout, set/get of index keys and scales (single and fused
batch gets), lockstep moves, host copy/restore including the indexer (no foreign index data
after a retract), and the indexer as a state descriptor group."""

import pytest
import torch
from _sparse_pool_checks import (
    DEVICE,
    ON_CUDA,
    assert_same_views,
    check_registration,
    loc,
    views_snapshot,
)

from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch
from kvxfer.pools.dsa import DSATokenToKVPool
from kvxfer.pools.write_loc import KVWriteLoc

pytestmark = pytest.mark.timeout(90)

SIZE, PS, R, DR, L, DI = 16, 4, 16, 8, 2, 128
PAGES = (SIZE + PS) // PS


def pool(**kw):
    return DSATokenToKVPool(SIZE, PS, torch.bfloat16, R, DR, L, DEVICE, **kw)


def index_data(n, seed, scales=1):
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 256, (n, DI), dtype=torch.uint8, generator=g)
    s = torch.rand((n, scales), generator=g) + 0.5
    return k.view(torch.float8_e4m3fn).to(DEVICE), s.to(DEVICE)


def latent(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, 1, R + DR), generator=g).to(torch.bfloat16).to(DEVICE)


def test_indexer_layout_matches_the_documented_byte_map():
    p = pool()
    assert p.index_num_pages == PAGES
    buf = p.get_index_k_with_scale_buffer(1)
    assert buf.dtype == torch.uint8 and tuple(buf.shape) == (PAGES, PS * (DI + 4))
    k, s = index_data(2, 1)
    p.set_index_k_scale_buffer(1, loc([9, 14]), k, s)  # page 2 slot 1, page 3 slot 2
    kb = k.view(torch.uint8)
    assert torch.equal(buf[2, 1 * DI : 2 * DI], kb[0]) and torch.equal(
        buf[3, 2 * DI : 3 * DI], kb[1]
    )
    tail = PS * DI
    assert torch.equal(buf[2, tail + 4 : tail + 8].view(torch.float32), s[0])
    assert torch.equal(buf[3, tail + 8 : tail + 12].view(torch.float32), s[1])
    assert int(buf.count_nonzero()) == int(kb.count_nonzero()) + int(
        s.view(torch.uint8).count_nonzero()
    )  # nothing else written
    assert not bool(p.get_index_k_with_scale_buffer(0).any())


def test_single_and_fused_gets():
    p = pool()
    k, s = index_data(SIZE, 2)
    tokens = loc(range(PS, SIZE + PS))  # pages 1..4
    p.set_index_k_scale_buffer(0, tokens, k, s)
    kb = k.view(torch.uint8)
    sb = s.contiguous().view(torch.uint8).reshape(SIZE, 4)
    # request A: pages [3, 1], 6 tokens -> tokens 12..15 then 4, 5
    want_a = torch.cat((torch.arange(8, 12), torch.arange(0, 2)))
    assert torch.equal(p.get_index_k_continuous(0, 6, loc([3, 1])), kb[want_a])
    assert torch.equal(p.get_index_k_scale_continuous(0, 6, loc([3, 1])), sb[want_a])
    # batch: A as above, B: pages [4, 2] with 3 tokens, C: no tokens
    table = loc([[3, 1], [4, 2], [0, 0]])
    lens = loc([6, 3, 0])
    want = torch.cat((want_a, torch.arange(12, 15)))
    for total in (None, 9):
        gk, gs = p.get_index_k_scale_buffer(0, lens, table, seq_len_sum=total, max_seq_len=6)
        assert torch.equal(gk, kb[want]) and torch.equal(gs, sb[want])
    assert torch.equal(p.get_index_k_scale_fp32(0, loc([4, 19])), s[[0, 15]])
    if ON_CUDA:  # no sync: positions past the table / on out-of-range pages read as zeros
        zero = torch.zeros(1, DI, dtype=torch.uint8, device=DEVICE)
        past = p.get_index_k_continuous(0, 9, loc([3, 1]))
        assert torch.equal(past, torch.cat((kb[want_a], kb[2:4], zero)))
        assert torch.equal(p.get_index_k_continuous(0, 2, loc([PAGES])), zero.expand(2, DI))
        assert torch.equal(
            p.get_index_k_scale_continuous(0, 2, loc([PAGES])),
            torch.zeros(2, 4, dtype=torch.uint8, device=DEVICE),
        )
    else:
        with pytest.raises(ShapeMismatch, match="page column"):
            p.get_index_k_continuous(0, 9, loc([3, 1]))
        with pytest.raises(IndexOutOfRange, match=str(PAGES)):
            p.get_index_k_continuous(0, 2, loc([PAGES]))
    with pytest.raises(ShapeMismatch):
        p.get_index_k_scale_buffer(0, loc([1]), table)
    if not ON_CUDA:  # the lengths are only validated off CUDA (validating them would sync)
        with pytest.raises(InvalidArgument, match="seq_len_sum"):
            p.get_index_k_scale_buffer(0, lens, table, seq_len_sum=8)


def test_set_index_accepts_raw_scale_bytes_and_rejects_bad_input():
    a, b = pool(), pool(kernel_backend="torch")
    k, s = index_data(3, 3)
    a.set_index_k_scale_buffer(0, KVWriteLoc(loc([1, 2, 3])), k, s[:, 0])  # [N] fp32
    b.set_index_k_scale_buffer(
        0, loc([1, 2, 3]), k.view(torch.uint8), s.contiguous().view(torch.uint8)
    )  # raw bytes
    assert torch.equal(a.index_k_with_scale_buffer[0], b.index_k_with_scale_buffer[0])
    if ON_CUDA:  # no raise, no sync: tokens 1 and 2 are written, the out-of-range one nowhere
        a.set_index_k_scale_buffer(0, loc([1, SIZE + PS, 2]), k, s)
        b.set_index_k_scale_buffer(0, loc([1, 2]), k.view(torch.uint8)[[0, 2]], s[[0, 2]])
        assert_same_views(
            a.get_state_item_views() + a.get_item_views(),
            b.get_state_item_views() + b.get_item_views(),
        )
    before = a.index_k_with_scale_buffer[0].clone()
    if not ON_CUDA:
        with pytest.raises(IndexOutOfRange, match=str(SIZE + PS)):
            a.set_index_k_scale_buffer(0, loc([1, SIZE + PS, 2]), k, s)
    with pytest.raises(InvalidArgument, match="1-byte"):
        a.set_index_k_scale_buffer(0, loc([1, 2, 3]), k.view(torch.uint8).float(), s)
    with pytest.raises(ShapeMismatch):
        a.set_index_k_scale_buffer(0, loc([1, 2, 3]), k, torch.ones(3, 2, device=DEVICE))
    with pytest.raises(InvalidArgument, match="float32"):
        a.set_index_k_scale_buffer(0, loc([1, 2, 3]), k, s.double())
    assert torch.equal(a.index_k_with_scale_buffer[0], before)
    with pytest.raises(InvalidArgument, match="multiple"):
        DSATokenToKVPool(SIZE, PS, torch.bfloat16, R, DR, L, DEVICE, index_head_dim=96)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_set_index_refuses_ids_past_num_slots_inside_the_last_page(backend):
    # size 50, page 16: num_slots 66 but 5 pages = 80 slots; ids 66..79 are no token's
    size, ps = 50, 16
    a = DSATokenToKVPool(size, ps, torch.bfloat16, R, DR, 1, DEVICE, kernel_backend=backend)
    b = DSATokenToKVPool(size, ps, torch.bfloat16, R, DR, 1, DEVICE, kernel_backend=backend)
    assert a.num_slots == 66 and a.index_num_pages == 5
    k, s = index_data(3, 7)
    a.set_index_k_scale_buffer(0, loc([1, 65, 64]), k, s)  # the last valid slot is accepted
    b.set_index_k_scale_buffer(0, loc([1, 65, 64]), k, s)
    for bad in (66, 79, 80):
        if ON_CUDA and backend == "triton":  # no raise, no sync: row 1 written, the bad one nowhere
            a.set_index_k_scale_buffer(0, loc([1, bad]), k[:2], s[:2])
            b.set_index_k_scale_buffer(0, loc([1]), k[:1], s[:1])
        else:
            with pytest.raises(IndexOutOfRange, match=f"{bad}.*66"):
                a.set_index_k_scale_buffer(0, loc([1, bad]), k[:2], s[:2])
        assert_same_views(a.get_state_item_views(), b.get_state_item_views())
    # slots 66..79 of the last page (page 4, slots 2..15) were never written
    kb = a.index_k_with_scale_buffer[0][4]
    assert not bool(kb[2 * DI : ps * DI].any()) and not bool(kb[ps * DI + 2 * 4 :].any())


def test_two_scales_per_token():
    p = pool(index_quant_block=64)
    k, s = index_data(2, 4, scales=2)
    p.set_index_k_scale_buffer(1, loc([5, 6]), k, s)
    assert torch.equal(p.get_index_k_scale_fp32(1, loc([5, 6])), s)
    assert p.get_index_k_with_scale_buffer(1).shape[1] == PS * (DI + 8)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_move_is_lockstep_latent_and_indexer(backend):
    p = pool(kernel_backend=backend)
    src, tgt = loc([4, 5, 13]), loc([17, 2, 9])
    rows = [latent(3, 10 + layer) for layer in range(L)]
    idx = [index_data(3, 20 + layer) for layer in range(L)]
    for layer in range(L):
        p.set_kv_buffer(layer, src, rows[layer])
        p.set_index_k_scale_buffer(layer, src, *idx[layer])
    p.move_kv_cache(tgt, src)
    for layer in range(L):
        assert torch.equal(p.get_key_buffer(layer)[tgt], rows[layer])
        assert torch.equal(p.get_index_k_scale_fp32(layer, tgt), idx[layer][1])
        pages = torch.div(tgt, PS, rounding_mode="floor")
        got_k = p.get_index_k_with_scale_buffer(layer)[pages].reshape(3, -1)
        for i, t in enumerate(tgt.tolist()):
            slot = t % PS
            assert torch.equal(
                got_k[i, slot * DI : (slot + 1) * DI], idx[layer][0][i].view(torch.uint8)
            )


def test_retract_restore_brings_back_own_index_data_only():
    p = pool()
    req_tokens = loc(range(4, 12))  # pages 1, 2
    rows = latent(8, 30)
    k, s = index_data(8, 31)
    for layer in range(L):
        p.set_kv_buffer(layer, req_tokens, rows)
        p.set_index_k_scale_buffer(layer, req_tokens, k, s)
    copy = p.get_cpu_copy(req_tokens)
    assert len(copy.tensors) == 3 * L  # latent, index keys, index scales
    # the pages go to another request, which writes its own latent + index data
    fk, fs = index_data(8, 32)
    for layer in range(L):
        p.set_kv_buffer(layer, req_tokens, latent(8, 33))
        p.set_index_k_scale_buffer(layer, req_tokens, fk, fs)
    # restore into pages 3, 4 (and, for the first tokens, over stale data of page 1)
    new_tokens = loc(list(range(12, 20)))
    p.load_cpu_copy(copy, new_tokens)
    for layer in range(L):
        assert torch.equal(p.get_key_buffer(layer)[new_tokens], rows)
        assert torch.equal(p.get_index_k_continuous(layer, 8, loc([3, 4])), k.view(torch.uint8))
        assert torch.equal(p.get_index_k_scale_fp32(layer, new_tokens), s)
        # the other request's data on pages 1, 2 is untouched by the restore
        assert torch.equal(p.get_index_k_continuous(layer, 8, loc([1, 2])), fk.view(torch.uint8))


def test_registration_and_state_group():
    p = pool()
    views = check_registration(p)  # the latent buffers (KV group)
    assert len(views) == L and p.get_contiguous_buf_infos()[0] == [
        b.data_ptr() for b in p.kv_buffer
    ]
    ptrs, lens, items = p.get_state_buf_infos()
    st = p.get_state_item_views()
    assert len(ptrs) == len(st) == L and p.get_state_dim_per_tensor() == [None] * L
    for v, ptr, n, it in zip(st, ptrs, lens, items):
        assert v.dtype == torch.uint8 and v.data_ptr() == ptr and tuple(v.shape) == (n // it, it)
        assert it == PS * (DI + 4) and v.shape[0] == views[0].shape[0] == PAGES  # id = page id
    d = p.describe()
    assert d["kind"] == "dsa" and d["index_head_dim"] == DI and d["index_item_lens"] == items
    before_kv, before_st = views_snapshot(views), views_snapshot(st)
    k, s = index_data(1, 40)
    p.set_index_k_scale_buffer(1, loc([10]), k, s)  # page 2 of layer 1's indexer only
    p.set_kv_buffer(0, loc([10]), latent(1, 41))  # page 2 of layer 0's latent only
    assert [i for i, (a, b) in enumerate(zip(before_st, st)) if not torch.equal(a, b)] == [1]
    assert (before_st[1] != st[1]).any(dim=1).nonzero().flatten().tolist() == [2]
    assert (before_kv[0] != views[0]).any(dim=1).nonzero().flatten().tolist() == [2]
    assert p.get_kv_size_bytes() == sum(p.get_contiguous_buf_infos()[1]) + sum(lens)


def test_offload_manager_moves_indexer_pages_as_state_items():
    """Page-granular retract through the generic offload manager: the indexer rides the state
    views with state id = page id."""
    from kvxfer.pools.offload import OffloadManager

    p = pool()
    rows = latent(8, 50)
    k, s = index_data(8, 51)
    p.set_kv_buffer(0, loc(range(4, 12)), rows)
    p.set_index_k_scale_buffer(0, loc(range(4, 12)), k, s)
    with OffloadManager(p, num_host_pages=4, num_host_slots=4) as mgr:
        h = mgr.offload([1, 2], state_slots=[1, 2])
        h.wait()
        fk, fs = index_data(8, 52)
        p.set_index_k_scale_buffer(0, loc(range(4, 12)), fk, fs)  # pages reused
        mgr.restore(h, [4, 3], [4, 3]).wait()
    assert torch.equal(p.get_key_buffer(0)[16:20], rows[:4])
    assert torch.equal(p.get_index_k_continuous(0, 8, loc([4, 3])), k.view(torch.uint8))
    assert torch.equal(
        p.get_index_k_scale_fp32(0, loc(list(range(16, 20)) + list(range(12, 16)))), s
    )
