"""The TP shape a rank advertises (KVArgs.tp_shape, fingerprint "tp") and the handshake
between ranks of different TP sizes (kvxfer.disagg.tp_shape.check_hetero via
check_compatible): what pairs, and what is refused with TpShapeMismatch naming both shapes."""

import pytest
import torch

from kvxfer.disagg import KVArgs, MetadataBuffer
from kvxfer.disagg.errors import LayoutMismatch, TpShapeMismatch
from kvxfer.disagg.kv_args import check_compatible
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.mla import MLATokenToKVPool

pytestmark = pytest.mark.timeout(60)
AUX = MetadataBuffer(4, 64)


def fp(tp, heads=4, layout="nhd", page=4, total=None, **kw):
    pool = MHATokenToKVPool(16, page, torch.bfloat16, max(1, heads // tp), 8, 2, layout=layout)
    args = KVArgs.from_pools(pool, aux=AUX, tp_size=tp, total_kv_heads=total)
    out = args.fingerprint()
    out.update(kw)
    return out


def check(p, d):
    check_compatible(p, d, us="prefill P", them="decode D", ours_is_prefill=True)
    check_compatible(d, p, us="decode D", them="prefill P", ours_is_prefill=False)


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4)])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_hetero_pairs(tp_p, tp_d, layout):
    p, d = fp(tp_p, layout=layout), fp(tp_d, layout=layout)
    assert p["tp"]["tp_size"] == tp_p and p["kv_item_lens"] != d["kv_item_lens"]
    check(p, d)


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4)])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("pages", [(4, 16), (16, 4)])
def test_hetero_pairs_across_page_sizes(tp_p, tp_d, layout, pages):
    p, d = fp(tp_p, layout=layout, page=pages[0]), fp(tp_d, layout=layout, page=pages[1])
    check(p, d)


def test_replicated_heads_need_the_total():
    p, d = fp(1, heads=2), fp(4, heads=2, total=2)  # decode replicates 2 heads over 4 ranks
    check(p, d)
    with pytest.raises(TpShapeMismatch, match="prefill tp 1"):
        check(p, fp(4, heads=2))  # without the total, decode claims 4 heads


def test_integrity_pairs_per_pair():
    check(fp(1, integrity="x"), fp(2, integrity="x"))  # checksummed per pair (integrity.py)
    with pytest.raises(LayoutMismatch, match="integrity"):
        check(fp(1, integrity="x"), fp(2))


def test_mla_latent_replicated():
    def mla(tp, page=4):
        pool = MLATokenToKVPool(16, page, torch.bfloat16, 16, 8, 2)
        return KVArgs.from_pools(pool, aux=AUX, tp_size=tp).fingerprint()

    check(mla(1), mla(4))
    check(mla(1, 16), mla(4, 4))
    check(mla(4, 4), mla(2, 16))


@pytest.mark.parametrize(
    "p,d,match",
    [
        (dict(tp=2, heads=6), dict(tp=4, heads=4), "decode tp 4"),  # heads disagree
        (dict(tp=1, layout="hnd"), dict(tp=2), "segment 0 differs"),  # HND 4 vs NHD 2
        (dict(tp=1, layout="hnd"), dict(tp=2, page=8), "blocks of 4 heads against rows of 2"),
        (dict(tp=2, heads=6, page=8), dict(tp=4, heads=4), "decode tp 4"),
        (dict(tp=1, tp_x=None), dict(tp=2), "states no TP geometry"),
    ],
)
def test_impossible_shapes_refused(p, d, match):
    if "tp_x" in p:
        p.pop("tp_x")
        fp_p = fp(**p)
        fp_p.pop("tp")  # a hand-built KVArgs: no shape
    else:
        fp_p = fp(**p)
    with pytest.raises(TpShapeMismatch, match=match) as e:
        check(fp_p, fp(**d))
    assert "tp 1" in str(e.value) or "tp 2" in str(e.value)


def test_equal_tp_unchanged():
    p, d = fp(2), fp(2)
    check(p, d)
    with pytest.raises(LayoutMismatch) as e:  # no side named: the equal-TP check, as before
        check_compatible(fp(1), fp(2), us="a", them="b")
    assert type(e.value) is LayoutMismatch


def test_shape_run_length_encoded():
    """Layers repeat one geometry: the shape stays small (bootstrap entries are bounded) and
    expands to one plain geometry per descriptor."""
    import msgpack

    from kvxfer.disagg.tp_plan import kv_geometries, tp_fingerprint
    from kvxfer.disagg.tp_shape import expand

    pool = MHATokenToKVPool(64, 16, torch.bfloat16, 4, 128, 128)
    shape = KVArgs.from_pools(pool, aux=AUX, tp_size=2).tp_shape
    assert len(msgpack.packb(shape)) < 200
    assert expand(shape) == tp_fingerprint(2, {"kv": kv_geometries(pool, 8, 2)})
    with pytest.raises(TpShapeMismatch, match="malformed"):
        expand({"tp_size": 2, "runs": {"kv": [[1]]}})
