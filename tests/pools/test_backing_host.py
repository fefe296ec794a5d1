"""The backing layer below BackedBuffers, on the host: extent bookkeeping of the contract,
mmap reserve / mprotect commit for real (an unbacked byte faults), rollback, and the CUDA
module's behaviour on a machine without CUDA."""

import ctypes
import itertools
import multiprocessing as mp
import signal
import traceback

import pytest
import torch

from kvxfer.kernels.errors import BackingError, InvalidArgument, UnsupportedOperation
from kvxfer.pools.backing import BackedBuffers, make_provider
from kvxfer.pools.backing.base import round_down, round_up, subtract_ranges
from kvxfer.pools.backing.host import HostBacking, HostBackingProvider
from kvxfer.pools.layout import per_layer_descs

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------ pure arithmetic
def test_round_helpers():
    for v, m in itertools.product(range(0, 40), (1, 3, 8)):
        assert round_up(v, m) % m == 0 and v <= round_up(v, m) < v + m
        assert round_down(v, m) % m == 0 and v - m < round_down(v, m) <= v


def test_subtract_ranges_exhaustive():
    """Against a brute-force set difference over every small configuration."""
    cells = range(0, 8)
    holes_choices = [[], [(1, 2)], [(0, 3), (5, 1)], [(2, 4), (3, 1)], [(6, 2), (0, 1)]]
    for lo, hi in itertools.combinations(range(0, 9), 2):
        for holes in holes_choices:
            got = subtract_ranges(lo, hi, holes)
            covered = {x for o, n in holes for x in range(o, o + n)}
            want = {x for x in cells if lo <= x < hi and x not in covered}
            flat = [x for a, b in got for x in range(a, b)]
            assert sorted(flat) == sorted(want) and len(flat) == len(set(flat))
            assert all(a < b for a, b in got)
            assert all(b1 < a2 for (_, b1), (a2, _) in zip(got, got[1:]))  # maximal runs


# ------------------------------------------------------------------------ Backing contract
def _byte(backing, off):
    return ctypes.c_uint8.from_address(backing.address + off)


def test_extents_are_aligned_capped_and_given_back_whole():
    p = HostBackingProvider()
    g = p.granularity
    b = p.reserve(10 * g + 1, max_extent_bytes=3 * g)
    try:
        assert b.reserved_bytes == 11 * g and b.address % g == 0
        assert b.backed_bytes == 0 and b.extents == []
        created = b.commit(g + 5, 6 * g)  # rounds out to [g, 8g)
        assert created == [(g, 2 * g), (3 * g, 3 * g), (6 * g, 2 * g)]  # split on the 3g grid
        assert b.backed_bytes == 7 * g and b.is_backed(g, 7 * g) and not b.is_backed(0, g)
        assert b.commit(2 * g, 3 * g) == []  # already backed: nothing new
        assert b.commit(0, 1) == [(0, g)]
        _byte(b, 0).value = 9
        _byte(b, 8 * g - 1).value = 7
        # [3g, 9g) wholly contains (3g,3g) and (6g,2g); (g,2g) straddles the start and stays
        assert b.decommit(2 * g, 7 * g) == 5 * g
        assert b.extents == [(0, g), (g, 2 * g)] and b.backed_bytes == 3 * g
        assert _byte(b, 0).value == 9
        b.commit(6 * g, 2 * g)
        assert _byte(b, 8 * g - 1).value == 0  # given back pages come back zeroed
        with pytest.raises(InvalidArgument, match="outside the reservation"):
            b.commit(10 * g, 2 * g)
        with pytest.raises(InvalidArgument):
            b.decommit(-1, g)
        assert "extents=3" in repr(b)
    finally:
        b.close()
    b.close()
    assert b.closed and "closed" in repr(b)
    with pytest.raises(BackingError, match="closed"):
        b.commit(0, g)


def test_provider_rejects_bad_sizes():
    p = HostBackingProvider()
    with pytest.raises(InvalidArgument):
        p.reserve(0)
    with pytest.raises(InvalidArgument):
        p.reserve(4096, max_extent_bytes=0)


def test_large_reservation_costs_no_memory():
    """An 8 GiB reservation with page 0 backed and written adds next to nothing to RSS."""

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    layers, rows = 4, (1 << 30) // 2048  # 4 x 2 buffers of 1 GiB (bf16 [rows,8,128])
    descs = per_layer_descs("k", layers, (rows, 8, 128), 2, 1) + per_layer_descs(
        "v", layers, (rows, 8, 128), 2, 1
    )
    before = rss()
    with BackedBuffers(
        descs, store_dtype=torch.bfloat16, page_size=16, reserved_num_tokens=rows - 16
    ) as owner:
        assert owner.reserved_bytes == 8 << 30
        for t in owner.tensors:
            t[:16] = 1
        owner.finalize(1000)
        for t in owner.backed_views():
            t.fill_(2)
        assert owner.backed_bytes < 8 * (1016 * 2048 + 4096)
        assert rss() - before < 64 << 20


def _touch_unbacked(conn):
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the fault is expected: no core dump
    try:
        descs = per_layer_descs("k", 1, (4096 + 16, 4, 16), 2, 1)
        owner = BackedBuffers(
            descs, store_dtype=torch.bfloat16, page_size=16, reserved_num_tokens=4096
        )
        t = owner.tensors[0]
        t[:16] = 1  # page 0: backed
        owner.finalize(100)
        t[:116] = 2
        conn.send("backed-ok")  # a pipe send is synchronous
        t[3000] = 3  # reserved but unbacked: must fault
        conn.send("no-fault")
    except BaseException:  # noqa: BLE001
        conn.send(traceback.format_exc())


