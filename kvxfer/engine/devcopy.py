"""Device lane: same-host CUDA→CUDA writes as one copy launch into the peer's memory.

Over UCX every run of a write is one cuda_ipc PUT, each with a fixed CPU cost to post, so a
scattered page set is bound by its op count, far below one large PUT of the same bytes
(lane against UCX PUTs: bench/results/transfer-h200.md). When both engines share a host,
the peer's registered CUDA regions can be mapped here with legacy CUDA IPC (the same
mechanism UCX's cuda_ipc uses) and every run of a write copied by ONE launch of the copy
kernel of :mod:`kvxfer.kernels.piece_copy` (few large runs: one ``cuMemcpyDtoDAsync`` each,
on the copy engines; one ``cuMemcpyBatchAsync`` of many runs costs more host time than the
kernel's launch: bench/results/lane-copy-h200.md). The launch is native where it can be
(:class:`~kvxfer.kernels.piece_copy.TaskLauncher`: ``cuLaunchKernel``, the table in a pinned
ring slot, the slot's driver event; PatternWrites by
:func:`~kvxfer.kernels.pattern_copy.copy_pattern_native`), else through torch and Triton.
The bytes are visible at the peer once the launch's event completed; only then does the
write flush/notify, exactly as for PUTs.

Invariants
- A lane exists only for a same-host peer whose Layout exported IPC blobs, and only with
  ``EngineConfig.device_copy == "auto"``. A write uses it from ``device_min_ops`` runs up
  (a launch's host time equals that of many PUTs; lane vs PUTs by runs and bytes per run:
  bench/results/lane-rule-h200.md), and from ``device_min_bytes`` bytes up
  (:func:`lane_wanted`). A region whose import fails
  (the peer is this process, peer access is impossible, ...) stays on UCX:
  :meth:`DeviceLane.select` picks only ops whose local registration is CUDA memory and
  whose remote region is mapped.
- Every op it copies was validated by the planner against the peer's descriptors and is
  checked again here against its remote region before translation; nothing is launched
  unless every op fits.
- Launches go to one stream per lane on the local memory's device. A write awaits its own event:
  polled inline briefly (:meth:`DeviceLane.settled`: a copy done by then costs no awaited
  wait), then once per loop iteration, then in the default executor (the GIL released), so
  the event loop never blocks for long. ``Peer.write``'s use of the lane is tested on CPU with
  a stand-in copy (tests/engine/test_lane_standin.py).
- A PatternWrite (:meth:`DeviceLane.launch_pattern`) is one launch of
  :func:`kvxfer.kernels.pattern_copy.copy_pattern`: its run table (a few hundred rows per
  page geometry) is built and uploaded once per pattern object and cached (bounded); per
  write only the item-pair table travels. The lane takes it only when every descriptor of
  the group is local CUDA memory and lies whole inside a mapped remote region
  (:meth:`DeviceLane.covers`), so every byte a program writes is inside a descriptor the
  peer registered (the planner checked ids and runs against both layouts).
- :meth:`DeviceLane.close` waits for the stream, then unmaps every imported region.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from kvxfer.engine import vmm_share
from kvxfer.errors import IndexOutOfRange

log = logging.getLogger(__name__)
_U64 = np.uint64

#: at most this many runs go as one cuMemcpyDtoDAsync each (copy engines, full bandwidth
#: for large runs); more runs take one kernel launch
MEMCPY_MAX_RUNS = 4
#: how long :meth:`DeviceLane.wait` polls a launch's event inline (the loop blocked), seconds
WAIT_SPIN_S = 50e-6
#: then how long it polls the event once per loop iteration (other callbacks run between
#: polls) before it waits in a thread (one hop, bench/results/tp-pattern-h200.md), seconds
WAIT_POLL_S = 5e-3
#: set (non-empty) to time each pattern launch's host parts; printed at close (diagnostics)
PROFILE_ENV = "KVXFER_LANE_PROFILE"
#: pattern run tables kept on the device (per pattern object, least recently used dropped)
PATTERN_CACHE = 16


def member(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``np.isin(values, table)`` for a sorted, duplicate-free ``table`` (the lane's local
    registration handles), by binary search: a few array operations where ``np.isin``
    costs tens of µs per call on a small input (it is on every lane write's path)."""
    values = np.asarray(values, dtype=table.dtype)  # mixed u64/i64 would compare as floats
    if table.size == 0:
        return np.zeros(values.shape, dtype=bool)
    at = np.searchsorted(table, values)
    at[at == table.size] = 0
    return table[at] == values


