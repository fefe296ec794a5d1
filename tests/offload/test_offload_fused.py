"""The fused offload/restore path: task planning (torch-free), the one-launch Triton copy
kernel against its torch reference (interpreter on CPU), and the manager's fused path over
every pool kind (on CPU forced with ``fused=True``; on CUDA also chosen automatically, with
the device loading/storing the mapped host pool directly)."""

import random

import numpy as np
import pytest
import torch
from offload_helpers import (
    ALL_KINDS,
    DEVICE,
    KV_KINDS,
    assert_same,
    clobber_rows,
    expected_after_restore,
    make_pool,
    randomize,
    snapshot,
    views,
)

from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch, UnsupportedOperation
from kvxfer.kernels.piece_copy import (
    ALIGNMENTS,
    copy_item_runs_reference,
    copy_tasks,
    kernel_runnable,
)
from kvxfer.pools.offload import OffloadManager, OffloadState
from kvxfer.pools.offload.pieces import (
    MAX_TILE,
    MIN_TILE,
    PieceTable,
    pick_tile_bytes,
    plan_tasks,
    split_by_alignment,
    task_alignment,
    wants_fused,
)
from kvxfer.pools.offload.runs import contiguous_runs

pytestmark = pytest.mark.timeout(120)


# -- planning (pure arithmetic) --------------------------------------------------------------
def _byte_map(table: PieceTable, runs: np.ndarray) -> list[tuple[int, int]]:
    """Oracle: every (src byte, dst byte) pair the pieces move, in piece order."""
    out = []
    for b in range(len(table)):
        n = int(table.lens[b])
        for s0, d0, k in runs.tolist():
            for j in range(k * n):
                out.append((int(table.src[b]) + s0 * n + j, int(table.dst[b]) + d0 * n + j))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_plan_tasks_covers_every_piece_byte_once(seed):
    rng = random.Random(seed)
    nbuf = rng.randint(1, 4)
    lens = [rng.choice([1, 6, 16, 24, 48, 128]) for _ in range(nbuf)]
    src = [rng.randrange(0, 1 << 20) * 16 + rng.choice([0, 0, 8]) for _ in range(nbuf)]
    dst = [rng.randrange(1 << 21, 1 << 22) * 16 for _ in range(nbuf)]
    table = PieceTable(src, dst, lens)
    ids = rng.sample(range(40), rng.randint(1, 12))
    runs = contiguous_runs(np.array(ids), np.arange(len(ids)) + rng.randint(0, 5))
    for tile in (16, 48, 4096):
        tasks = plan_tasks(table, runs, tile)
        assert tasks.dtype == np.int64 and tasks.shape[1] == 3
        assert (tasks[:, 2] > 0).all() and (tasks[:, 2] <= tile).all()
        moved = [(s + j, d + j) for s, d, n in tasks.tolist() for j in range(n)]
        assert moved == _byte_map(table, runs)  # exactly once, in piece order
        # swapping the table reverses every task
        back = plan_tasks(table.swapped(), runs[:, [1, 0, 2]], tile)
        assert np.array_equal(back[:, [1, 0, 2]], tasks)


def test_plan_edge_cases_and_validation():
    table = PieceTable([0], [4096], [32])
    assert table.align == 16 and PieceTable([0, 8], [0, 0], [16, 16]).align == 8
    assert PieceTable([0], [0], [24]).align == 8 and PieceTable([1 << 20], [0], [48]).align == 16
    # unequal pieces (general path) and equal pieces (broadcast path) agree on the same bytes
    uneven = plan_tasks(table, [[0, 0, 3], [10, 3, 1]], 64)
    assert uneven.tolist() == [[0, 4096, 64], [64, 4160, 32], [320, 4192, 32]]
    assert plan_tasks(table, np.zeros((0, 3), np.int64), 64).shape == (0, 3)
    assert plan_tasks(PieceTable([], [], []), [[0, 0, 1]], 64).shape == (0, 3)
    # a 100-item run of 32 B in 1 KiB tiles: 4 tiles, last one partial
    t = plan_tasks(table, [[2, 5, 100]], 1024)
    assert t.tolist() == [[64 + i * 1024, 4096 + 160 + i * 1024, 1024] for i in range(3)] + [
        [64 + 3072, 4096 + 160 + 3072, 128]
    ]
    for bad in (0, 8, 100, -16, 16.5):
        with pytest.raises(InvalidArgument, match="tile_bytes"):
            plan_tasks(table, [[0, 0, 1]], bad)
    with pytest.raises(InvalidArgument, match="runs"):
        plan_tasks(table, [[0, 0, 0]], 64)
    with pytest.raises(InvalidArgument, match=r"item_lens\[1\]"):
        PieceTable([0, 0], [0, 0], [16, 0])
    with pytest.raises(ShapeMismatch):
        PieceTable([0, 1], [0], [16, 16])


