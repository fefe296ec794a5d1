"""Exhaustive checks of the torch-free Mamba envelope / plain-layout arithmetic."""

import itertools

import pytest

from kvxfer.pools.mamba_layout import (
    align_up,
    contiguous_strides,
    dedup_conv_window_strides,
    dedup_conv_window_width,
    envelope_geometry,
    plain_state_buf_lens,
    plain_state_dims,
    prod,
)

pytestmark = pytest.mark.timeout(60)

CASES = [
    # (layers, conv_shapes, conv_itemsize, temporal_shape, temporal_itemsize)
    (1, [(3, 1)], 2, (1, 1, 1), 4),  # 6 conv bytes → temporal must be padded to offset 8
    (2, [(4, 3)], 2, (2, 2, 2), 2),
    (3, [(5, 3), (2, 3)], 1, (1, 3, 2), 4),
    (2, [(3,)], 4, (3, 1), 8),
    (4, [(1, 1), (1, 2), (3, 1)], 2, (2, 1, 1), 2),
]


@pytest.mark.parametrize("case", CASES)
def test_envelope_every_byte_owned_once_and_aligned(case):
    L, conv, cis, temporal, tis = case
    geom = envelope_geometry(L, conv, cis, temporal, tis)
    assert geom.entry_bytes % max(cis, tis) == 0
    assert geom.payload_bytes == L * (sum(prod(s) for s in conv) * cis + prod(temporal) * tis)
    slots = 3
    owner = {}
    for r in geom.regions:
        assert r.offset % r.itemsize == 0
        for s, layer, flat in itertools.product(range(slots), range(L), range(prod(r.shape))):
            off = r.element_byte_offset(geom.entry_bytes, layer, s, flat)
            assert off % r.itemsize == 0
            for b in range(r.itemsize):
                key = off + b
                assert key not in owner, f"byte {key} owned twice"
                owner[key] = (r.name, s, layer, flat)
            # the same byte via the view geometry (size, stride, storage offset)
            size, stride, soff = r.view_geometry(geom.entry_bytes, slots)
            assert size == (L, slots) + r.shape
            idx = [layer, s] + list(_unravel(flat, r.shape))
            elem = soff + sum(i * st for i, st in zip(idx, stride))
            assert elem * r.itemsize == off
    assert max(owner) < geom.total_bytes(slots)
    # every byte of a slot belongs to the slot (offsets never cross slot boundaries)
    for key, (_, s, _, _) in owner.items():
        assert s * geom.entry_bytes <= key < (s + 1) * geom.entry_bytes
    # padding is only the difference between entry and payload
    assert len(owner) == slots * geom.payload_bytes


def _unravel(flat, shape):
    out = []
    for d in reversed(shape):
        out.append(flat % d)
        flat //= d
    return reversed(out)


def test_envelope_region_order_conv_kinds_then_temporal():
    geom = envelope_geometry(2, [(4, 3), (2, 3)], 2, (2, 2, 2), 4)
    assert [r.name for r in geom.regions] == ["conv0", "conv1", "temporal"]
    assert [r.offset for r in geom.regions] == [0, 48, 72]
    assert geom.entry_bytes == 72 + 2 * 32


def test_envelope_alignment_options_and_errors():
    g = envelope_geometry(1, [(3, 1)], 2, (1,), 4, entry_align=64)
    assert g.entry_bytes == 64 and g.regions[1].offset == 8
    with pytest.raises(ValueError):
        envelope_geometry(1, [(3, 1)], 2, (1,), 4, entry_align=6)
    with pytest.raises(ValueError):
        envelope_geometry(0, [(3, 1)], 2, (1,), 4)
    with pytest.raises(ValueError):
        align_up(3, 0)


@pytest.mark.parametrize("case", CASES)
def test_plain_lens_and_dims(case):
    L, conv, cis, temporal, tis = case
    lens, items = plain_state_buf_lens(L, 5, conv, cis, temporal, tis)
    dims = plain_state_dims(L, conv, temporal)
    assert len(lens) == len(items) == len(dims) == L * (len(conv) + 1)
    shapes = [s for s in conv for _ in range(L)] + [temporal] * L
    sizes = [cis] * (L * len(conv)) + [tis] * L
    for ln, it, d, s, isz in zip(lens, items, dims, shapes, sizes):
        assert it == prod(s) * isz and ln == 5 * it and d == s[0]


def test_contiguous_strides_and_dedup_window():
    assert contiguous_strides((2, 3, 4)) == (12, 4, 1)
    assert contiguous_strides(()) == ()
    assert dedup_conv_window_width(4, 3) == 6
    # phys [L=2, S=3, dim=5, W=6] contiguous: view[l, s, t, d, w] == phys[l, s, d, t + w]
    phys = contiguous_strides((2, 3, 5, 6))
    st = dedup_conv_window_strides(phys)
    for l, s, t, d, w in itertools.product(range(2), range(3), range(4), range(5), range(3)):
        v = l * st[0] + s * st[1] + t * st[2] + d * st[3] + w * st[4]
        p = l * phys[0] + s * phys[1] + d * phys[2] + (t + w) * phys[3]
        assert v == p
