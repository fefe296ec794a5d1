"""Opt-in end-to-end integrity check: ``KVManager(..., integrity=True)`` on both sides.

A transfer that reports success with wrong bytes (a misplaced page, a stale page, a torn
write, a bad lane) is the worst failure of a disaggregated server: decode then produces
plausible gibberish. With integrity on, every item of a room is checksummed on both ends
(:mod:`kvxfer.kernels.checksum`: one batch per side and device for device memory, the numpy path for
host memory, chosen per buffer by where its memory lives) and compared before decode reports
``Success``:

* **prefill**, right before each write, checksums exactly the source items it is about to
  send (the chunk's kv pages; with the last chunk the state slots and the stamped aux row);
  the last write's ``Done`` carries them all (:attr:`messages.Done.sums`);
* **decode**, once ``Done`` arrived (so the bytes are visible) and the aux stamp matched,
  checksums its destination items and compares: a difference fails the room with
  :class:`~kvxfer.disagg.errors.IntegrityError` naming the first bad item;
* decode then sends prefill one :class:`~kvxfer.disagg.messages.Verdict` for every ``Done``
  it received, whatever ended the room; prefill holds its room (and its pages) until then
  and ends it with decode's outcome, so both schedulers see the same result.
* **heterogeneous TP** (a link with ``link.tp``): per prefill → decode pair, each item's
  checksum covers exactly the bytes that pair moves — the item's runs of
  :func:`kvxfer.disagg.tp_plan.item_runs`, one after the other as one stream
  (:func:`pair_sums`); both sides derive the same runs from the geometries validated at the
  handshake. The aux row counts only from the peer that writes it (0 from the others). A
  room with several peers checks and reports per leg (one Verdict per pair).

Invariants
- Both sides must agree: the setting is part of the manager's fingerprint, so a mismatch
  fails at connection time with :class:`~kvxfer.disagg.errors.LayoutMismatch` naming
  ``integrity``; a ``Done`` without checksums (or with a wrong count) fails the room.
- Off by default and then free: no checksum, no extra field on the wire, no verdict.
- Pages are released exactly as without the check: decode's room is released once its
  outcome is known (prefill has nothing in flight after ``Done``); prefill's once the
  verdict came, or its lease (``transfer_s``) ran out, or the peer is gone.
- Checksums of small host-memory requests and of device memory run on the manager's loop;
  large host-memory ones in the default executor, so the loop keeps serving other rooms.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from typing import Callable, Dict, List, Optional

import numpy as np

from kvxfer import errors as kerr
from kvxfer.disagg import errors as derr
from kvxfer.disagg import messages as m
from kvxfer.disagg.context import RoomOps
from kvxfer.disagg.errors import IntegrityError
from kvxfer.disagg.poll import KVPoll, is_terminal
from kvxfer.disagg.roles import RoomRole
from kvxfer.errors import KvxferError, ProtocolError, TransferAborted

log = logging.getLogger(__name__)

#: host-memory bytes checksummed on the loop itself; more go to the default executor
INLINE_HOST_BYTES = 1 << 20
GROUPS = ("kv", "state", "aux")
_OWED = "verdict owed"  # decode: Done arrived, prefill waits for our verdict


class _DeviceBatch:
    """The kernel's side of one CUDA device: a private stream, and pinned staging + device
    buffers for the task table and the per-task partial sums, grown geometrically and
    reused. One batch at a time (``lock``): the loop and executor threads may both compute.

    A batch is one H2D copy of the table, one launch per alignment class present, one D2H
    copy of the partials and one wait on this stream only, ordered after the calling
    thread's current stream; nothing is allocated per call once the buffers are big enough."""

    def __init__(self, dev: int) -> None:
        import torch

        self.dev = dev
        self.lock = threading.Lock()
        self.stream = torch.cuda.Stream(dev)
        self.rows = 0

    def _grow(self, rows: int) -> None:
        import torch

        rows = max(1024, 1 << (rows - 1).bit_length())
        self.h_tasks = torch.empty((rows, 4), dtype=torch.int64, pin_memory=True)
        self.d_tasks = torch.empty((rows, 4), dtype=torch.int64, device=f"cuda:{self.dev}")
        self.h_part = torch.empty(rows, dtype=torch.int32, pin_memory=True)
        self.d_part = torch.empty(rows, dtype=torch.int32, device=f"cuda:{self.dev}")
        self.rows = rows

    def run(self, tasks: np.ndarray, n: int, host_work: Callable[[], None]) -> np.ndarray:
        """uint32 ``[n]``: the table's sums per out index; ``host_work()`` runs while the
        device works."""
        import torch

        from kvxfer.kernels.checksum import add_partials, checksum_tasks, task_alignment

        t = tasks.shape[0]
        al = task_alignment(tasks)
        order = np.argsort(-al, kind="stable")  # 16-, then 4-, then 1-byte aligned
        tasks, al = tasks[order], al[order]
        with self.lock, torch.cuda.device(self.dev):
            caller = torch.cuda.current_stream(self.dev)
            if t > self.rows:
                self._grow(t)  # the old ones: nothing in flight
            self.stream.wait_stream(caller)  # after this thread's work
            h_tasks = self.h_tasks[:t]
            h_tasks.numpy()[:] = tasks
            try:
                with torch.cuda.stream(self.stream):
                    d_tasks = self.d_tasks[:t]
                    d_tasks.copy_(h_tasks, non_blocking=True)
                    lo = 0
                    for a in (16, 4, 1):
                        hi = lo + int(np.count_nonzero(al == a))
                        if hi > lo:
                            checksum_tasks(
                                d_tasks[lo:hi],
                                self.d_part[lo:hi],
                                a,
                                host_tasks=tasks[lo:hi],
                                per_task=True,
                            )
                        lo = hi
                    self.h_part[:t].copy_(self.d_part[:t], non_blocking=True)
                host_work()
            finally:
                self.stream.synchronize()  # staging reusable; partials here
            return add_partials(tasks, self.h_part[:t].numpy(), n)


