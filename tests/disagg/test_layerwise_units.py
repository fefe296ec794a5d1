"""Pure parts of layer-wise streaming: the layer map of each pool kind, and the per-layer
byte runs — over all layers they cover exactly the bytes of the whole-chunk plan, each byte
once, each layer's bytes inside that layer's segments (equal and different page sizes,
decode prefixes). No UCX."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from pd_harness import _build_pool

from kvxfer.disagg.aux import MetadataBuffer
from kvxfer.disagg.kv_args import KVArgs, replace
from kvxfer.disagg.layerwise import LayerMap, pack_mask, unpack_mask
from kvxfer.disagg.page_map import RoomPages, TokenGeometry, plan_runs
from kvxfer.errors import UnsupportedOperation

pytestmark = pytest.mark.timeout(60)


def _args(kind, page_size=4):
    pool, mamba = _build_pool(kind, 64, page_size)
    return KVArgs.from_pools(
        pool, aux=MetadataBuffer(4, 64), state_pool=pool if mamba is not None else None
    )


@pytest.mark.parametrize(
    "kind,layers,page_major",
    [
        ("mha", 2, False),
        ("mha_hnd", 2, False),
        ("mla", 2, False),
        ("page_major", 4, True),
        ("hybrid_per_layer", 2, False),
        ("hybrid_envelope", 2, True),
    ],
)
def test_layer_map_of_each_pool(kind, layers, page_major):
    a = _args(kind)
    lm = LayerMap.of(a)
    assert lm.num_layers == layers
    if page_major:
        assert list(lm.desc_layer) == [-1]
        assert list(lm.seg_layer) == [x for l in range(layers) for x in (l, l)]  # K, V per layer
    else:
        assert list(lm.desc_layer) == [d % layers for d in range(len(a.kv_data_ptrs))]


def test_layer_map_refuses_what_it_cannot_split():
    a = _args("page_major")
    with pytest.raises(UnsupportedOperation, match="cannot split"):
        LayerMap.of(replace(a, kv_segments=[]))
    with pytest.raises(UnsupportedOperation, match="layer count"):
        LayerMap.of(replace(a, layout={}))


def _bytes(runs, item_src):
    """Every moved byte as (desc, src byte, dst byte) rows."""
    rows = []
    for d, s, t, n in zip(runs.desc, runs.src_off, runs.dst_off, runs.nbytes):
        k = np.arange(n, dtype=np.int64)
        rows.append(np.stack([np.full(n, d), s + k, t + k], axis=1))
    return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)


@pytest.mark.parametrize("kind", ["mha", "mha_hnd", "page_major", "mla"])
@pytest.mark.parametrize(
    "ps,pd,tokens,prefix,exact_geom",
    [(4, 4, None, 0, False), (4, 4, 30, 9, True), (4, 8, 30, 0, True), (8, 4, 30, 5, True)],
)
def test_layer_runs_partition_the_chunk(kind, ps, pd, tokens, prefix, exact_geom):
    a = _args(kind, ps)
    lm = LayerMap.of(a)
    n_src = -(-(tokens or 8 * ps) // ps)
    n_dst = -(-(tokens or 8 * ps) // pd)
    pm = RoomPages.make(
        num_src=n_src,
        num_dst=n_dst,
        src_page_size=ps,
        dst_page_size=pd,
        prefix=prefix,
        tokens=tokens,
        geom=TokenGeometry.of(a.kv_segments),
        exact=False,
        who="t",
    )
    assert (pm.geom is not None) == exact_geom
    rng = np.random.default_rng(0)
    src_all = rng.permutation(np.arange(1, 14))[:n_src]
    dst = rng.permutation(np.arange(1, 14))[:n_dst]
    r = SimpleNamespace(pages_map=pm, dst_kv=dst)
    geom = TokenGeometry.of(a.kv_segments)
    for first, cnt in ((0, 2), (2, n_src - 2)):
        src = src_all[first : first + cnt]
        lo, hi = pm.chunk_tokens(first, cnt)
        whole = plan_runs(geom, src, ps, dst, pd, lo, hi, src_first_page=first)
        want = _bytes(whole, None)
        parts = [
            _bytes(lm.runs(a, TokenGeometry.of(a.kv_segments), r, src, first, [x]), None)
            for x in range(lm.num_layers)
        ]
        got = np.concatenate(parts)
        assert len(got) == len(want)  # each byte once
        key = lambda x: np.lexsort(x.T[::-1])  # noqa: E731
        assert np.array_equal(got[key(got)], want[key(want)])
        # layer 1's bytes sit in layer 1's part of each page (descriptor or segments)
        if len(parts[1]) and lm.seg_layer is not None and list(lm.desc_layer) == [-1]:
            segs = a.kv_segments[0]
            off = (parts[1][:, 1] % (ps * sum(segs))) // ps
            assert off.min() >= sum(segs[:2]) and off.max() < sum(segs[:4])
        elif len(parts[1]):
            assert set(parts[1][:, 0].tolist()) <= {
                d for d in range(len(a.kv_data_ptrs)) if lm.desc_layer[d] == 1
            }


def test_layer_runs_without_token_geometry_are_whole_items():
    a = replace(_args("mha"), kv_segments=[])
    lm = LayerMap.of(a)
    assert lm.seg_layer is None
    pm = RoomPages.make(
        num_src=3,
        num_dst=3,
        src_page_size=4,
        dst_page_size=4,
        prefix=0,
        tokens=None,
        geom=None,
        exact=False,
        who="t",
    )
    r = SimpleNamespace(pages_map=pm, dst_kv=np.array([7, 8, 9]))
    runs = lm.runs(a, TokenGeometry.of(a.kv_segments), r, np.array([1, 2, 5]), 0, [1])
    item = a.kv_item_lens[1]
    # layer 1: descriptors 1 (K) and 3 (V); pages 1,2 -> 7,8 merge, 5 -> 9
    assert runs.desc.tolist() == [1, 1, 3, 3]
    assert runs.src_off.tolist() == [item, 5 * item, item, 5 * item]
    assert runs.nbytes.tolist() == [2 * item, item, 2 * item, item]


def test_masks_round_trip():
    for n in (1, 7, 8, 9, 61):
        for layers in itertools.islice(itertools.combinations(range(n), min(n, 3)), 20):
            assert unpack_mask(pack_mask(layers, n), n) == sum(1 << i for i in layers)
