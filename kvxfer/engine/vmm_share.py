"""The device lane into CUDA VMM memory: what an engine offers same-host peers for its
registrations in VMM memory (``cuMemCreate``: the pools' post-capture backing, torch's
expandable segments), and the peer's fetch.

UCX reaches such memory only by emulated PUTs (the driver reports it not legacy-IPC capable,
:mod:`kvxfer.engine.ipc`), so a decode pool backed after graph capture would receive at a
small fraction of the copy rate. Its allocations can be exported as POSIX file descriptors
instead: a same-host peer maps them into its own address space and its device lane copies
into them exactly as into a legacy-IPC mapping (:class:`kvxfer.engine.devcopy.DeviceLane`).

Mechanics. The owner (:class:`VmmExporter`, one per engine, made at ``start()`` only when some
CUDA registration is VMM memory exportable as POSIX file descriptors) listens on an abstract
``AF_UNIX`` socket (no file; the kernel frees the name with the socket) served by one thread.
Each such region's Layout entry (``Layout.region_ipc``) is a :func:`pack_blob`: magic, the
region's index, the engine's token (32 random bytes) and the socket's name. The peer, after
the handshake, connects once per exporter and asks for the regions it wants
(:func:`fetch`); the owner checks the caller's uid (``SO_PEERCRED``) and the token, exports
one fd per extent of each region (:func:`kvxfer.kernels.cuda_driver.vmm_export`) and sends
them with a manifest (:mod:`kvxfer.pools.backing.share_wire`, ``SCM_RIGHTS``): per region
one range (its extents, relative to the first) and one buffer (the region inside it). The
peer maps them with :class:`kvxfer.pools.backing.share.ImportedBuffers`.

Invariants
- An unauthenticated party learns nothing: the token travels only in the Layout, which an
  engine sends after both sides proved the secret (:mod:`kvxfer.engine.handshake`), as the
  rkeys and legacy IPC handles do; a connection from another uid, with a wrong token, a
  malformed request or a region not offered is closed without a byte or an fd sent.
- The exported memory is what is mapped when the peer asks: a registration must stay mapped
  (no ``release_beyond`` / re-backing under it) while it is registered — the same rule as
  for its UCX registration.
- Every fd is closed on both sides once sent / imported, also on failure; the physical memory
  stays alive until both the owner and every importer released it.
- The serving threads never touch the engine's state: they read the immutable region table
  given at construction. One thread accepts, one per connection answers (bounded by
  :data:`SERVE_TIMEOUT_S`), at most :data:`MAX_CALLERS` at once (more are closed on
  arrival); :meth:`VmmExporter.close` stops accepting (bounded join).
- Importing this module imports no torch, UCX or driver; the driver calls are in
  :mod:`kvxfer.kernels.cuda_driver`, the wire format in :mod:`kvxfer.pools.backing.share_wire`
  (whose package imports torch: only on use).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import threading
from typing import (
    Any,
    Callable,
    Dict,
    Generator,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from kvxfer.errors import BackingError, KvxferError, ProtocolError

log = logging.getLogger(__name__)

#: the first bytes of a region's VMM blob (a legacy IPC blob is 72 bytes of handle + offset)
BLOB_MAGIC = b"KVXVMM1\0"
TOKEN_BYTES = 32
_BLOB = struct.Struct("<8sI32s")  # magic, region index, token; then the socket's name
#: an abstract socket's name is at most 107 bytes after its leading NUL
MAX_BLOB_BYTES = _BLOB.size + 108
_REQ = struct.Struct("<4s32sI")  # magic, token, region count; then one u32 per region
_REQ_MAGIC = b"KVXR"
#: regions one request may name (a pool registers a few hundred at most)
MAX_REQUEST_REGIONS = 1 << 16
#: how long the owner waits for a caller's request, and then for its share to go, seconds
SERVE_TIMEOUT_S = 10.0
#: connections answered at once; more are closed on arrival
MAX_CALLERS = 16

#: ``export(regions, which) -> (manifest, fd_of)``: :func:`export_regions` or a stand-in
Export = Callable[[Sequence[Tuple[int, int]], Sequence[int]], Tuple[Any, Callable[[int], int]]]
#: ``mapper(manifest, fds) -> imported``: maps a share as its fds arrive (the caller closes
#: each fd once the next is asked for); ``imported.tensors[k].data_ptr()`` is buffer k's
#: image, ``imported.close()`` unmaps. ``ImportedBuffers`` on the lane's device, or a stand-in
Mapper = Callable[[Any, Iterator[int]], Any]


def is_blob(blob: Union[bytes, bytearray]) -> bool:
    return bytes(blob[: len(BLOB_MAGIC)]) == BLOB_MAGIC


def pack_blob(region: int, token: bytes, name: bytes) -> bytes:
    return _BLOB.pack(BLOB_MAGIC, region, token) + name


def unpack_blob(blob: bytes) -> Tuple[int, bytes, bytes]:
    """``(region index, token, socket name)``; ProtocolError for a malformed blob."""
    blob = bytes(blob)
    if not is_blob(blob) or not _BLOB.size < len(blob) <= MAX_BLOB_BYTES:
        raise ProtocolError(f"layout: a VMM region blob of {len(blob)} bytes is malformed")
    _, region, token = _BLOB.unpack_from(blob)
    name = blob[_BLOB.size :]
    if name[:1] != b"\0":
        raise ProtocolError("layout: a VMM region blob names no abstract socket")
    return region, token, name


def export_regions(
    regions: Sequence[Tuple[int, int]], which: Sequence[int]
) -> Tuple[object, Callable[[int], int]]:
    """The share of regions ``which`` of ``regions`` (``(addr, length)`` each): a manifest
    with one range and one buffer per region (in ``which`` order), and ``fd_of(k)``, which
    exports extent ``k``'s fd when its batch is sent (:func:`~kvxfer.pools.backing.
    share_wire.send_share_stream` closes it). Raises KvxferError when a region is no longer
    exportable VMM memory."""
    from kvxfer.kernels import cuda_driver
    from kvxfer.pools.backing.share_wire import BufferGrant, RangeGrant, ShareManifest

    ranges, buffers, bases, grans = [], [], [], []
    for k, i in enumerate(which):
        addr, length = regions[i]
        found = cuda_driver.vmm_extents(addr, length)
        if found is None:
            raise BackingError(f"region {i} is no longer exportable VMM memory")
        extents, gran = found
        first = extents[0][0]
        bases += [base for base, _ in extents]
        end = extents[-1][0] + extents[-1][1]
        ranges.append(RangeGrant(end - first, tuple((b - first, n) for b, n in extents)))
        buffers.append(BufferGrant(f"region {i}", k, addr - first, length, 1))
        grans.append(gran)
    manifest = ShareManifest("posix_fd", min(grans), "", 0, tuple(ranges), tuple(buffers))
    return manifest, lambda k: cuda_driver.vmm_export(bases[k])


class VmmExporter:
    """Offers this engine's VMM regions ``offered`` (indices into ``regions``, ``(addr,
    length)`` each) to same-host peers; see the module docstring. ``export``: builds a share
    (:func:`export_regions`; tests pass a stand-in). Runs on: its own threads ("kvxfer-vmm")."""

    def __init__(
        self,
        regions: Sequence[Tuple[int, int]],
        offered: Sequence[int],
        export: Export = export_regions,
        timeout: float = SERVE_TIMEOUT_S,
        max_callers: int = MAX_CALLERS,
    ) -> None:
        self._regions = tuple((int(a), int(n)) for a, n in regions)
        self._offered = frozenset(int(i) for i in offered)
        self._export, self._timeout = export, timeout
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.served = 0  # shares sent
        self.refused = 0  # connections closed without one
        self._count = threading.Condition()
        self._callers = threading.BoundedSemaphore(max_callers)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(b"\0kvxfer-vmm-" + secrets.token_hex(12).encode())
            self._sock.listen(16)
        except BaseException:
            self._sock.close()
            raise
        self.name: bytes = self._sock.getsockname()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kvxfer-vmm", daemon=True)
        self._thread.start()

    def offers(self, region: int) -> bool:
        return region in self._offered

    def blob(self, region: int) -> bytes:
        """Region ``region``'s Layout entry."""
        assert region in self._offered
        return pack_blob(region, self.token, self.name)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            if not self._callers.acquire(blocking=False):  # a flood: no thread per attempt
                with self._count:
                    self.refused += 1
                    self._count.notify_all()
                conn.close()
                continue
            # one thread per connection: a caller that stalls holds up no other
            threading.Thread(target=self._one, args=(conn,), name="kvxfer-vmm", daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        ok = False
        with conn:
            try:
                ok = self._answer(conn)
            except (OSError, KvxferError) as exc:
                log.info("VMM share: a request failed: %s", exc)
            except Exception:  # noqa: BLE001 - report, never kill the process
                log.exception("VMM share: a request failed")
            with self._count:  # (counted before the caller sees the connection end)
                if ok:
                    self.served += 1
                else:
                    self.refused += 1
                self._count.notify_all()
            self._callers.release()

    def _answer(self, conn: socket.socket) -> bool:
        from kvxfer.pools.backing.share_wire import Deadline, recv_exact, send_share_stream

        deadline = Deadline(self._timeout)  # the whole answer: a trickling caller gains nothing
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.geteuid():
            log.warning("VMM share: refused a connection from uid %d", uid)
            return False
        head = recv_exact(conn, _REQ.size, deadline, "request")
        magic, token, count = _REQ.unpack(head)
        if magic != _REQ_MAGIC or not hmac.compare_digest(token, self.token):
            log.warning("VMM share: refused a request without this engine's token")
            return False
        if not 0 < count <= MAX_REQUEST_REGIONS:
            return False
        which = struct.unpack(f"<{count}I", recv_exact(conn, 4 * count, deadline, "regions"))
        if len(set(which)) != count or not set(which) <= self._offered:
            return False
        manifest, fd_of = self._export(self._regions, which)
        send_share_stream(conn, manifest, fd_of, self._timeout)  # (closes every fd)
        return True

    def wait_answered(self, n: int, timeout: float) -> bool:
        """Whether ``n`` connections were answered (served or refused, their fds closed)
        within ``timeout`` seconds (tests, diagnostics)."""
        with self._count:
            return self._count.wait_for(lambda: self.served + self.refused >= n, timeout)

    def close(self) -> None:
        """Stop serving (a request being answered ends within its timeout); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._sock.close()
        if self._thread is not threading.current_thread():
            self._thread.join(self._timeout + 1.0)


def fetch(
    name: bytes,
    token: bytes,
    regions: Sequence[int],
    lens: Sequence[int],
    mapper: Mapper,
    timeout: float,
) -> Any:
    """Ask the exporter at ``name`` for ``regions`` (its indices; ``lens``: every region's
    length in its Layout) and map the share with ``mapper`` while its fds arrive, each
    closed once mapped: however many extents the share has, at most one batch of fds is
    open here at once. Returns what ``mapper`` made (one buffer per region, in order).
    Raises BackingError (refused, closed, timed out, malformed, a buffer shorter than its
    region: the lane must never copy past what it mapped). Blocking: run it off the loop."""
    from kvxfer.pools.backing.share_wire import recv_share_stream

    req = _REQ.pack(_REQ_MAGIC, token, len(regions)) + struct.pack(f"<{len(regions)}I", *regions)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(name)
            s.sendall(req)
        except OSError as exc:
            raise BackingError(f"VMM share: connecting to the exporter failed: {exc}") from None
        manifest, stream = recv_share_stream(s, timeout)
        fds = _closing(stream)
        try:
            if len(manifest.buffers) != len(regions) or len(manifest.ranges) != len(regions):
                raise BackingError(
                    f"VMM share: asked for {len(regions)} regions, got {len(manifest.buffers)}"
                )
            short = [i for i, b in zip(regions, manifest.buffers) if b.span_bytes < int(lens[i])]
            if short:
                raise BackingError(
                    f"VMM share: the share maps less than the lengths of regions {short}"
                )
            imported = mapper(manifest, fds)
        finally:
            fds.close()  # (the last fd given out, and any not given out)
            stream.close()
        try:  # the exporter ends the exchange (after counting it): nothing may follow
            trailing = s.recv(1)
        except OSError as exc:
            trailing = str(exc).encode()
        if trailing:
            imported.close()
            raise BackingError("VMM share: the exporter sent more than one share")
    return imported


def _closing(stream: Iterator[int]) -> Generator[int, None, None]:
    """``stream``'s fds, each closed once the consumer asks for the next (or closes this)."""
    for fd in stream:
        try:
            yield fd
        finally:
            try:
                os.close(fd)
            except OSError:
                pass


def offers(blobs: Sequence[bytes]) -> Dict[Tuple[bytes, bytes], List[int]]:
    """``{(socket name, token): [region, ...]}`` of the VMM blobs among a peer's region
    entries (``blobs[i]`` is region ``i``'s); ProtocolError when a blob is malformed or
    names another region than its own."""
    out: Dict[Tuple[bytes, bytes], List[int]] = {}
    for i, b in enumerate(blobs):
        if not is_blob(b):
            continue
        region, token, name = unpack_blob(b)
        if region != i:
            raise ProtocolError(f"layout: region {i}'s VMM blob names region {region}")
        out.setdefault((name, token), []).append(i)
    return out


Share = Tuple[List[int], Any]  # (regions, what the mapper made of them)


def fetch_all(
    blobs: Sequence[bytes], lens: Sequence[int], mapper: Mapper, timeout: float
) -> List[Share]:
    """Every exporter's share of the VMM regions among ``blobs`` (a peer's region entries;
    ``lens``: the regions' lengths in its Layout), mapped (:func:`fetch`); an exporter that
    fails is logged and left out (its regions stay on UCX). Blocking."""
    out: List[Share] = []
    for (name, token), regions in offers(blobs).items():
        try:
            out.append((regions, fetch(name, token, regions, lens, mapper, timeout)))
        except KvxferError as exc:  # (loud: UCX's emulated PUTs are < 1 GB/s)
            log.warning("VMM share: regions %s stay on UCX's emulated PUTs: %s", regions, exc)
    return out


def close_shares(shares: Optional[Sequence[Share]]) -> None:
    """Unmap shares not (or no longer) needed; idempotent (a mapper's ``close`` is)."""
    for _, imported in shares or ():
        try:
            imported.close()
        except Exception as exc:  # noqa: BLE001 - keep unmapping the rest
            log.warning("VMM share: unmapping a share: %s", exc)