def test_tile_choice_alignment_classes_and_threshold():
    assert pick_tile_bytes(0) == MIN_TILE and pick_tile_bytes(1) == MIN_TILE
    assert pick_tile_bytes(1 << 40) == MAX_TILE
    for total in (5 << 20, 16 << 20, 100 << 20, 1 << 30):
        t = pick_tile_bytes(total)
        assert t & (t - 1) == 0 and MIN_TILE <= t <= MAX_TILE and t % 16 == 0
    tasks = np.array([[0, 16, 32], [8, 16, 16], [1, 2, 3], [32, 64, 4096], [4, 12, 20]])
    assert task_alignment(tasks).tolist() == [16, 8, 1, 16, 4]
    groups = split_by_alignment(tasks)
    assert [a for a, _ in groups] == [16, 8, 4, 1]
    assert groups[0][1].tolist() == [[0, 16, 32], [32, 64, 4096]]
    assert all(g.flags.c_contiguous for _, g in groups)
    assert split_by_alignment(np.zeros((0, 3), np.int64)) == []
    assert wants_fused(64, 64 << 20, min_pieces=4, max_piece_bytes=4 << 20)
    assert not wants_fused(3, 1 << 10, min_pieces=4, max_piece_bytes=4 << 20)  # few pieces
    assert not wants_fused(64, 1 << 30, min_pieces=4, max_piece_bytes=4 << 20)  # big ones


# -- the kernel against its torch reference -------------------------------------------------
def _views(lens, rows, gen, device=DEVICE):
    return [
        torch.randint(0, 256, (rows, n), dtype=torch.uint8, generator=gen).to(device) for n in lens
    ]


@pytest.mark.parametrize(
    "lens,tile", [((64, 32, 16), 4096), ((48, 24, 6), 48), ((4096 + 16,), 4096)]
)
def test_kernel_gathers_and_scatters_like_the_reference(lens, tile):
    """Gather device rows into a "host" arena along fragmented runs and scatter them back
    into other rows; every byte equals the torch reference's, nothing else is touched
    (odd item lengths exercise the narrower alignment classes)."""
    gen = torch.Generator().manual_seed(sum(lens))
    dev = _views(lens, 12, gen)
    host = _views(lens, 8, gen)
    host_ref = [h.clone() for h in host]
    dev_ids = np.array([7, 8, 2, 11, 3, 4])
    host_ids = np.array([0, 1, 2, 5, 6, 7])
    runs = contiguous_runs(dev_ids, host_ids)
    assert runs.shape[0] == 4  # (7,8)->(0,1), 2->2, 11->5, (3,4)->(6,7)
    table = PieceTable([v.data_ptr() for v in dev], [h.data_ptr() for h in host], lens)
    tasks = plan_tasks(table, runs, tile)
    for align, group in split_by_alignment(tasks):
        copy_tasks(torch.from_numpy(group).to(DEVICE), align, host_tasks=group)
    copy_item_runs_reference(dev, host_ref, runs)
    assert_same(host, host_ref, "gather")
    # scatter back into other rows
    back = contiguous_runs(host_ids, np.array([1, 2, 3, 9, 10, 0]))
    dev_ref = [d.clone() for d in dev]
    tasks = plan_tasks(
        PieceTable([h.data_ptr() for h in host], [v.data_ptr() for v in dev], lens), back, tile
    )
    for align, group in split_by_alignment(tasks):
        copy_tasks(torch.from_numpy(group).to(DEVICE), align, host_tasks=group)
    copy_item_runs_reference(host_ref, dev_ref, back)
    assert_same(dev, dev_ref, "scatter")


