"""The same-host host lane (kvxfer.engine.hostcopy): writes of many runs between host memory
of two processes as batched process_vm_writev calls.

Two parts: the lane against a real child process (no UCX: what it refuses, what it writes,
how it fails), and engines in separate processes over real UCX on loopback, where the
lane carries the scattered writes byte-exact next to engines that keep UCX PUTs.
"""

import asyncio
import ctypes
import os
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
from testenv import DEVICE

from kvxfer.bench.engine_node import EngineNode
from kvxfer.engine import hostcopy
from kvxfer.errors import (
    IndexOutOfRange,
    InvalidArgument,
    PeerClosed,
    ProtocolError,
    TransportError,
)
from kvxfer.procs import Worker
from kvxfer.transport.ucx_lib import load_ucx

pytestmark = pytest.mark.timeout(90)

BUF = 1 << 16

NONCE = bytes(range(32))  # "this side's" nonce: the child's offer holds it, as a peer's would

#: a child that offers a host lane (holding NONCE) and has a BUF-byte buffer of its own;
#: prints the offer and the buffer's address, then on each stdin line prints the buffer's
#: sha256 (or exits on "q")
CHILD = textwrap.dedent(
    f"""
    import ctypes, hashlib, sys
    from kvxfer.engine.hostcopy import Offer
    offer = Offer(bytes.fromhex(sys.argv[1]))
    buf = ctypes.create_string_buffer({BUF})
    o = offer.wire()
    print(o["pid"], o["ns"], o["addr"], ctypes.addressof(buf), flush=True)
    for line in sys.stdin:
        if line.strip() == "q":
            break
        print(hashlib.sha256(buf.raw).hexdigest(), flush=True)
    """
)


