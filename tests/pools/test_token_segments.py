"""kv_token_segments(): the token geometry each pool states matches its real byte layout.

For every token slot of every descriptor, the geometry's byte range (kvxfer.disagg.page_map)
must hold exactly that token's row in the pool's own tensors."""

import pytest
import torch

from kvxfer.pools import MHATokenToKVPool, MLATokenToKVPool, PageMajorMHATokenToKVPool

BF = torch.bfloat16


def _pools():
    return {
        "nhd": MHATokenToKVPool(32, 4, BF, 2, 8, 2, "cpu"),
        "hnd": MHATokenToKVPool(32, 4, BF, 2, 8, 2, "cpu", layout="hnd"),
        "page_major": PageMajorMHATokenToKVPool(32, 4, BF, 2, 8, 2, "cpu"),
        "mla": MLATokenToKVPool(32, 4, BF, 16, 8, 2, "cpu"),
    }


@pytest.mark.parametrize("kind", ["nhd", "hnd", "page_major", "mla"])
def test_segments_locate_every_token_row(kind):
    pool = _pools()[kind]
    segs = pool.kv_token_segments()
    _, _, items = pool.get_contiguous_buf_infos()
    assert [pool.page_size * sum(s) for s in segs] == items
    views = pool.get_item_views()  # uint8 [pages, item_len] per descriptor
    ps = pool.page_size
    token = 9  # page 2, slot 1
    if kind == "mla":
        layers = [(pool.kv_buffer[i], None) for i in range(pool.layer_num)]
    else:
        layers = [(pool.k_buffer[i], pool.v_buffer[i]) for i in range(pool.layer_num)]
    # fill: token `token` of every layer's K and V with distinct values, all else zero
    for i, (k, v) in enumerate(layers):
        for j, buf in enumerate((k, v)):
            if buf is None:
                continue
            buf.zero_()
            row = buf[2, :, 1] if kind == "hnd" else buf[2, 1] if buf.dim() == 4 else buf[token]
            row.copy_(torch.arange(row.numel()).reshape(row.shape).to(BF) + 1 + 100 * (2 * i + j))
    got = bytearray()
    for d, s in enumerate(segs):
        page = views[d][token // ps]
        cum = 0
        for tb in s:
            off = ps * cum + (token % ps) * tb
            got += bytes(page[off : off + tb].tolist())
            cum += tb
    total = sum(int(v.count_nonzero()) for v in views)
    assert sum(1 for b in got if b) == total  # every nonzero byte is inside the token's rows
    assert len(got) == sum(sum(s) for s in segs)


def test_unsupported_pools_say_none():
    from kvxfer.pools.quantized import MHATokenToKVPoolFP4

    assert MHATokenToKVPoolFP4.kv_token_segments(object.__new__(MHATokenToKVPoolFP4)) is None
