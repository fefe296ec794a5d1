"""MambaPool (per-layer and envelope layouts), MambaSlotAllocator, CPU copy/restore."""

import pytest
import torch
from testenv import DEVICE

from kvxfer.pools.errors import DoubleFree, IndexOutOfRange, InvalidArgument, ShapeMismatch
from kvxfer.pools.mamba import MambaCpuCopy, MambaPool, MambaSlotAllocator, MambaStateSpec

pytestmark = pytest.mark.timeout(60)

SIZE = 6


def make_spec(conv_dtype=torch.bfloat16, temporal_dtype=torch.float32, layer_ids=(1, 3, 4)):
    # conv 0: (dim 3, window 1) in bf16 = 6 bytes/layer → forces alignment padding in the envelope
    return MambaStateSpec(
        conv_shapes=[(3, 1), (4, 3)],
        temporal_shape=(2, 3, 2),
        conv_dtype=conv_dtype,
        temporal_dtype=temporal_dtype,
        layer_ids=layer_ids,
    )


def tensors(pool):
    return [*pool.conv, pool.temporal]


def as_bytes(t):
    return t.contiguous().view(torch.uint8).cpu()


def fill_random(pools, seed):
    """Apply the same random writes to every pool (through the public layer views)."""
    g = torch.Generator().manual_seed(seed)
    for lid in pools[0].spec.layer_ids:
        for slot in range(1, SIZE + 1):
            vals = [torch.randn(c.shape[2:], generator=g) for c in pools[0].conv]
            tv = torch.randn(pools[0].temporal.shape[2:], generator=g)
            for p in pools:
                lc = p.layer_cache(lid)
                for c, v in zip(lc.conv, vals):
                    c[slot] = v.to(c.dtype)
                lc.temporal[slot] = tv.to(lc.temporal.dtype)


@pytest.fixture(params=["per_layer", "envelope"])
def layout(request):
    return request.param


def test_shapes_and_slot_zero_reserved(layout):
    spec = make_spec()
    pool = MambaPool(SIZE, spec, DEVICE, layout=layout)
    assert [tuple(c.shape) for c in pool.conv] == [(3, SIZE + 1, 3, 1), (3, SIZE + 1, 4, 3)]
    assert tuple(pool.temporal.shape) == (3, SIZE + 1, 2, 3, 2)
    assert pool.conv[0].dtype == torch.bfloat16 and pool.temporal.dtype == torch.float32
    assert all(not t.any() for t in tensors(pool))
    a = MambaSlotAllocator(SIZE)
    got = a.alloc(SIZE)
    assert sorted(got) == list(range(1, SIZE + 1))
    assert a.alloc(1) is None


def test_envelope_matches_plain_byte_for_byte():
    spec = make_spec()
    plain = MambaPool(SIZE, spec, DEVICE, layout="per_layer")
    env = MambaPool(SIZE, spec, DEVICE, layout="envelope")
    fill_random([plain, env], seed=0)
    for p in (plain, env):
        p.clear_slots(torch.tensor([2, 5], device=DEVICE))
        p.copy_from(torch.tensor([1, 3]), torch.tensor([4, 3]))
        p.copy_from([6], [2])
    for a, b in zip(tensors(plain), tensors(env)):
        assert torch.equal(as_bytes(a), as_bytes(b))
    assert not plain.conv[0][:, 5].any() and not env.temporal[:, 5].any()
    assert torch.equal(env.temporal[:, 4], env.temporal[:, 1])
    # The envelope's single item row s is exactly slot s of every layer, region by region.
    (row_view,) = env.get_state_item_views()
    geom = env._geom
    for s in range(SIZE + 1):
        row = row_view[s].cpu()
        for region, t in zip(geom.regions, tensors(plain)):
            want = torch.cat([as_bytes(t[layer, s]).reshape(-1) for layer in range(t.shape[0])])
            assert torch.equal(row[region.offset : region.offset + region.nbytes], want)
        # alignment padding stays zero
        covered = torch.zeros(geom.entry_bytes, dtype=torch.bool)
        for region in geom.regions:
            covered[region.offset : region.offset + region.nbytes] = True
        assert not row[~covered].any()


