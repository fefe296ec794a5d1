"""kernels.checksum: the Triton kernel (interpreter on CPU), the numpy host path and the plain
oracle agree on every layout; the checksum sees misplaced pages, tokens, heads and layers and
every single-word change; the launcher refuses malformed tables."""

import numpy as np
import pytest
import torch
from _kernels_testlib import DEVICE, ON_CUDA, gen, rand

from kvxfer.kernels import checksum as ck
from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch

pytestmark = pytest.mark.timeout(120)


def _triton(views, ids):
    """Kernel checksums of items ``ids`` over ``views`` (one descriptor each, items on dim 0)."""
    out = ck.item_checksums(
        [v.data_ptr() for v in views], [_item_bytes(v) for v in views], ids, device=DEVICE
    )
    return out.cpu().numpy().view(np.uint32)


def _host(views, ids):
    hv = [v.cpu() for v in views]
    return ck.item_checksums_host([v.data_ptr() for v in hv], [_item_bytes(v) for v in hv], ids)


def _item_bytes(v):
    return v[0].numel() * v.element_size()


def _all_three(views, ids):
    before = [v.clone() for v in views]
    want = ck.checksum_items_reference(views, ids)
    assert want.dtype == np.uint32 and want.shape == (len(ids),)
    np.testing.assert_array_equal(_host(views, ids), want)
    np.testing.assert_array_equal(_triton(views, ids), want)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # read-only
        for a, b in zip(before, views)
    )
    return want


def test_per_layer_pool_layout():
    """2*L descriptors of [pages, page_size, heads, dim] bf16 (16-byte aligned path)."""
    g = gen(1)
    views = [rand((12, 4, 2, 8), torch.bfloat16, g) for _ in range(6)]
    _all_three(views, [3, 0, 11, 5, 7])


def test_page_major_items_span_several_tiles():
    """One descriptor whose items are larger than a tile: partial sums of tiles add up."""
    g = gen(2)
    item = ck.TILE_BYTES * 2 + 4096 + 48
    views = [rand((3, item), torch.uint8, g)]
    _all_three(views, [2, 0])


@pytest.mark.parametrize("sizes", [(13, 6, 7), (3,), (64, 1, 20)])
def test_odd_item_sizes_use_the_byte_path(sizes):
    """Item sizes that are not whole words: byte loads, each range zero-padded to a word."""
    g = gen(sum(sizes))
    views = [rand((9, n), torch.uint8, g) for n in sizes]
    _all_three(views, [8, 1, 4])


@pytest.mark.parametrize("shift", [1, 2, 4, 8])
def test_unaligned_buffers(shift):
    """Buffers starting 1/2/4/8 bytes past an aligned address (alignment classes 1 and 4)."""
    g = gen(shift)
    raw = rand((10 * 96 + 16,), torch.uint8, g)
    views = [raw[shift : shift + 10 * 96].view(10, 96), rand((10, 40), torch.uint8, g)]
    _all_three(views, list(range(10)))