def check_inside(
    raddr: np.ndarray, nbytes: np.ndarray, ridx: np.ndarray, rbase, rlen, lane: str
) -> None:
    """Raise IndexOutOfRange unless every op ``[raddr, +nbytes)`` lies inside its remote
    region ``ridx`` (``rbase`` / ``rlen`` per region): a same-host lane's second check, as
    ``put_batch``'s is for PUTs, before anything moves."""
    r = ridx.astype(np.intp)
    off = raddr - rbase[r]
    if ((raddr < rbase[r]) | (off > rlen[r]) | (nbytes > rlen[r] - off)).any():
        raise IndexOutOfRange(f"{lane}: an op falls outside its remote region")


def lane_wanted(ops: int, nbytes: np.ndarray, min_ops: int, small_ops: int, min_bytes: int) -> bool:
    """Whether a write of ``ops`` direct runs of ``nbytes`` bytes each should go to the
    device lane (where it is open): from ``min_ops`` runs up (one launch beats many PUTs),
    up to ``small_ops`` runs (0: never), or from ``min_bytes`` bytes up (0: never; the copy
    engines against cuda_ipc PUTs for large requests). Never for a write of no runs."""
    if ops <= 0:
        return False
    if ops >= min_ops or ops <= small_ops:
        return True
    return 0 < min_bytes <= int(nbytes.sum(dtype=_U64))


def _tile(nbytes: np.ndarray) -> int:
    """Bytes per copy program for a write of runs of ``nbytes``: about 1/2048 of the write
    (:func:`~kvxfer.pools.offload.pieces.pick_tile_bytes`, 8 KiB to 1 MiB), so a write of a
    few large runs still spreads over many programs."""
    from kvxfer.pools.offload.pieces import pick_tile_bytes

    return pick_tile_bytes(int(nbytes.sum(dtype=_U64)))