def test_descriptors_per_layer(layout):
    spec = make_spec()
    pool = MambaPool(SIZE, spec, DEVICE, layout=layout)
    ptrs, lens, items = pool.get_state_buf_infos()
    views = pool.get_state_item_views()
    dims = pool.get_state_dim_per_tensor()
    assert len(ptrs) == len(lens) == len(items) == len(views) == len(dims)
    if layout == "envelope":
        assert len(ptrs) == 1 and ptrs[0] == pool._raw.data_ptr()
        assert items == [pool._geom.entry_bytes] and lens == [(SIZE + 1) * items[0]]
        assert dims == [None]
        assert [r["name"] for r in pool.get_state_item_regions()] == ["conv0", "conv1", "temporal"]
    else:
        assert len(ptrs) == 3 * 3
        # conv0 layers, conv1 layers, temporal layers
        assert items == [6] * 3 + [24] * 3 + [48] * 3
        assert dims == [3] * 3 + [4] * 3 + [2] * 3
        assert ptrs[0] == pool.conv[0][0].data_ptr() and ptrs[-1] == pool.temporal[2].data_ptr()
        assert lens == [(SIZE + 1) * i for i in items]
    for p, ln, it, v in zip(ptrs, lens, items, views):
        assert v.dtype == torch.uint8 and tuple(v.shape) == (ln // it, it)
        assert v.data_ptr() == p and v.is_contiguous()
    # writing through the item view of slot 2 is visible in the logical tensors
    for v in views:
        v[2] = 0xFF
    for t in tensors(pool):
        assert bool((as_bytes(t[:, 2]) == 0xFF).all())
        assert not as_bytes(t[:, 1]).any()
    assert pool.describe()["item_lens"] == items
    d = pool.describe()
    assert d["kind"] == "mamba" and d["layout"] == layout and d["conv_dtype"] == "torch.bfloat16"


@pytest.mark.parametrize("dedup", [False, True])
def test_speculative_buffers_never_in_descriptors(layout, dedup):
    spec = make_spec()
    base = MambaPool(SIZE, spec, DEVICE, layout=layout)
    pool = MambaPool(
        SIZE,
        spec,
        DEVICE,
        layout=layout,
        speculative_num_draft_tokens=3,
        spec_state_size=2,
        conv_window_dedup=dedup,
    )
    assert base.intermediate_ssm is None and base.intermediate_conv_window is None
    assert tuple(pool.intermediate_ssm.shape) == (3, 3, 3, 2, 3, 2)
    assert [tuple(w.shape) for w in pool.intermediate_conv_window] == [
        (3, 3, 3, 3, 1),
        (3, 3, 3, 4, 3),
    ]
    _, lens_b, items_b = base.get_state_buf_infos()
    ptrs, lens, items = pool.get_state_buf_infos()
    assert (lens, items) == (lens_b, items_b)
    assert pool.get_state_dim_per_tensor() == base.get_state_dim_per_tensor()
    assert len(pool.get_state_item_views()) == len(base.get_state_item_views())
    scratch = [pool.intermediate_ssm, *pool._intermediate_conv_window_phys]
    for p, ln in zip(ptrs, lens):
        for s in scratch:
            lo, hi = s.data_ptr(), s.data_ptr() + s.nbytes
            assert p + ln <= lo or p >= hi, "a descriptor overlaps speculative scratch"
    assert pool.mem_usage_bytes() > base.mem_usage_bytes()
    lc = pool.layer_cache(3)
    assert tuple(lc.intermediate_ssm.shape) == (3, 3, 2, 3, 2)
    if dedup:
        w = pool.intermediate_conv_window[1]
        phys = pool._intermediate_conv_window_phys[1]
        assert tuple(phys.shape) == (3, 3, 4, 3 + 3 - 1)
        phys.copy_(torch.arange(phys.numel()).reshape(phys.shape).to(phys.dtype))
        for t in range(3):  # step t's window is phys columns t .. t + 2
            assert torch.equal(w[:, :, t], phys[..., t : t + 3])


def test_speculative_argument_errors():
    spec = make_spec()
    with pytest.raises(InvalidArgument, match="speculative_num_draft_tokens"):
        MambaPool(SIZE, spec, DEVICE, conv_window_dedup=True)
    bad3d = MambaStateSpec([(2, 2, 2)], (1, 1, 1), torch.float32, torch.float32, [0])
    with pytest.raises(InvalidArgument, match="2-D"):
        MambaPool(2, bad3d, DEVICE, speculative_num_draft_tokens=2, conv_window_dedup=True)
    with pytest.raises(InvalidArgument, match="linear draft chain"):
        MambaPool(
            2,
            spec,
            DEVICE,
            speculative_num_draft_tokens=2,
            conv_window_dedup=True,
            speculative_eagle_topk=4,
        )
    with pytest.raises(InvalidArgument, match="unknown mamba layout"):
        MambaPool(2, spec, DEVICE, layout="page")
    with pytest.raises(InvalidArgument):
        MambaStateSpec([(2, 0)], (1,), torch.float32, torch.float32, [0])
    with pytest.raises(InvalidArgument):
        MambaStateSpec([(2, 2)], (1,), torch.float32, torch.float32, [1, 1])
    with pytest.raises(InvalidArgument):
        MambaStateSpec([(2, 2)], (1,), "float32", torch.float32, [1])


@pytest.mark.parametrize("dst_layout", ["per_layer", "envelope"])
def test_cpu_copy_restore_into_different_slots(layout, dst_layout):
    spec = make_spec()
    src = MambaPool(SIZE, spec, DEVICE, layout=layout)
    dst = MambaPool(SIZE, spec, DEVICE, layout=dst_layout)
    fill_random([src], seed=1)
    copy = src.get_cpu_copy(torch.tensor([2, 5, 3]))
    assert isinstance(copy, MambaCpuCopy) and copy.num_slots == 3
    assert copy.temporal.device.type == "cpu"
    src.clear_slots([2, 5, 3])  # the source slots may be reused meanwhile
    dst.load_cpu_copy(copy, [6, 1, 4])
    ref = MambaPool(SIZE, spec, DEVICE, layout="per_layer")
    fill_random([ref], seed=1)
    for t, r in zip(tensors(dst), tensors(ref)):
        for d_slot, s_slot in [(6, 2), (1, 5), (4, 3)]:
            assert torch.equal(as_bytes(t[:, d_slot]), as_bytes(r[:, s_slot]))
        for other in (2, 3, 5):
            assert not as_bytes(t[:, other]).any()
    # the reference's (conv list, temporal) tuple form is accepted too
    dst.load_cpu_copy((list(copy.conv), copy.temporal), [2, 3, 5])
    assert torch.equal(as_bytes(dst.temporal[:, 2]), as_bytes(dst.temporal[:, 6]))


def test_bad_input_typed_and_nothing_written(layout):
    spec = make_spec()
    pool = MambaPool(SIZE, spec, DEVICE, layout=layout)
    fill_random([pool], seed=2)
    snapshot = [as_bytes(t).clone() for t in tensors(pool)]

    def unchanged():
        return all(torch.equal(a, as_bytes(t)) for a, t in zip(snapshot, tensors(pool)))

    with pytest.raises(IndexOutOfRange, match="slot 0"):
        pool.clear_slots([1, 0])
    with pytest.raises(IndexOutOfRange, match=f"slot {SIZE + 1}"):
        pool.clear_slots([SIZE + 1])
    with pytest.raises(IndexOutOfRange, match="slot -1"):
        pool.copy_from([-1], [2])
    with pytest.raises(ShapeMismatch, match="2 source slots but 1"):
        pool.copy_from([1, 2], [3])
    with pytest.raises(InvalidArgument, match="more than once"):
        pool.copy_from([1, 2], [3, 3])
    with pytest.raises(InvalidArgument):
        pool.clear_slots(torch.tensor([1.0]))
    with pytest.raises(IndexOutOfRange, match="layer id 2"):
        pool.layer_cache(2)
    good = pool.get_cpu_copy([1, 2])
    with pytest.raises(ShapeMismatch, match="2 slots but 3"):
        pool.load_cpu_copy(good, [3, 4, 5])
    with pytest.raises(IndexOutOfRange):
        pool.load_cpu_copy(good, [3, 99])
    with pytest.raises(InvalidArgument, match="more than once"):
        pool.load_cpu_copy(good, [3, 3])
    # copies made by differently shaped / typed pools are refused
    others = [
        MambaStateSpec([(3, 1), (4, 3)], (2, 3, 3), torch.bfloat16, torch.float32, (1, 3, 4)),
        MambaStateSpec([(3, 1), (4, 3)], (2, 3, 2), torch.float16, torch.float32, (1, 3, 4)),
        MambaStateSpec([(3, 1), (4, 3)], (2, 3, 2), torch.bfloat16, torch.float32, (1, 3)),
        MambaStateSpec([(3, 1)], (2, 3, 2), torch.bfloat16, torch.float32, (1, 3, 4)),
    ]
    for other_spec in others:
        other = MambaPool(SIZE, other_spec, DEVICE, layout=layout)
        with pytest.raises(ShapeMismatch):
            pool.load_cpu_copy(other.get_cpu_copy([1, 2]), [3, 4])
    # a tampered tuple with the wrong trailing shape
    bad_tuple = (list(good.conv), good.temporal[..., :1])
    with pytest.raises(ShapeMismatch, match="tensor 2"):
        pool.load_cpu_copy(bad_tuple, [3, 4])
    with pytest.raises(InvalidArgument):
        pool.load_cpu_copy("nope", [3, 4])
    assert unchanged()


def test_mamba_slot_allocator_errors():
    a = MambaSlotAllocator(4)
    s = a.alloc(2)
    assert s == [1, 2]
    with pytest.raises(IndexOutOfRange, match="mamba slot 0"):
        a.free([1, 0])
    with pytest.raises(IndexOutOfRange, match="mamba slot 5"):
        a.free(5)
    with pytest.raises(DoubleFree, match="mamba slot 3"):
        a.free([3])
    with pytest.raises(DoubleFree, match="mamba slot 1"):
        a.free(torch.tensor([1, 1]))
    assert a.available_size() == 2
    a.free(torch.tensor(s))
    assert a.available_size() == 4
    with pytest.raises(InvalidArgument):
        a.alloc(-1)
    with pytest.raises(InvalidArgument):
        MambaSlotAllocator(0)


def test_check_bounds_off_skips_hot_path_checks_but_not_host_copies():
    spec = make_spec()
    pool = MambaPool(SIZE, spec, DEVICE, layout="envelope", check_bounds=False)
    pool.temporal[:, 3] = 2.0
    pool.clear_slots([3])  # no validation needed for allocator-provided ids
    assert not pool.temporal[:, 3].any()
    with pytest.raises(IndexOutOfRange):
        pool.get_cpu_copy([0])
    with pytest.raises(IndexOutOfRange):
        pool.load_cpu_copy(pool.get_cpu_copy([1]), [SIZE + 1])
    assert "size" not in pool.describe()  # peers with different pool sizes stay compatible
