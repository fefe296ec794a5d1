"""BackedBuffers lifecycle on the test device (host mmap on CPU, CUDA VMM with
KVXFER_TEST_DEVICE=cuda): reserve -> page 0 -> finalize -> full use -> release_beyond -> close.

Buffer sizes are expressed in allocation granules of the device so the same tests exercise
several extents on both (4 KiB pages on the host, 2 MiB granules on an H200).
"""

import pytest
import torch
from testenv import DEVICE

from kvxfer.kernels.errors import BackingError, IndexOutOfRange, InvalidArgument, ShapeMismatch
from kvxfer.pools.backing import BackedBuffers, make_provider
from kvxfer.pools.backing.base import round_up
from kvxfer.pools.layout import KvBufferDesc, PageMajorGeometry, per_layer_descs

pytestmark = pytest.mark.timeout(60)

PS = 16  # page size
H, D = 2, 16  # heads, head dim -> bf16 row = 64 bytes


@pytest.fixture(scope="module")
def provider():
    p = make_provider(DEVICE)
    yield p
    p.close()


def _geometry(provider, granules=6):
    """(reserved tokens, rows) so that one bf16 [rows, H, D] buffer spans ``granules`` granules."""
    row_bytes = H * D * 2
    rows = granules * provider.granularity // row_bytes
    reserved = (rows - PS) // PS * PS
    return reserved, rows


def _nhd_owner(provider, layers=2, granules=6, shared=True, **kw):
    """Per-layer NHD-like owner; ``shared``: use ``provider`` (else the owner makes its own)."""
    reserved, rows = _geometry(provider, granules)
    descs = per_layer_descs("k", layers, (rows, H, D), 2, 1) + per_layer_descs(
        "v", layers, (rows, H, D), 2, 1
    )
    if shared:
        kw["provider"] = provider
    owner = BackedBuffers(
        descs,
        store_dtype=torch.bfloat16,
        device=DEVICE,
        page_size=PS,
        reserved_num_tokens=reserved,
        max_extent_bytes=provider.granularity,
        **kw,
    )
    return owner, reserved


