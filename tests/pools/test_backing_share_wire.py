"""The VMM share message (pools.backing.share_wire) on any machine: real SCM_RIGHTS fd passing
over a socketpair (with pipes standing in for the exported CUDA handles), manifest validation,
deadlines, and no fd leaked on any failure. The CUDA mapping itself is tests/gpu/test_vmm_share.py.
"""

import copy
import os
import socket
import struct

import pytest
import torch

from kvxfer.kernels.errors import BackingError, InvalidArgument, UnsupportedOperation
from kvxfer.pools.backing.share_wire import (
    MAGIC,
    MAX_FDS_PER_MSG,
    SHARE_VERSION,
    BufferGrant,
    RangeGrant,
    ShareManifest,
    recv_share_message,
    send_share_message,
    validate_manifest,
)

pytestmark = pytest.mark.timeout(30)

G = 4096


def _manifest(n_extents: int) -> ShareManifest:
    exts = tuple((i * G, G) for i in range(n_extents))
    return ShareManifest(
        "posix_fd",
        G,
        "GPU-test",
        3,
        (RangeGrant(n_extents * G + G, exts),),
        (BufferGrant("kv", 0, 0, n_extents * G, 2 * G),),
    )


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_roundtrip_passes_every_fd_in_batches(pair):
    a, b = pair
    n = 2 * MAX_FDS_PER_MSG + 22  # three batches
    pipes = [os.pipe() for _ in range(n)]
    try:
        man = _manifest(n)
        send_share_message(a, man, [w for _, w in pipes], timeout=10)
        got, fds = recv_share_message(b, timeout=10)
        try:
            assert got == man and len(fds) == n
            for i, (fd, (r, _)) in enumerate(zip(fds, pipes)):
                os.write(fd, struct.pack("<I", i))  # the received fd IS that pipe
                assert struct.unpack("<I", os.read(r, 4))[0] == i
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)


def _raw(man: ShareManifest) -> dict:
    return copy.deepcopy(man.to_json())


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: m.update(version=2), "version"),
        (lambda m: m.update(handle_type="fabric"), "posix_fd"),
        (lambda m: m.update(granularity=0), "granularity"),
        (lambda m: m.update(extra=1), "unknown fields"),
        (lambda m: m["ranges"][0].update(reserved_bytes=G * 3 + 1), "multiple"),
        (lambda m: m["ranges"][0]["extents"].reverse(), "overlapping, unsorted"),
        (lambda m: m["ranges"][0]["extents"][0].__setitem__(0, 1), "unaligned"),
        (lambda m: m["ranges"][0]["extents"][1].__setitem__(1, 99 * G), "outside"),
        (lambda m: m["ranges"][0]["extents"].__setitem__(0, [0, "x"]), "offset, nbytes"),
        (lambda m: m["buffers"][0].update(range=1), "range"),
        (lambda m: m["buffers"][0].update(span_bytes=3 * G), "not fully backed"),
        (lambda m: m["buffers"][0].update(offset=G, span_bytes=3 * G), "exceeds"),
        (lambda m: m["buffers"][0].update(name=5), "name"),
        (lambda m: m.update(generation=-1), "generation"),
    ],
)
def test_malformed_manifests_are_rejected(mutate, match):
    raw = _raw(_manifest(2))
    assert validate_manifest(raw, 2) == _manifest(2)
    mutate(raw)
    with pytest.raises(BackingError, match=match):
        validate_manifest(raw, 2)


def test_fd_count_must_match_extents(pair):
    with pytest.raises(BackingError, match="file descriptors"):
        validate_manifest(_raw(_manifest(2)), 3)
    with pytest.raises(InvalidArgument):
        send_share_message(pair[0], _manifest(2), [0], timeout=5)


def test_received_fds_are_closed_when_the_manifest_is_bad(pair):
    a, b = pair
    man = _manifest(3)
    bad = ShareManifest(
        "posix_fd", G, "GPU-test", 0, man.ranges, (BufferGrant("kv", 0, 0, 4 * G, G),)
    )  # span not backed
    pipes = [os.pipe() for _ in range(3)]
    try:
        before = _open_fds()
        send_share_message(a, bad, [w for _, w in pipes], timeout=5)
        with pytest.raises(BackingError, match="not fully backed"):
            recv_share_message(b, timeout=5)
        assert _open_fds() == before
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_deadline_peer_close_and_foreign_frames(pair):
    a, b = pair
    with pytest.raises(BackingError, match="timed out"):
        recv_share_message(b, timeout=0.2)  # nothing sent
    a.sendall(b"XXXX" + bytes(10))
    with pytest.raises(BackingError, match="magic"):
        recv_share_message(b, timeout=5)
    a.sendall(struct.pack("<4sHII", MAGIC, SHARE_VERSION + 1, 0, 0))
    with pytest.raises(BackingError, match="version"):
        recv_share_message(b, timeout=5)
    a.sendall(struct.pack("<4sHII", MAGIC, SHARE_VERSION, 100, 0) + b"{")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(BackingError, match="peer closed"):
        recv_share_message(b, timeout=5)
    with pytest.raises(InvalidArgument):
        recv_share_message(b, timeout=0)


def test_host_backing_cannot_be_exported():
    from kvxfer.pools.backing import BackedBuffers
    from kvxfer.pools.backing.share import export_buffers
    from kvxfer.pools.layout import per_layer_descs

    with BackedBuffers(
        per_layer_descs("k", 1, (64, 2, 16), 2, 1),
        store_dtype=torch.bfloat16,
        device="cpu",
        page_size=16,
        reserved_num_tokens=48,
    ) as owner:
        with pytest.raises(UnsupportedOperation, match="POSIX-FD"):
            export_buffers(owner)
    with pytest.raises(BackingError, match="closed"):
        export_buffers(owner)
