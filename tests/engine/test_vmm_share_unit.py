"""The VMM share service of the device lane (kvxfer.engine.vmm_share), on CPU.

The exporter and the fetch run for real (abstract AF_UNIX socket, SO_PEERCRED, SCM_RIGHTS,
the share_wire framing); only the CUDA export is a stand-in: each "extent" is a memfd whose
bytes name its region, so the importer can check that it got the right memory. The CUDA
half (cuMemExportToShareableHandle, the mapping, the lane's copies) is
tests/gpu/test_vmm_lane.py.
"""

import os
import socket
import struct

import pytest

from kvxfer.engine import vmm_share
from kvxfer.engine.groups import RemoteGroups, parse_ipc
from kvxfer.errors import BackingError, ProtocolError
from kvxfer.kernels.cuda_driver import IPC_BLOB_BYTES
from kvxfer.pools.backing.share_wire import BufferGrant, RangeGrant, ShareManifest

pytestmark = pytest.mark.timeout(60)

PAGE = 4096
REGIONS = [(0x10000, 3 * PAGE), (0x40000, PAGE), (0x80000, 2 * PAGE)]


def _memfd(tag: bytes, n: int) -> int:
    fd = os.memfd_create("kvxfer-test")
    os.write(fd, (tag * n)[:n])
    return fd


def fake_export(regions, which):
    """One range + one buffer per region, one memfd extent per page, filled with b"r<i>"
    (made when its batch is sent, as the CUDA export is)."""
    ranges, buffers, tags = [], [], []
    for k, i in enumerate(which):
        _, length = regions[i]
        pages = length // PAGE
        ranges.append(RangeGrant(length, tuple((p * PAGE, PAGE) for p in range(pages))))
        buffers.append(BufferGrant(f"region {i}", k, 0, length, 1))
        tags += [b"r%d" % i] * pages
    manifest = ShareManifest("posix_fd", PAGE, "", 0, tuple(ranges), tuple(buffers))
    return manifest, lambda k: _memfd(tags[k], PAGE)


def failing_export(regions, which):
    raise BackingError("region 0 is no longer exportable VMM memory")


def _nothing_answered(s: socket.socket) -> None:
    """The exporter closed ``s`` without a byte (a reset: it left part of the request
    unread)."""
    try:
        got = s.recv(100)
    except ConnectionResetError:
        got = b""
    assert got == b"", "the exporter answered a bad request"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Mapped:
    """Stands in for ImportedBuffers: reads each fd as it is given (the fetch closes it once
    the next is asked for) and counts the process's open fds meanwhile."""

    def __init__(self, manifest, fds):
        self.manifest, self.contents, self.peak_fds, self.closed = manifest, [], 0, False
        for fd in fds:
            self.contents.append(os.pread(fd, 2, 0))
            self.peak_fds = max(self.peak_fds, _open_fds())

    def close(self):
        self.closed = True


@pytest.fixture
def exporter():
    ex = vmm_share.VmmExporter(REGIONS, [0, 2], export=fake_export, timeout=5.0)
    yield ex
    ex.close()


LENS = [n for _, n in REGIONS]


def _fetch(ex, regions, token=None, timeout=5.0, lens=LENS):
    token = ex.token if token is None else token
    return vmm_share.fetch(ex.name, token, regions, lens, Mapped, timeout)


def test_fetch_maps_the_regions_memory_in_order(exporter):
    before = _open_fds()
    got = _fetch(exporter, [2, 0])
    assert [b.name for b in got.manifest.buffers] == ["region 2", "region 0"]
    assert [b.span_bytes for b in got.manifest.buffers] == [2 * PAGE, 3 * PAGE]
    # one fd per extent (page), region 2's first, each read before the next was asked for
    assert got.contents == [b"r2"] * 2 + [b"r0"] * 3
    assert _open_fds() == before, "an fd leaked (each side closes its own)"
    assert (exporter.served, exporter.refused) == (1, 0)


def test_a_large_share_streams_its_fds():
    """A share of 600 extents never has more than a batch (64) open on either side: the
    exporter makes each batch's fds just before sending them and closes them after, the
    importer maps each before it asks for the next (a pool in torch's 20 MiB expandable
    segments is thousands of extents; RLIMIT_NOFILE is often 1024)."""
    regions = [(0, 600 * PAGE)]
    ex = vmm_share.VmmExporter(regions, [0], export=fake_export, timeout=5.0)
    try:
        before = _open_fds()
        got = vmm_share.fetch(ex.name, ex.token, [0], [600 * PAGE], Mapped, 10.0)
        assert got.contents == [b"r0"] * 600
        assert got.peak_fds - before <= 2 * 64 + 8, got.peak_fds - before
        assert _open_fds() == before
    finally:
        ex.close()


@pytest.mark.parametrize(
    "case",
    ["wrong token", "not offered", "twice", "none", "bad magic", "truncated"],
)
def test_bad_requests_get_nothing(exporter, case):
    before = _open_fds()
    if case == "wrong token":
        with pytest.raises(BackingError):
            _fetch(exporter, [0], token=bytes(32))
    elif case == "not offered":
        with pytest.raises(BackingError):
            _fetch(exporter, [1])  # registered, but not VMM memory
    elif case == "twice":
        with pytest.raises(BackingError):
            _fetch(exporter, [0, 0])
    elif case == "none":
        with pytest.raises(BackingError):
            _fetch(exporter, [])
    else:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(exporter.name)
            if case == "bad magic":
                s.sendall(struct.pack("<4s32sI", b"XXXX", exporter.token, 1) + b"\0" * 4)
            else:
                s.sendall(b"KVXR" + exporter.token[:10])
                s.shutdown(socket.SHUT_WR)
            _nothing_answered(s)
    assert _open_fds() == before
    # refused, counted, and the exporter still serves
    assert _fetch(exporter, [0]).contents == [b"r0"] * 3
    assert (exporter.served, exporter.refused) == (1, 1)