def test_copy_tasks_rejects_bad_tables_and_writes_nothing():
    gen = torch.Generator().manual_seed(3)
    a, b = _views((32,), 4, gen)[0], _views((32,), 4, gen)[0]
    b0 = b.clone()
    good = np.array([[a.data_ptr(), b.data_ptr(), 32]], dtype=np.int64)
    t = torch.from_numpy(good).to(DEVICE)
    with pytest.raises(ShapeMismatch):
        copy_tasks(t[:, :2].contiguous(), 16, host_tasks=good[:, :2].copy())
    with pytest.raises(ShapeMismatch):
        copy_tasks(t.to(torch.int32), 16, host_tasks=good)
    with pytest.raises(InvalidArgument, match="align"):
        copy_tasks(t, 32, host_tasks=good)
    skew = good + np.array([[4, 0, 0]])
    with pytest.raises(InvalidArgument, match="16-byte"):
        copy_tasks(torch.from_numpy(skew).to(DEVICE), 16, host_tasks=skew)
    with pytest.raises(InvalidArgument, match="align"):
        copy_tasks(t, 3, host_tasks=good)
    with pytest.raises(ShapeMismatch, match="host_tasks"):
        copy_tasks(t, 16, host_tasks=np.concatenate([good, good]))
    if DEVICE == "cpu":
        with pytest.raises(InvalidArgument, match="not 16-byte"):
            copy_tasks(torch.from_numpy(skew), 16)  # checked on the table itself
    assert torch.equal(b, b0)
    empty = np.zeros((0, 3), dtype=np.int64)
    assert copy_tasks(torch.from_numpy(empty).to(DEVICE), 16, host_tasks=empty) == 0
    assert ALIGNMENTS == (1, 2, 4, 8, 16)


def test_kernel_compiles_to_16_byte_vectors_for_sm90():
    """Offline compile (no GPU needed) of the kernel for an H100/H200: 16-byte aligned
    tasks must move as 128-bit vector loads and stores."""
    import triton
    from triton.runtime.jit import JITFunction

    from kvxfer.kernels import piece_copy

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"this Triton cannot compile offline: {exc}")
    kern = piece_copy._copy_tasks_kernel
    fn = kern if isinstance(kern, JITFunction) else JITFunction(kern.fn)
    src = ASTSource(
        fn=fn,
        signature={"tasks": "*i64", "ALIGN": "constexpr", "BLOCK": "constexpr"},
        constexprs={"ALIGN": 16, "BLOCK": piece_copy.BLOCK_BYTES},
    )
    try:
        k = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": piece_copy.NUM_WARPS}
        )
    except Exception as exc:  # no NVIDIA backend / ptxas in this install
        pytest.skip(f"offline CUDA compile unavailable: {type(exc).__name__}: {exc}")
    ptx = k.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "st.global.b8" not in ptx and "st.global.u8" not in ptx


# -- the manager's fused path ----------------------------------------------------------------
def _has_kv(kind):
    return not kind.startswith("mamba_")


def _has_state(kind):
    return kind not in KV_KINDS


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_fused_restore_is_byte_exact_for_every_pool_kind(kind):
    """Fragmented offload into split host extents, restore into different pages/slots, all
    through the one-launch path; every other row of every buffer is untouched."""
    gen = torch.Generator().manual_seed(11)
    pool = make_pool(kind, num_pages=40)
    randomize(pool, gen)
    _, nkv = views(pool)
    st = _has_state(kind)
    kv = _has_kv(kind)
    mgr = OffloadManager(
        pool,
        num_host_pages=12,
        num_host_slots=3 if st else 0,
        fused=True,
        fused_tile_bytes=64 if DEVICE == "cpu" else None,
    )
    assert mgr.fused_available
    hold = mgr.offload([1, 2] if kv else [], [1] if st else [])  # host pages [0, 2)
    filler = mgr.offload([3] if kv else [], [2] if st else [])
    mgr.discard(hold)  # the next request's host pages split into two extents
    src = [30, 12, 14, 15, 5, 6, 7, 21, 38, 9] if kv else []
    dst = [1, 3, 4, 8, 9, 10, 17, 19, 20, 22] if kv else []
    ssrc, sdst = ([4, 6], [7, 1]) if st else ([], [])
    orig = snapshot(pool)
    h = mgr.offload(src, ssrc)
    assert h.path == "fused" and h.num_launches >= 1 and not h.staged
    if kv:
        assert len(h.block.pages) == 2
    h.wait()
    assert h.state is OffloadState.OFFLOADED
    clobber_rows(pool, nkv, src + dst, ssrc + sdst, gen)
    before = snapshot(pool)
    mgr.restore(h, dst, sdst).wait()
    assert h.path == "fused" and h.state is OffloadState.RESTORED
    assert_same(
        snapshot(pool), expected_after_restore(before, orig, nkv, src, dst, ssrc, sdst), kind
    )
    assert mgr.stats["fused"] >= 2
    mgr.close()
    assert mgr.host.is_empty and filler.state is OffloadState.DISCARDED