def _fill(t, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(t.shape, generator=g).to(dtype=t.dtype, device=t.device)


def test_lifecycle_addresses_stable_and_data_kept():
    """Own provider (closed with the owner); the whole lifecycle of issue 4."""
    p = make_provider(DEVICE)  # only for the granularity
    g = p.granularity
    p.close()
    owner, reserved = _nhd_owner(p, shared=False)
    try:
        assert owner.num_tokens is None and not owner.finalized
        assert owner.usable_tokens == PS
        assert owner.span_bytes == [d.prefix_span_bytes(PS, PS) for d in owner.descs]
        assert owner.backed_bytes == len(owner.descs) * g  # page 0: one granule each
        assert owner.reserved_bytes >= sum(owner.reserved_spans)
        ptrs = [t.data_ptr() for t in owner.tensors]
        assert all(tuple(t.shape) == d.shape for t, d in zip(owner.tensors, owner.descs))
        assert all(t.dtype == torch.bfloat16 and t.device.type == DEVICE for t in owner.tensors)

        # page 0 (the dummy-write page) is usable before finalize
        page0 = [_fill(t[:PS], i) for i, t in enumerate(owner.tensors)]
        for t, x in zip(owner.tensors, page0):
            t[:PS] = x
        assert owner.byte_views()[0].numel() == PS * H * D * 2

        n = reserved - 3 * PS - 5  # not a page multiple on purpose
        owner.finalize(n)
        assert owner.num_tokens == n and owner.usable_tokens == n + PS
        assert [t.data_ptr() for t in owner.tensors] == ptrs
        spans = [d.final_span_bytes(n, PS) for d in owner.descs]
        assert owner.span_bytes == spans and owner.requested_bytes == sum(spans)
        assert owner.backed_bytes == sum(round_up(s, g) for s in spans)
        for t, x in zip(owner.tensors, page0):  # page 0 survived finalize
            assert torch.equal(t[:PS], x)

        # full use of every backed row; everything past page 0 read zeros before
        views = owner.backed_views()
        assert all(v.shape[0] == n + PS for v in views)
        assert all(not v[PS:].any() for v in views)
        data = [_fill(v, 100 + i) for i, v in enumerate(views)]
        for v, x in zip(views, data):
            v.copy_(x)
        for t, x in zip(owner.tensors, data):
            assert torch.equal(t[: n + PS], x)

        before = owner.backed_bytes
        m = 2 * PS + 3
        freed = owner.release_beyond(m)
        assert owner.num_tokens == m and owner.usable_tokens == m + PS
        assert freed == before - owner.backed_bytes > 0
        assert owner.backed_bytes == sum(
            round_up(d.final_span_bytes(m, PS), g) for d in owner.descs
        )
        for t, x in zip(owner.tensors, data):  # the kept prefix is intact
            assert torch.equal(t[: m + PS], x[: m + PS])
        with pytest.raises(IndexOutOfRange, match=str(m + PS)):
            owner.check_token_ids(m + PS)

        # grow again: the region given back, and the tail of the kept granule, read zeros
        owner.finalize(n)
        for t, x in zip(owner.tensors, data):
            assert torch.equal(t[: m + PS], x[: m + PS])
            assert not t[m + PS : n + PS].any()
        assert [t.data_ptr() for t in owner.tensors] == ptrs
    finally:
        owner.close()
    owner.close()  # idempotent
    assert owner.closed and owner.tensors == []
    for call in (
        lambda: owner.finalize(1),
        owner.byte_views,
        owner.backed_views,
        lambda: owner.check_token_ids(0),
        owner.buf_infos,
    ):
        with pytest.raises(BackingError, match="closed"):
            call()


def test_buf_infos_report_backed_span_not_reserved(provider):
    owner, reserved = _nhd_owner(provider, layers=1)
    with owner:
        ptrs, lens, items = owner.buf_infos()
        assert ptrs == [t.data_ptr() for t in owner.tensors]
        assert lens == [PS * H * D * 2] * 2 and items == [PS * H * D * 2] * 2
        owner.finalize(5 * PS)
        ptrs2, lens, _ = owner.buf_infos()
        assert ptrs2 == ptrs and lens == [6 * PS * H * D * 2] * 2
        assert max(lens) < min(owner.reserved_spans)
        iv = owner.item_views()
        assert [tuple(v.shape) for v in iv] == [(6, PS * H * D * 2)] * 2
        assert iv[1].data_ptr() == owner.tensors[1].data_ptr()
        iv[1][5].fill_(7)  # item row p = page p
        assert (owner.tensors[1][5 * PS : 6 * PS].view(torch.uint8) == 7).all()


def test_page_rows_round_up_partial_last_page(provider):
    """Page-major buffer (uint8, rows are pages): n=17, page=16 backs 3 pages, not 2."""
    g = provider.granularity
    size = 4 * g // 64
    geo = PageMajorGeometry.for_pool(
        size=size, page_size=PS, layer_num=2, head_num=1, head_dim=8, v_head_dim=8, itemsize=1
    )
    desc = geo.buffer_desc("kv")
    with BackedBuffers(
        [desc],
        store_dtype=torch.uint8,
        device=DEVICE,
        page_size=PS,
        reserved_num_tokens=size,
        provider=provider,
    ) as owner:
        assert owner.usable_tokens == PS and owner.span_bytes == [geo.page_bytes]
        owner.finalize(17)
        assert owner.span_bytes == [3 * geo.page_bytes] and owner.usable_tokens == 3 * PS
        owner.check_token_ids(torch.tensor([0, 3 * PS - 1], device=DEVICE))
        with pytest.raises(IndexOutOfRange):
            owner.check_token_ids([3 * PS])
        (raw,) = owner.backed_views()
        assert raw.shape == (3 * geo.page_bytes,)
        raw.fill_(1)
        assert int(owner.tensors[0][: 3 * geo.page_bytes].sum()) == 3 * geo.page_bytes


def test_one_range_buffers_are_disjoint_and_aligned(provider):
    owner, reserved = _nhd_owner(provider, layers=2, one_range=True)
    with owner:
        g = provider.granularity
        ptrs = sorted(t.data_ptr() for t in owner.tensors)
        assert all(p % g == 0 for p in ptrs)
        assert all(b - a >= owner.reserved_spans[0] for a, b in zip(ptrs, ptrs[1:]))
        owner.finalize(reserved)
        for i, t in enumerate(owner.tensors):
            t.fill_(i + 1)
        for i, t in enumerate(owner.tensors):
            assert bool((t == i + 1).all())
        owner.release_beyond(0)
        assert owner.backed_bytes == len(owner.descs) * g
        assert owner.usable_tokens == PS


def test_check_token_ids_bounds(provider):
    owner, reserved = _nhd_owner(provider, layers=1)
    with owner:
        owner.check_token_ids([0, PS - 1])
        owner.check_token_ids(torch.empty(0, dtype=torch.int64))
        with pytest.raises(IndexOutOfRange, match=f"token id {PS} "):
            owner.check_token_ids(torch.tensor([3, PS], device=DEVICE))
        with pytest.raises(IndexOutOfRange, match="-1"):
            owner.check_token_ids([-1, 2])
        owner.finalize(100)
        owner.check_token_ids(torch.arange(100 + PS, device=DEVICE))
        with pytest.raises(IndexOutOfRange, match=str(100 + PS)):
            owner.check_token_ids(100 + PS)


def test_finalize_rejects_bad_counts_without_changing_anything(provider):
    owner, reserved = _nhd_owner(provider, layers=1)
    with owner:
        backed, spans = owner.backed_bytes, list(owner.span_bytes)
        for bad in (reserved + 1, -1, 3.0, True, None):
            with pytest.raises(InvalidArgument):
                owner.finalize(bad)
            assert owner.backed_bytes == backed and owner.span_bytes == spans
            assert owner.num_tokens is None
        with pytest.raises(BackingError, match="before finalize"):
            owner.release_beyond(0)
        owner.finalize(reserved)  # the full reservation is allowed
        assert owner.usable_tokens == reserved + PS
        with pytest.raises(InvalidArgument, match=str(reserved + 1)):
            owner.release_beyond(reserved + 1)
        assert owner.num_tokens == reserved


def test_descriptor_validation(provider):
    kw = dict(store_dtype=torch.bfloat16, device=DEVICE, page_size=PS, provider=provider)
    good = KvBufferDesc("k0", (64 + PS, H, D), row_bytes=H * D * 2, tokens_per_row=1)
    with pytest.raises(ShapeMismatch, match="reserved_num_tokens=65"):
        BackedBuffers([good], reserved_num_tokens=65, **kw)
    with pytest.raises(InvalidArgument, match="at least one"):
        BackedBuffers([], reserved_num_tokens=1, **kw)
    ragged = KvBufferDesc("k0", (64 + PS, H, D), row_bytes=H * D * 2 + 2, tokens_per_row=1)
    with pytest.raises(ShapeMismatch, match="whole"):
        BackedBuffers([ragged], reserved_num_tokens=8, **kw)
    with pytest.raises(InvalidArgument, match="one per descriptor"):
        BackedBuffers([good], reserved_num_tokens=8, **{**kw, "store_dtype": [torch.bfloat16] * 2})
    with pytest.raises(InvalidArgument, match="KvBufferDesc"):
        BackedBuffers([("k0", (80, 2, 16))], reserved_num_tokens=8, **kw)
    with pytest.raises(InvalidArgument, match="page_size"):
        BackedBuffers([good], reserved_num_tokens=8, **{**kw, "page_size": 0})
    with BackedBuffers([good], reserved_num_tokens=64, **kw) as owner:
        owner.finalize(64)
        assert owner.usable_tokens == 64 + PS
