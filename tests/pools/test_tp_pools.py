"""Pools under heterogeneous TP (kvxfer.disagg.tp_plan): the KV geometries match the
pools' items, and MambaPool's per-part metadata (``conv_parts``) drives a state move between
pools of different TP sizes, per-layer and envelope layouts; every decode slot must hold its
rank's rows of every part (Mamba2's conv ``x | B | C`` split part by part)."""

import itertools

import pytest
import torch

from kvxfer.disagg.tp_plan import (
    decode_peers,
    envelope_state_geometry,
    hnd_item,
    kv_geometries,
    local_units,
    nhd_item,
    owned,
    page_major_item,
    plan_axis,
    plan_pages,
    replicated_item,
    state_geometries,
)
from kvxfer.pools.errors import InvalidArgument
from kvxfer.pools.mamba import MambaPool, MambaStateSpec
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.mla import MLATokenToKVPool
from kvxfer.pools.page_major import PageMajorMHATokenToKVPool

pytestmark = pytest.mark.timeout(60)

# over all ranks: conv x|B|C = 8 | 4 | 4 rows (window 3), a 4-row single-part conv,
# temporal 4 heads x (2, 3)
X, B, C, CONV2, HEADS = 8, 4, 4, 4, 4


def spec(tp: int) -> MambaStateSpec:
    return MambaStateSpec(
        conv_shapes=[((X + B + C) // tp, 3), (CONV2 // tp, 3)],
        temporal_shape=(HEADS // tp, 2, 3),
        conv_dtype=torch.bfloat16,
        temporal_dtype=torch.float32,
        layer_ids=(0, 2),
        conv_parts=[(X // tp, B // tp, C // tp), (CONV2 // tp,)],
    )


def test_conv_parts_validated_and_reported():
    with pytest.raises(InvalidArgument, match="conv_parts"):
        MambaStateSpec([(6, 3)], (2, 2), torch.float32, torch.float32, (0,), conv_parts=[(2, 2)])
    plain = MambaStateSpec([(6, 3)], (2, 2), torch.float32, torch.float32, (0,))
    assert "conv_parts" not in plain.fingerprint()  # unchanged for single-part specs
    pool = MambaPool(2, spec(2))
    assert pool.get_state_parts_per_tensor() == [[4, 2, 2]] * 2 + [[2]] * 2 + [[2]] * 2
    assert pool.get_state_dim_per_tensor() == [8] * 2 + [2] * 2 + [2] * 2
    assert [r["parts"] for r in pool.get_state_item_regions()][:2] == [[4, 2, 2]] * 2
    env = MambaPool(2, spec(2), layout="envelope")
    assert env.get_state_parts_per_tensor() == [[]]
    assert [r["parts"] for r in env.get_state_item_regions()] == [[4, 2, 2], [2], [2]]


def geometries(pool: MambaPool, tp: int):
    _, _, items = pool.get_state_buf_infos()
    if pool.layout == "envelope":
        return [envelope_state_geometry(items[0], pool.get_state_item_regions(), tp)]
    dims = pool.get_state_dim_per_tensor()
    return state_geometries(items, dims, pool.get_state_parts_per_tensor(), tp)


def global_rows(rank: int, tp: int, parts):
    """Global row ids (of the concatenated tensor) rank ``rank`` holds, part by part."""
    out, base = [], 0
    for g in parts:
        n = g // tp
        out += list(range(base + rank * n, base + rank * n + n))
        base += g
    return out


@pytest.mark.parametrize("layout", ["per_layer", "envelope"])
@pytest.mark.parametrize("tp_p,tp_d", list(itertools.product((1, 2, 4), repeat=2)))
def test_hetero_tp_state_move(layout, tp_p, tp_d):
    torch.manual_seed(0)
    # the full (tp 1) state of slot 1, then every rank's pools holding their rows
    full = MambaPool(2, spec(1))
    for t in [*full.conv, full.temporal]:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    parts = [(X, B, C), (CONV2,), (HEADS,)]

    def pools(tp):
        out = []
        for r in range(tp):
            pool = MambaPool(2, spec(tp), layout=layout)
            for mine, whole, p in zip(
                [*pool.conv, pool.temporal], [*full.conv, full.temporal], parts
            ):
                mine[:, 1] = whole[:, 1, global_rows(r, tp, p)]
            out.append(pool)
        return out

    src, dst = pools(tp_p), [MambaPool(2, spec(tp_d), layout=layout) for _ in range(tp_d)]
    for d, dpool in enumerate(dst):
        dviews = [v.numpy() for v in dpool.get_state_item_views()]
        for p, spool in enumerate(src):
            plan = plan_pages(
                geometries(spool, tp_p), geometries(dpool, tp_d), p, d, tp_p, tp_d, [1], [2]
            )
            sviews = [v.numpy() for v in spool.get_state_item_views()]
            for di, so, do, n in zip(plan.desc, plan.src_off, plan.dst_off, plan.nbytes):
                sflat, dflat = sviews[di].reshape(-1), dviews[di].reshape(-1)
                dflat[do : do + n] = sflat[so : so + n]
        for mine, whole, p in zip(
            [*dpool.conv, dpool.temporal], [*full.conv, full.temporal], parts
        ):
            torch.testing.assert_close(
                mine[:, 2], whole[:, 1, global_rows(d, tp_d, p)], rtol=0, atol=0
            )
    # each decode rank's rows came from as many prefill ranks as own them
    assert len(plan_axis(X, tp_p, tp_d).receives(0)) == max(1, tp_p // tp_d)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_kv_geometries_match_pools(tp):
    """The KV geometries kv_geometries builds have the pools' item sizes and layouts."""
    heads, L, ps = 8, 3, 4
    kw = dict(size=16, page_size=ps, dtype=torch.bfloat16, head_num=heads // tp, layer_num=L)
    nhd = MHATokenToKVPool(head_dim=8, v_head_dim=4, **kw)
    assert (
        kv_geometries(nhd, heads, tp)
        == [nhd_item(ps, 16, heads, tp)] * L + [nhd_item(ps, 8, heads, tp)] * L
    )
    hnd = MHATokenToKVPool(head_dim=8, layout="hnd", **kw)
    assert kv_geometries(hnd, heads, tp) == [hnd_item(ps, 16, heads, tp)] * (2 * L)
    pm = PageMajorMHATokenToKVPool(head_dim=8, v_head_dim=4, **kw)
    assert kv_geometries(pm, heads, tp) == [page_major_item(L, ps, 16, 8, heads, tp)]
    mla = MLATokenToKVPool(16, ps, torch.bfloat16, 8, 4, L)
    (il,) = set(mla.get_contiguous_buf_infos()[2])
    assert [g.item_bytes for g in kv_geometries(mla, 1, tp)] == [il] * L
    with pytest.raises(InvalidArgument, match="not the .* heads of a rank"):
        kv_geometries(nhd, heads * 2, tp)  # the pool holds half the heads that implies


def _kv_pool(layout: str, heads: int, tp: int):
    kw = dict(size=16, page_size=4, dtype=torch.bfloat16, head_num=local_units(heads, tp))
    kw.update(head_dim=8, v_head_dim=4 if layout != "hnd" else 8, layer_num=2)
    if layout == "page_major":
        return PageMajorMHATokenToKVPool(**kw)
    return MHATokenToKVPool(layout=layout, **kw)


@pytest.mark.parametrize("layout", ["nhd", "hnd", "page_major"])
@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (2, 8), (8, 2), (1, 8), (4, 4)])
def test_hetero_tp_kv_move(layout, tp_p, tp_d):
    """Real pools, geometries from their token statement (kv_token_segments + heads): every
    decode rank's pages end up as if it had stored its own heads (4 heads: tp 8 replicates
    them, a rank's single head joins a peer holding several)."""
    torch.manual_seed(0)
    H, ps, pages = 4, 4, [1, 2, 3]
    ref = _kv_pool(layout, H, 1)
    k = [torch.randn(12, H, ref.head_dim).bfloat16() for _ in range(2)]
    v = [torch.randn(12, H, ref.v_head_dim).bfloat16() for _ in range(2)]

    def filled(rank, tp, at):
        pool = _kv_pool(layout, H, tp)
        a, b = owned(rank, tp, H)
        loc = torch.tensor([p * ps + s for p in at for s in range(ps)])
        for layer in range(2):
            pool.set_kv_buffer(layer, loc, k[layer][:, a:b], v[layer][:, a:b])
        return pool

    src = [filled(p, tp_p, pages) for p in range(tp_p)]
    dst_pages = [3, 0, 2]
    for d in range(tp_d):
        got = _kv_pool(layout, H, tp_d)
        views = [x.numpy().reshape(-1) for x in got.get_item_views()]
        for p in decode_peers(d, tp_p, tp_d):
            sg, dg = kv_geometries(src[p], H, tp_p), kv_geometries(got, H, tp_d)
            plan = plan_pages(sg, dg, p, d, tp_p, tp_d, pages, dst_pages, salt=7)
            sviews = [x.numpy().reshape(-1) for x in src[p].get_item_views()]
            for di, so, do, n in zip(plan.desc, plan.src_off, plan.dst_off, plan.nbytes):
                views[di][do : do + n] = sviews[di][so : so + n]
        want = filled(d, tp_d, dst_pages)
        for mine, ref_view in zip(got.get_item_views(), want.get_item_views()):
            assert torch.equal(mine[dst_pages], ref_view[dst_pages])


def test_pools_state_their_heads():
    """MLA-family latents are replicated; FP4 MHA states no TP geometry."""
    from kvxfer.pools.dsa import DSATokenToKVPool
    from kvxfer.pools.quantized import MHATokenToKVPoolFP4

    dsa = DSATokenToKVPool(16, 4, torch.bfloat16, 16, 8, 2)
    (il,) = set(dsa.get_contiguous_buf_infos()[2])
    assert dsa.kv_token_segments() is None  # no page-size change, yet replicated under TP
    assert kv_geometries(dsa, 8, 4) == [replicated_item(il)] * 2
    fp4 = MHATokenToKVPoolFP4(16, 4, torch.bfloat16, 2, 16, 2)
    assert fp4.kv_token_heads() is None
    with pytest.raises(InvalidArgument, match="no TP geometry"):
        kv_geometries(fp4, 4, 2)
    hnd = _kv_pool("hnd", 4, 2)
    assert hnd.kv_token_heads() == [[(0, 1), (1, 1)]] * 4
    assert _kv_pool("page_major", 4, 2).kv_token_heads() == [[(0, 2)] * 4]