def test_fused_and_copy_paths_produce_identical_host_bytes():
    gen = torch.Generator().manual_seed(12)
    pool = make_pool("hybrid_per_layer", num_pages=30)
    randomize(pool, gen)
    src, slots = [9, 3, 4, 5, 20, 11, 12], [5]
    a = OffloadManager(pool, num_host_pages=7, num_host_slots=1, fused=True)
    b = OffloadManager(pool, num_host_pages=7, num_host_slots=1, fused=False)
    ha, hb = a.offload(src, slots).wait(), b.offload(src, slots).wait()
    # without the fused path, CUDA gathers fragmented runs through its staging buffer
    assert (ha.path, hb.path) == ("fused", "staged" if DEVICE == "cuda" else "direct")
    assert_same(
        [v.clone() for v in a.host.page_views + a.host.slot_views],
        [v.clone() for v in b.host.page_views + b.host.slot_views],
        "host bytes",
    )
    a.close()
    b.close()


def test_batch_copy_of_large_pieces_matches_the_kernel():
    """Pieces averaging >= batch_min_piece_bytes go as one cuMemcpyBatchAsync on CUDA (path
    "batch"), byte for byte what the kernel writes, both ways; on CPU the batch copy is off
    (0) and such requests stay on the kernel."""
    gen = torch.Generator().manual_seed(13)
    pool = make_pool("hybrid_per_layer", num_pages=30)
    randomize(pool, gen)
    src, slots, dst = [9, 3, 4, 5, 20, 11, 12], [5], [1, 2, 6, 7, 8, 10, 13]
    with pytest.raises(InvalidArgument, match="batch_min_piece_bytes"):
        OffloadManager(pool, num_host_pages=7, batch_min_piece_bytes=-1)
    a = OffloadManager(
        pool, num_host_pages=7, num_host_slots=1, fused=True, batch_min_piece_bytes=1
    )
    b = OffloadManager(
        pool, num_host_pages=7, num_host_slots=1, fused=True, batch_min_piece_bytes=0
    )
    assert b.batch_min_piece_bytes == 0
    want = "batch" if DEVICE == "cuda" and a.batch_min_piece_bytes else "fused"
    assert DEVICE != "cuda" or want == "batch"  # CUDA 13 on the GPU machine has the call
    ha, hb = a.offload(src, slots).wait(), b.offload(src, slots).wait()
    assert (ha.path, hb.path) == (want, "fused")
    assert_same(
        [v.clone() for v in a.host.page_views + a.host.slot_views],
        [v.clone() for v in b.host.page_views + b.host.slot_views],
        "host bytes",
    )
    a.restore(ha, dst, [7]).wait()
    assert ha.path == want and a.stats[want] == 2
    after = snapshot(pool)
    b.restore(hb, dst, [7]).wait()
    assert_same(snapshot(pool), after, "restored bytes")
    a.close()
    b.close()


