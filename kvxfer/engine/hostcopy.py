"""Host lane: same-host host-memory writes of many runs as a few ``process_vm_writev`` calls.

Over UCX's cma lane every run of a write is one PUT, and cma copies each PUT with one
``process_vm_writev`` system call, so a write of thousands of small runs (head slices of
heterogeneous TP, scattered pages) pays the call's fixed cost per run: 16000 runs of 8 KiB
took 2.4× the time of the same bytes in 10 runs (bench/results/host-lane-cpu.md). UCP's
``ucp_put_nbx`` takes contiguous buffers only. When both engines share a host, this lane
hands the runs to the kernel up to :data:`IOV_BATCH` iovecs per side at a time (one call
copies them all; runs adjacent on one side are one iovec: :func:`calls`).

Invariants
- A lane exists only to a peer that offered it in its Layout (:class:`Offer`: its pid, its pid
  namespace, and the address of a buffer of its memory holding the nonce *this* side sent
  in the handshake; the Layout travels only after both sides proved the secret), on this
  host (same hostname and pid namespace), with ``EngineConfig.host_copy == "auto"`` and
  host registrations on this side, and only once this process read its own nonce back from
  that pid at that address (:func:`verify`, ``process_vm_readv``, during the handshake):
  the pid is the process this handshake talks to, not a stranger's or a reused one (no
  other process holds this handshake's fresh nonce). A pidfd of the peer, opened before the
  check, is asked before every call whether the process is still the same (a reused pid
  fails it), so bytes never go to another process (short of a pid reused between that
  question and the call, microseconds later).
- A write uses the lane from ``host_min_ops`` runs up (:func:`lane_wanted`), for the runs
  whose local registration is host memory and whose remote region is host memory
  (:meth:`HostLane.select`); every run was validated by the planner against the peer's
  descriptors and is checked again here against its remote region before anything moves.
  A PatternWrite (heterogeneous TP's head slices) comes as its pattern, item ids and
  descriptors (:meth:`HostLane.start_patterns`): the planner validated the ids and the runs
  inside the items, each remote descriptor is checked here against its region, and each
  descriptor's runs are expanded on the copying thread, never the whole write's at once.
- A call's local runs are either its local iovecs or, packed (:data:`PACK_RUN_BYTES`), first
  copied back to back into the copying thread's buffer by :func:`_gather`: read in this
  process, as a PUT's source is, inside registrations the planner checked; the bytes that
  reach the peer are the same stream either way (:func:`calls`).
- The bytes are in the peer's memory when the job's future resolves; only then does the
  write flush / notify, exactly as after PUTs. A job that failed (the peer exited: PeerClosed;
  an address not mapped, a permission refused: TransportError) may have copied a prefix of
  its runs, as a failed PUT batch may have.
- :meth:`HostLane.close` stops jobs between calls and waits (bounded) until none runs: after
  it, nothing of this lane writes into the peer.
- Where it runs: :meth:`HostLane.start` and the future's resolution on the engine's loop
  thread (or a guest of it); a write of at most :data:`INLINE_BYTES` is copied right there
  (less time than a hand-over), larger ones on the process's host-lane threads
  (``kvxfer-host-lane``, at most :data:`MAX_THREADS`, made at first use), so the loop never
  blocks on a large copy; a large one is cut into parts at run boundaries, one per thread
  (:data:`SPLIT_BYTES`), and its future resolves only once every part ended, also when
  one failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno as errno_mod
import functools
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from kvxfer.config import (
    host_pack_bytes,
    host_patterns,
    host_split_bytes,
    host_split_parts,
    usable_cpus,
)
from kvxfer.engine.devcopy import check_inside, member
from kvxfer.errors import PeerClosed, ProtocolError, TransportError

log = logging.getLogger(__name__)
_U64 = np.uint64

#: runs handed to the kernel per ``process_vm_writev`` (Linux's IOV_MAX)
IOV_BATCH = 1024
#: at most this many bytes per call (unless one run is larger): a closing lane stops its
#: writes between calls, so this bounds how long a close waits
BATCH_BYTES = 64 << 20
#: host-lane threads per process (fewer on a host of fewer CPUs)
MAX_THREADS = 4
#: a write of at most this many bytes is copied on the thread that starts it (the loop's, or
#: a guest's): its copy takes less than handing it to a host-lane thread and back
#: (bench/results/host-lane-cpu.md)
INLINE_BYTES = 1 << 20
#: a larger write (copied on a host-lane thread) takes the lane from this many runs,
#: whatever their length: over cma each run is a system call, each iovec costs the kernel
#: ~1 µs, a hand-over ~0.1-0.3 ms; measured by runs x bytes per run (32 KiB-256 KiB runs:
#: 0.78-0.99x the PUTs' time from 256 runs, 1.03-1.40x below; bench/results/host-lane-cpu.md,
#: "Long runs")
THREAD_MIN_OPS = 256
#: a write whose local side is many short pieces (at most this long on average, and at least
#: twice as many as the remote side's: head slices of a strided source going to whole
#: destination pages) is packed first: its runs are copied back to back into a buffer of
#: the copying thread (:func:`_gather`, one memcpy per run in native code) that then goes
#: as one local iovec per call, rather than one local iovec per run for the kernel to walk
#: (measured both ways by run size: bench/results/host-lane-cpu.md, "Packed local runs").
#: ``$KVXFER_HOST_PACK_BYTES`` (read at import: :func:`kvxfer.config.host_pack_bytes`) sets
#: it; 0: never pack
PACK_RUN_BYTES = host_pack_bytes()
#: the packing buffer of each thread that packs (at most this many bytes per call then)
BOUNCE_BYTES = 2 << 20
#: a write handed to the host-lane threads is cut at run boundaries into parts of at least
#: this many bytes, at most one per thread (:func:`split_parts`), copied at once: one
#: thread's copy (packing included) is what bounds a large write where cores are spare
#: (bench/results/host-lane-cpu.md, "Parts on several threads").
#: ``$KVXFER_HOST_SPLIT_BYTES`` (read at import: :func:`kvxfer.config.host_split_bytes`)
#: sets it; 0: never cut
SPLIT_BYTES = host_split_bytes()
#: at most this many parts (``$KVXFER_HOST_SPLIT_PARTS``); 0: :func:`split_parts` chooses
SPLIT_PARTS = host_split_parts()
#: PatternWrites are copied from their patterns (:meth:`HostLane.start_patterns`), not
#: expanded into runs by the planner first (``$KVXFER_HOST_PATTERNS``, read at import)
PATTERNS = host_patterns()


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_calls():
    """``(process_vm_readv, process_vm_writev)`` through ctypes (the GIL is released for the
    call), or None where the C library has none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        calls = (libc.process_vm_readv, libc.process_vm_writev)
    except (OSError, AttributeError):
        return None
    for fn in calls:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
    return calls


