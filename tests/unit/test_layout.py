"""Exhaustive checks of the torch-free layout math (pools/layout.py) against brute force."""

import itertools
import math

import pytest

from kvxfer.kernels.errors import InvalidArgument
from kvxfer.pools.layout import (
    KvBufferDesc,
    PageMajorGeometry,
    ViewSpec,
    ceil_div,
    num_pages_for,
    per_layer_descs,
)

pytestmark = pytest.mark.timeout(60)


def _brute_rows(n_tokens, tokens_per_row):
    """Rows needed by counting, not by formula."""
    rows, held = 0, 0
    while held < n_tokens:
        rows += 1
        held += tokens_per_row
    return rows


def test_ceil_div_matches_math_ceil():
    for a in range(0, 50):
        for b in range(1, 12):
            assert ceil_div(a, b) == math.ceil(a / b)


@pytest.mark.parametrize("tokens_per_row_is_page", [False, True])
def test_kv_buffer_desc_spans_brute_force(tokens_per_row_is_page):
    for page_size in (1, 2, 3, 4, 16):
        tpr = page_size if tokens_per_row_is_page else 1
        for row_bytes in (1, 6, 64):
            d = KvBufferDesc("k0", (7, 2, 3), row_bytes=row_bytes, tokens_per_row=tpr)
            for n in range(-2, 40):
                assert d.prefix_span_bytes(n, page_size) == _brute_rows(max(n, 0), tpr) * row_bytes
                assert (
                    d.final_span_bytes(n, page_size)
                    == _brute_rows(max(n, 0) + page_size, tpr) * row_bytes
                )
            assert d.item_len_bytes(page_size) == page_size // tpr * row_bytes
            assert d.reserved_span_bytes(2) == 7 * 2 * 3 * 2


def test_final_span_is_ceil_not_floor():
    d = KvBufferDesc("kv", (3, 100), row_bytes=100, tokens_per_row=16)
    assert d.final_span_bytes(17, 16) == 3 * 100  # 33 tokens -> 3 pages, not 2
    assert d.final_span_bytes(16, 16) == 2 * 100
    assert d.prefix_span_bytes(17, 16) == 2 * 100


def test_kv_buffer_desc_rejects_bad_arguments():
    with pytest.raises(InvalidArgument, match="row_bytes"):
        KvBufferDesc("k", (1,), row_bytes=0, tokens_per_row=1)
    with pytest.raises(InvalidArgument, match="tokens_per_row"):
        KvBufferDesc("k", (1,), row_bytes=4, tokens_per_row=0)
    d = KvBufferDesc("k", (8, 4), row_bytes=4, tokens_per_row=4)
    with pytest.raises(InvalidArgument, match="page_size=6"):
        d.item_len_bytes(6)
    with pytest.raises(InvalidArgument):
        d.item_len_bytes(0)


def test_kv_buffer_desc_equality_and_repr():
    a = KvBufferDesc("k0", (4, 2), row_bytes=8, tokens_per_row=1)
    b = KvBufferDesc("k0", [4, 2], row_bytes=8, tokens_per_row=1)
    assert a == b and hash(a) == hash(b)
    assert a != KvBufferDesc("k1", (4, 2), row_bytes=8, tokens_per_row=1)
    assert "k0" in repr(a)


def test_per_layer_descs_names_and_rows():
    ds = per_layer_descs("v", 3, (10, 2, 5), 2, 1)
    assert [d.name for d in ds] == ["v0", "v1", "v2"]
    assert all(d.row_bytes == 2 * 5 * 2 and d.tokens_per_row == 1 for d in ds)
    assert ds[0].final_span_bytes(6, 4) == 10 * 20  # rows = size + page_size


def test_num_pages_for():
    assert num_pages_for(0, 4) == 1
    assert num_pages_for(12, 4) == 4
    with pytest.raises(InvalidArgument, match="size=13"):
        num_pages_for(13, 4)
    with pytest.raises(InvalidArgument):
        num_pages_for(4, 0)


def _brute_page_major_map(L, ps, H, D, Dv, isz, P):
    """Enumerate elements in the documented nesting order (page, layer, K then V, slot, head,
    elem); the n-th element must sit at byte n * isz."""
    addr = {}
    nxt = 0
    for page in range(P):
        for layer in range(L):
            for kind, dim in (("k", D), ("v", Dv)):
                for slot in range(ps):
                    for h in range(H):
                        for e in range(dim):
                            addr[(kind, layer, page * ps + slot, h, e)] = nxt
                            nxt += isz
    return addr, nxt


