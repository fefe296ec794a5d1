"""The native launch path of the copy kernel (skipped without CUDA): ``TaskLauncher`` writes
each launch's task table into a pinned, device-mapped ring slot and launches the Triton-compiled
kernel by ``cuLaunchKernel``. Checked byte for byte against the plain-torch copy of the same
tasks: device to device, device to pinned host and back, every alignment class, more launches
than ring slots (slots reused, tables grown), from a thread with no current CUDA context; and
the pieces that guard it (parameter layout, misaligned tables refused before any launch, the
switch that keeps Triton's launch).

Run on the GPU machine: ``KVXFER_TEST_DEVICE=cuda python -m pytest -q tests/gpu/test_native_launch.py``
(``bench/gpu/lane_copy.sh`` runs it with the engine tests).
"""

import threading

import numpy as np
import pytest
import torch

from kvxfer.kernels import native_launch, piece_copy
from kvxfer.kernels.errors import InvalidArgument
from kvxfer.pools.offload.pieces import split_by_alignment, tile_pieces

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]


def _tasks(src: torch.Tensor, dst: torch.Tensor, rng, n: int, align: int, max_len: int):
    """``n`` pieces of at most ``max_len`` bytes into distinct destination slots (``max_len``
    + 64 bytes each, shuffled), offsets and sizes multiples of ``align``: host table rows
    (src addr, dst addr, nbytes). Sizes may later grow by up to 16 bytes."""
    slot = max_len + 64
    assert dst.numel() // slot >= n
    slots = rng.permutation(dst.numel() // slot)[:n]
    lens = rng.integers(1, max_len // align + 1, size=n) * align
    soff = rng.integers(0, (src.numel() - slot) // align, size=n) * align
    return np.stack([src.data_ptr() + soff, dst.data_ptr() + slots * slot, lens], axis=1).astype(
        np.int64
    )


def _reference(src: torch.Tensor, dst: torch.Tensor, tasks: np.ndarray) -> torch.Tensor:
    """``dst`` after the tasks, by torch slicing on the CPU."""
    s_cpu, out = src.cpu(), dst.cpu().clone()
    s0, d0 = src.data_ptr(), dst.data_ptr()
    for s, d, n in tasks.tolist():
        out[d - d0 : d - d0 + n] = s_cpu[s - s0 : s - s0 + n]
    return out


@pytest.fixture
def launcher():
    t = piece_copy.TaskLauncher(torch.cuda.current_device())
    yield t
    t.close()


def _run(launcher, tasks, stream=None):
    stream = stream or torch.cuda.current_stream()
    groups = split_by_alignment(tile_pieces(tasks[:, 0], tasks[:, 1], tasks[:, 2], 1 << 16))
    assert launcher.supports(groups)
    ev = launcher.launch(groups, stream.cuda_stream)
    ev.synchronize()
    return groups


@pytest.mark.parametrize("align", [16, 8, 4, 1])
def test_device_to_device_byte_exact(launcher, align):
    rng = np.random.default_rng(align)
    src = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda")
    tasks = _tasks(src, dst, rng, 200, align, 1 << 14)
    if align < 16:  # a mix of classes: some rows wider-aligned than others
        tasks[::3, 2] = (tasks[::3, 2] // 16 + 1) * 16
    want = _reference(src, dst, tasks)
    groups = _run(launcher, tasks)
    assert align in {a for a, _ in groups}
    assert torch.equal(dst.cpu(), want)


def test_device_to_pinned_host_and_back(launcher):
    rng = np.random.default_rng(7)
    dev = torch.randint(0, 256, (1 << 21,), dtype=torch.uint8, device="cuda")
    host = torch.zeros(1 << 21, dtype=torch.uint8, pin_memory=True)
    tasks = _tasks(dev, host, rng, 64, 16, 1 << 14)
    want = _reference(dev, host, tasks)
    _run(launcher, tasks)
    assert torch.equal(host, want)
    back = torch.zeros_like(dev)  # restore: host -> device, the same pieces reversed
    rev = tasks[:, [1, 0, 2]].copy()
    rev[:, 1] += back.data_ptr() - dev.data_ptr()
    want_back = _reference(host, back, rev)
    _run(launcher, rev)
    assert torch.equal(back.cpu(), want_back)
    assert int(want_back.count_nonzero()) > 0


def test_more_launches_than_slots_reuse_and_grow(launcher):
    """Slots are rewritten only after their launch ran: 3 x RING_SLOTS launches in flight on
    one stream, each with its own table (some larger than a slot's first size), all exact."""
    rng = np.random.default_rng(3)
    src = torch.randint(0, 256, (1 << 24,), dtype=torch.uint8, device="cuda")
    k = 3 * native_launch.RING_SLOTS
    outs = [torch.zeros(1 << 22, dtype=torch.uint8, device="cuda") for _ in range(k)]
    tables = [
        _tasks(src, dst, rng, native_launch.RING_WORDS // 3 + 5 if i % 5 == 0 else 50, 16, 1 << 10)
        for i, dst in enumerate(outs)
    ]  # every 5th table grows its slot
    wants = [_reference(src, dst, t) for dst, t in zip(outs, tables)]
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()  # the zero fills (default stream) before any launch
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # the first launches wait: their slots are still busy
    for tasks in tables:
        launcher.launch(split_by_alignment(tasks), stream.cuda_stream)
    stream.synchronize()
    assert launcher.ring.waits >= 1  # some take found its slot's launch still running
    assert launcher.ring.grown >= 1  # and some table outgrew its slot
    for got, want in zip(outs, wants):
        assert torch.equal(got.cpu(), want)


def test_launch_from_a_thread_without_a_context(launcher):
    rng = np.random.default_rng(5)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    tasks = _tasks(src, dst, rng, 32, 16, 1 << 12)
    want = _reference(src, dst, tasks)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    errors: list = []

    def body():
        try:
            t = piece_copy.TaskLauncher(src.device.index)
            ev = t.launch(split_by_alignment(tasks), stream.cuda_stream)
            ev.synchronize()
            t.close()
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    th = threading.Thread(target=body)
    th.start()
    th.join(60)
    assert not th.is_alive() and not errors, errors
    assert torch.equal(dst.cpu(), want)


def test_record_orders_after_issued_copies(launcher):
    src = torch.randint(0, 256, (1 << 24,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(5_000_000)
        dst.copy_(src)
    ev = launcher.record(stream.cuda_stream)
    ev.synchronize()
    assert torch.equal(dst, src)


def test_misaligned_table_refused_before_any_launch(launcher):
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    good = np.array([[src.data_ptr(), dst.data_ptr(), 64]], dtype=np.int64)
    bad = np.array([[src.data_ptr() + 1, dst.data_ptr() + 128, 64]], dtype=np.int64)
    with pytest.raises(InvalidArgument):
        launcher.launch([(16, good), (16, bad)], torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert not dst.any()


def test_compiled_kernel_parameters_are_pointer_sized():
    k = piece_copy.native_kernel(torch.cuda.current_device(), 16)
    assert not isinstance(k, str), k
    assert k.nparams >= 1 and native_launch.param_sizes(k.function) == [8] * k.nparams
    assert k.block == piece_copy.NUM_WARPS * 32


def test_switch_keeps_triton_launch(monkeypatch):
    from kvxfer.pools.offload.fused import FusedCopier

    dev = torch.device("cuda", torch.cuda.current_device())
    t = piece_copy.task_launcher(dev.index, "test")
    assert t is not None and FusedCopier(dev, True, 0).native
    t.close()
    monkeypatch.setenv(native_launch.NATIVE_ENV, "0")
    assert piece_copy.task_launcher(dev.index, "test") is None
    assert not FusedCopier(dev, True, 0).native


@pytest.mark.parametrize(
    "page,heads,head_b,n_pairs",
    [(16, 8, 256, 300), (3, 2, 16, 40), (4, 4, 6, 17)],  # 32 rows; 6 rows; 2-byte aligned
)
def test_pattern_copy_native_matches_the_oracle(page, heads, head_b, n_pairs):
    """NHD half heads (two descriptors) for many item pairs through ``copy_pattern_native``:
    the bytes equal ``copy_pattern_reference``'s, and the Triton launch gives the same."""
    from kvxfer.kernels.pattern_copy import (
        copy_pattern,
        copy_pattern_native,
        copy_pattern_reference,
        pattern_rows,
        row_alignment,
    )

    rng = np.random.default_rng(page)
    i = np.arange(page, dtype=np.int64)
    n = np.full(page, heads // 2 * head_b)
    so, do = i * (heads // 2) * head_b, i * heads * head_b
    runs = [(so, do, n), (so, do + n, n)]
    item_s, item_d = page * heads // 2 * head_b, page * heads * head_b
    n_src, n_dst = n_pairs + 3, n_pairs + 5
    s_off = np.array([0, item_s * n_src], dtype=np.int64)
    d_off = np.array([0, item_d * n_dst], dtype=np.int64)
    src = torch.randint(0, 256, (2 * item_s * n_src,), dtype=torch.uint8, device="cuda")
    dst = torch.randint(0, 256, (2 * item_d * n_dst,), dtype=torch.uint8, device="cuda")
    dst2 = dst.clone()
    pairs = np.stack(
        [rng.integers(0, n_src, n_pairs), rng.permutation(n_dst)[:n_pairs]], axis=1
    ).astype(np.int64)
    want = dst.cpu().clone()
    strides = (np.array([item_s] * 2), np.array([item_d] * 2))
    copy_pattern_reference(src.cpu(), want, pattern_rows(s_off, d_off, *strides, runs), pairs)
    rows = pattern_rows(s_off + src.data_ptr(), d_off + dst.data_ptr(), *strides, runs)
    align = row_alignment(rows)
    dev_rows = torch.from_numpy(rows).cuda()
    ring = native_launch.TableRing(src.device.index)
    try:
        ev = copy_pattern_native(
            ring, dev_rows.data_ptr(), rows, pairs, align, torch.cuda.current_stream().cuda_stream
        )
        assert ev is not None
        ev.synchronize()
    finally:
        ring.close()
    assert torch.equal(dst.cpu(), want)
    rows2 = pattern_rows(s_off + src.data_ptr(), d_off + dst2.data_ptr(), *strides, runs)
    copy_pattern(
        torch.from_numpy(rows2).cuda(), torch.from_numpy(pairs).cuda(), align, host_rows=rows2
    )
    torch.cuda.synchronize()
    assert torch.equal(dst2.cpu(), want)


@pytest.mark.parametrize("n_pairs,align_b", [(250, 256), (70, 6)])
def test_several_patterns_in_one_native_launch(n_pairs, align_b):
    """Piece classes (each its own runs and item pairs) in ONE ``copy_pattern_native`` over
    the concatenated rows (``[P, 4]`` items): the bytes of the patterns applied one by one
    (the oracle), nothing else written; the Triton launch of the same tables agrees."""
    from kvxfer.kernels.pattern_copy import (
        class_items,
        copy_pattern,
        copy_pattern_native,
        copy_pattern_reference,
        pattern_rows,
        row_alignment,
    )

    rng = np.random.default_rng(n_pairs)
    item_s, item_d, nd = 16 * align_b, 64 * align_b, 2
    n_src, n_dst = n_pairs + 3, n_pairs // 4 + 5
    src = torch.randint(0, 256, (nd * item_s * n_src,), dtype=torch.uint8, device="cuda")
    dst = torch.randint(0, 256, (nd * item_d * n_dst,), dtype=torch.uint8, device="cuda")
    dst2 = dst.clone()
    s_off = np.arange(nd, dtype=np.int64) * item_s * n_src
    d_off = np.arange(nd, dtype=np.int64) * item_d * n_dst
    strides = (np.full(nd, item_s), np.full(nd, item_d))
    want = dst.cpu().clone()
    tables, tables2, bounds, parts = [], [], [0], []
    for b in range(4):  # slot b of the larger page: 16 token rows of align_b bytes each
        so = np.arange(16, dtype=np.int64) * align_b
        runs = [(so, so + b * item_s, np.full(16, align_b))] * nd
        k = n_pairs // 4
        pairs = np.stack([rng.permutation(n_src)[:k], rng.permutation(n_dst)[:k]], 1)
        copy_pattern_reference(src.cpu(), want, pattern_rows(s_off, d_off, *strides, runs), pairs)
        tables.append(pattern_rows(s_off + src.data_ptr(), d_off + dst.data_ptr(), *strides, runs))
        tables2.append(
            pattern_rows(s_off + src.data_ptr(), d_off + dst2.data_ptr(), *strides, runs)
        )
        bounds.append(bounds[-1] + len(tables[-1]))
        parts.append((pairs[:, 0], pairs[:, 1]))
    rows, rows2 = np.concatenate(tables), np.concatenate(tables2)
    items = class_items(parts, bounds)
    span = max(b - a for a, b in zip(bounds, bounds[1:]))
    align = row_alignment(rows)
    dev_rows = torch.from_numpy(rows).cuda()
    ring = native_launch.TableRing(src.device.index)
    try:
        ev = copy_pattern_native(
            ring,
            dev_rows.data_ptr(),
            rows,
            items,
            align,
            torch.cuda.current_stream().cuda_stream,
            span,
        )
        assert ev is not None
        ev.synchronize()
    finally:
        ring.close()
    assert torch.equal(dst.cpu(), want)
    copy_pattern(
        torch.from_numpy(rows2).cuda(),
        torch.from_numpy(items).cuda(),
        align,
        host_rows=rows2,
        span=span,
    )
    torch.cuda.synchronize()
    assert torch.equal(dst2.cpu(), want)


def test_pattern_copy_native_declines_one_row():
    from kvxfer.kernels.pattern_copy import copy_pattern_native

    ring = native_launch.TableRing(torch.cuda.current_device())
    try:
        rows = np.array([[0, 0, 16, 16, 16]], dtype=np.int64)
        got = copy_pattern_native(ring, 0, rows, np.zeros((1, 2), np.int64), 16, 0)
        assert got is None  # Triton makes a 1 a constant: the caller keeps copy_pattern
    finally:
        ring.close()


@pytest.mark.parametrize("align,tile", [(16, 1 << 13), (16, 1 << 16), (4, 1 << 13), (1, 1 << 14)])
def test_launch_pieces_cuts_tiles_on_the_device(launcher, align, tile):
    """One row per piece, tiles cut by the kernel: byte-exact for pieces of many sizes."""
    rng = np.random.default_rng(tile + align)
    src = torch.randint(0, 256, (1 << 23,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(1 << 23, dtype=torch.uint8, device="cuda")
    tasks = _tasks(src, dst, rng, 200, align, 1 << 15)
    want = _reference(src, dst, tasks)
    stream = torch.cuda.current_stream().cuda_stream
    ev = launcher.launch_pieces(tasks[:, 0], tasks[:, 1], tasks[:, 2], tile, stream)
    assert ev is not None
    ev.synchronize()
    assert torch.equal(dst.cpu(), want)


def test_launch_pieces_declines_uneven_shapes(launcher):
    src = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    n = np.array([1 << 21] + [16] * 100, dtype=np.int64)
    s = src.data_ptr() + np.arange(n.size, dtype=np.int64) * 16
    d = dst.data_ptr() + np.concatenate([[0], (1 << 21) + np.arange(100) * 16]).astype(np.int64)
    assert launcher.launch_pieces(s, d, n, 1 << 13, 0) is None  # the host cuts these
    assert launcher.launch_pieces(s[:1], d[:1], n[:1], 24, 0) is None  # not a 16-multiple
    torch.cuda.synchronize()
    assert not dst.any()


def test_short_driver_calls_keep_the_gil(monkeypatch):
    """The launch path's driver calls (context, launch, event record / query) are made without
    releasing the GIL — a thread busy in the interpreter would keep it for a switch interval
    after each release — unless ``KVXFER_NATIVE_GIL=release``; the events still work."""
    import ctypes

    from kvxfer.kernels import cuda_driver

    def keeps(fn) -> bool:
        return bool(fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI)

    assert keeps(cuda_driver.proc("cuEventQuery", 2000, ctypes.c_void_p, keep_gil=True))
    assert not keeps(cuda_driver.proc("cuEventQuery", 2000, ctypes.c_void_p))
    monkeypatch.setenv(cuda_driver.NATIVE_GIL_ENV, "release")
    assert not keeps(cuda_driver.proc("cuEventQuery", 2000, ctypes.c_void_p, keep_gil=True))
    monkeypatch.delenv(cuda_driver.NATIVE_GIL_ENV)
    ring = native_launch.TableRing(torch.cuda.current_device())
    try:
        assert keeps(ring.ctx._push) and keeps(ring.ctx._get)
    finally:
        ring.close()
    ev = cuda_driver.Event(torch.cuda.current_device())
    assert keeps(ev._query) and keeps(ev._record)
    x = torch.empty(1 << 26, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # (the fill lands well after ``after`` could copy)
        x.fill_(1)
    ev.record(s)
    after = torch.cuda.Stream()
    ev.wait(after)  # ``after``'s work follows ``s``'s
    with torch.cuda.stream(after):
        y = x[:16].clone()
    after.synchronize()
    assert ev.query() and bool((y == 1).all())
    ev.close()


def test_ring_regrows_every_idle_slot_in_one_block():
    """A table larger than the slots regrows every slot whose launch is done, in one
    page-locked block (one allocation, not one per slot as each is taken); a slot whose
    launch is still running keeps its table until it is taken again; every slot's table is
    its own (disjoint words)."""
    ring = native_launch.TableRing(torch.cuda.current_device(), slots=4, words=16)
    stream = torch.cuda.Stream()
    try:
        busy, _, _ = ring.take(8)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # slot 0's launch still running below
        ring.done(busy, stream.cuda_stream)
        k, words, _ = ring.take(1000)  # slot 1 outgrows: slots 1-3 regrown with it
        assert k == 1 and words.shape[0] >= 1000 and ring.grown == 3
        tables = [words] + [ring.take(1000)[1] for _ in range(2)]  # slots 2, 3: no allocation
        assert ring.grown == 3
        ptrs = sorted(t.ctypes.data for t in tables)
        assert all(b - a >= 8 * 1000 for a, b in zip(ptrs, ptrs[1:]))
        stream.synchronize()
        k, words, _ = ring.take(1000)  # slot 0, done now, grows when taken
        assert k == 0 and words.shape[0] >= 1000 and ring.grown == 4
    finally:
        stream.synchronize()
        ring.close()