def test_pieces_are_the_plan_without_tiles():
    """FusedCopier.pieces (the batch copy's arrays) is plan_tasks with one task per piece,
    parts concatenated in order, source and destination swapped for restore."""
    from kvxfer.pools.offload.fused import FusedCopier

    rng = np.random.default_rng(3)
    dev = [torch.empty(12, n, dtype=torch.uint8) for n in (32, 48, 16)]
    host = [torch.empty(12, n, dtype=torch.uint8) for n in (32, 48, 16)]
    sdev, shost = dev[:1], host[:1]
    for _ in range(20):
        k = int(rng.integers(1, 6))
        runs = contiguous_runs(rng.permutation(12)[:k], rng.permutation(12)[:k])
        sruns = contiguous_runs(np.array([int(rng.integers(0, 12))]), np.array([3]))
        parts = [(dev, host, runs), (sdev, shost, sruns), (dev[:0], host[:0], runs)]
        for to_host in (True, False):
            fc = FusedCopier(torch.device("cpu"), to_host, 0, tile_bytes=1 << 40)
            want = np.concatenate([fc.plan([p])[0] for p in parts[:2]])
            dst, src, n = fc.pieces(parts)
            assert [a.dtype for a in (dst, src, n)] == [np.int64] * 3
            np.testing.assert_array_equal(np.stack([src, dst, n], axis=1), want)
    fc = FusedCopier(torch.device("cpu"), True, 0)
    assert [a.size for a in fc.pieces([(dev, host, np.zeros((0, 3), np.int64))])] == [0, 0, 0]


def _calls(pieces: int, first: int) -> int:
    """Driver calls of a batch copy: ``first`` pieces, then chunks twice the previous."""
    calls, done, k = 0, 0, first or pieces
    while done < pieces:
        calls, done, k = calls + 1, done + k, 2 * k
    return calls


@pytest.mark.parametrize("first", [0, 1, 4])
def test_large_pieces_take_the_batch_copy_where_the_kernel_would_not(first):
    """Pieces over fused_max_piece_bytes (which the kernel leaves to copy_ per piece) still
    go through the batch copy on CUDA when they average >= batch_min_piece_bytes, posted in
    chunks growing from ``first`` pieces (0: one call); byte for byte what copy_ per piece
    writes, both ways. On CPU: no batch copy, copy_ per piece."""
    gen = torch.Generator().manual_seed(17)
    pool = make_pool("hybrid_per_layer", num_pages=30)
    randomize(pool, gen)
    src, slots, dst = [3, 4, 5, 6, 20, 21], [5], [1, 2, 7, 8, 9, 10]
    with pytest.raises(InvalidArgument, match="batch_first_pieces"):
        OffloadManager(pool, num_host_pages=6, batch_first_pieces=-1)
    a = OffloadManager(
        pool,
        num_host_pages=6,
        num_host_slots=1,
        fused_max_piece_bytes=1,
        batch_min_piece_bytes=1,
        batch_first_pieces=first,
    )
    b = OffloadManager(pool, num_host_pages=6, num_host_slots=1, fused=False, staging_bytes=0)
    want = "batch" if a.batch_min_piece_bytes else "direct"
    assert DEVICE != "cuda" or want == "batch"
    ha, hb = a.offload(src, slots).wait(), b.offload(src, slots).wait()
    assert (ha.path, hb.path) == (want, "direct")
    assert ha.num_launches == (_calls(ha.num_chunks, first) if want == "batch" else 0)
    assert want != "batch" or ha.num_chunks > 4  # several calls when first is 1 or 4
    assert_same(
        [v.clone() for v in a.host.page_views + a.host.slot_views],
        [v.clone() for v in b.host.page_views + b.host.slot_views],
        "host bytes",
    )
    a.restore(ha, dst, [7]).wait()
    assert ha.path == want
    after = snapshot(pool)
    clobber_rows(pool, views(pool)[1], dst, [7], gen)
    b.restore(hb, dst, [7]).wait()
    assert_same(snapshot(pool), after, "restored bytes")
    a.close()
    b.close()


def test_fused_options_are_validated():
    pool = make_pool("mha")
    for kw in (
        dict(fused="yes"),
        dict(fused_min_pieces=0),
        dict(fused_max_piece_bytes=0),
        dict(fused_tile_bytes=24),
        dict(fused_tile_bytes=0),
    ):
        with pytest.raises(InvalidArgument):
            OffloadManager(pool, num_host_pages=2, **kw)
    off = OffloadManager(pool, num_host_pages=4, fused=False)
    assert not off.fused_available
    h = off.offload([1, 5, 9, 13])
    assert h.path == ("staged" if DEVICE == "cuda" else "direct") and h.num_launches == 0
    off.close()
    if DEVICE == "cpu":
        # CPU pools keep the copy_ path unless the fused path is asked for explicitly
        auto = OffloadManager(pool, num_host_pages=4)
        assert not auto.fused_available
        assert auto.offload([1, 5, 9, 13]).path == "direct"
        auto.close()
        assert kernel_runnable(torch.device("cpu"))  # the interpreter is active in tests
    else:
        with pytest.raises(UnsupportedOperation, match="not pinned"):
            OffloadManager(pool, num_host_pages=2, fused=True, pin_memory=False)