_CALLS = _libc_calls()
_pool_lock = threading.Lock()
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_pid = 0


@functools.lru_cache(maxsize=None)
def _cpus() -> int:
    """The CPUs this process may run on (asked once)."""
    return usable_cpus()


def thread_count() -> int:
    """How many host-lane threads this process has: :data:`MAX_THREADS`, fewer where it
    may run on fewer CPUs."""
    return max(1, min(MAX_THREADS, _cpus()))


def split_parts() -> int:
    """Into how many parts a large write may be cut (:data:`SPLIT_BYTES`): :data:`SPLIT_PARTS`
    where set, else one per host-lane thread, at most half the CPUs (the peer, and other
    ranks of this host, copy too: on two CPUs cutting made many-to-one rows 8-30 % slower;
    host-lane-cpu.md)."""
    if SPLIT_PARTS:
        return SPLIT_PARTS
    return max(1, min(thread_count(), _cpus() // 2))


def _threads() -> concurrent.futures.ThreadPoolExecutor:
    """The process's host-lane threads (made at first use; again in a forked child, where
    the parent's threads do not exist)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            n = thread_count()
            _pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="kvxfer-host-lane")
            _pool_pid = os.getpid()
        return _pool


class Call(NamedTuple):
    """One ``process_vm_writev`` of runs ``[first, end)``: ``liov`` its local iovecs, or None
    when the runs are to be packed first (:func:`_gather`) and go as one local iovec."""

    first: int
    end: int
    liov: Optional[np.ndarray]
    riov: np.ndarray
    nbytes: int


def calls(
    laddr: np.ndarray,
    raddr: np.ndarray,
    nbytes: np.ndarray,
    max_iov: int = IOV_BATCH,
    max_bytes: int = BATCH_BYTES,
    pack: Optional[bool] = None,
    bounce: int = BOUNCE_BYTES,
) -> List[Call]:
    """The ``process_vm_writev`` calls copying runs ``laddr[i] -> raddr[i]`` of ``nbytes[i]``
    (in order), each iovec array ``(k, 2)`` uint64 rows ``(address, length)``. A call copies
    its local iovecs' bytes, as one stream, into its remote iovecs'; so runs adjacent on one
    side are one iovec of that side whatever the other side does (head slices of
    heterogeneous TP: strided on one side, contiguous on the other), and a call covers whole
    runs, at most ``max_iov`` iovecs on each side and ``max_bytes`` bytes (a run longer than
    that is a call of its own).

    ``pack``: the local runs are packed into a buffer of ``bounce`` bytes before each call
    (None: when :data:`PACK_RUN_BYTES` says so); then only the remote side counts iovecs,
    a call carries at most ``bounce`` bytes, and its ``liov`` is None, except for a single
    run longer than ``bounce`` (its own local iovec)."""
    n = int(nbytes.size)
    if n == 0:
        return []
    la, ra = laddr.astype(_U64, copy=False), raddr.astype(_U64, copy=False)
    nb = nbytes.astype(_U64, copy=False)
    lbreak = np.ones(n, dtype=bool)
    rbreak = np.ones(n, dtype=bool)
    lbreak[1:] = la[1:] != la[:-1] + nb[:-1]
    rbreak[1:] = ra[1:] != ra[:-1] + nb[:-1]
    lcum, rcum = np.cumsum(lbreak), np.cumsum(rbreak)  # segments up to and including run i
    bcum = np.cumsum(nb, dtype=_U64)
    if pack is None:
        lsegs, rsegs = int(lcum[-1]), int(rcum[-1])
        pack = lsegs >= 2 * rsegs and int(bcum[-1]) <= lsegs * PACK_RUN_BYTES
    if pack:
        max_bytes = min(max_bytes, bounce)
    out: List[Call] = []
    s = 0
    while s < n:
        before = int(bcum[s - 1]) if s else 0
        # (keys of the arrays' own dtypes: a mixed one makes searchsorted convert the array)
        e = min(
            n if pack else int(np.searchsorted(lcum, lcum[s] + (max_iov - 1), side="right")),
            int(np.searchsorted(rcum, rcum[s] + (max_iov - 1), side="right")),
            int(np.searchsorted(bcum, _U64(before + max_bytes), side="right")),
        )
        e = max(e, s + 1)
        packed = pack and (e > s + 1 or int(nb[s]) <= bounce)
        liov = None if packed else _segments(la, bcum, lbreak, s, e)
        out.append(Call(s, e, liov, _segments(ra, bcum, rbreak, s, e), int(bcum[e - 1]) - before))
        s = e
    return out


def may_cut() -> bool:
    """Whether this process cuts large writes into parts at all."""
    return SPLIT_BYTES > 0 and split_parts() > 1


def cut_worth(nbytes: int) -> bool:
    """Whether a write of ``nbytes`` is cut into several parts (:func:`split_points`)."""
    return nbytes >= 2 * SPLIT_BYTES and may_cut()


def split_points(
    nbytes: np.ndarray, parts: int, min_bytes: int, total: Optional[int] = None
) -> np.ndarray:
    """Run indices ``[0, c1, ..., n]`` cutting a write of runs of ``nbytes`` (``total``
    bytes, summed here when not given) into at most ``parts`` parts of about equal bytes,
    at most ``total // min_bytes`` of them: each cut at the run boundary nearest to
    ``i * total / k`` (a run is never cut, so parts can be uneven and fewer); ``[0, n]``
    when it is not cut (``parts`` or ``min_bytes`` below 2 / 1, or too few bytes). Every
    part is non-empty and the parts keep the runs' order."""
    n = int(nbytes.size)
    if parts <= 1 or min_bytes <= 0 or n <= 1:  # (no pass over the runs)
        return np.array([0, n], dtype=np.int64)
    if total is None:
        total = int(nbytes.sum(dtype=_U64))
    k = min(parts, total // min_bytes, n)
    if k <= 1:
        return np.array([0, n], dtype=np.int64)
    cum = np.cumsum(nbytes, dtype=np.int64)
    targets = total * np.arange(1, k, dtype=np.int64) // k
    held = np.searchsorted(cum, targets, side="left")  # the run holding each target
    before = np.where(held > 0, cum[np.maximum(held - 1, 0)], 0)
    cuts = np.where(targets - before <= cum[held] - targets, held, held + 1)  # nearer edge
    inner = np.unique(cuts[(cuts > 0) & (cuts < n)])
    return np.concatenate(([0], inner, [n])).astype(np.int64)


def _segments(addr: np.ndarray, bcum: np.ndarray, brk: np.ndarray, s: int, e: int) -> np.ndarray:
    """The iovecs of runs ``[s, e)`` of one side: a new one where a run does not continue the
    previous one (``brk``), each as long as its runs together."""
    starts = np.flatnonzero(brk[s + 1 : e]) + (s + 1)
    starts = np.concatenate(([s], starts))
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = e
    first = bcum[np.maximum(starts - 1, 0)]  # bytes before each segment's first run
    first[starts == 0] = 0
    iov = np.empty((starts.size, 2), dtype=_U64)
    iov[:, 0] = addr[starts]
    iov[:, 1] = bcum[ends - 1] - first
    return iov


def lands_whole(sides) -> bool:
    """Whether one side's item-relative runs ``[(offs, lens)]`` (per descriptor) follow each
    other in every item: they then merge into one segment per item and descriptor, which
    the lane writes as few long iovecs. Where the *destination* side does not (many-to-one
    head slices: each item gets a strided share), the kernel takes each short remote iovec
    separately, and staging (decode scatters its own pages) is faster on host memory
    (bench/results/host-lane-cpu.md)."""
    for offs, lens in sides:
        o, n = np.asarray(offs, dtype=np.int64), np.asarray(lens, dtype=np.int64)
        if o.size > 1 and not bool(np.all(o[1:] == o[:-1] + n[:-1])):
            return False
    return True


def _pid_ns() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``), 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


#: UCX transports that copy host memory between processes of one host directly (a PUT is
#: one copy); without one (error mode "peer": tcp) every byte goes through sockets
SHM_LANES = ("cma", "knem", "xpmem", "posix", "sysv")


def lane_wanted(ops: int, nbytes: int, min_ops: int, shm: bool = True) -> bool:
    """Whether a write of ``ops`` direct runs of ``nbytes`` bytes in all should take the host
    lane (where it is open): from ``min_ops`` runs up (fewer are as fast as PUTs, and a
    write that ends on its starter's stack keeps coalescing from batching small requests)
    when it is copied inline (at most :data:`INLINE_BYTES`); a larger one, handed to a
    thread, from :data:`THREAD_MIN_OPS` runs up, whatever their length (fewer gain less than
    the hand-over costs). Without a shared-memory UCX lane (``shm`` False: tcp) any write
    larger than :data:`INLINE_BYTES`, whatever its runs, and on a host of spare CPUs any
    write the threads copy in parts (:func:`cut_worth`), whatever its runs
    (bench/results/host-lane-cpu.md)."""
    if ops <= 0:
        return False
    if (not shm and nbytes > INLINE_BYTES) or cut_worth(nbytes):
        return True
    return ops >= min_ops and (nbytes <= INLINE_BYTES or ops >= THREAD_MIN_OPS)


class Offer:
    """This side's offer in one handshake (``Layout.host_lane``): its pid, its pid namespace
    and the address of a buffer of its memory holding the nonce the *peer* sent in that
    handshake. The peer reads it back to check that the pid is the process it is talking
    to (:func:`verify`); the buffer lives as long as this object, which the handshake keeps
    until its end (the peer checks before it sends its last message)."""

    def __init__(self, peer_nonce: bytes) -> None:
        self._buf = ctypes.create_string_buffer(bytes(peer_nonce), len(peer_nonce))

    def wire(self) -> Dict[str, int]:
        return {"pid": os.getpid(), "ns": _pid_ns(), "addr": ctypes.addressof(self._buf)}


def parse_offer(raw) -> Optional[Dict[str, int]]:
    """Validate ``Layout.host_lane`` (None, or the dict of :meth:`Offer.wire`)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"pid", "ns", "addr"}:
        raise ProtocolError("layout: host_lane is malformed")
    for k in ("pid", "ns", "addr"):
        v = raw[k]
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 64:
            raise ProtocolError(f"layout: host_lane.{k} must be an unsigned 64-bit int")
    if not 0 < raw["pid"] < 1 << 31:
        raise ProtocolError("layout: host_lane.pid is not a pid")
    return dict(raw)


def _read_back(pid: int, addr: int, n: int) -> bytes:
    """``n`` bytes at ``addr`` of process ``pid`` (``process_vm_readv``); raises OSError."""
    assert _CALLS is not None
    buf = ctypes.create_string_buffer(n)
    liov = _Iovec(ctypes.addressof(buf), n)
    riov = _Iovec(addr, n)
    got = _CALLS[0](pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
    if got != n:
        e = ctypes.get_errno() if got < 0 else errno_mod.EFAULT
        raise OSError(e, os.strerror(e))
    return buf.raw


class Verified:
    """A peer process checked by :func:`verify`: its pid and a pidfd of it (owned: closed by
    :meth:`close`, or by the :class:`HostLane` that takes it)."""

    __slots__ = ("pid", "pidfd")

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid, self.pidfd = pid, pidfd

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def verify(
    offer: Optional[Dict[str, int]], our_nonce: bytes, hostname: str, want: bool
) -> Tuple[Optional[Verified], str]:
    """Check a peer's offer (``RemoteGroups.host_lane``) during the handshake: ``want`` (this
    side uses host lanes: ``host_copy="auto"`` and host registrations), the peer on this host
    (``hostname``) and pid namespace, then a pidfd of its pid and ``our_nonce`` (the nonce
    this side sent in the handshake) read back from that pid at the offered address. Returns
    ``(Verified, "")`` or ``(None, why not)``. Runs on: the engine's loop thread."""
    if not want:
        return None, "off (host_copy='off', or no host registrations here)"
    if _CALLS is None:
        return None, f"off (no process_vm_writev on {sys.platform})"
    if offer is None:
        return None, "off (the peer offered none)"
    if hostname != socket.gethostname():
        return None, f"off (peer on host {hostname!r})"
    if offer["ns"] != _pid_ns() or offer["pid"] == os.getpid():
        return None, "off (the peer is in another pid namespace, or is this process)"
    try:
        pidfd = os.pidfd_open(offer["pid"])
    except (OSError, AttributeError) as exc:
        return None, f"off (pidfd_open: {exc})"
    try:
        seen = _read_back(offer["pid"], offer["addr"], len(our_nonce))
    except OSError as exc:
        os.close(pidfd)
        return None, f"off (process_vm_readv: {exc})"
    if seen != our_nonce:
        os.close(pidfd)
        return None, "off (the offer did not read back this handshake's nonce: not the peer)"
    return Verified(offer["pid"], pidfd), ""


def open_lane(
    groups, remote, verified: Optional[Verified], why: str, shm: bool = True
) -> Tuple[Optional["HostLane"], str]:
    """``(lane or None, status text)`` for the host lane to a peer checked by :func:`verify`
    (``verified``, or None and ``why`` not): ``groups`` is the engine's LocalGroups, ``remote``
    the peer's RemoteGroups, ``shm`` whether UCX reaches it over a shared-memory lane
    (:data:`SHM_LANES`). The lane takes ``verified``'s pidfd; without a lane it is closed
    here."""
    if verified is None:
        return None, why or "off"
    if "host" not in groups.mem_types or "host" not in remote.types:
        verified.close()
        return None, "off (no host memory on both sides)"
    local = np.array(
        sorted({int(r.handle) for r in groups.regions if r.mem_type == "host"}), dtype=_U64
    )
    lane = HostLane(verified.pid, verified.pidfd, local, remote.bases, remote.lens, remote.types)
    lane.shm = shm
    verified.pidfd = -1  # the lane's now
    return lane, f"active (pid {lane.pid})"


_bounces = threading.local()


def _gather() -> Any:
    """The native run packer (``_rma.gather``), or None where the extension is missing
    (then nothing is packed). Loaded at first use: a lane exists only once UCX is up."""
    from kvxfer.transport.ucx_lib import native_helper

    return native_helper("gather")


def _bounce() -> np.ndarray:
    """This thread's packing buffer (:data:`BOUNCE_BYTES`, made at its first packed call)."""
    buf = getattr(_bounces, "buf", None)
    if buf is None:
        buf = _bounces.buf = np.empty(BOUNCE_BYTES, dtype=np.uint8)
    return buf


class _Halted(InterruptedError):
    """A part of a write stopped because another part of it failed."""


class _Job:
    """One write's runs (or a part of them) for the host-lane threads; ``stop`` (the
    lane's) ends it between calls, as does ``halt`` (its write's, set when another part
    of the write failed)."""

    __slots__ = ("pid", "pidfd", "laddr", "raddr", "nbytes", "stop", "halt", "packed")

    def __init__(
        self,
        pid: int,
        pidfd: int,
        laddr,
        raddr,
        nbytes,
        stop,
        halt: Optional[threading.Event] = None,
    ) -> None:
        self.pid, self.pidfd, self.stop, self.halt = pid, pidfd, stop, halt
        self.laddr = np.ascontiguousarray(laddr, dtype=_U64)
        self.raddr = np.ascontiguousarray(raddr, dtype=_U64)
        self.nbytes = np.ascontiguousarray(nbytes, dtype=_U64)
        #: calls whose local runs were packed
        self.packed = 0

    def run(self) -> None:
        """Copy every run (:func:`calls`; packed first where that says so). Raises OSError
        (errno ESRCH: the peer exited or its pid is another process now) or
        InterruptedError (the lane closed; :class:`_Halted`: another part failed); a part
        that fails sets its write's ``halt``."""
        try:
            self._run()
        except BaseException:
            if self.halt is not None:
                self.halt.set()
            raise

    def _stretches(self, pack: Optional[bool], bounce: int):
        """``(local runs, run lengths, calls, local shift, remote shift)`` of each stretch
        of runs to copy: the calls' addresses and the local runs are relative to the
        shifts. Here one stretch, the job's runs as they are."""
        c = calls(self.laddr, self.raddr, self.nbytes, pack=pack, bounce=bounce)
        yield self.laddr, self.nbytes, c, 0, 0

    def _run(self) -> None:
        assert _CALLS is not None
        pvw = _CALLS[1]
        gather = _gather()
        buf = _bounce() if gather is not None else None  # (no memory touched until used)
        pack, bounce = (None, buf.size) if buf is not None else (False, 0)
        for la, nb, cs, lshift, rshift in self._stretches(pack, bounce):
            for c in cs:
                if self.stop.is_set():
                    raise InterruptedError("host lane closed")
                if self.halt is not None and self.halt.is_set():
                    raise _Halted("another part of the write failed")
                liov = c.liov
                if liov is None:  # the local runs, packed back to back
                    assert buf is not None
                    addr = buf.ctypes.data
                    runs = la[c.first : c.end]
                    gather(
                        addr, buf.size, runs + _U64(lshift) if lshift else runs, nb[c.first : c.end]
                    )
                    liov = np.array([[addr, c.nbytes]], dtype=_U64)
                    self.packed += 1
                elif lshift:
                    liov = liov.copy()
                    liov[:, 0] += _U64(lshift)
                riov = c.riov
                if rshift:
                    riov = riov.copy()
                    riov[:, 0] += _U64(rshift)
                signal.pidfd_send_signal(self.pidfd, 0)  # ProcessLookupError once it is gone
                got = pvw(
                    self.pid, liov.ctypes.data, liov.shape[0], riov.ctypes.data, riov.shape[0], 0
                )
                if got != c.nbytes:
                    e = ctypes.get_errno() if got < 0 else errno_mod.EFAULT
                    raise OSError(e, f"process_vm_writev: {os.strerror(e)} (copied {got} B)")


class _Template:
    """One descriptor's runs of a pattern write, as offsets from the descriptor's base on
    each side, and their calls: made by the first job that needs them (on its host-lane
    thread), shared by every descriptor of a uniform pattern and by the write's parts."""

    __slots__ = ("runs", "src", "dst", "d", "_lock", "_got")

    def __init__(self, runs, src: np.ndarray, dst: np.ndarray, d: int) -> None:
        self.runs, self.src, self.dst, self.d = runs, src, dst, d
        self._lock = threading.Lock()
        self._got: Optional[tuple] = None

    def get(self, pack: Optional[bool], bounce: int) -> tuple:
        """``(local offsets, run lengths, calls)`` (uint64; the calls' addresses offsets)."""
        with self._lock:
            if self._got is None:
                s, t, nb = (
                    a.astype(_U64) for a in self.runs.expand_one(self.src, self.dst, self.d)
                )
                self._got = (s, nb, calls(s, t, nb, pack=pack, bounce=bounce))
            return self._got


class _PatternJob(_Job):
    """Descriptors of pattern writes (or a part of them) for the host-lane threads:
    ``units`` = ``[(template, local base, remote base)]``, one per descriptor, copied in
    order; no array of the whole write's runs is ever made."""

    __slots__ = ("units",)

    def __init__(
        self,
        pid: int,
        pidfd: int,
        units: List[Tuple[_Template, int, int]],
        stop,
        halt: Optional[threading.Event] = None,
    ) -> None:
        self.pid, self.pidfd, self.stop, self.halt = pid, pidfd, stop, halt
        self.units = units
        self.packed = 0

    def _stretches(self, pack: Optional[bool], bounce: int):
        for template, lbase, rbase in self.units:
            la, nb, cs = template.get(pack, bounce)
            yield la, nb, cs, lbase, rbase


def _error(exc: BaseException, name: str) -> BaseException:
    if isinstance(exc, ProcessLookupError) or getattr(exc, "errno", None) == errno_mod.ESRCH:
        return PeerClosed(f"host lane to {name}: the peer process is gone")
    if isinstance(exc, InterruptedError):
        return PeerClosed(f"host lane to {name} closed")
    return TransportError(f"host lane to {name}: {exc}")


class HostLane:
    """A same-host peer's host regions, written by ``process_vm_writev`` (see the module)."""

    def __init__(
        self,
        pid: int,
        pidfd: int,
        local: np.ndarray,
        rbases: List[int],
        rlens: List[int],
        rtypes: List[str],
    ) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._local = local  # sorted handles of our host registrations
        self._rbase = np.asarray(rbases, dtype=_U64)
        self._rlen = np.asarray(rlens, dtype=_U64)
        self._usable = np.array([t == "host" for t in rtypes], dtype=bool)
        self._stop = threading.Event()
        #: jobs handed to the threads and not settled yet (touched on the loop thread only)
        self._jobs: "set[concurrent.futures.Future]" = set()
        self.closed = False
        #: UCX reaches the peer over a shared-memory lane (else tcp: :func:`lane_wanted`)
        self.shm = True
        #: writes and runs this lane copied, writes copied on the starting thread, calls
        #: whose local runs were packed first (:data:`PACK_RUN_BYTES`; settled parts only)
        self.writes = 0
        self.runs = 0
        self.inline = 0
        self.packed = 0
        #: writes cut into parts copied on several threads at once (:data:`SPLIT_BYTES`)
        self.split = 0
        #: writes copied from their patterns (:meth:`start_patterns`)
        self.patterns = 0

    def select(self, lmemh: np.ndarray, ridx: np.ndarray) -> np.ndarray:
        """Boolean mask of the ops this lane copies (local and remote host memory)."""
        if self.closed or ridx.size == 0:
            return np.zeros(ridx.size, dtype=bool)
        return self._usable[ridx.astype(np.intp)] & member(lmemh, self._local)

    def start(
        self,
        laddr: np.ndarray,
        raddr: np.ndarray,
        nbytes: np.ndarray,
        ridx: np.ndarray,
        name: str,
    ) -> asyncio.Future:
        """Check every run against its remote region (IndexOutOfRange: nothing moves), then
        copy the runs: here when they are at most :data:`INLINE_BYTES` (the returned future
        is then done), else on the host-lane threads, cut into parts (:func:`split_points`,
        :data:`SPLIT_BYTES`) copied at once. The returned future (of the running loop)
        resolves once every byte is in the peer's memory, or fails with PeerClosed /
        TransportError once every part stopped (a failed part halts the others between
        calls; none writes after the failure is reported). Runs on: the engine's loop thread
        (or a guest of it)."""
        if self.closed:
            raise PeerClosed(f"host lane to {name} closed")
        check_inside(raddr, nbytes, ridx, self._rbase, self._rlen, "host lane")
        self.writes += 1
        self.runs += int(laddr.size)
        total = int(nbytes.sum(dtype=_U64))
        if total <= INLINE_BYTES:  # copied here: no hop, no wake-up
            return self._inline(_Job(self.pid, self._pidfd, laddr, raddr, nbytes, self._stop), name)
        return self._on_threads(
            nbytes,
            total,
            lambda a, b, halt: _Job(
                self.pid, self._pidfd, laddr[a:b], raddr[a:b], nbytes[a:b], self._stop, halt
            ),
            name,
        )

    def start_patterns(self, parts, name: str) -> asyncio.Future:
        """Copy PatternWrites from their patterns. ``parts`` = ``[(runs, src ids, dst ids,
        local descriptor ptrs, remote descriptor ptrs, remote descriptor lens, remote
        regions)]``: ``runs`` a :class:`~kvxfer.engine.slices.PatternRuns` and the ids as
        the planner validated them (in range on both sides, every run inside its item: so
        inside its descriptor on both sides); every remote descriptor is checked here to lie
        in its region (IndexOutOfRange: nothing moves). Each descriptor's runs are expanded
        on the copying thread, once per distinct descriptor pattern (a uniform one: once per
        write), and shifted to each descriptor's bases call by call, so no array of the
        whole write's runs is ever made (planning those faulted ~25 MiB in per 1 -> 2 NHD
        leg, bench/results/host-lane-cpu.md). Copied as :meth:`start` copies runs: here up to
        :data:`INLINE_BYTES`, else on the threads, cut into parts of whole descriptors. The
        ids are copied: a job never reads its caller's arrays after this returns. Runs on:
        the engine's loop thread (or a guest of it)."""
        if self.closed:
            raise PeerClosed(f"host lane to {name} closed")
        units: List[Tuple[_Template, int, int]] = []
        sizes: List[int] = []
        runs_n = 0
        for runs, src, dst, lptrs, rptrs, rlens, ridx in parts:
            if not len(src):
                continue
            rp = np.asarray(rptrs, dtype=_U64)
            check_inside(
                rp, np.asarray(rlens, dtype=_U64), ridx, self._rbase, self._rlen, "host lane"
            )
            si, di = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
            shared = _Template(runs, si, di, 0) if runs.uniform else None
            for d, (lp, r) in enumerate(zip(lptrs, rp.tolist())):
                size = int(runs.lens[d].sum()) * si.size
                if size:
                    units.append((shared or _Template(runs, si, di, d), int(lp), r))
                    sizes.append(size)
            runs_n += runs.runs_per_item * si.size
        self.writes += 1
        self.patterns += 1
        self.runs += runs_n
        total = sum(sizes)
        if total <= INLINE_BYTES:
            return self._inline(_PatternJob(self.pid, self._pidfd, units, self._stop), name)
        return self._on_threads(
            np.array(sizes, dtype=_U64),
            total,
            lambda a, b, halt: _PatternJob(self.pid, self._pidfd, units[a:b], self._stop, halt),
            name,
        )

    def _inline(self, job: _Job, name: str) -> asyncio.Future:
        """Run ``job`` on this thread; its future, done."""
        fut = asyncio.get_running_loop().create_future()
        self.inline += 1
        try:
            job.run()
        except Exception as exc:  # noqa: BLE001 - handed to the write as its error
            fut.set_exception(_error(exc, name))
        else:
            fut.set_result(None)
        self.packed += job.packed
        return fut

    def _on_threads(
        self,
        sizes: np.ndarray,
        total: int,
        make: Callable[[int, int, Optional[threading.Event]], _Job],
        name: str,
    ) -> asyncio.Future:
        """Cut a write of units (runs, or a pattern's descriptors) of ``sizes`` bytes,
        ``total`` in all, into parts (:func:`split_points`, :data:`SPLIT_BYTES`) and hand
        each to the threads as ``make(first, end, halt)`` (the job of units ``[first, end)``;
        ``halt`` shared by the parts when there are several); the write's future (see
        :meth:`start`)."""
        cut = split_points(sizes, split_parts(), SPLIT_BYTES, total)
        halt = threading.Event() if cut.size > 2 else None
        jobs = [make(a, b, halt) for a, b in zip(cut[:-1].tolist(), cut[1:].tolist())]
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if halt is not None:
            self.split += 1
        w = _Write(fut, name, len(jobs))
        pool = _threads()
        for i, job in enumerate(jobs):
            try:
                cf = pool.submit(job.run)
            except RuntimeError as exc:  # the interpreter is exiting: no part from this one
                if halt is not None:
                    halt.set()
                w.exc = exc
                w.left = i  # (no part settled yet: settling runs on this thread)
                if not w.left:
                    fut.set_exception(_error(exc, name))
                break
            self._jobs.add(cf)
            cf.add_done_callback(functools.partial(_on_done, loop, self._settle, w, job))
        return fut

    async def close(self, timeout: float) -> None:
        """Stop the jobs between calls and wait (up to ``timeout``) until none runs; then
        close the pidfd. Idempotent. Runs on: the engine's loop thread."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        jobs = [asyncio.wrap_future(c) for c in self._jobs]
        if jobs:
            _, pending = await asyncio.wait(jobs, timeout=timeout)
            if pending:  # the pidfd stays open: a running job still asks it
                log.warning("host lane to pid %d: %d copies still running", self.pid, len(pending))
                return
        os.close(self._pidfd)

    def _settle(self, w: "_Write", job: _Job, c: concurrent.futures.Future) -> None:
        """Count a part of a write in (on the loop thread); the write's future resolves
        when its last part did, with the first error of a part that failed itself (not one
        halted by it). A future already done (the write gave up: timeout, the peer's death)
        only has the parts' outcomes retrieved."""
        self._jobs.discard(c)
        self.packed += job.packed
        exc = c.exception()
        if exc is not None and (w.exc is None or isinstance(w.exc, _Halted)):
            w.exc = exc
        w.left -= 1
        if w.left or w.fut.done():
            return
        if w.exc is None:
            w.fut.set_result(None)
        else:
            w.fut.set_exception(_error(w.exc, w.name))


class _Write:
    """A write handed to the host-lane threads: its future and how many of its parts are
    still running (touched on the loop thread only)."""

    __slots__ = ("fut", "name", "left", "exc")

    def __init__(self, fut: asyncio.Future, name: str, parts: int) -> None:
        self.fut, self.name, self.left = fut, name, parts
        self.exc: Optional[BaseException] = None


def _on_done(loop, settle, w: _Write, job: _Job, c: concurrent.futures.Future) -> None:
    """A part's job ended (on its host-lane thread): count it in on the loop thread."""
    try:
        loop.call_soon_threadsafe(settle, w, job, c)
    except RuntimeError:  # the loop closed: nobody waits any more
        pass