def _tasks(laddr: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """The task kernel's rows for runs ``laddr -> dst`` of ``nbytes``, cut into
    :func:`_tile`-byte tiles on the host."""
    from kvxfer.pools.offload.pieces import tile_pieces

    n = nbytes.astype(np.int64)
    return tile_pieces(laddr.astype(np.int64), dst.astype(np.int64), n, _tile(nbytes))


class DeviceLane:
    """Kernel/copy-engine writes into one peer's IPC-mapped CUDA regions."""

    def __init__(
        self,
        device: int,
        blobs: Sequence[bytes],
        rbase: Sequence[int],
        rlen: Sequence[int],
        local_cuda_memh: Sequence[int],
        shares: Sequence[Any] = (),
    ):
        """``shares``: the peer's VMM regions, mapped for this lane
        (:func:`fetch_shares`); owned (and unmapped at :meth:`close`) here."""
        import torch

        from kvxfer.kernels import cuda_driver
        from kvxfer.kernels.piece_copy import task_launcher

        self.device = device
        self._torch = torch
        self._rbase = np.asarray(rbase, dtype=_U64)
        self._rlen = np.asarray(rlen, dtype=_U64)
        self._local = np.asarray(sorted(set(int(h) for h in local_cuda_memh)), dtype=_U64)
        self.mapped = np.zeros(len(blobs), dtype=_U64)  # image of each region's base, 0 = not
        self._bases: List[int] = []  # what ipc_close takes
        self.failures: List[str] = []  # why regions stayed on UCX
        #: regions in the peer's CUDA VMM memory, mapped here (UCX would emulate PUTs into
        #: them): every op into them takes the lane (:meth:`pick`)
        self.emulated = np.zeros(len(blobs), dtype=bool)
        self._imports: List[Any] = []  # ImportedBuffers of those regions
        with torch.cuda.device(device):
            self._stream = torch.cuda.Stream(device)
            self._stream_h = int(self._stream.cuda_stream)
            self._tasks = task_launcher(device, "the device lane")
            for i, blob in enumerate(blobs):
                if not blob or vmm_share.is_blob(blob):
                    continue
                try:
                    image, base = cuda_driver.ipc_open(bytes(blob), device)
                except (cuda_driver.CudaError, ValueError) as exc:
                    log.info("device lane: region %d stays on UCX (%s)", i, exc)
                    self.failures.append(f"region {i}: {exc}")
                    continue
                self.mapped[i] = image
                self._bases.append(base)
            self._import_shares(shares)
        self._usable = self.mapped != 0
        self._any_emulated = bool(self.emulated.any())
        self.closed = False
        #: id(pattern) -> (pattern, local bases, host rows, device rows, align, launch
        #: shape), and for several patterns in one launch ((group, id) of each) ->
        #: (patterns, local bases of each, host rows, device rows, align, launch shape, row
        #: bounds, widest range); the rows are checked once, when cached
        #: (:func:`~kvxfer.kernels.pattern_copy.checked_shape`); the patterns are held so
        #: that their ids are not reused while cached
        self._patterns: Dict[Any, tuple] = {}
        #: (group, id(runs)) -> (launch stats of its row table, the runs held so that
        #: the id is not reused while cached, the local bases): what :meth:`joins` compares
        self._stats: Dict[Any, tuple] = {}
        #: host-time parts of each pattern launch ($KVXFER_LANE_PROFILE, diagnostics)
        self.profile: Optional[Dict[str, Any]] = {} if os.environ.get(PROFILE_ENV) else None

    def _import_shares(self, shares: Sequence[Any]) -> None:
        """Take the peer's mapped VMM regions (:mod:`kvxfer.engine.vmm_share`: ``(regions,
        ImportedBuffers)`` each, one buffer per region); unmapped at :meth:`close`."""
        for regions, imported in shares:
            self._imports.append(imported)
            for k, i in enumerate(regions):
                self.mapped[i] = imported.tensors[k].data_ptr()
                self.emulated[i] = True

    def pick(self, lmemh: np.ndarray, ridx: np.ndarray, wanted: bool) -> Optional[np.ndarray]:
        """Boolean mask of the ops a write copies on this lane, None for none: every op it
        can (:meth:`select`) when the write wants the lane (:func:`lane_wanted`), else the
        ops into regions UCX would emulate PUTs into (the peer's CUDA VMM memory mapped
        here), whatever the write's size."""
        if wanted:
            return self.select(lmemh, ridx)
        if not self._any_emulated:
            return None
        mask = self.select(lmemh, ridx) & self.emulated[ridx.astype(np.intp)]
        return mask if mask.any() else None

    @property
    def native(self) -> bool:
        """Whether this lane launches its copies natively (no torch or Triton per write)."""
        return self._tasks is not None

    @property
    def active(self) -> bool:
        return bool(self._usable.any()) and not self.closed

    def select(self, lmemh: np.ndarray, ridx: np.ndarray) -> np.ndarray:
        """Boolean mask of the ops this lane copies (local CUDA, remote region mapped)."""
        if not self.active or ridx.size == 0:
            return np.zeros(ridx.size, dtype=bool)
        return self._usable[ridx.astype(np.intp)] & member(lmemh, self._local)

    def launch(self, laddr: np.ndarray, raddr: np.ndarray, nbytes: np.ndarray, ridx: np.ndarray):
        """Translate, check and launch the copy of these ops; returns the CUDA event that
        completes with it (see :meth:`wait`)."""
        check_inside(raddr, nbytes, ridx, self._rbase, self._rlen, "device lane")
        r = ridx.astype(np.intp)
        dst = self.mapped[r] + (raddr - self._rbase[r])
        if self._tasks is not None:
            ev = self._launch_native(laddr, dst, nbytes)
            if ev is not None:
                return ev
        torch = self._torch
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if laddr.size <= MEMCPY_MAX_RUNS:
                from kvxfer.kernels.cuda_driver import memcpy_dtod_async

                h = self._stream.cuda_stream
                for s, d, n in zip(laddr.tolist(), dst.tolist(), nbytes.tolist()):
                    memcpy_dtod_async(d, s, n, h)
            else:
                from kvxfer.kernels.piece_copy import copy_tasks
                from kvxfer.pools.offload.pieces import split_by_alignment

                tasks = _tasks(laddr, dst, nbytes)
                for align, part in split_by_alignment(tasks):
                    copy_tasks(self._upload(part), align, host_tasks=part)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        return ev

    def _launch_native(self, laddr: np.ndarray, dst: np.ndarray, nbytes: np.ndarray):
        """:meth:`launch`'s copies through the native launcher: ``cuMemcpyDtoDAsync`` per run
        for a few runs, else one ``cuLaunchKernel`` of the tile-cutting kernel over one row
        per run (:meth:`~kvxfer.kernels.piece_copy.TaskLauncher.launch_pieces`) read from the
        launcher's pinned ring; the ring slot's event is returned. Runs too uneven for that
        are cut into tiles on the host (one launch per alignment class); None — nothing
        launched — when some alignment class has no native kernel (:meth:`launch` then takes
        Triton's launch, on the same stream)."""
        from kvxfer.pools.offload.pieces import split_by_alignment

        tasks, stream = self._tasks, self._stream_h
        if laddr.size <= MEMCPY_MAX_RUNS:
            from kvxfer.kernels.cuda_driver import memcpy_dtod_async

            pushed = tasks.ctx.enter()
            try:
                for s, d, n in zip(laddr.tolist(), dst.tolist(), nbytes.tolist()):
                    memcpy_dtod_async(d, s, n, stream)
            finally:
                tasks.ctx.leave(pushed)
            return tasks.record(stream)
        ev = tasks.launch_pieces(laddr, dst, nbytes, _tile(nbytes), stream)
        if ev is not None:  # the usual case: one row per run, tiles cut by the kernel
            return ev
        groups = split_by_alignment(_tasks(laddr, dst, nbytes))
        return tasks.launch(groups, stream) if tasks.supports(groups) else None

    def covers(self, lmemh: np.ndarray, rptrs, rlens, ridx: np.ndarray) -> bool:
        """Whether every descriptor (local registration ``lmemh[d]``; remote ``[rptrs[d],
        +rlens[d])`` in region ``ridx[d]``) is local CUDA memory inside a mapped region."""
        if not self.select(lmemh, ridx).all():
            return False
        r = ridx.astype(np.intp)
        p, n = np.asarray(rptrs, dtype=_U64), np.asarray(rlens, dtype=_U64)
        return bool(((p >= self._rbase[r]) & (p - self._rbase[r] + n <= self._rlen[r])).all())

    def launch_patterns(self, parts, bases):
        """Launch the copies of several PatternWrites in ONE native launch: ``parts`` =
        ``[(pattern, src, dst, group)]`` (each as :meth:`launch_pattern` takes it; a write's
        piece classes of the kv pages, its state slices), ``bases[group]`` = ``(lptrs,
        rptrs, ridx)`` of that group's descriptors. Their run tables are concatenated
        (uploaded once per combination of patterns and kept like a single pattern's), each
        item pair naming its pattern's rows (:func:`~kvxfer.kernels.pattern_copy.
        class_items`).

        Every part of the first live part's group goes in; a part of another group joins
        only where it leaves the launch as it is (:func:`~kvxfer.kernels.pattern_copy.
        joins_launch`: no more rows than the widest class, no longer vector block, no
        narrower alignment: joined, a short-row kv launch took several times the GPU time,
        bench/results/tp-pattern-h200.md); the others go in launches of their own, one per
        group, by the same rule (:meth:`joins` tells a caller beforehand). One part, no
        native launcher, or a table the native kernel refuses: :meth:`launch_pattern` per
        part. Returns the CUDA event of the last launch (the lane's stream orders them;
        None for no live part)."""
        live = [p for p in parts if len(p[1])]
        if len(live) < 2 or self._tasks is None:
            return self._one_by_one(live, bases)
        from kvxfer.kernels.pattern_copy import class_items, copy_pattern_native

        prof = self.profile
        t0 = time.perf_counter()
        c0 = time.thread_time() if prof is not None else 0.0
        key = tuple((g, id(p)) for p, _, _, g in live)
        local = tuple(bases[g][0] for _, _, _, g in live)  # (tuples: compared by identity)
        entry = self._patterns.pop(key, None)
        if entry is None or entry[1] != local:
            if prof is not None:
                prof["misses"] = prof.get("misses", 0) + 1
            tables = [self._pattern_rows(p, *bases[g]) for p, _, _, g in live]
            # the patterns are held so that their ids are not reused while cached
            entry = (tuple(p for p, _, _, _ in live), local, *self._combined(live, tables))
            self._evict()
        self._patterns[key] = entry
        _, _, joined, host, rows, align, shape, bounds, span = entry
        apart = [p for p, j in zip(live, joined) if not j]
        live = [p for p, j in zip(live, joined) if j]
        ev = None
        if host is None:  # one part in this launch
            ev = self._one_by_one(live, bases)
        else:
            t1 = time.perf_counter()
            stamps: Optional[List[float]] = [] if prof is not None else None
            if span:
                items = class_items([(s, d) for _, s, d, _ in live], bounds)
                ev = copy_pattern_native(
                    self._tasks.ring,
                    rows.data_ptr(),
                    host,
                    items,
                    align,
                    self._stream_h,
                    span,
                    shape,
                    stamps,
                )
            if ev is None:  # refused natively (or no rows): one launch per part
                ev = self._one_by_one(live, bases)
            elif prof is not None:
                t4 = time.perf_counter()
                self._profile(prof, c0, t0, t1, t1, t1, t4, t4, native=[t1, *(stamps or ())])
        if apart:  # other groups' parts that would widen it: launches of their own
            if prof is not None:
                prof["apart"] = prof.get("apart", 0) + len(apart)
            ev = self.launch_patterns(apart, bases)
        return ev

    def joins(self, main, extra, bases) -> bool:
        """Whether pattern ``extra`` = ``(group, runs)`` of another group would join a launch
        of ``main`` = ``[(group, runs)]`` (the piece classes of one group) in
        :meth:`launch_patterns` (:func:`~kvxfer.kernels.pattern_copy.joins_launch`;
        ``bases`` as there). Each pattern's table is measured once (cached). False without
        a native launcher (where every part is a launch of its own)."""
        if self._tasks is None:
            return False
        from kvxfer.kernels.pattern_copy import joins_launch

        return joins_launch([self._stats_of(p, bases) for p in main], self._stats_of(extra, bases))

    def _stats_of(self, part, bases) -> tuple:
        """:func:`~kvxfer.kernels.pattern_copy.launch_stats` of ``part`` = ``(group, runs)``
        between ``bases[group]``, cached."""
        group, runs = part
        got = self._stats.get((group, id(runs)))
        if got is None or got[2] != bases[group][0]:  # (local bases: as _patterns checks)
            from kvxfer.kernels.pattern_copy import launch_stats

            while len(self._stats) >= 4 * PATTERN_CACHE:
                self._stats.pop(next(iter(self._stats)))
            rows = self._pattern_rows(runs, *bases[group])
            got = self._stats[(group, id(runs))] = (launch_stats(rows), runs, bases[group][0])
        return got[0]

    def _combined(self, live, tables) -> tuple:
        """``(joined, host rows, device rows, align, launch shape, row bounds, widest range)``
        of a combined launch of the ``live`` parts with row tables ``tables``: ``joined[k]``
        whether part ``k`` is in it (:meth:`launch_patterns`' rule); the rest None when
        fewer than two parts are."""
        from kvxfer.kernels.pattern_copy import joins_launch, launch_stats

        main = [launch_stats(t) for p, t in zip(live, tables) if p[3] == live[0][3]]
        joined = [
            p[3] == live[0][3] or joins_launch(main, launch_stats(t)) for p, t in zip(live, tables)
        ]
        tables = [t for t, j in zip(tables, joined) if j]
        if len(tables) < 2:
            return (joined, None, None, 0, None, None, 0)
        return (joined, *self._joint(tables))

    def _joint(self, tables) -> tuple:
        """``(host rows, device rows, align, launch shape, row bounds, widest range)`` of one
        launch over the row tables ``tables`` concatenated (each part's rows
        ``[bounds[k], bounds[k + 1])``), checked and uploaded once."""
        from kvxfer.kernels.pattern_copy import checked_shape, row_alignment

        bounds = np.cumsum([0] + [len(t) for t in tables]).tolist()
        host = np.ascontiguousarray(np.concatenate(tables))
        span = max(b - a for a, b in zip(bounds, bounds[1:]))
        align = row_alignment(host)
        shape = checked_shape(host, align)
        return (host, self._upload_rows(host), align, shape, bounds, span)

    def _one_by_one(self, parts, bases):
        """:meth:`launch_pattern` per part; the last event (None for no part)."""
        ev = None
        for pattern, src, dst, group in parts:
            ev = self.launch_pattern(pattern, *bases[group], src, dst)
        return ev

    def _pattern_rows(self, pattern, lptrs, rptrs, ridx: np.ndarray) -> np.ndarray:
        """The host row table of ``pattern`` between these descriptors (see
        :meth:`launch_pattern`)."""
        from kvxfer.kernels.pattern_copy import pattern_rows

        r = ridx.astype(np.intp)
        rp = np.asarray(rptrs, dtype=_U64)
        dst_bases = (self.mapped[r] + (rp - self._rbase[r])).astype(np.int64)
        return pattern_rows(
            np.asarray(lptrs, dtype=np.int64),
            dst_bases,
            np.asarray(pattern.src_item_lens, dtype=np.int64),
            np.asarray(pattern.dst_item_lens, dtype=np.int64),
            list(zip(pattern.src, pattern.dst, pattern.lens)),
        )

    def _upload_rows(self, host: np.ndarray):
        """A row table's device copy, uploaded on the lane's stream: every launch that reads
        it is ordered after it."""
        torch = self._torch
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            return torch.from_numpy(host).to(f"cuda:{self.device}", non_blocking=True)

    def _evict(self) -> None:
        """Make room for one more cached row table (least recently used dropped)."""
        while len(self._patterns) >= PATTERN_CACHE:
            self._patterns.pop(next(iter(self._patterns)))

    def launch_pattern(self, pattern, lptrs, rptrs, ridx: np.ndarray, src, dst):
        """Launch the copy of ``pattern`` (a validated :class:`~kvxfer.engine.slices.
        PatternRuns`) for item pairs ``src[k] -> dst[k]`` (validated ids) between local
        descriptors at ``lptrs`` and the peer's at ``rptrs`` (regions ``ridx``, checked by
        :meth:`covers`); returns the CUDA event that completes with it."""
        torch = self._torch
        from kvxfer.kernels.pattern_copy import checked_shape, copy_pattern, row_alignment

        prof = self.profile
        t0 = time.perf_counter()
        c0 = time.thread_time() if prof is not None else 0.0
        entry = self._patterns.pop(id(pattern), None)
        if entry is None or entry[1] != tuple(lptrs):
            if prof is not None:
                prof["misses"] = prof.get("misses", 0) + 1
            host = self._pattern_rows(pattern, lptrs, rptrs, ridx)
            rows = self._upload_rows(host)
            align = row_alignment(host)
            entry = (pattern, tuple(lptrs), host, rows, align, checked_shape(host, align))
            self._evict()
        self._patterns[id(pattern)] = entry
        _, _, host, rows, align, shape = entry
        t1 = time.perf_counter()
        if self._tasks is not None and len(src):
            from kvxfer.kernels.pattern_copy import copy_pattern_native

            pairs = np.empty((len(src), 2), dtype=np.int64)
            pairs[:, 0], pairs[:, 1] = src, dst
            stamps: Optional[List[float]] = [] if prof is not None else None
            ev = copy_pattern_native(
                self._tasks.ring,
                rows.data_ptr(),
                host,
                pairs,
                align,
                self._stream_h,
                shape=shape,
                stamps=stamps,
            )
            if ev is not None:
                if prof is not None:
                    t4 = time.perf_counter()
                    self._profile(prof, c0, t0, t1, t1, t1, t4, t4, native=[t1, *(stamps or ())])
                return ev
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            t2 = time.perf_counter()
            pairs = np.empty((len(src), 2), dtype=np.int64)
            pairs[:, 0], pairs[:, 1] = src, dst
            items = self._upload(pairs)
            t3 = time.perf_counter()
            copy_pattern(rows, items, align, host_rows=host)
            t4 = time.perf_counter()
            ev = torch.cuda.Event()
            ev.record(self._stream)
        if prof is not None:
            self._profile(prof, c0, t0, t1, t2, t3, t4, time.perf_counter())
        return ev

    @staticmethod
    def _profile(prof: Dict[str, Any], c0: float, *t: float, native: Sequence[float] = ()) -> None:
        """Record one pattern launch's parts (wall µs from the stamps ``t``) and the loop
        thread's CPU time over it: a gap between the two is waiting (GIL, driver locks,
        preemption), not slow execution. ``native``: the native launch's own stamps (its
        start, then :data:`~kvxfer.kernels.pattern_copy.NATIVE_PARTS`' ends), recorded as
        ``native: <part>``."""
        from kvxfer.kernels.pattern_copy import NATIVE_PARTS

        prof.setdefault("total cpu", []).append((time.thread_time() - c0) * 1e6)
        names = ("table", "context", "upload", "kernel launch", "event")
        for k, a, b in zip(names, t, t[1:]):
            prof.setdefault(k, []).append((b - a) * 1e6)
        for k, a, b in zip(NATIVE_PARTS, native, native[1:]):
            prof.setdefault(f"native: {k}", []).append((b - a) * 1e6)
        prof.setdefault("total", []).append((t[-1] - t[0]) * 1e6)

    def profile_summary(self) -> str:
        """With ``$KVXFER_LANE_PROFILE`` set: the pattern launches' host time per part (p50
        µs) and table-cache misses."""
        prof = self.profile or {}
        parts = [
            f"{k} {statistics.median(v):.1f}" for k, v in prof.items() if isinstance(v, list) and v
        ]
        return (
            f"{len(prof.get('total', []))} pattern launches, p50 µs: "
            + ", ".join(parts)
            + f"; table misses {prof.get('misses', 0)}"
            + f"; parts launched apart {prof.get('apart', 0)}"
        )

    def _upload(self, table: np.ndarray):
        """``table`` (int64) on the device, copied on the lane's stream (the current one):
        from pageable memory the driver stages it before returning, so ``table`` may be
        reused at once; the device tensor, allocated on the lane's stream, is reused only
        after the launch that reads it. (A pinned staging buffer was tried on the H200: the
        host time of this step stayed 180-230 µs in the PD bench, bench/results/
        tp-pattern-h200.md, so the simpler copy stays.)"""
        t = self._torch.from_numpy(table).to(f"cuda:{self.device}", non_blocking=True)
        t.record_stream(self._stream)  # not reused before the launch ran
        return t

    @staticmethod
    def settled(ev, spin_s: float = WAIT_SPIN_S) -> bool:
        """Whether the launch's event completed, polled inline (the caller's thread blocked)
        for up to ``spin_s``: a write whose copy is done by then needs no awaited wait (no
        task, future and timer round trip through the loop). Runs on: the caller's thread."""
        if ev.query():
            return True
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:
            if ev.query():
                return True
        return False

    @staticmethod
    async def wait(ev, spin_s: float = WAIT_SPIN_S, poll_s: float = WAIT_POLL_S) -> None:
        """Until the launch's event completed (bytes visible at the peer). Polls the event
        inline for up to ``spin_s`` (a small copy is done within microseconds), then once
        per loop iteration for up to ``poll_s`` (a large one within a millisecond or two;
        the loop runs other callbacks between polls, no thread hop), then waits in the
        default executor, the event loop running on. Runs on: the asyncio loop thread;
        ``ev.synchronize`` runs in the default executor."""
        if ev.query():
            return
        now = time.perf_counter()
        end = now + spin_s
        while now < end:
            if ev.query():
                return
            now = time.perf_counter()
        end = now + poll_s
        while time.perf_counter() < end:
            await asyncio.sleep(0)
            if ev.query():
                return
        await asyncio.get_running_loop().run_in_executor(None, ev.synchronize)

    def close(self) -> None:
        """Wait for the stream, then unmap every imported region; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.profile:  # diagnostics: straight to stderr (bench/gpu/pattern.sh keeps it)
            print(f"lane-profile: device {self.device}: {self.profile_summary()}", file=sys.stderr)
        from kvxfer.kernels.cuda_driver import CudaError, ipc_close

        torch = self._torch
        with torch.cuda.device(self.device):
            self._stream.synchronize()
            if self._tasks is not None:
                self._tasks.close()
            for base in self._bases:
                try:
                    ipc_close(base, self.device)
                except CudaError as exc:
                    log.warning("device lane: unmapping a peer region: %s", exc)
            for imp in self._imports:
                try:
                    imp.close()
                except Exception as exc:  # noqa: BLE001 - keep unmapping the rest
                    log.warning("device lane: unmapping a peer's VMM regions: %s", exc)
        self._bases, self._imports = [], []
        self._patterns.clear()
        self.mapped[:] = 0
        self._usable[:] = False
        self.emulated[:] = False
        self._any_emulated = False


def _lane_device(config, groups, hostname: str) -> Optional[int]:
    """The CUDA device a lane to a peer on ``hostname`` would run on, None for no lane."""
    if (
        config.device_copy != "auto"
        or "cuda" not in groups.mem_types
        or hostname != socket.gethostname()
    ):
        return None
    return _first_cuda_device(groups)


def _first_cuda_device(groups) -> Optional[int]:
    from kvxfer.kernels.cuda_driver import device_ordinal

    first = next(r for r in groups.regions if r.mem_type == "cuda")
    return device_ordinal(first.addr)


async def fetch_shares(config, groups, hostname: str, remote, timeout: float) -> List[Any]:
    """The peer's VMM regions mapped on the device of the lane :func:`open_lane` opens
    (:func:`kvxfer.engine.vmm_share.fetch_all`, in the default executor: it blocks on a
    socket and maps each extent as its fd arrives), bounded by ``timeout``; [] when there is
    no lane or nothing to fetch. The caller owns them (``open_lane`` takes them). Runs on:
    the asyncio loop thread."""
    if not any(vmm_share.is_blob(b) for b in remote.ipc or ()):
        return []
    device = _lane_device(config, groups, hostname)
    if device is None:
        return []

    def mapper(manifest, fds):
        from kvxfer.pools.backing.share import ImportedBuffers

        return ImportedBuffers(manifest, fds, device)

    fut = asyncio.get_running_loop().run_in_executor(
        None, vmm_share.fetch_all, list(remote.ipc), list(remote.lens), mapper, timeout / 2
    )
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
        # what it mapped, when it still ends, is unmapped then
        fut.add_done_callback(
            lambda f: None if f.cancelled() or f.exception() else vmm_share.close_shares(f.result())
        )
        if isinstance(exc, asyncio.CancelledError):
            raise
        log.warning("device lane: mapping the peer's VMM regions timed out: they stay on UCX")
        return []


def open_lane(config, groups, hostname: str, remote, shares: Optional[List[Any]] = None):
    """``(lane or None, status text)`` for the device lane to a peer: ``config`` is the
    engine's EngineConfig, ``groups`` its LocalGroups, ``remote`` the peer's RemoteGroups,
    ``shares`` its VMM regions mapped by :func:`fetch_shares` (the lane takes them; without
    a lane they are unmapped here)."""
    lane = None
    try:
        lane, why = _open_lane(config, groups, hostname, remote, shares or [])
    finally:
        if lane is None:
            vmm_share.close_shares(shares)
    return lane, why


def _open_lane(config, groups, hostname: str, remote, shares: List[Any]):
    if config.device_copy != "auto":
        return None, "off (device_copy='off')"
    if "cuda" not in groups.mem_types:
        return None, "off (no local CUDA registrations)"
    if not any(remote.ipc or ()):
        return None, "off (the peer exported no CUDA IPC handles)"
    if hostname != socket.gethostname():
        return None, f"off (peer on host {hostname!r})"
    device = _first_cuda_device(groups)
    if device is None:
        return None, "off (no device ordinal for the local CUDA memory)"
    try:
        lane = DeviceLane(
            device,
            remote.ipc,
            remote.bases,
            remote.lens,
            [r.handle for r in groups.cuda_regions(device)],
            shares,
        )
    except Exception as exc:  # no torch / CUDA trouble: UCX carries everything
        log.info("no device lane to a same-host peer: %s", exc)
        return None, f"off ({type(exc).__name__}: {exc})"
    if not lane.active:
        why = lane.failures[0] if lane.failures else "no region mapped"
        lane.close()
        return None, f"off ({why})"
    return lane, f"active on cuda:{device} ({int(lane.mapped.astype(bool).sum())} regions)"