def test_no_items_and_item_order():
    g = gen(3)
    views = [rand((5, 32), torch.uint8, g), rand((5, 8), torch.uint8, g)]
    assert _triton(views, []).shape == (0,) and _host(views, []).shape == (0,)
    one = _all_three(views, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(_triton(views, [4, 2, 0]), one[[4, 2, 0]])


def test_tiling_is_invisible():
    """The same items through tables cut into 48-byte and whole-range tiles."""
    g = gen(4)
    views = [rand((4, 400), torch.uint8, g), rand((4, 52), torch.uint8, g)]
    ptrs, lens = [v.data_ptr() for v in views], [400, 52]
    want = ck.checksum_items_reference(views, [1, 3])
    for tile in (48, 1 << 20):
        tasks = ck.item_tasks(ptrs, lens, ck.word_offsets(lens), [1, 3], tile)
        out = torch.zeros(2, dtype=torch.int32, device=DEVICE)
        widest = int(ck.task_alignment(tasks).min())
        assert widest == 4  # 52-byte items: word aligned
        for align in (4, 1):  # a word-aligned table also runs on the byte path
            out.zero_()
            ck.checksum_tasks(torch.from_numpy(tasks).to(DEVICE), out, align, host_tasks=tasks)
            np.testing.assert_array_equal(out.cpu().numpy().view(np.uint32), want)


def test_word_offsets_pad_each_range():
    assert ck.word_offsets([8, 13, 4, 1]).tolist() == [0, 2, 6, 7]


# ---------------------------------------------------------------------- detection
def _kv(g, pages=6, ps=4, heads=2, dim=8, layers=2):
    return [rand((pages, ps, heads, dim), torch.bfloat16, g) for _ in range(2 * layers)]


def _sums(views, ids):
    return _triton(views, ids)


def test_sees_misplaced_tokens_heads_layers_and_pages():
    g = gen(5)
    views = _kv(g)
    ids = list(range(6))
    base = _sums(views, ids)
    assert len(set(base.tolist())) == 6
    # two tokens of page 2, layer 1's K, swapped
    t = [v.clone() for v in views]
    t[2][2, [0, 1]] = t[2][2, [1, 0]]
    assert (_sums(t, ids) != base).tolist() == [i == 2 for i in ids]
    # two heads of one token of page 4 swapped in every descriptor
    t = [v.clone() for v in views]
    for v in t:
        v[4, 3, [0, 1]] = v[4, 3, [1, 0]]
    assert (_sums(t, ids) != base).tolist() == [i == 4 for i in ids]
    # layer 0 and layer 1 K exchanged (descriptor order)
    assert (_sums([views[2], views[1], views[0], views[3]], ids) != base).all()
    # pages delivered in the wrong order: the per-position lists differ where misplaced
    perm = [0, 1, 3, 2, 4, 5]
    assert (_sums(views, perm) != base).tolist() == [False, False, True, True, False, False]
    # a stale page (the destination never written) differs from what was sent
    t = [v.clone() for v in views]
    t[0][5] = rand((4, 2, 8), torch.bfloat16, g)
    assert (_sums(t, ids) != base).tolist() == [i == 5 for i in ids]


def test_every_single_word_change_is_seen():
    """Each term is a bijection of its word: any one changed word changes the checksum."""
    g = gen(6)
    rows = torch.randint(0, 256, (1, 4096), dtype=torch.uint8, generator=g).numpy()
    base = ck.checksum_rows(rows, 7)[0]
    rng = np.random.default_rng(0)
    for _ in range(300):
        t = rows.copy()
        w = int(rng.integers(0, 1024))
        t[0, 4 * w : 4 * w + 4] ^= rng.integers(0, 256, 4, dtype=np.uint8) | np.uint8(1)
        assert ck.checksum_rows(t, 7)[0] != base
    # the kernel sees a flipped top bit of the last byte too
    flipped = rows.copy()
    flipped[0, 4095] ^= 0x80
    got = [_sums([torch.from_numpy(x).to(DEVICE)], [0])[0] for x in (rows, flipped)]
    assert got[0] == ck.checksum_rows(rows)[0] and got[1] != got[0]


def test_zero_pages_are_not_all_alike_in_position():
    """The same word at another position contributes differently (unlike a plain sum)."""
    a = np.zeros((1, 64), dtype=np.uint8)
    b = a.copy()
    a[0, 0] = 1
    b[0, 4] = 1
    assert ck.checksum_rows(a)[0] != ck.checksum_rows(b)[0]


def test_per_task_partials_add_up_to_the_item_sums():
    g = gen(11)
    views = [rand((8, 3 * 64 + 16), torch.uint8, g), rand((8, 48), torch.uint8, g)]
    ptrs, lens, ids = [v.data_ptr() for v in views], [v.shape[1] for v in views], [6, 1, 6]
    tasks = ck.item_tasks(ptrs, lens, ck.word_offsets(lens), ids, tile_bytes=64)
    align = int(ck.task_alignment(tasks).min())
    part = torch.full((tasks.shape[0] + 3,), -1, dtype=torch.int32, device=DEVICE)  # no zeroing
    assert (
        ck.checksum_tasks(
            torch.from_numpy(tasks).to(DEVICE), part, align, host_tasks=tasks, per_task=True
        )
        == tasks.shape[0]
    )
    got = ck.add_partials(tasks, part[: tasks.shape[0]].cpu().numpy(), len(ids))
    np.testing.assert_array_equal(got, ck.checksum_items_reference(views, ids))
    with pytest.raises(ShapeMismatch):  # one partial per task
        ck.checksum_tasks(
            torch.from_numpy(tasks).to(DEVICE), part[:2], align, host_tasks=tasks, per_task=True
        )


# ---------------------------------------------------------------------- launcher checks
def test_launcher_refuses_malformed_tables():
    g = gen(7)
    buf = rand((4, 64), torch.uint8, g)
    tasks = ck.item_tasks([buf.data_ptr()], [64], [0], [0, 1])
    out = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    dev_tasks = torch.from_numpy(tasks).to(DEVICE)
    with pytest.raises(ShapeMismatch):
        ck.checksum_tasks(dev_tasks[:, :3].contiguous(), out, 16, host_tasks=tasks[:, :3].copy())
    with pytest.raises(ShapeMismatch):
        ck.checksum_tasks(dev_tasks, out.to(torch.int64), 16, host_tasks=tasks)
    with pytest.raises(IndexOutOfRange):
        ck.checksum_tasks(dev_tasks, out[:1], 16, host_tasks=tasks)
    with pytest.raises(InvalidArgument):
        ck.checksum_tasks(dev_tasks, out, 8, host_tasks=tasks)  # not an alignment
    bad = tasks.copy()
    bad[0, 0] += 2
    with pytest.raises(InvalidArgument):
        ck.checksum_tasks(torch.from_numpy(bad).to(DEVICE), out, 4, host_tasks=bad)
    if ON_CUDA:
        with pytest.raises(InvalidArgument):
            ck.checksum_tasks(dev_tasks, out, 16)  # no host copy
    with pytest.raises(InvalidArgument):
        ck.item_tasks([buf.data_ptr()], [64], [0], [0], tile_bytes=24)
    with pytest.raises(IndexOutOfRange):
        ck.item_tasks([buf.data_ptr()], [64], [0], [-1])
    empty = np.zeros((0, 4), dtype=np.int64)
    assert ck.checksum_tasks(torch.from_numpy(empty).to(DEVICE), out, 16, host_tasks=empty) == 0
    assert out.abs().sum().item() == 0