SHAPES = [
    # L, ps, H, D, Dv, isz, P
    (1, 1, 1, 1, 1, 1, 1),
    (2, 1, 1, 3, 2, 2, 3),
    (3, 2, 2, 2, 3, 1, 3),
    (2, 4, 3, 2, 2, 4, 2),
    (4, 3, 1, 5, 1, 2, 4),
]


@pytest.mark.parametrize("L,ps,H,D,Dv,isz,P", SHAPES)
def test_page_major_byte_map_is_the_documented_bijection(L, ps, H, D, Dv, isz, P):
    g = PageMajorGeometry(L, ps, H, D, Dv, isz, P)
    brute, total = _brute_page_major_map(L, ps, H, D, Dv, isz, P)
    assert g.total_bytes == total == P * g.page_bytes
    assert g.page_bytes == L * ps * H * (D + Dv) * isz
    assert g.entry_bytes * ps == g.page_bytes
    assert g.num_tokens == P * ps
    for key, want in brute.items():
        assert g.byte_offset(*key) == want, key
    # bijection onto [0, total) at itemsize granularity
    assert sorted(brute.values()) == list(range(0, total, isz))


@pytest.mark.parametrize("L,ps,H,D,Dv,isz,P", SHAPES)
def test_page_major_view_specs_address_the_same_bytes(L, ps, H, D, Dv, isz, P):
    g = PageMajorGeometry(L, ps, H, D, Dv, isz, P)
    seen = set()
    for layer, kind in itertools.product(range(L), "kv"):
        spec = g.view_spec(kind, layer)
        dim = D if kind == "k" else Dv
        assert spec.shape == (P, ps, H, dim)
        for page, slot, h, e in itertools.product(range(P), range(ps), range(H), range(dim)):
            byte = spec.element_offset((page, slot, h, e)) * isz
            assert byte == g.byte_offset(kind, layer, page * ps + slot, h, e)
            seen.add(byte)
        # each token row is contiguous: (h, e) strides are row-major
        assert spec.strides[3] == 1 and spec.strides[2] == dim and spec.strides[1] == H * dim
    assert len(seen) * isz == g.total_bytes


@pytest.mark.parametrize("L,ps,H,D,Dv,isz,P", SHAPES)
def test_page_major_pages_are_contiguous_item_ranges(L, ps, H, D, Dv, isz, P):
    g = PageMajorGeometry(L, ps, H, D, Dv, isz, P)
    desc = g.buffer_desc()
    assert desc.item_len_bytes(ps) == g.page_bytes
    size = (P - 1) * ps
    assert desc.final_span_bytes(size, ps) == g.total_bytes
    assert desc.reserved_span_bytes(1) == g.total_bytes
    for page in range(P):
        lo, hi = g.page_range(page)
        for layer, kind in itertools.product(range(L), "kv"):
            for slot in range(ps):
                b = g.byte_offset(kind, layer, page * ps + slot)
                assert lo <= b < hi


def test_page_major_for_pool_and_errors():
    g = PageMajorGeometry.for_pool(
        size=8, page_size=4, layer_num=2, head_num=1, head_dim=2, v_head_dim=2, itemsize=2
    )
    assert g.num_pages == 3
    with pytest.raises(InvalidArgument):
        PageMajorGeometry.for_pool(
            size=9, page_size=4, layer_num=2, head_num=1, head_dim=2, v_head_dim=2, itemsize=2
        )
    with pytest.raises(InvalidArgument, match="layer_num"):
        PageMajorGeometry(0, 1, 1, 1, 1, 1, 1)
    with pytest.raises(InvalidArgument, match="kind"):
        g.view_spec("q", 0)
    with pytest.raises(InvalidArgument, match="layer 2"):
        g.block_offset_bytes("k", 2)
    with pytest.raises(InvalidArgument, match="token 12"):
        g.byte_offset("k", 0, 12)
    with pytest.raises(InvalidArgument):
        g.page_range(3)


def test_view_spec_element_offset_checks_bounds():
    spec = ViewSpec(offset=3, shape=(2, 2), strides=(10, 1))
    assert spec.element_offset((1, 1)) == 14
    with pytest.raises(InvalidArgument):
        spec.element_offset((2, 0))
    with pytest.raises(InvalidArgument):
        spec.element_offset((0,))
