"""One authenticated connection to a remote engine (symmetric after the handshake).

Invariants
- ``write`` validates every part (groups exist on both sides, ids in range, unique
  destinations, addresses inside the peer's registered regions) before one byte moves;
  then posts one native batch, flushes, and only then sends ``notify``: the peer's message
  handler therefore runs after the bytes are visible there. Where the peer takes chained
  notifications (:mod:`kvxfer.engine.notes`) the flush and the notify are one native
  chain (the flush's completion callback sends it; the loop sees only the end), with the
  same rule: nothing is sent unless the flush succeeded. Notifications leave in the order
  the writes were called (``EngineConfig.notify_order``, default): a write hands its notify
  over only after the previous notifying write's was (flushes of concurrent writes may
  complete out of order, e.g. over cuda_ipc).
- Every await is bounded (``timeout`` or the engine's ``transfer_timeout_s``) and also
  ends as soon as the peer is known dead (``PeerClosed``), whichever comes first.
- Messages from the peer reach the engine's handlers in arrival order, one at a time; those
  that arrived before the peer closed or died are still delivered (bounded by close grace).
- Staged parts (more PUTs than ``stage_min_ops``; see :mod:`kvxfer.engine.staging`): each
  chunk takes a landing slot the peer granted us (a slot is reused only after the peer's
  SlotFree for it), is gathered, PUT as one op, flushed, and its scatter plan is sent; the
  peer validates the plan, scatters and frees the slot before it dispatches anything that
  arrived after the plan (the notify), so handlers still run after the bytes are in place.
  A staged write that ends early (cancelled, timed out, failed) before its notify was
  handed over abandons its chunks whose plans are out: the peer drops those it has not
  scattered yet and every landing slot comes back (:mod:`kvxfer.engine.landing`); once
  the notify left, the chunks are scattered before it is delivered, as for a completed write.
- Same-host CUDA->CUDA ops go over the device lane when there is one
  (:mod:`kvxfer.engine.devcopy`); the write waits for its launch AND its UCX flush before
  ``notify``, so the same visibility rule holds for both lanes.
- ``close()`` is idempotent: goodbye (best effort, bounded), stop tasks, quiesce the RMA
  endpoint (every PUT of ours completes or fails; only then are its keys destroyed) and
  the device lane (its stream, then unmap), then close the channel (an orderly close: the
  peer learns that nothing more comes from us, and we wait, bounded, for the same from
  it); the engine's peer-closed handlers run exactly once per peer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import (
    Any,
    Coroutine,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

import numpy as np

from kvxfer import wire
from kvxfer.config import DEVICE_MIN_OPS, HOST_MIN_OPS, native_plan, spin_flushes
from kvxfer.engine import devcopy, hostcopy
from kvxfer.engine import messages as m
from kvxfer.engine.groups import RemoteGroups
from kvxfer.engine.host import PeerHost, resolved
from kvxfer.engine.landing import Chunk
from kvxfer.engine.notes import NoteBox, chainable
from kvxfer.engine.peer_staged import Reclaim, SliceScatter, StagedPath
from kvxfer.engine.slices import PatternRuns
from kvxfer.engine.staged_send import StagedLink
from kvxfer.engine.types import ItemWrite, PatternWrite, RawWrite, SliceWrite, TransferStats
from kvxfer.engine.writeplan import WritePlanner
from kvxfer.errors import (
    Closed,
    InvalidArgument,
    KvxferError,
    PeerClosed,
    ProtocolError,
    TransferTimeout,
)
from kvxfer.transport.base import Channel, RmaEndpoint
from kvxfer.transport.ucx_lib import native_helper

log = logging.getLogger(__name__)
_U64 = np.uint64
T = TypeVar("T")


class _Rest:
    """The rest of a message whose inline delivery (:meth:`Peer._deliver`) met a handler that
    returned an awaitable: the dispatcher awaits it before anything queued after it."""

    __slots__ = ("coro",)

    def __init__(self, coro: Any) -> None:
        self.coro = coro


class Peer:
    """One authenticated connection (see the module docstring); built by the engine, which
    hands it a :class:`~kvxfer.engine.host.PeerHost` (all it uses of the engine)."""

    def __init__(
        self,
        host: PeerHost["Peer"],
        channel: Channel,
        rma: RmaEndpoint,
        engine_id: str,
        name: str,
        hostname: str,
        remote: RemoteGroups,
        granted: Optional[dict] = None,
        notes: Optional[NoteBox] = None,
        shares: Optional[list] = None,
        verified: Optional[hostcopy.Verified] = None,
        unverified_why: str = "",
    ):
        """``shares``: the peer's VMM regions mapped for the device lane
        (:func:`kvxfer.engine.devcopy.fetch_shares`; the lane owns them); ``verified``: the
        peer checked for a host lane at the handshake (:func:`kvxfer.engine.hostcopy.verify`;
        the lane owns its pidfd), or None and ``unverified_why`` why not."""
        self._host = host
        self._config = config = host.config
        self._groups = groups = host.groups
        self._timeout = host.transfer_timeout_s
        self._channel = channel
        self._rma = rma
        self.id = engine_id
        self.name = name
        self.hostname = hostname
        self._remote = remote
        self._loop = asyncio.get_running_loop()
        self._dead: asyncio.Future = self._loop.create_future()
        self._waiters: set = set()  # futures of pending bounded waits, woken on death
        self._inbox: asyncio.Queue = asyncio.Queue()
        #: messages are handed to the engine's handlers inline when nothing is queued before
        #: them (:meth:`_deliver`): open between start() and the dispatcher's end, busy
        #: while one is being handled
        self._deliver_open = False
        self._delivering = False
        self._tasks: List[asyncio.Task] = []
        self._closing = False
        #: done once a teardown closed the endpoints; the task running it
        self._torn_down: Optional[asyncio.Future] = None
        self._tearer: Optional[asyncio.Task] = None
        self._notified = False
        #: chained notifications: ours to receive (token in our Layout) and the peer's token
        self._notes = notes
        if notes is not None:
            notes.attach(self._deliver)
        self._note_to = remote.note_token
        self._notes_sent = 0  # chained notifications completed (told to the peer in Bye)
        #: the last notifying write's gate: done once its notify was handed to UCX
        self._note_gate: Optional[asyncio.Future] = None
        self.lanes: List[str] = rma.lanes()
        #: flushes progressed by the transport's native poller (see config.FLUSH_PROGRESS)
        self.spin = spin_flushes(
            resolved(config.flush_progress, "flush_progress"), groups.mem_types, remote.types
        )
        #: the same-host device lane (kvxfer.engine.devcopy) and why there is / is not one
        self._dev, self.device_lane = devcopy.open_lane(config, groups, hostname, remote, shares)
        #: the same-host host lane (kvxfer.engine.hostcopy) and why there is / is not one
        self._hostl, self.host_lane = hostcopy.open_lane(
            groups,
            remote,
            verified,
            unverified_why,
            shm=any(lane.startswith(hostcopy.SHM_LANES) for lane in self.lanes),
        )
        # staged path: slots we granted the peer (target role) and slots it granted us
        self._granted_raw = granted or {}
        self._staged = StagedPath(
            StagedLink(
                name=name or engine_id,
                loop=self._loop,
                channel=channel,
                rma=rma,
                spin=self.spin,
                transfer_timeout_s=self._timeout,
                bounded=self._bounded,
                left=self._left,
                mark_dead=self._mark_dead,
            ),
            groups,
            self._granted_raw,
            remote.landing or {},
        )
        self._pattern_ok: Dict[str, bool] = {}  # can_pattern per group, resolved once
        self._host_ok: Dict[str, bool] = {}  # host_lane_covers per group, resolved once
        self._planner = WritePlanner(
            groups,
            remote,
            name or engine_id,
            self._staged.can_stage,
            self.can_pattern,
            self._host_pattern,
            native_helper("plan_items") if native_plan() else None,
        )

    # ------------------------------------------------------------ properties
    @property
    def remote_groups(self) -> Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        """``{name: (lens, item_lens)}`` of the peer's registered groups."""
        return {n: (g.lens, g.item_lens) for n, g in self._remote.groups.items()}

    @property
    def remote_num_items(self) -> Dict[str, int]:
        return {n: g.num_items for n, g in self._remote.groups.items()}

    @property
    def closed(self) -> bool:
        return self._dead.done()

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return f"Peer({self.name or self.id[:8]}, lanes={','.join(self.lanes)}, {state})"

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start receiving (the engine calls it once the peer is registered)."""
        self._channel.on_closed(self._on_channel_closed)
        self._rma.on_failed(self._on_channel_closed)
        self._dead.add_done_callback(lambda f: f.exception())  # never "never retrieved"
        self._tasks = [
            self._loop.create_task(self._reader(), name=f"kvxfer-recv-{self.id[:8]}"),
            self._loop.create_task(self._dispatcher(), name=f"kvxfer-dispatch-{self.id[:8]}"),
        ]
        self._deliver_open = True

    def _on_channel_closed(self, exc: Exception) -> None:
        """Runs on: the asyncio loop thread (the transport hops there before calling)."""
        self._mark_dead(exc if isinstance(exc, KvxferError) else PeerClosed(str(exc)))

    def _mark_dead(self, exc: Exception) -> None:
        if self._dead.done():
            return
        self._dead.set_exception(exc)
        waiters, self._waiters = self._waiters, set()
        for w in waiters:
            _wake(w, _DEAD)
        if not self._closing:  # died under us: release in the background (engine awaits it)
            self._host.spawn(self._teardown(send_bye=False))
        self._host.peer_gone(self, exc)

    async def _reader(self) -> None:
        try:
            while True:
                raw = await self._channel.recv(None)
                msg = wire.decode(raw)
                if isinstance(msg, m.AppMessage):
                    self._deliver(bytes(msg.payload))
                elif isinstance(msg, m.StagedWrite):
                    self._inbox.put_nowait(self._staged.check_plan(msg))
                elif isinstance(msg, m.SliceChunk):
                    self._inbox.put_nowait(self._staged.check_slice(msg))
                elif isinstance(msg, m.SlotFree):
                    self._staged.slot_freed(msg)
                elif isinstance(msg, m.SlotAbandon):
                    self._inbox.put_nowait(self._staged.abandon_received(msg))
                    await self._staged.at("abandon")
                elif isinstance(msg, m.SlotReclaimed):
                    self._staged.slot_reclaimed(msg)
                elif isinstance(msg, m.Bye):
                    if self._notes is not None and msg.notes > self._notes.received:
                        # its chained notifications travel outside the channel
                        got = await self._notes.wait_for(msg.notes, self._config.close_timeout_s)
                        if not got:
                            log.warning(
                                "peer %s: %d of %d chained notifications before its Bye",
                                self,
                                self._notes.received,
                                msg.notes,
                            )
                    self._mark_dead(
                        PeerClosed(
                            f"peer {self.name or self.id} closed{': ' + msg.reason if msg.reason else ''}"
                        )
                    )
                    return
                else:
                    raise ProtocolError(f"unexpected {msg.TAG} after the handshake")
        except asyncio.CancelledError:
            raise
        except ProtocolError as exc:
            log.warning("peer %s sent a bad message (%s); closing it", self, exc)
            self._mark_dead(exc)
        except KvxferError as exc:
            self._mark_dead(exc)

    def _deliver(self, payload: bytes) -> None:
        """An app message or chained notification, in arrival order: handed to the engine's
        handlers right here when nothing is queued or being handled before it (no task hop
        to the dispatcher), else queued behind the rest. A handler's awaitable (and the
        handlers after it) is queued first, so what arrives later still waits for it.
        Runs on: the loop thread (the reader task, or the transport's completion callback)."""
        if not self._deliver_open or self._delivering or not self._inbox.empty():
            self._inbox.put_nowait(payload)
            return
        self._delivering = True
        try:
            rest = self._host.dispatch_now(self, payload)
        finally:
            self._delivering = False
        if rest is not None:
            self._inbox.put_nowait(_Rest(rest))

    async def _dispatcher(self) -> None:
        try:
            while True:
                payload = await self._inbox.get()
                if payload is None:  # teardown: everything received before it was delivered
                    return
                self._delivering = True
                try:
                    await self._dispatch_one(payload)
                finally:
                    self._delivering = False
        finally:
            self._deliver_open = False

    async def _dispatch_one(self, payload: Any) -> None:
        if isinstance(payload, tuple):  # a validated scatter plan: drain before dispatching on
            await self._staged.scatter(*payload)
        elif isinstance(payload, SliceScatter):  # likewise, a validated slice chunk
            await self._staged.scatter_slice(payload)
        elif isinstance(payload, Reclaim):  # after every plan of the abandoned slot
            await self._staged.reclaim(payload)
        elif isinstance(payload, _Rest):  # the rest of a message handled inline
            await payload.coro
        else:
            await self._host.dispatch(self, payload)

    # ------------------------------------------------------------------ data
    def _check_open(self) -> None:
        if self._dead.done():
            exc = self._dead.exception()
            if isinstance(exc, Closed):
                raise Closed(f"peer {self.name or self.id} is closed")
            raise PeerClosed(f"peer {self.name or self.id} is gone: {exc}")

    def expect_slices(self, key: int, group: str, items: Any, runs: Any) -> None:
        """Accept :class:`SliceWrite` chunks from this peer under ``key``: the slices
        ``runs`` (OUR item-relative runs per descriptor, ``runs[d] = (offs, lens)``, no two
        overlapping) of ``items`` of ``group``, each item once. Chunks that name other items
        or byte counts close the peer (ProtocolError) before anything of them is written;
        the key is dropped once every item arrived, or by :meth:`forget_slices`."""
        self._check_open()
        self._staged.expect_slices(key, group, items, runs)

    def forget_slices(self, key: int) -> None:
        """Stop accepting slices under ``key`` (idempotent; e.g. when a request ends)."""
        self._staged.forget_slices(key)

    def accepts_slices(self, group: str) -> bool:
        """Whether we granted this peer landing slots of ``group`` (it may then send us
        slice writes we registered with :meth:`expect_slices`)."""
        return group in self._staged.granted and group in self._groups.stages

    def can_slice(self, group: str) -> bool:
        """Whether :class:`SliceWrite` of ``group`` can go to this peer (it granted us
        landing slots: both engines with ``stage_slice_min_ops > 0``)."""
        return self._staged.can_stage(group)

    def can_pattern(self, group: str) -> bool:
        """Whether a :class:`PatternWrite` of ``group`` to this peer is one device-lane launch
        (same host, every descriptor of the group local CUDA memory inside a region the lane
        mapped); otherwise its runs go as PUTs."""
        ok = self._pattern_ok.get(group)
        if ok is None:
            lg, rg = self._groups.groups.get(group), self._remote.groups.get(group)
            ok = (
                self._dev is not None
                and lg is not None
                and rg is not None
                and lg.count == rg.count
                and self._dev.covers(
                    self._groups.desc_memh[group],
                    rg.ptrs,
                    rg.lens,
                    self._remote.desc_region[group],
                )
            )
            self._pattern_ok[group] = ok
        return ok and self._dev is not None and self._dev.active

    def host_lane_covers(self, group: str) -> bool:
        """Whether the same-host host lane (:mod:`kvxfer.engine.hostcopy`) takes the runs of
        ``group`` to this peer: it is open and every descriptor of the group is host memory
        on both sides (a write of many short runs then costs a few system calls, not one
        per run: the disagg layer writes one-to-many head slices of such a group as runs,
        not staged)."""
        if self._hostl is None or self._hostl.closed:
            return False
        ok = self._host_ok.get(group)
        if ok is None:  # (the layouts are fixed for the peer's life: resolved once)
            memh, rg = self._groups.desc_memh.get(group), self._remote.desc_region.get(group)
            ok = (
                memh is not None
                and rg is not None
                and bool(self._hostl.select(np.asarray(memh, dtype=_U64), rg).all())
            )
            self._host_ok[group] = ok
        return ok

    def _host_pattern(self, group: str) -> bool:
        """Whether a PatternWrite of ``group`` goes to the host lane as its pattern
        (:meth:`~kvxfer.engine.hostcopy.HostLane.start_patterns`, unless
        ``$KVXFER_HOST_PATTERNS=0``) instead of expanded into runs."""
        return hostcopy.PATTERNS and self.host_lane_covers(group)

    def joins_launch(self, main: Sequence[PatternWrite], extra: PatternWrite) -> bool:
        """Whether PatternWrite ``extra`` (another group's: a request's state slices) would
        go in the same device-lane launch as ``main`` (one write's PatternWrites of one
        group: its kv piece classes) instead of a launch of its own
        (:meth:`~kvxfer.engine.devcopy.DeviceLane.launch_patterns`' rule; each pattern's
        table measured once: :meth:`~kvxfer.engine.devcopy.DeviceLane.joins`); False where a group has no pattern launch or a plan is not a
        validated :class:`~kvxfer.engine.slices.PatternRuns`. A caller with the choice
        writes such a part another way (its runs as PUTs: cheaper than a launch for a few)."""
        if not main or not self.can_pattern(main[0].group) or not self.can_pattern(extra.group):
            return False
        parts = [(w.group, w.runs) for w in (*main, extra)]
        if not all(isinstance(r, PatternRuns) for _, r in parts):
            return False
        assert self._dev is not None
        groups = {g for g, _ in parts}
        return self._dev.joins(parts[:-1], parts[-1], {g: self._lane_bases(g) for g in groups})

    def _lane_bases(self, group: str) -> Tuple[Tuple[int, ...], Tuple[int, ...], np.ndarray]:
        """``(local ptrs, remote ptrs, remote regions)`` of ``group``'s descriptors, as the
        device lane's pattern launches take them."""
        return (
            self._groups.groups[group].ptrs,
            self._remote.groups[group].ptrs,
            self._remote.desc_region[group],
        )

    def plan(self, writes: Iterable[Union[ItemWrite, RawWrite, PatternWrite]]):
        """Validate and plan ``writes`` (nothing is posted), all unstaged and as PUTs (a
        PatternWrite expanded). Returns the native arrays ``(laddr, raddr, nbytes, lmemh,
        ridx)``."""
        return self._planner.plan(writes, patterns=False)[:5]

    async def _bounded(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        """Await ``coro`` until done, ``timeout``, or the peer's death, whichever first.

        O(1) per call: the waiter joins the peer's ``_waiters`` set (a hash set) and
        ``_mark_dead`` wakes every member once; nothing is attached to the shared ``_dead``
        future (removing a done-callback from it is linear in the number of callbacks,
        which made thousands of writes in flight cost quadratic time). The inner task is
        owned: its outcome is always retrieved, also after it was abandoned."""
        if self._dead.done():
            coro.close()
            self._check_open()
        task = self._loop.create_task(coro)
        waiter = self._loop.create_future()
        task.add_done_callback(functools.partial(_task_done, waiter))
        try:
            await self._bounded_future(waiter, timeout, what)  # _DONE, or raises
        except BaseException:
            task.cancel()
            raise
        return task.result()

    async def _bounded_future(self, fut: asyncio.Future, timeout: float, what: str):
        """Await a transport future until it resolves, ``timeout``, or the peer's death.
        Lighter than :meth:`_bounded` (no task: the future itself is the waiter, woken by
        the transport, the timer or ``_mark_dead``); its result is the transport's value."""
        if self._dead.done():
            fut.cancel()
            self._check_open()
        if fut.done():  # ended inline (a flush in the starting call): no timer to arm
            res = fut.result()
        else:
            # (a cancelled timer stays in the loop's heap: armed for every write, it made a
            # guest's write wake the idle loop for nothing: LoopThread.run_here)
            timer = self._loop.call_later(timeout, _wake, fut, _TIMEOUT)
            self._waiters.add(fut)
            try:
                res = await fut
            finally:
                timer.cancel()
                self._waiters.discard(fut)
        if res is _DEAD:
            self._check_open()
        if res is _TIMEOUT:
            raise TransferTimeout(
                f"{what} to {self.name or self.id} not done after {timeout:.3g} s"
            )
        return res

    def _note_turn(self) -> Tuple[Optional[asyncio.Future], Optional[asyncio.Future]]:
        """Notifications leave in call order (``EngineConfig.notify_order``; concurrent
        writes may flush out of order: cuda_ipc): returns the previous notification's gate,
        which this one waits for before it is handed to UCX, and this one's, which its
        sender completes once it was handed over or given up; (None, None) when off."""
        if not self._config.notify_order:
            return None, None
        prev, self._note_gate = self._note_gate, self._loop.create_future()
        return prev, self._note_gate

    async def notify(self, payload: bytes, timeout: Optional[float] = None) -> None:
        """Deliver ``payload`` to the peer's message handlers as a write's notification
        without a write: where the peer takes chained notifications (and ``payload`` fits
        one), natively on the RMA endpoint — one active message, no flush, so it follows the
        bytes of every write that completed before this call, not those still in flight —
        else on the channel as :meth:`send`. Ordered with this peer's other notifications
        (``EngineConfig.notify_order``), not with :meth:`send`'s messages. Raises
        InvalidArgument, PeerClosed / TransferTimeout / TransportError."""
        self._check_open()
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"notify must be bytes, got {type(payload).__name__}")
        timeout = self._timeout if timeout is None else timeout
        gate_prev, gate = self._note_turn()
        try:
            if gate_prev is not None and not gate_prev.done():
                await self._bounded(asyncio.wait([gate_prev]), timeout, "notify order")
            fut = None
            if chainable(self._note_to, payload, False, True):
                fut = self._rma.note_future(self._note_to, bytes(payload))
            if fut is None:
                await self.send(payload, timeout)
                return
            if gate is not None:  # handed to UCX: later notifications may go behind it
                gate.set_result(None)
            await self._bounded_future(fut, timeout, "notify")
            self._notes_sent += 1
        except PeerClosed as exc:
            self._mark_dead(exc)
            raise
        finally:
            if gate is not None and not gate.done():
                gate.set_result(None)

    async def write(
        self,
        writes: Iterable[Union[ItemWrite, RawWrite, SliceWrite, PatternWrite]],
        notify: Optional[bytes] = None,
        timeout: Optional[float] = None,
        inline: bool = True,
    ) -> TransferStats:
        """Move the items, flush, then deliver ``notify`` to the peer's message handlers.
        Raises (before any byte moves) UnknownGroup / IndexOutOfRange / InvalidArgument;
        afterwards PeerClosed / TransferTimeout / TransportError. ``inline=False``: plan,
        launch and post, then suspend instead of first waiting on the calling stack (a
        device copy is polled once, not spun on; the flush + notify chain starts with no
        inline wait): a caller with more writes to start right after lets them go first."""
        self._check_open()
        timeout = self._timeout if timeout is None else timeout
        if notify is not None and not isinstance(notify, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"notify must be bytes, got {type(notify).__name__}")
        (laddr, raddr, nbytes, lmemh, ridx, staged, sliced, patterned, host_patterned, nb) = (
            self._planner.plan(writes, self._config.stage_min_ops)
        )
        for group, _, _, runs, _ in sliced:
            cap = self._staged.slice_cap(group)
            if runs.per_item > cap:
                raise InvalidArgument(
                    f"slice write of {group!r}: one item's slices ({runs.per_item} B) exceed "
                    f"the {cap}-byte staging slot"
                )
        stats = TransferStats(bytes=nb, ops=laddr.size, lanes=list(self.lanes))
        t0 = time.perf_counter()
        deadline = self._loop.time() + timeout
        launched = None
        cfg = self._config
        on_dev = (
            None
            if self._dev is None
            else self._dev.pick(
                lmemh,
                ridx,
                devcopy.lane_wanted(
                    laddr.size,
                    nbytes,
                    cfg.device_min_ops or DEVICE_MIN_OPS,
                    cfg.device_small_ops or 0,
                    cfg.device_min_bytes or 0,
                ),
            )
        )
        if on_dev is not None:
            assert self._dev is not None
            if on_dev.all():  # the usual case: every op on the lane, no column copied
                t_l = time.perf_counter()
                launched = self._dev.launch(laddr, raddr, nbytes, ridx)
                stats.launch_s += time.perf_counter() - t_l
                stats.device_ops = int(laddr.size)
                stats.device_bytes = int(nbytes.sum(dtype=_U64))
                laddr, raddr, nbytes, lmemh, ridx = (
                    c[:0] for c in (laddr, raddr, nbytes, lmemh, ridx)
                )
            elif on_dev.any():
                t_l = time.perf_counter()
                launched = self._dev.launch(
                    laddr[on_dev], raddr[on_dev], nbytes[on_dev], ridx[on_dev]
                )
                stats.launch_s += time.perf_counter() - t_l
                stats.device_ops = int(on_dev.sum())
                stats.device_bytes = int(nbytes[on_dev].sum(dtype=_U64))
                keep = ~on_dev
                laddr, raddr, nbytes, lmemh, ridx = (
                    laddr[keep],
                    raddr[keep],
                    nbytes[keep],
                    lmemh[keep],
                    ridx[keep],
                )
        if patterned:  # ONE launch for the PatternWrites of the write (kv; state that fits)
            assert self._dev is not None
            parts, bases = [], {}
            for group, src, dst, pattern in patterned:
                parts.append((pattern, src, dst, group))
                if group not in bases:
                    bases[group] = self._lane_bases(group)
                n = pattern.runs_per_item * int(src.size)
                b = pattern.bytes_per_item * int(src.size)
                stats.ops += n
                stats.device_ops += n
                stats.bytes += b
                stats.device_bytes += b
            t_l = time.perf_counter()
            launched = self._dev.launch_patterns(parts, bases)
            stats.launch_s += time.perf_counter() - t_l
        hosted: List[asyncio.Future] = []  # the host lane's copies (patterns, runs it took)
        try:
            if host_patterned:
                hosted.append(self._host_patterns(host_patterned, stats))
            min_ops = cfg.host_min_ops or HOST_MIN_OPS
            hl = self._hostl
            if (
                hl is not None
                # (no sum for cma's 1-page writes where no write is cut into parts)
                and (laddr.size >= min_ops or not hl.shm or hostcopy.may_cut())
                and hostcopy.lane_wanted(laddr.size, int(nbytes.sum(dtype=_U64)), min_ops, hl.shm)
            ):
                on_host = hl.select(lmemh, ridx)
                if on_host.any():
                    t_l = time.perf_counter()
                    sel = slice(None) if on_host.all() else on_host
                    name = self.name or self.id
                    hosted.append(hl.start(laddr[sel], raddr[sel], nbytes[sel], ridx[sel], name))
                    stats.launch_s += time.perf_counter() - t_l
                    stats.host_ops += int(on_host.sum())
                    stats.host_bytes += int(nbytes[sel].sum(dtype=_U64))
                    keep = ~on_host
                    laddr, raddr, nbytes, lmemh, ridx = (
                        c[keep] for c in (laddr, raddr, nbytes, lmemh, ridx)
                    )
        except BaseException as exc:
            await self._settle_copies(launched, hosted, deadline, exc)
            raise
        if stats.launch_s:
            stats.launched_ns = time.monotonic_ns()
        gate_prev, gate = self._note_turn() if notify is not None else (None, None)
        chunks: List[Chunk] = []  # staged chunks whose plans are out: given up on failure
        promised = False  # the notify was handed over: it vouches for every chunk
        try:
            try:
                stats.put_ns = time.monotonic_ns()
                if laddr.size:
                    self._rma.put(laddr, raddr, nbytes, lmemh, ridx)
                t1, m1 = time.perf_counter(), time.monotonic()
                stats.posted_ns = int(m1 * 1e9)
                spin = devcopy.WAIT_SPIN_S if inline else 0.0
                if launched is not None and not self._dev.settled(launched, spin):
                    await self._bounded(self._dev.wait(launched, 0.0), timeout, "device copy")
                for h in hosted:  # (waited through a task: the copy's own future resolves
                    if not h.done():  # only once its parts stopped, _settle_copies' wait)
                        await self._bounded(asyncio.wait([h]), timeout, "host copy")
                    h.result()
                for group, src, dst, direct_ops in staged:
                    chunks += await self._staged.write(group, src, dst, deadline, stats)
                    stats.staged_direct_ops += direct_ops
                for group, src, dst, runs, key in sliced:
                    chunks += await self._staged.write_slices(
                        group, src, dst, runs, key, deadline, stats
                    )
                if gate_prev is not None and not gate_prev.done():
                    await self._bounded(
                        asyncio.wait([gate_prev]),
                        self._left(deadline, "notify order"),
                        "notify order",
                    )
                chain = None
                # a device launch counts as posted: its bytes are visible (awaited above), the
                # flush of an idle endpoint completes at once and sends the notification natively
                if chainable(
                    self._note_to,
                    notify,
                    bool(staged or sliced),
                    bool(laddr.size) or launched is not None or bool(hosted),
                ):
                    assert notify is not None
                    promised = True
                    chain = self._rma.flush_notify_future(
                        self._note_to, bytes(notify), self.spin, inline
                    )
                if chain is not None:  # flush -> notify natively: one wake-up at the end
                    t_done = await self._bounded_future(chain, timeout, "flush + notify")
                    self._notes_sent += 1
                    notify = None
                    stats.flush_s = max(0.0, t_done - m1)
                    stats.wake_s = max(0.0, time.monotonic() - m1)
                elif laddr.size:
                    t_done = await self._bounded_future(
                        self._rma.flush_future(self.spin), timeout, "flush"
                    )
                    stats.flush_s = max(0.0, t_done - m1)
                    stats.wake_s = max(0.0, time.monotonic() - m1)
            except PeerClosed as exc:  # the endpoint failed: this peer is gone
                self._mark_dead(exc)
                raise
            if notify is not None:
                promised = True
                await self._bounded(
                    self._channel.send(m.AppMessage(payload=bytes(notify)).encode(), timeout),
                    timeout,
                    "notify",
                )
            if chunks:  # complete = bytes in their final place at the peer, as for direct PUTs
                await self._staged.at("drain")
                t = self._left(deadline, "staged write")
                await self._bounded(_all([c.drained for c in chunks]), t, "scatter at the peer")
            stats.post_s, stats.complete_s = t1 - t0, time.perf_counter() - t1
            return stats
        except BaseException as exc:
            # cancelled, timed out or failed before a notify vouched for the chunks: the peer
            # drops what it has not scattered yet and gives the landing slots back
            # (kvxfer.engine.peer_staged); after it, they are scattered before the notify
            if chunks and not promised and not self._dead.done():
                self._staged.abandon(chunks)
            if gate is not None and not gate.done():  # (later notifications go on)
                gate.set_result(None)
            await self._settle_copies(launched, hosted, deadline, exc)
            raise
        finally:
            if gate is not None and not gate.done():
                gate.set_result(None)

    async def _settle_copies(
        self,
        launched: Any,
        hosted: List[asyncio.Future],
        deadline: float,
        exc: BaseException,
    ) -> None:
        """A write failing after its device-lane copy was launched or its host-lane copies
        started: until those copies ended (bounded by the write's deadline), so that the
        failure is reported only once none of its bytes can still land in the peer's pages
        (their release may follow at once). Not for a cancellation, nor a timeout
        (the caller fences the write's pages, the copies maybe still running; the host
        lane's close stops its copies and waits for them); a copy still running at the
        deadline raises :class:`TransferTimeout` from ``exc`` (fenced the same way). A
        device lane closed meanwhile synchronised its stream first: the copy is done; a
        host-lane copy's future resolves only once each of its parts stopped copying."""
        for h in hosted:  # given up on: its outcome is retrieved when it ends
            h.add_done_callback(_retrieve)
        if isinstance(exc, (asyncio.CancelledError, TransferTimeout)):
            return
        running = []
        if not await self._device_copy_ended(launched, deadline):
            running.append("device copy")
        if not await _ended(hosted, deadline - self._loop.time()):
            running.append("host-lane copy")
        if running:
            raise TransferTimeout(
                f"write to {self.name or self.id} failed ({exc}) with its "
                f"{' and '.join(running)} still running at its deadline"
            ) from exc

    async def _device_copy_ended(self, launched: Any, deadline: float) -> bool:
        """:meth:`_settle_copies`' wait for the device-lane copy: whether it ended by
        ``deadline`` (True also without one, or when it can no longer write)."""
        dev = self._dev
        if launched is None:
            return True
        try:
            if dev is None or dev.closed or launched.query():
                return True
            left = deadline - self._loop.time()
            if left > 0:
                await asyncio.wait_for(dev.wait(launched, 0.0), left)
                return True
        except asyncio.TimeoutError:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:  # the launch itself failed (nothing in flight), or its lane
            return True  # closed meanwhile (its stream synchronised: the copy is done)
        return False

    def _host_patterns(self, parts, stats: TransferStats) -> asyncio.Future:
        """Start the host lane's copy of the planned PatternWrite ``parts`` (``(group, src,
        dst, runs)``) from their patterns, counted in ``stats``; its future."""
        hl = self._hostl
        assert hl is not None  # (host_lane_covers said so on this stack)
        todo = []
        for group, src, dst, runs in parts:
            rg = self._remote.groups[group]
            todo.append(
                (
                    runs,
                    src,
                    dst,
                    self._groups.groups[group].ptrs,
                    rg.ptrs,
                    rg.lens,
                    self._remote.desc_region[group],
                )
            )
            n, b = runs.runs_per_item * int(src.size), runs.bytes_per_item * int(src.size)
            stats.ops += n
            stats.host_ops += n
            stats.bytes += b
            stats.host_bytes += b
        t_l = time.perf_counter()
        fut = hl.start_patterns(todo, self.name or self.id)
        stats.launch_s += time.perf_counter() - t_l
        return fut

    def _left(self, deadline: float, what: str) -> float:
        left = deadline - self._loop.time()
        if left <= 0:
            raise TransferTimeout(f"{what} to {self.name or self.id}: deadline passed")
        return left

    async def send(self, payload: bytes, timeout: Optional[float] = None) -> None:
        """Application message (no RMA), delivered in order to the peer's handlers."""
        self._check_open()
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"payload must be bytes, got {type(payload).__name__}")
        timeout = self._timeout if timeout is None else timeout
        await self._bounded(
            self._channel.send(m.AppMessage(payload=bytes(payload)).encode(), timeout),
            timeout,
            "send",
        )

    async def close(self) -> None:
        """Say goodbye (bounded), release keys and endpoints; idempotent. Returns only once
        the endpoints are closed, also when a teardown was already under way (the peer died
        under us and one was spawned): a caller that fences on it (kvxfer.disagg releases a
        dead peer's pages after this) must not go on while the peer's last PUTs can still
        land."""
        if self._closing:
            done = self._torn_down
            if done is not None and not done.done() and asyncio.current_task() is not self._tearer:
                await asyncio.shield(done)
            return
        await self._teardown(send_bye=not self._dead.done())

    async def _teardown(self, send_bye: bool) -> None:
        if self._closing:
            return
        self._closing = True
        self._torn_down = self._loop.create_future()
        self._tearer = asyncio.current_task()
        try:
            await self._teardown_steps(send_bye)
        finally:
            if not self._torn_down.done():
                self._torn_down.set_result(None)

    async def _teardown_steps(self, send_bye: bool) -> None:
        grace = self._config.close_timeout_s
        if send_bye:
            try:
                bye = m.Bye(reason="closed", notes=self._notes_sent)
                await self._channel.send(bye.encode(), grace)
            except KvxferError:
                pass
        self._mark_dead(Closed(f"peer {self.name or self.id} closed locally"))
        await self._staged.close()  # background reclaims (they use the endpoint)
        current = asyncio.current_task()
        if self._tasks:  # deliver what already arrived (bounded), then stop both tasks
            reader, dispatcher = self._tasks
            reader.cancel()
            self._inbox.put_nowait(None)
            if dispatcher is not current:
                try:
                    await asyncio.wait_for(asyncio.shield(dispatcher), grace)
                except (asyncio.TimeoutError, Exception):
                    pass
        for t in self._tasks:
            if t is not current:
                t.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not current), return_exceptions=True)
        # quiesce both lanes first (the device lane's close waits for its stream): the
        # channel's close tells the peer that nothing more comes from us
        await self._rma.close(grace)
        if self._hostl is not None:
            await self._hostl.close(grace)
        if self._dev is not None:
            self._dev.close()
        await self._channel.close(grace)
        if self._notes is not None:  # the dispatcher is done: late notifications are dropped
            self._notes.close()
        self._groups.release_landing(self._granted_raw)
        self._granted_raw = {}


_DONE, _DEAD, _TIMEOUT = "done", "dead", "timeout"


async def _all(futures: List[asyncio.Future]) -> None:
    await asyncio.gather(*futures)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def _ended(futs: List[asyncio.Future], timeout: float) -> bool:
    """Whether every one of ``futs`` is done within ``timeout`` s (their outcomes left to
    their callbacks)."""
    running = [f for f in futs if not f.done()]
    if running and timeout > 0:
        _, pending = await asyncio.wait(running, timeout=timeout)
        return not pending
    return not running


def _wake(waiter: asyncio.Future, why: str) -> None:
    if not waiter.done():
        waiter.set_result(why)


def _task_done(waiter: asyncio.Future, task: asyncio.Task) -> None:
    """Done-callback of a bounded task: wake its waiter and always retrieve the outcome
    (an abandoned task that failed must not log "Task exception was never retrieved")."""
    if not task.cancelled():
        task.exception()
    _wake(waiter, _DONE)