class Child:
    def __init__(self):
        self.p = subprocess.Popen(
            [sys.executable, "-c", CHILD, NONCE.hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        pid, ns, addr, buf = self.p.stdout.readline().split()
        self.offer = {"pid": int(pid), "ns": int(ns), "addr": int(addr)}
        self.buf = int(buf)

    def digest(self) -> str:
        self.p.stdin.write("d\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def stop(self):
        if self.p.poll() is None:
            self.p.stdin.write("q\n")
            self.p.stdin.flush()
        self.p.wait(10)


@pytest.fixture
def child():
    c = Child()
    try:
        yield c
    finally:
        c.stop()


HOST = socket.gethostname()


def _sides(child, types=("host",), local=b"x" * BUF):
    src = ctypes.create_string_buffer(local, BUF)
    groups = SimpleNamespace(
        mem_types={"host"}, regions=[SimpleNamespace(handle=7, mem_type="host")]
    )
    remote = SimpleNamespace(types=list(types), bases=[child.buf], lens=[BUF])
    return src, groups, remote


def _open(child, offer=None, nonce=NONCE, want=True, types=("host",), local=b"x" * BUF):
    src, groups, remote = _sides(child, types, local)
    ok, why = hostcopy.verify(child.offer if offer is None else offer, nonce, HOST, want)
    lane, why = hostcopy.open_lane(groups, remote, ok, why)
    return src, lane, why


def _cut(monkeypatch, split_bytes, parts):
    """Every lane write on the threads (none inline), cut into at most ``parts`` parts of at
    least ``split_bytes``."""
    monkeypatch.setattr(hostcopy, "SPLIT_BYTES", split_bytes)
    monkeypatch.setattr(hostcopy, "INLINE_BYTES", 0)
    monkeypatch.setattr(hostcopy, "split_parts", lambda: parts)


def _runs(src, child, pieces):
    """Columns of runs ``(src offset, dst offset, bytes)``, handle 7, region 0."""
    a = np.array(pieces, dtype=np.uint64).reshape(-1, 3)
    base = np.uint64(ctypes.addressof(src))
    laddr = a[:, 0] + base
    raddr = a[:, 1] + np.uint64(child.buf)
    lmemh = np.full(len(a), 7, dtype=np.uint64)
    ridx = np.zeros(len(a), dtype=np.uint64)
    return laddr, raddr, a[:, 2].copy(), lmemh, ridx


def _expected(pieces, local: bytes) -> str:
    import hashlib

    out = bytearray(BUF)
    for s, d, n in pieces:
        out[d : d + n] = local[s : s + n]
    return hashlib.sha256(bytes(out)).hexdigest()


def test_the_lane_writes_every_run_and_nothing_else(child):
    local = bytes(np.random.default_rng(3).integers(0, 256, BUF, dtype=np.uint8))
    src, lane, why = _open(child, local=local)
    assert lane is not None, why
    assert why.startswith("active")
    # 3000 runs of 8 B at every 16th byte (three batches of the kernel's iovec limit), from
    # scattered source offsets
    pieces = [((i * 40) % (BUF - 8), 16 * i + 8, 8) for i in range(3000)]
    laddr, raddr, nbytes, lmemh, ridx = _runs(src, child, pieces)
    assert lane.select(lmemh, ridx).all()

    async def go():
        await lane.start(laddr, raddr, nbytes, ridx, "child")
        await lane.close(5.0)

    asyncio.run(go())
    assert child.digest() == _expected(pieces, local)
    assert (lane.writes, lane.runs) == (1, 3000)


@pytest.mark.parametrize("inline", [True, False])
def test_short_strided_local_runs_are_packed_and_land_exactly(child, monkeypatch, inline):
    """Head slices: 1000 runs of 24 B taken from every 64 B of the source (in a scrambled
    page order) into consecutive destination bytes. Packed into the copying thread's buffer
    (here 4 KiB: several calls) on the starting thread or a host-lane thread."""
    monkeypatch.setattr(hostcopy, "BOUNCE_BYTES", 4096)
    monkeypatch.setattr(hostcopy, "INLINE_BYTES", 1 << 20 if inline else 0)
    monkeypatch.setattr(hostcopy._bounces, "buf", None, raising=False)
    local = bytes(np.random.default_rng(4).integers(0, 256, BUF, dtype=np.uint8))
    src, lane, why = _open(child, local=local)
    assert lane is not None, why
    order = np.random.default_rng(6).permutation(1000)
    pieces = [(64 * int(p) + 8, 100 + 24 * i, 24) for i, p in enumerate(order)]
    laddr, raddr, nbytes, _, ridx = _runs(src, child, pieces)

    async def go():
        await lane.start(laddr, raddr, nbytes, ridx, "child")
        await lane.close(5.0)

    asyncio.run(go())
    assert child.digest() == _expected(pieces, local)
    assert lane.packed == -(-24000 // 4080) and lane.inline == int(inline)


def test_a_large_write_is_cut_into_parts_on_several_threads_and_lands_exactly(child, monkeypatch):
    """SPLIT_BYTES 4 KiB, nothing inline, 4 parts: 3000 scattered runs of 8-20 B go as parts
    on the host-lane threads (queued where there are fewer), every byte where it belongs."""
    _cut(monkeypatch, 4096, 4)
    local = bytes(np.random.default_rng(8).integers(0, 256, BUF, dtype=np.uint8))
    src, lane, why = _open(child, local=local)
    assert lane is not None, why
    rng = np.random.default_rng(9)
    pieces = [
        (int(rng.integers(0, BUF - 64)), 20 * i, int(rng.integers(8, 21))) for i in range(3000)
    ]
    laddr, raddr, nbytes, _, ridx = _runs(src, child, pieces)
    parts = []
    real = hostcopy._Job.run
    monkeypatch.setattr(
        hostcopy._Job, "run", lambda job: (parts.append(job.laddr.size), real(job))[1]
    )

    async def go():
        await lane.start(laddr, raddr, nbytes, ridx, "child")
        await lane.close(5.0)

    asyncio.run(go())
    assert child.digest() == _expected(pieces, local)
    assert lane.split == 1 and len(parts) == 4 and sum(parts) == 3000


def test_a_failed_part_halts_the_others_and_the_write_fails_after_the_last_one(child, monkeypatch):
    """Forced interleaving: part 0 fails at once while part 1 is held before its first call;
    the write's future stays pending until part 1 ran (and stopped at the halt, copying
    nothing), then fails with part 0's error (a TransportError), not part 1's halt."""
    import threading

    _cut(monkeypatch, 1000, 2)
    src, lane, _ = _open(child)
    before = child.digest()
    laddr, raddr, nbytes, _, ridx = _runs(src, child, [(64 * i, 64 * i, 64) for i in range(40)])
    first = int(laddr[0])
    hold, held = threading.Event(), threading.Event()
    real = hostcopy._Job._run

    def run(job):
        if int(job.laddr[0]) == first:
            raise OSError(14, "Bad address")
        held.set()
        assert hold.wait(10)
        real(job)

    monkeypatch.setattr(hostcopy._Job, "_run", run)
    settled, counted = [], []
    real_settle = hostcopy.HostLane._settle

    def settle(self, w, job, c):  # on the loop thread
        real_settle(self, w, job, c)
        settled.append((type(c.exception()).__name__, w.fut.done()))
        counted[0].set()

    monkeypatch.setattr(hostcopy.HostLane, "_settle", settle)

    async def go():
        counted.append(asyncio.Event())
        fut = lane.start(laddr, raddr, nbytes, ridx, "child")
        await asyncio.wait_for(counted[0].wait(), 10)  # part 0's failure counted in
        assert settled == [("OSError", False)] and not fut.done()
        hold.set()
        with pytest.raises(TransportError, match="Bad address"):
            await fut
        assert settled[1] == ("_Halted", True)
        await lane.close(5.0)

    asyncio.run(go())
    assert child.digest() == before  # part 1 stopped at the halt


def test_a_write_whose_later_parts_cannot_start_fails_after_its_first_part(child, monkeypatch):
    """The lane threads refuse work (the interpreter exiting) after the first part: the
    write fails with that, once the first part ended, and no job is left behind."""
    _cut(monkeypatch, 1000, 3)
    src, lane, _ = _open(child)
    laddr, raddr, nbytes, _, ridx = _runs(src, child, [(64 * i, 64 * i, 64) for i in range(60)])
    real, taken = hostcopy._threads(), []

    class Pool:
        def submit(self, fn):
            if taken:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            taken.append(fn)
            return real.submit(fn)

    monkeypatch.setattr(hostcopy, "_threads", lambda: Pool())

    async def go():
        with pytest.raises(TransportError, match="cannot schedule"):
            await lane.start(laddr, raddr, nbytes, ridx, "child")
        assert not lane._jobs and len(taken) == 1
        await lane.close(5.0)

    asyncio.run(go())


#: the direct pattern tests' descriptors: 4 of 32 items of 256 B on each side
PD, PITEMS, PITEM = 4, 32, 256
PDESC = PITEMS * PITEM


def _pattern(uniform=True):
    from kvxfer.engine.slices import PatternRuns

    one = ([8, 72, 136, 200], [0, 16, 32, 48], [16] * 4)  # head slices: strided -> whole
    other = ([8, 100], [16, 240], [80, 16])
    descs = [one] * PD if uniform else [one, other, one, ([], [], [])]
    return PatternRuns.make(descs, [PITEM] * PD, [PITEM] * PD)


def _pattern_part(src, child, runs, si, di, shift=0):
    base = ctypes.addressof(src)
    lptrs = [base + d * PDESC for d in range(PD)]
    rptrs = [child.buf + d * PDESC + shift for d in range(PD)]
    return (runs, si, di, lptrs, rptrs, [PDESC] * PD, np.zeros(PD, dtype=np.uint64))


def _pattern_pieces(runs, si, di):
    desc, s, t, n = runs.expand(si, di)
    return list(zip((desc * PDESC + s).tolist(), (desc * PDESC + t).tolist(), n.tolist()))


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("threads", [False, True])
def test_pattern_writes_are_copied_from_their_pattern_exactly(child, monkeypatch, uniform, threads):
    """A PatternWrite's descriptors copied from the pattern (each descriptor's runs expanded
    once, on the copying thread, then shifted to the descriptor's bases): every byte where
    the expanded runs put it, nothing else written; inline, or on the threads cut into parts
    of whole descriptors (3 here), short runs packed (a 1 KiB buffer: several calls)."""
    monkeypatch.setattr(hostcopy, "BOUNCE_BYTES", 1024)
    monkeypatch.setattr(hostcopy._bounces, "buf", None, raising=False)
    if threads:
        _cut(monkeypatch, 1000, 3)
    local = bytes(np.random.default_rng(21).integers(0, 256, BUF, dtype=np.uint8))
    src, lane, why = _open(child, local=local)
    assert lane is not None, why
    rng = np.random.default_rng(22)
    si, di = rng.permutation(PITEMS)[:20], rng.permutation(PITEMS)[:20]
    runs = _pattern(uniform)
    parts = []
    real = hostcopy._PatternJob.run
    monkeypatch.setattr(
        hostcopy._PatternJob, "run", lambda job: (parts.append(len(job.units)), real(job))[1]
    )

    async def go():
        await lane.start_patterns([_pattern_part(src, child, runs, si, di)], "child")
        await lane.close(5.0)

    asyncio.run(go())
    assert child.digest() == _expected(_pattern_pieces(runs, si, di), local)
    units = PD if uniform else PD - 1  # (a descriptor that moves nothing is no unit)
    assert sorted(parts) == ([1, 1, units - 2] if threads else [units])
    assert (lane.writes, lane.patterns, lane.inline) == (1, 1, int(not threads))
    assert lane.runs == runs.runs_per_item * 20 and lane.packed > 0


def test_a_pattern_job_reads_the_ids_as_they_were_when_it_started(child, monkeypatch):
    """Forced interleaving: the job is held on its thread while the caller reuses its id
    arrays; the bytes land where the ids said when the write started."""
    import threading

    monkeypatch.setattr(hostcopy, "INLINE_BYTES", 0)
    local = bytes(np.random.default_rng(23).integers(0, 256, BUF, dtype=np.uint8))
    src, lane, _ = _open(child, local=local)
    si, di = np.arange(10), np.arange(10)[::-1].copy()
    want = _expected(_pattern_pieces(_pattern(), si, di), local)
    hold = threading.Event()
    real = hostcopy._PatternJob._run
    monkeypatch.setattr(hostcopy._PatternJob, "_run", lambda job: (hold.wait(10), real(job))[1])

    async def go():
        fut = lane.start_patterns([_pattern_part(src, child, _pattern(), si, di)], "child")
        si[:], di[:] = 20, np.arange(20, 30)  # the caller's arrays, reused
        hold.set()
        await fut
        await lane.close(5.0)

    asyncio.run(go())
    assert child.digest() == want


def test_a_pattern_descriptor_outside_the_remote_region_moves_nothing(child):
    src, lane, _ = _open(child)
    before = child.digest()
    shift = BUF - PD * PDESC + 8  # the last descriptor ends 8 B past the region
    part = _pattern_part(src, child, _pattern(), np.arange(3), np.arange(3), shift=shift)

    async def go():
        with pytest.raises(IndexOutOfRange, match="host lane"):
            lane.start_patterns([part], "child")
        await lane.close(5.0)

    asyncio.run(go())
    assert child.digest() == before and lane.writes == 0


def test_a_pattern_write_to_a_peer_that_exited_fails_with_peer_closed(child):
    src, lane, _ = _open(child)
    child.stop()
    part = _pattern_part(src, child, _pattern(), np.arange(5), np.arange(5))

    async def go():
        with pytest.raises(PeerClosed, match="gone"):
            await lane.start_patterns([part], "child")
        await lane.close(5.0)

    asyncio.run(go())


def test_host_patterns_setting(monkeypatch):
    from kvxfer.config import host_patterns

    monkeypatch.delenv("KVXFER_HOST_PATTERNS", raising=False)
    assert host_patterns() is True
    monkeypatch.setenv("KVXFER_HOST_PATTERNS", "0")
    assert host_patterns() is False
    monkeypatch.setenv("KVXFER_HOST_PATTERNS", "yes")
    with pytest.raises(InvalidArgument, match="KVXFER_HOST_PATTERNS"):
        host_patterns()


def test_split_points():
    def parts(sizes, k, least):
        cut = hostcopy.split_points(np.array(sizes, dtype=np.uint64), k, least)
        assert cut[0] == 0 and cut[-1] == len(sizes) and (np.diff(cut) > 0).all()
        return [int(sum(sizes[a:b])) for a, b in zip(cut[:-1], cut[1:])]

    assert parts([10] * 100, 4, 100) == [250] * 4
    assert parts([10] * 100, 4, 300) == [330, 340, 330]  # 1000 // 300 = 3 parts
    assert parts([10] * 100, 4, 0) == [1000]  # 0: never cut
    assert parts([10] * 100, 1, 100) == [1000]
    assert parts([10] * 100, 4, 1001) == [1000]
    assert parts([1000, 1, 1, 1], 4, 1) == [1000, 3]  # a run is never cut
    assert parts([1, 1, 1, 1000], 4, 1) == [3, 1000]
    assert parts([100, 100, 100, 100], 2, 1) == [200, 200]
    assert parts([5], 4, 1) == [5]
    assert hostcopy.split_points(np.zeros(0, np.uint64), 4, 1).tolist() == [0, 0]
    rng = np.random.default_rng(1)
    for _ in range(200):
        sizes = rng.integers(1, 5000, int(rng.integers(1, 300))).tolist()
        k, least = int(rng.integers(1, 9)), int(rng.integers(1, 20000))
        got = parts(sizes, k, least)
        assert sum(got) == sum(sizes) and len(got) <= max(1, min(k, sum(sizes) // least))


def test_split_parts_leave_half_the_cpus(monkeypatch):
    monkeypatch.setattr(hostcopy, "SPLIT_PARTS", 0)
    for cpus, want in ((1, 1), (2, 1), (3, 1), (4, 2), (6, 3), (8, 4), (64, hostcopy.MAX_THREADS)):
        monkeypatch.setattr(hostcopy, "_cpus", lambda c=cpus: c)
        assert hostcopy.split_parts() == want
        assert hostcopy.thread_count() == min(cpus, hostcopy.MAX_THREADS)
    monkeypatch.setattr(hostcopy, "SPLIT_PARTS", 3)  # KVXFER_HOST_SPLIT_PARTS
    assert hostcopy.split_parts() == 3


def test_host_split_bytes_setting(monkeypatch):
    from kvxfer.config import HOST_SPLIT_BYTES, host_split_bytes, host_split_parts

    monkeypatch.delenv("KVXFER_HOST_SPLIT_PARTS", raising=False)
    assert host_split_parts() == 0
    monkeypatch.setenv("KVXFER_HOST_SPLIT_PARTS", "3")
    assert host_split_parts() == 3
    monkeypatch.setenv("KVXFER_HOST_SPLIT_PARTS", "-2")
    with pytest.raises(InvalidArgument, match="KVXFER_HOST_SPLIT_PARTS"):
        host_split_parts()

    monkeypatch.delenv("KVXFER_HOST_SPLIT_BYTES", raising=False)
    assert host_split_bytes() == HOST_SPLIT_BYTES
    monkeypatch.setenv("KVXFER_HOST_SPLIT_BYTES", "0")
    assert host_split_bytes() == 0
    for bad in ("-1", "x"):
        monkeypatch.setenv("KVXFER_HOST_SPLIT_BYTES", bad)
        with pytest.raises(InvalidArgument, match="KVXFER_HOST_SPLIT_BYTES"):
            host_split_bytes()


def test_a_run_outside_the_remote_region_moves_nothing(child):
    src, lane, _ = _open(child)
    before = child.digest()
    pieces = [(0, 0, 64), (0, BUF - 32, 64)]  # the second one ends 32 B past the region
    laddr, raddr, nbytes, _, ridx = _runs(src, child, pieces)

    async def go():
        with pytest.raises(IndexOutOfRange):
            lane.start(laddr, raddr, nbytes, ridx, "child")
        await lane.close(5.0)

    asyncio.run(go())
    assert child.digest() == before


@pytest.mark.parametrize(
    "change, why",
    [
        ({}, "did not read back this handshake's nonce"),  # another nonce (below)
        ({"pid": os.getpid()}, "this process"),
        ({"ns": 1}, "pid namespace"),
        ({"addr": 8}, "process_vm_readv"),
    ],
)
def test_an_offer_that_does_not_check_out_gets_no_lane(child, change, why):
    other = NONCE[::-1] if not change else NONCE
    src, lane, text = _open(child, offer={**child.offer, **change}, nonce=other)
    assert lane is None and why in text, text


def test_no_lane_when_unwanted_elsewhere_or_not_host_memory(child):
    assert _open(child, want=False)[1] is None
    _, lane, why = _open(child, types=("cuda",))
    assert lane is None and "no host memory" in why
    assert hostcopy.verify(child.offer, NONCE, "another-host", True)[1] == (
        "off (peer on host 'another-host')"
    )
    assert hostcopy.verify(None, NONCE, HOST, True) == (None, "off (the peer offered none)")


def test_a_checked_peer_that_gets_no_lane_has_its_pidfd_closed(child):
    ok, _ = hostcopy.verify(child.offer, NONCE, HOST, True)
    fd = ok.pidfd
    os.fstat(fd)  # open
    _, groups, remote = _sides(child, types=("cuda",))
    assert hostcopy.open_lane(groups, remote, ok, "")[0] is None
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_peer_that_exited_fails_the_write_with_peer_closed(child):
    src, lane, _ = _open(child)
    child.stop()  # the process is gone (reaped): its pidfd says so before any byte moves
    laddr, raddr, nbytes, _, ridx = _runs(src, child, [(0, 0, 64)] * 100)

    async def go():
        with pytest.raises(PeerClosed, match="gone"):
            await lane.start(laddr, raddr, nbytes, ridx, "child")
        await lane.close(5.0)

    asyncio.run(go())


def test_a_closed_lane_takes_no_write(child):
    src, lane, _ = _open(child)
    laddr, raddr, nbytes, _, ridx = _runs(src, child, [(0, 0, 64)])

    async def go():
        await lane.close(5.0)
        with pytest.raises(PeerClosed):
            lane.start(laddr, raddr, nbytes, ridx, "child")
        assert not lane.select(np.array([7], np.uint64), np.zeros(1, np.uint64)).any()

    asyncio.run(go())


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"pid": 1, "ns": 1},
        {"pid": 1, "ns": 1, "addr": 1, "cookie": b"c"},
        {"pid": 0, "ns": 1, "addr": 1},
        {"pid": 1 << 40, "ns": 1, "addr": 1},
        {"pid": True, "ns": 1, "addr": 1},
        {"pid": 5, "ns": -1, "addr": 1},
        {"pid": 5, "ns": 1, "addr": "1"},
    ],
)
def test_a_malformed_offer_is_a_protocol_error(raw):
    with pytest.raises(ProtocolError):
        hostcopy.parse_offer(raw)


def _runs_of(rng, n, adjacent):
    """``n`` runs on each side (inside 64 KiB): lengths 1-40, with probability
    ``adjacent`` a run continues the previous one on its side (merging), else it starts
    at a random gap; destinations never overlap (they are laid out in order)."""
    lens = rng.integers(1, 41, n)
    out = []
    for _ in range(2):
        addr, pos = [], int(rng.integers(0, 50))
        for i in range(n):
            if i and rng.random() >= adjacent:
                pos += int(rng.integers(1, 60))
            addr.append(pos)
            pos += int(lens[i])
        out.append(np.array(addr, dtype=np.uint64))
    if rng.random() < 0.5:  # the local side in any order (sources may repeat / overlap)
        out[0] = rng.permutation(out[0])
    return out[0], out[1], lens.astype(np.uint64)


@pytest.mark.parametrize("seed", range(90))
def test_calls_copy_every_run_as_streams_within_the_limits(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 400))
    la, ra, nb = _runs_of(rng, n, [0.0, 0.5, 0.95][seed % 3])
    max_iov, max_bytes = int(rng.integers(1, 40)), int(rng.integers(1, 3000))
    pack = [False, True, None][(seed // 3) % 3]
    bounce = int(rng.integers(1, 3000))
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    want = np.zeros(1 << 16, dtype=np.uint8)
    for a, b, k in zip(la.tolist(), ra.tolist(), nb.tolist()):
        want[b : b + k] = src[a : a + k]
    got = np.zeros_like(want)
    out = hostcopy.calls(la, ra, nb, max_iov, max_bytes, pack=pack, bounce=bounce)
    total, longest, end = 0, int(nb.max()) if n else 0, 0
    cap = min(max_bytes, bounce) if pack else max_bytes
    for c in out:
        assert c.first == end < c.end  # every run once, in order
        end = c.end
        assert 1 <= c.riov.shape[0] <= max_iov
        assert int(c.riov[:, 1].sum()) == c.nbytes == int(nb[c.first : c.end].sum())
        assert c.nbytes <= max(cap, longest)
        if c.liov is None:  # packed: the runs back to back (what _rma.gather does)
            assert pack is not False and c.nbytes <= bounce
            stream = np.concatenate(
                [
                    src[int(a) : int(a) + int(k)]
                    for a, k in zip(la[c.first : c.end], nb[c.first : c.end])
                ]
            )
        else:
            assert 1 <= c.liov.shape[0] <= max_iov and int(c.liov[:, 1].sum()) == c.nbytes
            assert not pack or (c.end == c.first + 1 and c.nbytes > bounce)
            stream = np.concatenate([src[int(a) : int(a) + int(k)] for a, k in c.liov])
        at = 0
        for b, k in c.riov.tolist():
            got[b : b + k] = stream[at : at + k]
            at += k
        total += c.nbytes
    assert end == n and total == int(nb.sum())
    assert np.array_equal(got, want)
    if n and max_iov >= n and cap >= total and not pack:  # one call, maximally merged
        assert len(out) == 1
        assert out[0].riov.shape[0] == 1 + int(np.count_nonzero(ra[1:] != ra[:-1] + nb[:-1]))


def test_calls_pack_many_short_local_pieces_only():
    """Auto: packed when the local side has at least twice the remote side's iovecs and
    they average at most PACK_RUN_BYTES; head slices of a strided source going to whole
    pages are; the same runs the other way round (strided destinations) are not."""
    k, run = 64, 512
    strided = np.arange(k, dtype=np.uint64) * (2 * run)
    whole = np.arange(k, dtype=np.uint64) * run
    nb = np.full(k, run, dtype=np.uint64)
    assert [c.liov for c in hostcopy.calls(strided, whole, nb)] == [None]
    assert hostcopy.calls(whole, strided, nb)[0].liov is not None
    long = np.full(k, 2 * hostcopy.PACK_RUN_BYTES, dtype=np.uint64)
    assert hostcopy.calls(strided * 8, whole * 4, long)[0].liov is not None  # long pieces
    assert hostcopy.calls(strided, strided, nb)[0].liov is not None  # as many remote pieces


def test_gather_packs_runs_back_to_back_and_refuses_an_overflow():
    _rma = load_ucx()[1]
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)  # above 64 KiB: the GIL-free copy too
    offs = rng.permutation(np.arange(0, src.size - 4096, 4096))[:200].astype(np.uint64)
    lens = rng.integers(1, 4097, offs.size).astype(np.uint64)
    out = np.zeros(int(lens.sum()), dtype=np.uint8)
    la = offs + np.uint64(src.ctypes.data)
    assert _rma.gather(out.ctypes.data, out.size, la, lens) == out.size
    want = np.concatenate([src[int(o) : int(o + n)] for o, n in zip(offs, lens)])
    assert np.array_equal(out, want)
    out[:] = 0
    with pytest.raises(ValueError, match="exceed"):
        _rma.gather(out.ctypes.data, out.size - 1, la, lens)
    assert not out.any()  # nothing copied
    with pytest.raises(ValueError, match="entries"):
        _rma.gather(out.ctypes.data, out.size, la, lens[:-1])
    with pytest.raises(TypeError):
        _rma.gather(out.ctypes.data, out.size, la.astype(np.int32), lens)


def test_lands_whole():
    a = np.array
    assert hostcopy.lands_whole([])
    assert hostcopy.lands_whole([(a([0]), a([8])), (a([0, 8, 24]), a([8, 16, 4]))])
    assert not hostcopy.lands_whole([(a([0, 16]), a([8, 8]))])  # a gap: strided shares
    assert not hostcopy.lands_whole([(a([0]), a([8])), (a([8, 0]), a([8, 8]))])  # not in order


def test_lane_wanted(monkeypatch):
    monkeypatch.setattr(hostcopy, "split_parts", lambda: 1)  # two CPUs: nothing is cut
    big, many = hostcopy.INLINE_BYTES, hostcopy.THREAD_MIN_OPS
    assert not hostcopy.lane_wanted(0, 0, 1)
    assert not hostcopy.lane_wanted(63, 63, 64)
    assert hostcopy.lane_wanted(64, 64, 64)
    assert hostcopy.lane_wanted(64, big, 64)  # copied inline, whatever its runs
    # handed to a thread: from THREAD_MIN_OPS runs, whatever their length
    assert not hostcopy.lane_wanted(many - 1, big + 1, 64)  # (short runs too)
    assert hostcopy.lane_wanted(many, big + 1, 64)
    assert hostcopy.lane_wanted(many, many * (256 << 10), 64)  # 64 MiB of 256 KiB runs
    assert not hostcopy.lane_wanted(64, 64 * 65536, 64)  # few long runs stay PUTs
    assert not hostcopy.lane_wanted(many, big + 1, many + 1)  # (and never below min_ops)
    # without a shared-memory UCX lane (tcp): long runs too, and any write above 1 MiB
    assert hostcopy.lane_wanted(64, 64 * 65536, 64, shm=False)
    assert hostcopy.lane_wanted(2, big + 1, 64, shm=False)
    assert not hostcopy.lane_wanted(2, big, 64, shm=False)  # small and few: PUTs
    cut = 2 * hostcopy.SPLIT_BYTES
    assert not hostcopy.lane_wanted(2, cut, 64)
    # spare CPUs: a write the threads copy in parts, whatever its runs
    monkeypatch.setattr(hostcopy, "split_parts", lambda: 2)
    assert hostcopy.lane_wanted(2, cut, 64) and not hostcopy.lane_wanted(2, cut - 1, 64)
    monkeypatch.setattr(hostcopy, "SPLIT_BYTES", 0)  # never cut
    assert not hostcopy.lane_wanted(2, cut, 64)


# ------------------------------------------------------------------ engines over UCX

SECRET = b"host-lane-secret"
#: the target engine each initiator engine talks to (error modes match: "peer" runs RMA over
#: tcp only when both ends are in it)
TARGET = {"none": "main", "peer": "peer", "off": "main"}
L, ITEM, ITEMS = 3, 256, 64


def _groups():
    return {
        "kv": {"item_lens": [ITEM] * (2 * L), "items": ITEMS, "contiguous": True},
        "big": {"item_lens": [1 << 20], "items": 4},
    }


def _eng(name, mode="none", **kw):
    cfg = dict(secret=SECRET, name=name, error_mode=mode, transfer_timeout_s=10.0, **kw)
    return {"config": cfg, "groups": _groups(), "device": DEVICE}


@pytest.fixture(scope="module")
def engines():
    if DEVICE != "cpu":
        pytest.skip("host memory only")
    a = Worker(
        EngineNode,
        {
            "engines": {
                "main": _eng("A"),
                "closed": _eng("A-off", host_copy="off"),
                # both ends in error mode "peer": RMA over tcp (no shared-memory lane)
                "peer": _eng("A-peer", mode="peer"),
            }
        },
        name="A",
    )
    b = Worker(
        EngineNode,
        {
            "engines": {
                "none": _eng("B"),
                "peer": _eng("B-peer", mode="peer"),
                "off": _eng("B-off", host_copy="off"),
            }
        },
        name="B",
    )
    try:
        ports = a.start().proxy(EngineNode).ports()
        b.start()
        bp = b.proxy(EngineNode)
        ids = {}
        for key in ("none", "peer", "off"):
            ids[key] = bp.connect(key, "127.0.0.1", ports[TARGET[key]])["ok"]
        ids["to-closed"] = bp.connect("none", "127.0.0.1", ports["closed"])["ok"]
        yield a.proxy(EngineNode), bp, ids
    finally:
        b.close()
        a.close()


def _write(engines, key, peer, target, ids, seed):
    a, b, _ = engines
    b.fill(key, "kv", seed)
    a.zero(target, "kv")
    res = b.write(key, peer, [("kv", ids, ids[::-1])], b"n")
    assert "ok" in res, res
    assert [p for _, p in a.messages(target, 1, 10.0)] == [b"n"]
    assert a.items(target, "kv", ids[::-1]) == b.items(key, "kv", ids)
    rest = sorted(set(range(ITEMS)) - set(ids))
    assert not any(a.items(target, "kv", rest)), "bytes outside the destination written"
    return res["ok"]


@pytest.mark.parametrize("key", ["none", "peer"])
def test_engines_on_one_host_write_scattered_pages_through_the_lane(engines, key):
    ids = [int(i) for i in np.random.default_rng(5).permutation(ITEMS)[:40]]
    st = _write(engines, key, engines[2][key], TARGET[key], ids, 11)
    assert st["host_lane"].startswith("active"), st["host_lane"]
    assert st["host_ops"] == st["ops"] >= 64  # adjacent pages' runs merged
    assert st["host_bytes"] == st["bytes"] == 40 * 2 * L * ITEM


def _kv_pieces(runs, si, di):
    desc, s, t, n = runs.expand(si, di)
    block = ITEMS * ITEM
    return zip((desc * block + s).tolist(), (desc * block + t).tolist(), n.tolist())


@pytest.mark.parametrize("key", ["none", "off"])
def test_pattern_writes_between_engines_land_exactly_with_the_lane_or_as_puts(engines, key):
    """A PatternWrite of head-slice-like runs (few items: below the lane's run count for
    expanded runs) goes to the host lane as its pattern where the lane is open, as expanded
    PUTs where it is not; byte-exact and nothing else written either way."""
    from kvxfer.engine.slices import PatternRuns

    a, b, ids = engines
    one = ([0, 128], [128, 0], [64, 64])
    runs = PatternRuns.make([one] * (2 * L), [ITEM] * (2 * L), [ITEM] * (2 * L))
    si, di = [5, 9, 2], [40, 3, 17]
    b.fill(key, "kv", 41)
    a.zero(TARGET[key], "kv")
    res = b.write(key, ids[key], [("kv", si, di, [one] * (2 * L))], b"n")
    assert "ok" in res, res
    assert [p for _, p in a.messages(TARGET[key], 1, 10.0)] == [b"n"]
    source = b.items(key, "kv", range(ITEMS))
    want = bytearray(len(source))
    for s, t, n in _kv_pieces(runs, np.array(si), np.array(di)):
        want[t : t + n] = source[s : s + n]
    assert a.items(TARGET[key], "kv", range(ITEMS)) == bytes(want)
    st = res["ok"]
    assert st["bytes"] == 3 * 2 * L * 128
    lane = key == "none"
    assert st["host_ops"] == (3 * 2 * L * 2 if lane else 0), st
    assert (st["host_patterns"] > 0) == lane, st


def test_few_runs_stay_on_ucx_puts(engines):
    st = _write(engines, "none", engines[2]["none"], "main", [3, 9], 12)
    assert st["host_lane"].startswith("active")
    assert (st["host_ops"], st["ops"]) == (0, 2 * 2 * L)


@pytest.mark.parametrize(
    "key, peer, target, why",
    [
        ("off", "off", "main", "host_copy='off'"),
        ("none", "to-closed", "closed", "the peer offered none"),
    ],
)
def test_without_the_lane_the_same_writes_go_as_puts(engines, key, peer, target, why):
    ids = [int(i) for i in np.random.default_rng(6).permutation(ITEMS)[:40]]
    st = _write(engines, key, engines[2][peer], target, ids, 13)
    assert why in st["host_lane"], st["host_lane"]
    assert st["host_ops"] == 0 and st["ops"] >= 64


@pytest.mark.parametrize("key, lane", [("peer", True), ("none", False)])
def test_a_large_write_of_few_runs_takes_the_lane_only_over_tcp(engines, key, lane):
    """Two 1 MiB runs: over tcp (error mode "peer") the lane copies them; over cma they stay
    PUTs (cma copies long runs as fast). Byte-exact either way."""
    a, b, ids = engines
    b.fill(key, "big", 21)
    a.zero(TARGET[key], "big")
    res = b.write(key, ids[key], [("big", [0, 1], [3, 2])], b"n")
    assert "ok" in res, res
    assert [p for _, p in a.messages(TARGET[key], 1, 10.0)] == [b"n"]
    assert a.items(TARGET[key], "big", [3, 2]) == b.items(key, "big", [0, 1])
    assert not any(a.items(TARGET[key], "big", [0, 1]))
    assert any(x.startswith("tcp") for x in res["ok"]["lanes"]) == lane, res["ok"]["lanes"]
    assert res["ok"]["host_ops"] == (2 if lane else 0), (res["ok"]["lanes"], res["ok"])


def test_large_writes_cut_into_parts_land_exactly_between_engines():
    """An initiator told to cut (KVXFER_HOST_SPLIT_PARTS=3, parts of >= 4 KiB: what a host of
    spare CPUs does from 32 MiB): a 3 MiB write of three 1 MiB runs (few, long: PUTs
    otherwise) goes over the lane in parts, byte-exact, nothing else written; a scattered
    kv write in the same engine too."""
    if DEVICE != "cpu":
        pytest.skip("host memory only")
    env = {"KVXFER_HOST_SPLIT_PARTS": "3", "KVXFER_HOST_SPLIT_BYTES": "4096"}
    a = Worker(EngineNode, {"engines": {"main": _eng("A")}}, name="A")
    b = Worker(EngineNode, {"engines": {"none": _eng("B")}}, name="B", env=env)
    try:
        port = a.start().proxy(EngineNode).ports()["main"]
        b.start()
        pa, pb = a.proxy(EngineNode), b.proxy(EngineNode)
        peer = pb.connect("none", "127.0.0.1", port)["ok"]
        pb.fill("none", "big", 31)
        pa.zero("main", "big")
        res = pb.write("none", peer, [("big", [0, 1, 2], [3, 1, 0])], b"n")
        assert "ok" in res, res
        assert [p for _, p in pa.messages("main", 1, 10.0)] == [b"n"]
        assert pa.items("main", "big", [3, 1, 0]) == pb.items("none", "big", [0, 1, 2])
        assert not any(pa.items("main", "big", [2]))
        assert res["ok"]["host_ops"] == 3, res["ok"]
        ids = list(range(0, ITEMS, 2))
        got = _write((pa, pb, None), "none", peer, "main", ids, 32)
        assert got["host_ops"] > 0, got
    finally:
        b.close()
        a.close()


def test_check_inside_is_exact_at_both_ends():
    from kvxfer.engine.devcopy import check_inside

    base, ln = np.array([1000, 5000], np.uint64), np.array([100, 10], np.uint64)
    u = lambda *v: np.array(v, np.uint64)  # noqa: E731
    check_inside(u(1000, 5000), u(100, 10), u(0, 1), base, ln, "lane")  # both exactly fill
    for raddr, nb, ridx in [(999, 1, 0), (1000, 101, 0), (1099, 2, 0), (5010, 1, 1), (1000, 11, 1)]:
        with pytest.raises(IndexOutOfRange, match="lane: an op falls outside"):
            check_inside(u(raddr), u(nb), u(ridx), base, ln, "lane")


def test_host_pack_bytes_setting(monkeypatch):
    from kvxfer.config import HOST_PACK_BYTES, host_pack_bytes

    monkeypatch.delenv("KVXFER_HOST_PACK_BYTES", raising=False)
    assert host_pack_bytes() == HOST_PACK_BYTES
    monkeypatch.setenv("KVXFER_HOST_PACK_BYTES", "0")
    assert host_pack_bytes() == 0
    for bad in ("x", "-1"):
        monkeypatch.setenv("KVXFER_HOST_PACK_BYTES", bad)
        with pytest.raises(InvalidArgument, match="KVXFER_HOST_PACK_BYTES"):
            host_pack_bytes()


def test_a_write_whose_peer_dies_mid_copy_fails_only_after_the_copy():
    """Forced interleaving over real UCX and a real lane: a 4 MiB write of 2 KiB runs goes
    to the host lane's threads, held at its start while the peer is marked dead (as UCX's
    error handler does); the write must not end while its copy is held, and it fails
    (PeerClosed) only once no copy of it runs: none of its bytes lands after its failure
    is reported."""
    if DEVICE != "cpu":
        pytest.skip("host memory only")
    groups = {"wide": {"item_lens": [2048] * 8, "items": 512}}
    spec = lambda name: {  # noqa: E731
        "engines": {"e": dict(_eng(name), groups=groups)}
    }
    a = Worker(EngineNode, spec("A-wide"), name="A")
    b = Worker(EngineNode, spec("B-wide"), name="B")
    try:
        port = a.start().proxy(EngineNode).ports()["e"]
        bp = b.start().proxy(EngineNode)
        peer = bp.connect("e", "127.0.0.1", port)["ok"]
        ids = list(range(0, 512, 2))  # 256 items x 8 runs of 2 KiB: nothing merges
        res = bp.write_peer_dies_mid_copy("e", peer, [("wide", ids, ids)])
        assert res["error"] == "PeerClosed", res
        assert res["done_while_held"] is False, res
        assert res["jobs_at_raise"] == 0, res
    finally:
        b.close()
        a.close()