def test_unbacked_memory_really_faults():
    """Proves the reservation is real address space without backing: bypassing the owner's
    bounds (raw tensor indexing past usable_tokens) kills the process with SIGSEGV."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_touch_unbacked, args=(child,))
    proc.start()
    child.close()
    proc.join(50)
    if proc.is_alive():
        proc.kill()
        pytest.fail("child did not finish")
    msgs = []
    while parent.poll(1):
        try:
            msgs.append(parent.recv())
        except EOFError:
            break
    assert msgs == ["backed-ok"], msgs
    assert proc.exitcode == -signal.SIGSEGV


class _FailingBacking(HostBacking):
    """Fault injection: the ``fail_at``-th extent mapping fails like a real out-of-memory."""

    def __init__(self, *a, injector):
        super().__init__(*a)
        self._injector = injector

    def _map_extent(self, offset, nbytes):
        inj = self._injector
        inj.counter[0] += 1
        if inj.counter[0] == inj.fail_at:
            raise BackingError("injected: out of memory")
        super()._map_extent(offset, nbytes)


class _FailingProvider(HostBackingProvider):
    def __init__(self, fail_at):
        super().__init__()
        self.counter, self.fail_at = [0], fail_at

    def reserve(self, nbytes, *, max_extent_bytes=None):
        return _FailingBacking(
            self._reserve_size(nbytes),
            self.granularity,
            self._extent_cap(max_extent_bytes),
            injector=self,
        )


def test_failed_finalize_rolls_back_everything():
    """A mapping failure in the 3rd buffer undoes the extents committed for buffers 1-2."""
    p = _FailingProvider(fail_at=None)
    descs = per_layer_descs("k", 4, (2048 + 16, 4, 16), 2, 1)  # 4 x 256 KiB
    owner = BackedBuffers(
        descs,
        store_dtype=torch.bfloat16,
        page_size=16,
        reserved_num_tokens=2048,
        provider=p,
        max_extent_bytes=64 << 10,
    )
    with owner:
        assert p.counter[0] == 4  # page 0 of each buffer
        backed, spans = owner.backed_bytes, list(owner.span_bytes)
        extents = [b.extents for b in owner._backings]
        # each buffer grows by 5 extents (64 KiB grid): fail on the 3rd extent of buffer 3
        p.fail_at = p.counter[0] + 5 + 5 + 3
        with pytest.raises(BackingError, match="injected"):
            owner.finalize(2048)
        assert p.counter[0] == p.fail_at
        assert owner.backed_bytes == backed and owner.span_bytes == spans
        assert [b.extents for b in owner._backings] == extents
        assert owner.num_tokens is None and owner.usable_tokens == 16
        p.fail_at = None
        owner.finalize(2048)
        assert owner.usable_tokens == 2048 + 16
        for t in owner.tensors:
            t.fill_(1)


# ------------------------------------------------------------------------ device selection
def test_make_provider_devices():
    assert make_provider("cpu").granularity > 0
    with pytest.raises(InvalidArgument, match="CUDA devices only"):
        make_provider("cpu", handle_types=("none",))
    with pytest.raises(UnsupportedOperation, match="meta"):
        make_provider("meta")


def test_cuda_provider_validates_before_touching_the_driver():
    from kvxfer.pools.backing.cuda import CudaVmmProvider

    with pytest.raises(InvalidArgument, match="bogus"):
        CudaVmmProvider(0, handle_types=("fabric", "bogus"))
    with pytest.raises(InvalidArgument):
        CudaVmmProvider(0, handle_types=())
    with pytest.raises(InvalidArgument):
        CudaVmmProvider(-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_cuda_backing_without_cuda_is_a_clear_error():
    descs = per_layer_descs("k", 1, (64 + 16, 2, 16), 2, 1)
    for device in ("cuda:0", "cuda"):
        with pytest.raises(BackingError, match="no usable CUDA device"):
            BackedBuffers(
                descs,
                store_dtype=torch.bfloat16,
                device=device,
                page_size=16,
                reserved_num_tokens=64,
            )
    from kvxfer.pools.backing.cuda import CudaVmmProvider

    with pytest.raises(BackingError, match="cuda-bindings|CUDA driver"):  # no package / no driver
        CudaVmmProvider(0)


def test_provider_must_match_the_device():
    descs = per_layer_descs("k", 1, (64 + 16, 2, 16), 2, 1)
    with pytest.raises(InvalidArgument, match="does not serve"):
        BackedBuffers(
            descs,
            store_dtype=torch.bfloat16,
            device="meta",
            page_size=16,
            reserved_num_tokens=64,
            provider=HostBackingProvider(),
        )


def _mapped(address):
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_forgotten_owner_keeps_memory_until_last_tensor_dies():
    """Without close(), the mapping lives exactly as long as some tensor over it."""
    import gc

    descs = per_layer_descs("k", 1, (256 + 16, 4, 16), 2, 1)
    owner = BackedBuffers(descs, store_dtype=torch.bfloat16, page_size=16, reserved_num_tokens=256)
    owner.finalize(256)
    view = owner.tensors[0][10:20]
    addr = owner.tensors[0].data_ptr()
    del owner
    gc.collect()
    view.fill_(5)  # still mapped: no fault
    assert _mapped(addr) and bool((view == 5).all())
    del view
    gc.collect()
    assert not _mapped(addr)