def test_failed_fused_launch_leaks_no_host_memory(monkeypatch):
    from kvxfer.pools.offload import fused

    pool = make_pool("mha")
    mgr = OffloadManager(pool, num_host_pages=4, fused=True)

    def boom(*a, **k):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(fused.FusedCopier, "copy", boom)
    with pytest.raises(RuntimeError, match="launch failed"):
        mgr.offload([1, 2, 3])
    assert mgr.host.is_empty and not mgr.live_handles
    monkeypatch.undo()
    assert mgr.offload([1, 2, 3, 4]).block.pages == [(0, 4)]
    mgr.close()


# -- CUDA only: automatic choice, mapped host pool, streams ----------------------------------
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="the automatic fused path is CUDA-only")


@cuda_only
def test_cuda_pool_is_mapped_and_auto_picks_fused_for_many_pieces():
    pool = make_pool("mha", num_pages=64, layers=4)  # 8 buffers
    mgr = OffloadManager(pool, num_host_pages=32, fused_min_pieces=8)
    assert mgr.host.pinned and mgr.host.device_delta is not None and mgr.fused_available
    gen = torch.Generator().manual_seed(13)
    randomize(pool, gen)
    orig = snapshot(pool)
    many = mgr.offload([1, 2, 3, 10, 11, 20])  # 3 runs x 8 buffers = 24 pieces
    one = mgr.offload([30, 31, 32, 33])  # 1 run x 8 buffers = 8 pieces: still >= 8
    assert (many.path, one.path) == ("fused", "fused")
    few = OffloadManager(pool, num_host_pages=4, fused_min_pieces=9)
    assert few.offload([44, 45, 46, 47]).path == "direct"  # not among the targets below
    big = OffloadManager(pool, num_host_pages=8, fused_max_piece_bytes=16)
    assert big.offload([1, 2, 3, 10, 11, 20]).path == "direct"  # pieces too large
    mgr.restore(many, [40, 41, 42, 50, 51, 52]).wait()
    mgr.restore(one, [60, 61, 62, 63]).wait()
    after = snapshot(pool)
    for o, n in zip(orig, after):
        assert torch.equal(n[[40, 41, 42, 50, 51, 52]], o[[1, 2, 3, 10, 11, 20]])
        assert torch.equal(n[60:64], o[30:34])
    for m in (mgr, few, big):
        m.close()


@cuda_only
def test_cuda_fused_path_orders_on_streams_without_synchronize(monkeypatch):
    """Offload sees writes queued on the caller's stream before it; restore is ordered
    before later reads; no device-wide synchronize anywhere on the fused path."""
    pool = make_pool("mha", num_pages=320, head_dim=256, layers=4)
    kv, _ = views(pool)
    mgr = OffloadManager(pool, num_host_pages=128, fused=True)
    src = [p for p in range(1, 257) if p % 4 != 0][:96]  # runs of 3: many pieces
    dst = list(range(200, 296))
    idx = torch.as_tensor(src, device=kv[0].device)

    def forbidden(*a, **k):
        raise AssertionError("device-wide synchronize on the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    for i, v in enumerate(kv):  # queued on the current stream just before the offload
        v[idx] = (i + 5) % 256
    h = mgr.offload(src)
    assert h.path == "fused" and h.event is not None
    h.order_before()
    for v in kv:  # after the ordered offload: must not leak into the host copy
        v[idx] = 0
    mgr.restore(h, dst)
    h.order_before()
    didx = torch.as_tensor(dst, device=kv[0].device)
    sums = [v[didx].to(torch.int64).sum() for v in kv]
    monkeypatch.undo()
    for i, (s, v) in enumerate(zip(sums, kv)):
        assert int(s) == (i + 5) % 256 * len(dst) * v.shape[1]
    h.wait()
    assert h.state is OffloadState.RESTORED and mgr.host.is_empty
    mgr.close()
