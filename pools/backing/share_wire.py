"""The share message: a manifest of a VMM-backed pool's memory plus its POSIX file descriptors,
passed over a connected ``AF_UNIX`` stream socket with ``SCM_RIGHTS``. Torch-free, CUDA-free.

Frame (all integers little-endian)::

    header   b"KVXS" | u16 version | u32 manifest_bytes | u32 num_fds
    manifest JSON object (see :func:`validate_manifest`)
    batches  ceil(num_fds / MAX_FDS_PER_MSG) times: u32 count, sent with ``count`` fds attached

The manifest describes, per reserved range of the exporter, its size and its backed extents
``[offset, nbytes]`` (one fd per extent, in manifest order over all ranges), and per pool
buffer which range it lives in, at what offset, its backed span and its item (page) size.
Everything is validated before anything is mapped: ranges and extents granularity-aligned,
extents sorted, disjoint and inside their range, every buffer span fully backed, one fd per
extent. A malformed frame raises :class:`BackingError`; fds already received are closed.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional

from kvxfer.kernels.errors import BackingError, InvalidArgument

from .base import subtract_ranges

__all__ = [
    "SHARE_VERSION",
    "ShareManifest",
    "RangeGrant",
    "BufferGrant",
    "send_share_message",
    "send_share_stream",
    "recv_share_message",
    "recv_share_stream",
    "validate_manifest",
]

SHARE_VERSION = 1
MAGIC = b"KVXS"
_HEADER = struct.Struct("<4sHII")
_COUNT = struct.Struct("<I")
#: fds attached to one sendmsg (the kernel's SCM_MAX_FD is 253)
MAX_FDS_PER_MSG = 64
MAX_MANIFEST_BYTES = 4 << 20
MAX_FDS = 1 << 16


@dataclass(frozen=True)
class RangeGrant:
    """One reserved range of the exporter: its size and backed extents ``(offset, nbytes)``."""

    reserved_bytes: int
    extents: tuple


@dataclass(frozen=True)
class BufferGrant:
    """One pool buffer: ``[offset, offset + span_bytes)`` of range ``range`` is backed."""

    name: str
    range: int
    offset: int
    span_bytes: int
    item_bytes: int


@dataclass(frozen=True)
class ShareManifest:
    handle_type: str
    granularity: int
    device_uuid: str
    generation: int
    ranges: tuple
    buffers: tuple

    @property
    def num_extents(self) -> int:
        return sum(len(r.extents) for r in self.ranges)

    def to_json(self) -> dict:
        return {
            "version": SHARE_VERSION,
            "handle_type": self.handle_type,
            "granularity": self.granularity,
            "device_uuid": self.device_uuid,
            "generation": self.generation,
            "ranges": [
                {"reserved_bytes": r.reserved_bytes, "extents": [list(e) for e in r.extents]}
                for r in self.ranges
            ],
            "buffers": [
                {
                    "name": b.name,
                    "range": b.range,
                    "offset": b.offset,
                    "span_bytes": b.span_bytes,
                    "item_bytes": b.item_bytes,
                }
                for b in self.buffers
            ],
        }


def _bad(msg: str) -> BackingError:
    return BackingError(f"malformed share manifest: {msg}")


def _int(obj: dict, key: str, minimum: int = 0) -> int:
    v = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _bad(f"{key} must be an int >= {minimum}, got {v!r}")
    return v


def _fields(obj: Any, what: str, allowed: set) -> dict:
    if not isinstance(obj, dict):
        raise _bad(f"{what} must be an object, got {type(obj).__name__}")
    extra = set(obj) - allowed
    if extra:
        raise _bad(f"{what} has unknown fields {sorted(extra)}")
    return obj


def validate_manifest(raw: Any, num_fds: int) -> ShareManifest:
    """Check a decoded manifest against the invariants in the module docstring."""
    m = _fields(
        raw,
        "manifest",
        {"version", "handle_type", "granularity", "device_uuid", "generation", "ranges", "buffers"},
    )
    if m.get("version") != SHARE_VERSION:
        raise _bad(f"version {m.get('version')!r}, this side speaks {SHARE_VERSION}")
    if m.get("handle_type") != "posix_fd":
        raise _bad(f"handle_type {m.get('handle_type')!r}, only 'posix_fd' can be imported")
    g = _int(m, "granularity", 1)
    gen = _int(m, "generation")
    uuid = m.get("device_uuid")
    if not isinstance(uuid, str):
        raise _bad(f"device_uuid must be a string, got {uuid!r}")
    if not isinstance(m.get("ranges"), list) or not isinstance(m.get("buffers"), list):
        raise _bad("ranges and buffers must be lists")
    ranges = []
    for i, r in enumerate(m["ranges"]):
        r = _fields(r, f"ranges[{i}]", {"reserved_bytes", "extents"})
        size = _int(r, "reserved_bytes", 1)
        if size % g:
            raise _bad(f"ranges[{i}].reserved_bytes={size} is not a multiple of {g}")
        exts, end = [], 0
        for e in r.get("extents") if isinstance(r.get("extents"), list) else [None]:
            if (
                not isinstance(e, list)
                or len(e) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in e)
            ):
                raise _bad(f"ranges[{i}].extents entries must be [offset, nbytes], got {e!r}")
            off, n = e
            if off < end or n <= 0 or off % g or n % g or off + n > size:
                raise _bad(
                    f"ranges[{i}] extent {e} is unaligned, overlapping, unsorted or "
                    f"outside [0, {size})"
                )
            exts.append((off, n))
            end = off + n
        ranges.append(RangeGrant(size, tuple(exts)))
    buffers = []
    for i, b in enumerate(m["buffers"]):
        b = _fields(b, f"buffers[{i}]", {"name", "range", "offset", "span_bytes", "item_bytes"})
        name = b.get("name")
        if not isinstance(name, str):
            raise _bad(f"buffers[{i}].name must be a string")
        ri, off = _int(b, "range"), _int(b, "offset")
        span, item = _int(b, "span_bytes", 1), _int(b, "item_bytes", 1)
        if ri >= len(ranges):
            raise _bad(f"buffers[{i}].range={ri} but there are {len(ranges)} ranges")
        if off + span > ranges[ri].reserved_bytes:
            raise _bad(f"buffers[{i}] [{off}, {off + span}) exceeds range {ri}")
        if subtract_ranges(off, off + span, list(ranges[ri].extents)):
            raise _bad(f"buffers[{i}] span [{off}, {off + span}) is not fully backed")
        buffers.append(BufferGrant(name, ri, off, span, item))
    man = ShareManifest("posix_fd", g, uuid, gen, tuple(ranges), tuple(buffers))
    if man.num_extents != num_fds:
        raise _bad(f"{man.num_extents} extents but {num_fds} file descriptors")
    return man


# -- framing --------------------------------------------------------------------------------
class Deadline:
    """One bound for a whole exchange: each socket call gets what is left of it."""

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.end = time.monotonic() + self.timeout

    def arm(self, sock: socket.socket) -> None:
        left = self.end - time.monotonic()
        if left <= 0:
            raise BackingError(f"share exchange timed out after {self.timeout:.1f} s")
        sock.settimeout(left)


def _io(fn, deadline: Deadline, sock: socket.socket, what: str):
    deadline.arm(sock)
    try:
        return fn()
    except socket.timeout:
        raise BackingError(
            f"share exchange timed out after {deadline.timeout:.1f} s ({what})"
        ) from None
    except OSError as exc:
        raise BackingError(f"share exchange failed ({what}): {exc}") from exc


def recv_exact(sock: socket.socket, n: int, deadline: Deadline, what: str) -> bytes:
    """Exactly ``n`` bytes within ``deadline``; BackingError when the peer closes first or
    time runs out (``what`` names the step)."""
    buf = b""
    while len(buf) < n:
        chunk = _io(functools.partial(sock.recv, n - len(buf)), deadline, sock, what)
        if not chunk:
            raise BackingError(
                f"peer closed the share socket ({what}: got {len(buf)} of {n} bytes)"
            )
        buf += chunk
    return buf


def send_share_message(
    sock: socket.socket, manifest: ShareManifest, fds: list, timeout: float = 30.0
) -> None:
    """Send ``manifest`` and ``fds`` (one per extent, manifest order). The caller keeps
    ownership of ``fds`` (the receiver gets duplicates)."""
    if manifest.num_extents != len(fds):
        raise InvalidArgument(f"{manifest.num_extents} extents but {len(fds)} fds")
    send_share_stream(sock, manifest, lambda k: int(fds[k]), timeout, close=False)


def send_share_stream(
    sock: socket.socket,
    manifest: ShareManifest,
    fd_of: Callable[[int], int],
    timeout: float = 30.0,
    close: bool = True,
) -> None:
    """Send ``manifest`` and extent ``k``'s fd ``fd_of(k)``, asked for batch by batch just
    before the batch goes (with ``close``, each batch's fds are closed once sent, also on
    failure): at most :data:`MAX_FDS_PER_MSG` of them are open at once here, however many
    extents the share has."""
    deadline = Deadline(timeout)
    n = manifest.num_extents
    payload = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
    if len(payload) > MAX_MANIFEST_BYTES or n > MAX_FDS:
        raise InvalidArgument(f"share too large: {len(payload)} manifest bytes, {n} fds")
    frame = _HEADER.pack(MAGIC, SHARE_VERSION, len(payload), n) + payload
    _io(functools.partial(sock.sendall, frame), deadline, sock, "manifest")
    for lo in range(0, n, MAX_FDS_PER_MSG):
        batch: list = []
        try:
            for k in range(lo, min(n, lo + MAX_FDS_PER_MSG)):
                batch.append(fd_of(k))
            count = _COUNT.pack(len(batch))
            sent = _io(
                functools.partial(socket.send_fds, sock, [count], batch), deadline, sock, "fds"
            )
            if sent < len(count):
                _io(functools.partial(sock.sendall, count[sent:]), deadline, sock, "fds")
        finally:
            if close:
                close_fds(batch)


def recv_share_message(sock: socket.socket, timeout: float = 30.0) -> tuple[ShareManifest, list]:
    """Receive one share message; returns the validated manifest and the received fds, which
    the caller owns (and must close). On any error every received fd is closed."""
    manifest, stream = recv_share_stream(sock, timeout)
    fds: list = []
    try:
        for fd in stream:
            fds.append(fd)
        return manifest, fds
    except BaseException:
        close_fds(fds)
        raise
    finally:
        stream.close()


def recv_share_stream(
    sock: socket.socket, timeout: float = 30.0
) -> tuple[ShareManifest, Generator[int, None, None]]:
    """Receive one share message's manifest (validated against the announced fd count), and
    a generator of its fds in manifest order, received batch by batch as it is iterated
    (within the same deadline). The consumer owns each fd it was given; fds received but not
    yet given out are closed when the generator is closed or fails (close it: a consumer that
    stops early must). Raises :class:`BackingError` as :func:`recv_share_message`."""
    deadline = Deadline(timeout)
    magic, version, nbytes, nfds = _HEADER.unpack(
        recv_exact(sock, _HEADER.size, deadline, "header")
    )
    if magic != MAGIC:
        raise BackingError(f"not a kvxfer share message (magic {magic!r})")
    if version != SHARE_VERSION:
        raise BackingError(f"share message version {version}, this side speaks {SHARE_VERSION}")
    if nbytes > MAX_MANIFEST_BYTES or nfds > MAX_FDS:
        raise BackingError(f"share message too large: {nbytes} manifest bytes, {nfds} fds")
    try:
        raw = json.loads(recv_exact(sock, nbytes, deadline, "manifest"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"not JSON: {exc}") from None
    manifest = validate_manifest(raw, nfds)

    def fds() -> Generator[int, None, None]:
        done = 0
        while done < nfds:
            want = min(MAX_FDS_PER_MSG, nfds - done)
            data, got, flags, _ = _io(
                functools.partial(socket.recv_fds, sock, _COUNT.size, want), deadline, sock, "fds"
            )
            pending = list(got)
            try:
                if flags & getattr(socket, "MSG_CTRUNC", 0):
                    raise BackingError(
                        "file descriptors were truncated in transit (RLIMIT_NOFILE reached?)"
                    )
                if not data:
                    raise BackingError(
                        f"peer closed the share socket after {done + len(got)} of {nfds} fds"
                    )
                data += recv_exact(sock, _COUNT.size - len(data), deadline, "fds")
                (count,) = _COUNT.unpack(data)
                if count != len(got) or count != want:
                    raise BackingError(
                        f"fd batch announced {count} fds, {len(got)} arrived ({want} expected)"
                    )
                while pending:
                    fd = pending.pop(0)
                    done += 1
                    yield fd
            finally:  # not given out: ours to close
                close_fds(pending)

    return manifest, fds()


def close_fds(fds: Optional[list]) -> None:
    """Close every fd in ``fds`` (errors ignored: teardown)."""
    for fd in fds or []:
        try:
            os.close(fd)
        except OSError:
            pass