def test_a_stalled_caller_holds_up_no_other(exporter):
    """The exporter answers each connection on its own thread: a caller that connected and
    sends nothing (its answer would wait for the 5 s serve timeout) does not delay a fetch
    bounded by 2 s."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
        stalled.connect(exporter.name)
        assert _fetch(exporter, [0], timeout=2.0).contents == [b"r0"] * 3


def test_a_failed_export_closes_the_connection():
    ex = vmm_share.VmmExporter(REGIONS, [0], export=failing_export, timeout=5.0)
    try:
        with pytest.raises(BackingError, match="closed"):
            _fetch(ex, [0])
        assert (ex.served, ex.refused) == (0, 1)
    finally:
        ex.close()


def test_closed_exporter_refuses_at_once():
    ex = vmm_share.VmmExporter(REGIONS, [0], export=fake_export)
    ex.close()
    ex.close()  # idempotent
    assert not ex._thread.is_alive()
    with pytest.raises(BackingError, match="connecting"):
        _fetch(ex, [0], timeout=2.0)


def test_fetch_all_skips_an_exporter_that_fails(exporter):
    gone = vmm_share.VmmExporter(REGIONS, [1], export=fake_export)
    gone.close()
    blobs = [exporter.blob(0), gone.blob(1), exporter.blob(2)]
    shares = vmm_share.fetch_all(blobs, LENS, Mapped, 5.0)
    assert [(regions, len(m.contents)) for regions, m in shares] == [([0, 2], 5)]
    vmm_share.close_shares(shares)
    assert all(m.closed for _, m in shares)


def test_blobs_round_trip_and_are_validated(exporter):
    blob = exporter.blob(2)
    assert vmm_share.is_blob(blob) and len(blob) <= vmm_share.MAX_BLOB_BYTES
    assert vmm_share.unpack_blob(blob) == (2, exporter.token, exporter.name)
    with pytest.raises(ProtocolError):
        vmm_share.unpack_blob(blob[: vmm_share._BLOB.size])  # no socket name
    with pytest.raises(ProtocolError):
        vmm_share.unpack_blob(blob[: vmm_share._BLOB.size] + b"path-not-abstract")
    with pytest.raises(ProtocolError, match="names region 2"):
        vmm_share.offers([b"", blob])  # region 1's entry names region 2
    legacy = b"\1" * IPC_BLOB_BYTES
    assert parse_ipc([legacy, b"", blob], 3) == [legacy, b"", blob]
    with pytest.raises(ProtocolError):
        parse_ipc([legacy, b"", blob[:-200] + b"x" * 200], 3)  # too long
    with pytest.raises(ProtocolError):
        parse_ipc([b"", blob, b""], 3)  # at the wrong region
    with pytest.raises(ProtocolError):
        parse_ipc([b"x" * 5, b"", b""], 3)


def test_vmm_covers_every_cuda_region_of_a_group(exporter):
    import numpy as np

    remote = RemoteGroups(
        groups={},
        desc_region={"kv": np.array([0, 2], dtype=np.uint64), "aux": np.array([1], np.uint64)},
        bases=[a for a, _ in REGIONS],
        lens=[n for _, n in REGIONS],
        keys=[b"k"] * 3,
        types=["cuda", "host", "cuda"],
        address=None,
        ipc=[exporter.blob(0), b"", exporter.blob(2)],
    )
    assert remote.vmm_covers("kv")
    assert not remote.vmm_covers("aux")  # host memory: no VMM region in it
    remote.ipc[2] = b"\1" * IPC_BLOB_BYTES  # a legacy handle beside a VMM blob: both mapped
    assert remote.vmm_covers("kv")
    remote.ipc[0] = b""  # a CUDA region the lane cannot map
    assert not remote.vmm_covers("kv")
    assert not remote.vmm_covers("unknown")


def test_callers_beyond_the_limit_are_closed_at_once():
    """With every answering slot taken (here one, by a caller that sends nothing), the next
    caller's connection is closed on arrival: nothing sent, no thread spent on it."""
    ex = vmm_share.VmmExporter(REGIONS, [0], export=fake_export, timeout=5.0, max_callers=1)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
            stalled.connect(ex.name)  # accepted first: holds the one slot
            with pytest.raises(BackingError):
                _fetch(ex, [0], timeout=2.0)
            assert ex.served == 0 and ex.refused == 1
    finally:
        ex.close()


def test_a_share_shorter_than_its_region_is_refused_before_mapping(exporter):
    """The peer's Layout says region 2 is longer than the share maps (a confused or lying
    exporter): nothing is mapped, every fd closed, the regions stay on UCX — the lane never
    copies past what it mapped."""
    before = _open_fds()
    lens = list(LENS)
    lens[2] += PAGE
    with pytest.raises(BackingError, match="less than the lengths of regions \\[2\\]"):
        _fetch(exporter, [0, 2], lens=lens)
    assert vmm_share.fetch_all([exporter.blob(0), b"", exporter.blob(2)], lens, Mapped, 5.0) == []
    # the exporter's sends fail once the importer hung up: it closes what it made, then
    # counts the connection
    assert exporter.wait_answered(2, 5.0)
    assert _open_fds() == before