class ItemSums:
    """Checksums of one descriptor group's items. Each descriptor is read where its memory
    lives (asked once, of the CUDA driver): host memory by the CPU (numpy path), device
    memory only by the kernel on its own device; the parts of an item add up modulo
    ``2**32``. :func:`item_sums` computes several groups with one batch per device."""

    def __init__(
        self, ptrs, lens, item_lens, batches: Optional[Dict[int, _DeviceBatch]] = None
    ) -> None:
        from kvxfer.kernels import cuda_driver
        from kvxfer.kernels.checksum import word_offsets

        self.ptrs = np.asarray(ptrs, dtype=np.int64)
        self.lens = np.asarray(item_lens, dtype=np.int64)
        self.pos0 = word_offsets(item_lens)
        where = np.array(
            [-1 if w is None else w for w in (cuda_driver.kernel_device(int(p)) for p in ptrs)],
            dtype=np.int64,
        )
        self.host = where < 0
        #: (rows view, first stream word) of each host descriptor, built once
        self._host_views = [
            (
                np.ctypeslib.as_array(
                    (ctypes.c_uint8 * int(lens[d])).from_address(int(ptrs[d]))
                ).reshape(-1, int(item_lens[d])),
                int(self.pos0[d]),
            )
            for d in np.flatnonzero(self.host)
        ]
        #: CUDA ordinal -> the descriptors whose memory lives there
        self.devices = {int(w): np.flatnonzero(where == w) for w in np.unique(where[where >= 0])}
        self.host_item_bytes = int(self.lens[self.host].sum())
        #: CUDA ordinal -> its batch (shared by the groups of one manager)
        self.batches = {} if batches is None else batches

    def device_tasks(self, dev: int, ids: np.ndarray, base: int) -> np.ndarray:
        """Task table of ``ids`` over this group's descriptors on ``dev``; out index
        ``base + position in ids``."""
        from kvxfer.kernels.checksum import item_tasks

        ds = self.devices[dev]
        tasks = item_tasks(self.ptrs[ds], self.lens[ds], self.pos0[ds], ids)
        tasks[:, 2] += base
        return tasks

    def add_host(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Add the host descriptors' part of each item of ``ids`` into ``out``."""
        from kvxfer.kernels.checksum import checksum_rows

        for rows, pos0 in self._host_views:
            out += checksum_rows(rows, pos0, ids)

    def sums(self, ids) -> np.ndarray:
        """uint32 checksum of each item in ``ids`` (host and device parts added)."""
        return item_sums([(self, ids)])[0]


def item_sums(parts) -> List[np.ndarray]:
    """uint32 checksums of ``(ItemSums, ids)`` pairs: one batch per CUDA device for all of
    them (its groups share ``batches``), the host parts computed while the devices work."""
    ids_of = [np.asarray(ids, dtype=np.int64).reshape(-1) for _, ids in parts]
    bounds = np.cumsum([0] + [len(i) for i in ids_of])
    total = np.zeros(int(bounds[-1]), dtype=np.uint32)

    def host_work() -> None:
        for (g, _), ids, lo in zip(parts, ids_of, bounds):
            if len(ids):
                g.add_host(ids, total[lo : lo + len(ids)])

    tables: Dict[int, list] = {}
    batches: Dict[int, _DeviceBatch] = {}
    for (g, _), ids, lo in zip(parts, ids_of, bounds):
        if not len(ids):
            continue
        for dev in g.devices:
            tables.setdefault(dev, []).append(g.device_tasks(dev, ids, int(lo)))
            if dev not in g.batches:
                g.batches[dev] = _DeviceBatch(dev)
            batches.setdefault(dev, g.batches[dev])
    for dev, ts in tables.items():
        tasks = np.concatenate(ts) if len(ts) > 1 else ts[0]
        total += batches[dev].run(tasks, total.size, host_work)
        host_work = _nothing
    host_work()
    return [total[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def _nothing() -> None:
    pass


def pair_sums(sums: "ItemSums", tp, group: str, ids, prefill_side: bool, salt: int) -> np.ndarray:
    """uint32 checksum of each item of ``ids`` (a group's items on one side of the pair
    ``tp``, a :class:`kvxfer.disagg.tp_rooms.TpPair`) over the bytes that pair moves: per
    descriptor, in order, the item's runs (``tp_plan.item_runs``) as one stream, each run
    padded to whole words. Host descriptors by numpy, device ones in one batch per device."""
    from kvxfer.disagg.tp_plan import item_runs
    from kvxfer.kernels.checksum import TILE_BYTES, checksum_rows

    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    out = np.zeros(ids.size, dtype=np.uint32)
    if not ids.size or group not in tp.src:
        return out
    host = dict(zip(np.flatnonzero(sums.host).tolist(), sums._host_views))
    dev_of = {int(d): dev for dev, ds in sums.devices.items() for d in ds}
    tables: Dict[int, list] = {}
    pos = 0
    for d, (s, t) in enumerate(zip(tp.src[group], tp.dst[group])):
        ro, rd, rn = item_runs(
            s, t, tp.prefill_rank, tp.decode_rank, tp.prefill_tp, tp.decode_tp, salt
        )
        offs = ro if prefill_side else rd
        words = -(-rn // 4)
        starts = pos + np.concatenate(([0], np.cumsum(words)[:-1])).astype(np.int64)
        pos += int(words.sum())
        if d in host:
            rows = host[d][0]
            for o, n, p0 in zip(offs.tolist(), rn.tolist(), starts.tolist()):
                out += checksum_rows(rows[:, o : o + n], p0, ids)
            continue
        k = -(-rn // TILE_BYTES)  # tiles per run
        run = np.repeat(np.arange(rn.size), k)
        t_off = (np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)) * TILE_BYTES
        task = np.empty((run.size, ids.size, 4), dtype=np.int64)
        base = int(sums.ptrs[d]) + ids * int(sums.lens[d])
        task[:, :, 0] = (offs[run] + t_off)[:, None] + base[None, :]
        task[:, :, 1] = np.minimum(TILE_BYTES, rn[run] - t_off)[:, None]
        task[:, :, 2] = np.arange(ids.size)[None, :]
        task[:, :, 3] = (starts[run] + t_off // 4)[:, None]
        tables.setdefault(dev_of[d], []).append(task.reshape(-1, 4))
    for dev, ts in tables.items():
        batch = sums.batches.setdefault(dev, _DeviceBatch(dev))
        out += batch.run(np.concatenate(ts), ids.size, _nothing)
    return out


class _Sending:
    """Prefill's per-room record: kv checksums so far, decode's verdict if it came early."""

    __slots__ = ("kv", "sent", "verdict")

    def __init__(self) -> None:
        self.kv: List[np.ndarray] = []
        self.sent = False
        self.verdict: Optional[m.Verdict] = None


class Integrity:
    """The integrity check of one manager (see module docstring)."""

    def __init__(self, mgr: RoomOps) -> None:
        from kvxfer.kernels.checksum import ALGORITHM

        self.mgr = mgr
        self.algorithm = ALGORITHM
        a = mgr.args
        batches: Dict[int, _DeviceBatch] = {}
        self.groups = {g: ItemSums(*a.group(g), batches=batches) for g in GROUPS}
        #: test hook: called with the room right before decode checksums its destination
        #: items (a test corrupts a byte there); None otherwise.
        #: Runs on: the manager's loop thread.
        self.before_check: Optional[Callable] = None

    # ------------------------------------------------------------------ computing
    def _sums(self, parts) -> List[np.ndarray]:
        """Runs on: the loop thread (small host work) or the default executor (see
        :meth:`_compute`)."""
        return item_sums([(self.groups[g], ids) for g, ids in parts])

    async def _compute(self, parts) -> List[np.ndarray]:
        host = sum(len(ids) * self.groups[g].host_item_bytes for g, ids in parts)
        if host <= INLINE_HOST_BYTES:
            return self._sums(parts)
        return await asyncio.get_running_loop().run_in_executor(None, self._sums, parts)

    # ------------------------------------------------------------------ prefill
    async def source(self, r, src, src_state, last: bool) -> Optional[bytes]:
        """Checksums of the source items of the write about to be issued; on the last
        chunk, the ``Done.sums`` payload of the whole room (else None). Fails ``r`` when
        they cannot be computed."""
        st = r.integrity if isinstance(r.integrity, _Sending) else _Sending()
        r.integrity = st
        parts = [("kv", src)]
        if last:
            parts += [("state", [] if src_state is None else src_state), ("aux", [r.aux_index])]
        try:
            tp = r.link.tp if r.link is not None else None
            if tp is not None:  # (the chunk's first page: the pages of the chunks before it)
                got = self._pair(r, tp, parts, True, first=r.pages_done)
            else:
                got = await self._compute(parts)
        except Exception as exc:  # a device or driver error
            self.mgr.fail(
                r,
                IntegrityError(
                    f"room {r.room}: could not compute checksums on {self.mgr.name}: {exc}",
                    room=r.room,
                ),
            )
            return None
        st.kv.append(got[0])
        if not last:
            return None
        return np.concatenate(st.kv + got[1:]).astype("<u4").tobytes()

    def _pair(self, r, tp, parts, prefill_side: bool, first: int = 0) -> List[np.ndarray]:
        """:func:`pair_sums` of ``parts`` (the aux row: its item sum from the peer that
        writes it, 0 from the others; kv pages that replicas share out, each page's sum from
        the replica whose block holds it, 0 from the others: ``first``, the index of the
        first of the kv ids among the room's pages). Runs on: the loop thread."""
        out = []
        for g, ids in parts:
            if g == "aux":
                writes = tp.writes_aux(r.room)
                out.append(self._sums([(g, ids)])[0] if writes else np.zeros(1, np.uint32))
            elif g == "kv" and tp.replicas(g) > 1:
                out.append(self._replica_sums(r, tp, ids, prefill_side, first))
            else:
                out.append(pair_sums(self.groups[g], tp, g, ids, prefill_side, r.room))
        return out

    def _replica_sums(self, r, tp, ids, prefill_side: bool, first: int) -> np.ndarray:
        """:meth:`_pair` of kv pages the replicas share out
        (:meth:`~kvxfer.disagg.tp_rooms.TpPair.replica_blocks`): the whole page's sum where
        this pair sends it, 0 elsewhere (as a pair that moves nothing of a page)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.zeros(ids.size, dtype=np.uint32)
        mine = tp.replica_blocks("kv", r.room, first, ids.size, len(r.dst_kv))
        sends = tp.sending_classes("kv")
        if sends and mine.any():  # (the class in which this pair sends every whole page)
            out[mine] = pair_sums(self.groups["kv"], tp, "kv", ids[mine], prefill_side, sends[0])
        return out

    def sent(self, r) -> None:
        """Prefill's last write completed: end the room on decode's verdict (now, if it is
        already here; else hold the room under its Transferring lease)."""
        st = r.integrity
        st.sent = True
        if st.verdict is not None:
            self._apply(r, st.verdict)
        else:
            self.mgr.arm(r)

    def on_verdict(self, link, msg: m.Verdict) -> None:
        r = self.mgr.rooms.get(msg.room)
        if r is not None and r.legs is not None:  # the leg of that decode peer
            r = r.legs.of(link, True)
        if (
            r is None
            or r.role is not RoomRole.SENDER
            or r.link is not link
            or is_terminal(r.state)
            or not isinstance(r.integrity, _Sending)
        ):
            log.debug("%s: verdict for room %d ignored (not awaiting one)", self.mgr.name, msg.room)
            return
        if r.integrity.sent:
            self._apply(r, msg)
        else:  # our write's completion is still on its way
            r.integrity.verdict = msg

    def _apply(self, r, msg: m.Verdict) -> None:
        mgr = self.mgr
        if msg.ok:
            mgr.advance(r, KVPoll.Success)
            mgr.release(r)
            return
        text = f"decode {r.link.name}: {msg.reason}"
        if msg.kind == IntegrityError.__name__:
            exc: KvxferError = IntegrityError(text, room=r.room)
        else:  # decode's error class, by name
            cls = getattr(derr, msg.kind, None) or getattr(kerr, msg.kind, None)
            if not (isinstance(cls, type) and issubclass(cls, KvxferError)):
                cls = TransferAborted
            exc = cls(text)
        mgr.fail(r, exc, notify=False)

    # ------------------------------------------------------------------ decode
    def done_arrived(self, r) -> None:
        """Decode got ``Done``: prefill now waits for our verdict (sent once r is terminal)."""
        r.integrity = _OWED
        if is_terminal(r.state):
            self._send_verdict(r)

    def terminal(self, r) -> None:
        """Manager hook: ``r`` just became terminal."""
        if r.integrity is _OWED:
            self._send_verdict(r)

    def _send_verdict(self, r) -> None:
        r.integrity = None
        ok = r.state == KVPoll.Success
        if r.link is not None:
            self.mgr.send_msg(
                r.link,
                m.Verdict(
                    room=r.room,
                    ok=ok,
                    reason="" if ok else str(r.exc),
                    kind="" if ok else type(r.exc).__name__,
                ),
            )

    def check(self, r, msg: m.Done) -> None:
        """Compare prefill's checksums with those of our destination items; reports Success
        or fails ``r`` (IntegrityError / ProtocolError), from a task the manager owns."""
        n_kv, n_state = len(r.dst_kv), len(r.dst_state)
        want = 4 * (n_kv + n_state + 1)
        if msg.sums is None or len(msg.sums) != want:
            got = "none" if msg.sums is None else f"{len(msg.sums)} bytes"
            self.mgr.fail(
                r,
                ProtocolError(
                    f"room {r.room}: integrity is on but prefill's Done carries {got} of "
                    f"checksums, expected {want} bytes ({n_kv} pages, {n_state} state slots, "
                    f"1 aux row)"
                ),
                notify=False,
            )
            return
        if self.before_check is not None:
            self.before_check(r)
        expected = np.frombuffer(msg.sums, dtype="<u4")
        parts = [("kv", r.dst_kv), ("state", r.dst_state), ("aux", [r.dst_aux_row])]
        self.mgr.spawn(self._verify(r, expected, parts))

    async def _verify(self, r, expected: np.ndarray, parts) -> None:
        mgr = self.mgr
        try:
            tp = r.link.tp if r.link is not None else None
            got = np.concatenate(
                self._pair(r, tp, parts, False) if tp is not None else await self._compute(parts)
            )
        except Exception as exc:  # a device or driver error: cannot verify
            if not is_terminal(r.state):
                mgr.fail(
                    r,
                    IntegrityError(
                        f"room {r.room}: could not compute checksums on {mgr.name}: {exc}",
                        room=r.room,
                    ),
                    notify=False,
                )
            return
        if is_terminal(r.state):
            return
        bad = np.flatnonzero(got != expected)
        if bad.size == 0:
            mgr.advance(r, KVPoll.Success)
            mgr.release(r)
            return
        i, k = int(bad[0]), 0
        while i >= len(parts[k][1]):  # the group and index of flat item i
            i -= len(parts[k][1])
            k += 1
        group, ids = parts[k]
        what = {"kv": "page", "state": "state slot", "aux": "aux row"}[group]
        mgr.fail(
            r,
            IntegrityError(
                f"room {r.room}: {group} item {i} (decode {what} {int(ids[i])}) has checksum "
                f"{int(got[bad[0]]):#010x}, prefill sent {int(expected[bad[0]]):#010x} "
                f"({bad.size} bad item(s)); data rejected",
                room=r.room,
                group=group,
                index=i,
            ),
            notify=False,
        )
