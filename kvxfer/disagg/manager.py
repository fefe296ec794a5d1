"""KVManager: owns one rank's transfer engine, its peers, its rooms and their deadlines.

One manager per rank and mode (prefill or decode). Everything that changes state runs on the
manager's event loop: either the caller's (``await mgr.start()``) or a private background
thread (``mgr.start_background()``) for schedulers that are not async. ``KVSender`` /
``KVReceiver`` calls made from another thread validate their arguments synchronously (typed
errors, nothing sent) and hand the rest to the loop without blocking — or, a small send
(and a sender's init and adoption) while the private loop waits for events, run it on the
calling thread as the loop's guest (:meth:`KVManager.call`, docs/engine.md "Guest runs");
``poll()`` reads a plain attribute and is safe from any thread.

Reliability: one timer per room (the deadline of its current state), one heartbeat task
per manager pinging every peer; a peer that closes, dies or stays silent past
``heartbeat_timeout_s`` fails all its rooms at once. Role-specific protocol lives in
:mod:`kvxfer.disagg.prefill_side` and :mod:`kvxfer.disagg.decode_side`; they (and the
integrity check) see this manager only through the Protocols of :mod:`kvxfer.disagg.context`.

Fenced release (the invariant every path keeps): a room's ``on_done`` runs only once no write
for it can still land in (decode) or read from (prefill) its items — after the peer said so
(Done, Abort, AbortAck, each sent only when nothing is in flight), or after the peer is gone
(it closed or died, and we closed our endpoints to it so that what it sent last has landed).

A peer we give up on while it may be alive (silent past ``heartbeat_timeout_s``, no abort ack
within ``abort_ack_s``, a write that timed out):

* prefill (the writer) *fences* it: closes the link's endpoints, then releases. Its own
  writes read its pages, and they have stopped once its endpoints are closed.
* decode (written into) *holds* it (:meth:`KVManager._hold`): its rooms fail at once
  (``poll()`` says Failed) but their pages, state slots and aux rows stay held — ``on_done``
  does not run — until the peer confirms each room or is gone. Closing our endpoints would
  not stop it: one-sided lanes (cma, cuda_ipc, the device lane's IPC-mapped copies, RDMA DC)
  write without our side taking part, so a frozen writer that resumes would still land its
  bytes. Its endpoints stay open so that, once it runs again, it answers each room's Abort.
  A peer that never runs again keeps them held until it dies or :meth:`close` runs.

``close()`` tells every peer, waits (``abort_ack_s``) for their answers, closes the engine,
and only then releases what is left (rooms still held are released with a warning: the
manager is going away, and with it the endpoints that could have confirmed them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from typing import Any, Callable, Coroutine, Dict, List, Optional, Set, Tuple, Union

from kvxfer import config, wire
from kvxfer.argcheck import as_int
from kvxfer.config import env_defaults
from kvxfer.disagg import messages as m
from kvxfer.disagg.aux import AuxRows, check_room
from kvxfer.disagg.context import IntegrityOps, Timeouts
from kvxfer.disagg.decode_side import DecodeSide
from kvxfer.disagg.handle import OnDone
from kvxfer.disagg.kv_args import KVArgs
from kvxfer.disagg.link import Link
from kvxfer.disagg.page_map import TokenGeometry
from kvxfer.disagg.poll import KVPoll, can_advance, is_terminal
from kvxfer.disagg.prefill_side import PrefillSide
from kvxfer.disagg.roles import DisaggMode, RoomRole
from kvxfer.disagg.rooms import Room, RoomTable
from kvxfer.disagg.trace import StageTrace
from kvxfer.disagg.trace import enabled as trace_enabled
from kvxfer.errors import (
    Closed,
    InvalidArgument,
    KvxferError,
    PeerClosed,
    ProtocolError,
    TransferTimeout,
)
from kvxfer.loop_thread import LoopThread

#: values of ``KVManager(tp_pattern=...)``
TP_PATTERN = ("auto", "always", "off")
#: default of ``KVManager(tp_stage_min_ops=...)``: a hetero-TP kv write of more PUTs than
#: this goes staged (head slices of NHD / page-major pages cost one PUT per token row)
TP_STAGE_MIN_OPS = 256
#: the kv group's staging memory for slice writes (per process: 4 landing slots of 16 MiB,
#: one granted per peer, and one staging slot; each chunk of a bigger write reuses them)
TP_STAGE_ENGINE: Dict[str, Any] = dict(
    stage_groups=("kv",), stage_slot_bytes=16 << 20, stage_slots=4, stage_peer_slots=1
)

# re-exported: their home moved below the manager, their public name did not
__all__ = ["DisaggMode", "KVManager", "Link", "Timeouts"]

log = logging.getLogger(__name__)
#: a room's timer that fires less than this before its deadline counts as on time
_EARLY_S = 1e-3


class KVManager:
    """Transfer manager of one rank. See module docstring for threading and reliability."""

    #: Test-only: ``test_hook(point, room)`` is called at named points of the protocol
    #: ("room_failed", "pending_retired", "abort_received", "decode_attached",
    #: "before_write", "before_layer_write", "closing" with room -1) so that a test can force
    #: an interleaving deterministically (block there while another thread acts, or freeze
    #: the process). None in production.
    #: Runs on: the manager's loop thread, or a scheduler thread running a direct call or a
    #: poll's take, or the transport's native receive thread, as the loop's guest
    #: (:meth:`call`, :meth:`take_arrived`, :meth:`take_natively`; set ``direct_pages = 0``,
    #: ``poll_takes = False`` and ``take_natively(False)`` to keep hooks on the loop).
    test_hook: Optional[Callable[[str, int], None]] = None

    def __init__(
        self,
        args: KVArgs,
        mode: Union[DisaggMode, str, Any],
        *,
        bootstrap_addr: Optional[str] = None,
        secret: Optional[Union[bytes, str]] = None,
        host: str = "127.0.0.1",
        port: int = 0,
        error_mode: str = "peer",
        timeouts: Optional[Timeouts] = None,
        name: Optional[str] = None,
        max_tombstones: int = 65536,
        integrity: bool = False,
        trace: Optional[bool] = None,
        tp_stage_min_ops: int = TP_STAGE_MIN_OPS,
        tp_pattern: str = "auto",
        direct_pages: Optional[int] = None,
        coalesce_after: Optional[int] = None,
        poll_takes: Optional[bool] = None,
        native_takes: Optional[bool] = None,
        host_copy: Optional[str] = None,
    ) -> None:
        """``mode``: :class:`DisaggMode`, SGLang's ``DisaggregationMode`` or
        ``"prefill"`` / ``"decode"``. ``trace``: record per-request stage timestamps
        (:mod:`kvxfer.disagg.trace`; None: ``$KVXFER_TRACE``), read by :meth:`drain_trace`.
        ``tp_stage_min_ops``: with a TP shape, a kv write to a peer of another TP size whose
        direct plan needs more PUTs than this (head slices inside token rows) goes staged
        as a :class:`~kvxfer.engine.types.SliceWrite` (docs/shapes.md "The staged path"),
        unless the peer's host lane takes the kv group's runs and each decode page gets one
        whole share (host memory on one host, one-to-many: a few system calls for all the
        runs beat the gather and scatter); 0: always direct.
        Both sides need it > 0 (it gives the kv group staging memory). ``host_copy``: the
        engine's :attr:`~kvxfer.config.EngineConfig.host_copy` (None: its default, "auto").
        ``tp_pattern``: where the kv pages are split, the write goes as
        :class:`~kvxfer.engine.types.PatternWrite` s before any of the above is considered:
        with a TP shape, a share that is not whole pages is one; at any TP (equal too), the
        byte runs of different page sizes or an unaligned decode prefix are one per piece
        class (:func:`kvxfer.disagg.page_map.piece_classes`, docs/shapes.md "Patterns at
        equal TP"). ``"auto"`` to a same-host peer whose device lane covers the kv group
        (CUDA on both sides: one copy launch each), ``"always"`` to any peer (without a lane
        the engine posts their expanded runs: the same bytes as the runs it replaces),
        ``"off"`` never. Whole pages and layer-wise sends keep their writes.
        ``direct_pages``: a ``KVSender.send`` of at most this many pages (and ``init``, and
        the sender's adoption of decode's metadata) runs on the calling thread while the
        manager's own loop thread (:meth:`start_background`) waits for events — planned and
        posted there, its flush + notification chained natively, without the wake-up of
        the loop thread in between; the call then takes as long as that (the plan and the
        post; on kvxfer's own worker the transport waits inline for the flush only
        ``KVXFER_GUEST_INLINE_US`` on such a thread: 50 µs; not for a polling scheduler's
        burst, :mod:`kvxfer.disagg.bursts`). 0: every call is
        handed to the loop. None: ``$KVXFER_DIRECT_PAGES``, else :data:`kvxfer.config.DIRECT_PAGES`.
        Figures: bench/results/direct-cpu.md; docs/engine.md, "Guest runs".
        ``coalesce_after`` (prefill): a room's last chunk that finds this many writes of
        ours in flight to its decode peer waits, and every room that finishes meanwhile goes
        with it as one write with one notification (:mod:`kvxfer.disagg.coalesce`); 0:
        every room its own write. None: ``$KVXFER_COALESCE_AFTER``, else
        :data:`kvxfer.config.COALESCE_AFTER`.
        ``poll_takes``: a ``KVSender`` / ``KVReceiver`` ``poll()`` of a room that is not
        terminal first handles what already arrived for this manager (a Done, a flush
        completion: :meth:`take_arrived`), so that a scheduler polling its rooms sees the
        new state without waiting for the loop thread to wake; only with the manager's own
        loop thread while it waits for events. None: ``$KVXFER_POLL_TAKES``, else
        :data:`kvxfer.config.POLL_TAKES` (on).
        ``native_takes``: with the manager's own loop thread (:meth:`start_background`)
        and a transport on kvxfer's own worker, that worker's receive thread handles what it
        just received (a Done, a flush completion) as the loop's guest when the loop waits
        for events, instead of waking the loop for it (:meth:`take_natively`); None:
        ``$KVXFER_NATIVE_TAKES``, else :data:`kvxfer.config.NATIVE_TAKES` (on)."""
        from kvxfer.config import resolve_secret

        if not isinstance(args, KVArgs):
            raise InvalidArgument(f"args must be KVArgs, got {type(args).__name__}")
        #: shared by the engines and the bootstrap server (``secret=`` or $KVXFER_SECRET)
        self.secret = resolve_secret(secret, "KVManager")
        self.mode = DisaggMode.parse(mode)
        if self.mode is DisaggMode.PREFILL and bootstrap_addr is None:
            raise InvalidArgument("a prefill KVManager needs bootstrap_addr to register at")
        self.args = args
        #: the kv pool's token geometry (None: none stated), made once: every room's page
        #: map uses it, and building it walks every descriptor's segments
        self.kv_geometry = TokenGeometry.of(args.kv_segments)
        self.bootstrap_addr = bootstrap_addr
        self.t = timeouts or Timeouts()
        self.name = name or f"{self.mode.value}-dp{args.dp_rank}-tp{args.tp_rank}"
        self._engine_kw = dict(
            secret=self.secret,
            host=host,
            port=port,
            error_mode=error_mode,
            connect_timeout_s=min(10.0, self.t.bootstrap_s),
            transfer_timeout_s=self.t.transfer_s,
            name=self.name,
            # a room's writes are chained (each starts once the previous one, its notification
            # included, completed), so its notifications are in order without the engine's
            # call-order gate; across rooms order means nothing, and the gate serialises
            # concurrent rooms' flushes (1-page req/s ~1.8x without it:
            # bench/results/stages-h200.md). KVXFER_NOTIFY_ORDER still decides when set.
            notify_order=env_defaults().get("notify_order", False),
        )
        if host_copy is not None:  # else EngineConfig's default ($KVXFER_HOST_COPY, "auto")
            self._engine_kw["host_copy"] = host_copy
        self.tp_stage_min_ops = (
            as_int(tp_stage_min_ops, "tp_stage_min_ops", 0) if args.tp_shape else 0
        )
        if self.tp_stage_min_ops:
            self._engine_kw.update(TP_STAGE_ENGINE, stage_slice_min_ops=self.tp_stage_min_ops)
        if tp_pattern not in TP_PATTERN:
            raise InvalidArgument(f"tp_pattern must be one of {TP_PATTERN}, got {tp_pattern!r}")
        self.tp_pattern = tp_pattern
        self.direct_pages = config.direct_pages(direct_pages)
        self.coalesce_after = config.coalesce_after(coalesce_after)
        self.poll_takes = config.poll_takes(poll_takes)
        self.native_takes = config.native_takes(native_takes)
        self.fingerprint: Dict[str, Any] = args.fingerprint()
        #: end-to-end checksums of every item (kvxfer.disagg.integrity); None when off
        self.integrity: Optional[IntegrityOps] = None
        if integrity:
            from kvxfer.disagg.integrity import Integrity

            self.integrity = Integrity(self)
            self.fingerprint["integrity"] = self.integrity.algorithm
        self.items = {g: args.num_items(g) for g in ("kv", "state", "aux")}
        self.aux = AuxRows(args.aux_data_ptrs[0], args.aux_data_lens[0], args.aux_item_lens[0])
        self.rooms = RoomTable(max_tombstones)
        self.trace: Optional[StageTrace] = StageTrace() if trace_enabled(trace) else None
        self.links: Dict[str, Link] = {}  # peer.id -> Link
        #: peer.id -> Link that decode gave up on but holds open (see _hold)
        self.held: Dict[str, Link] = {}
        self.engine: Any = None  # kvxfer.engine.TransferEngine once started
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_tid: Optional[int] = None
        self._thread: Optional[LoopThread] = None
        self._direct_lock = threading.Lock()  # stats["direct_calls"] (scheduler threads)
        #: time.monotonic() of the latest poll of one of this manager's rooms
        #: (``RoomHandle.poll``, on the scheduler's thread); 0.0: none yet
        self.polled_at = 0.0
        self._tasks: Set[asyncio.Task] = set()
        self._closed = False
        self._idle: Optional[asyncio.Future] = None  # close(): resolved when no room is left
        self.stats: Dict[str, Any] = {
            "succeeded": 0,
            "failed": 0,
            "bytes": 0,
            "ops": 0,
            "device_bytes": 0,  # of "bytes": copied by the same-host device lane
            "host_bytes": 0,  # of "bytes": copied by the same-host host lane
            "writes": 0,
            "direct_calls": 0,  # calls that ran as the loop's guest (:meth:`call`)
            # polls that handled arrived completions as the loop's guest (:meth:`take_arrived`)
            "poll_takes": 0,
            # receipts handled by the transport's native receive thread as the loop's guest
            # (:meth:`take_natively`)
            "native_takes": 0,
            # prefill: coalesced last-chunk writes and the rooms they carried
            # (kvxfer.disagg.coalesce; each also counts in "writes")
            "coalesced_writes": 0,
            "coalesced_rooms": 0,
            "coalesce_refused": 0,  # coalesced writes refused, then written room by room
            # prefill: writes of a polling scheduler's bursts (kvxfer.disagg.bursts) started
            # with no inline flush wait
            "burst_writes": 0,
            "lanes": set(),
        }
        #: the role-specific protocol; it sees this manager as a Prefill/DecodeContext
        self.side: Union[PrefillSide, DecodeSide] = (
            PrefillSide(self) if self.mode is DisaggMode.PREFILL else DecodeSide(self)
        )

    @property
    def direct_calls(self) -> int:
        """How many calls ran direct, as the loop's guest (``stats["direct_calls"]``)."""
        return self.stats["direct_calls"]

    @property
    def guest_wakes(self) -> int:
        """How many guest runs on the manager's own loop thread woke it afterwards
        (``LoopThread.guest_wakes``: they left it callbacks or an earlier timer); 0 without
        :meth:`start_background`."""
        lt = self._thread
        return 0 if lt is None else lt.guest_wakes

    def __repr__(self) -> str:
        return f"KVManager({self.name}, rooms={len(self.rooms)}, peers={len(self.links)})"

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> Optional[Tuple[str, int]]:
        return None if self.engine is None else self.engine.address

    @property
    def pattern_min_runs(self) -> int:
        """The data engine's ``device_min_ops`` (PrefillContext.pattern_min_runs)."""
        cfg = self.engine.config if self.engine is not None else None
        return int((cfg.device_min_ops if cfg is not None else None) or config.DEVICE_MIN_OPS)

    async def start(self) -> "KVManager":
        """Start the engine on the running loop (and register with bootstrap, prefill)."""
        if self.engine is not None:
            return self
        self.loop = asyncio.get_running_loop()
        self._loop_tid = threading.get_ident()
        self.engine = engine = self._make_engine()
        a = self.args
        # with token geometry a peer of another page size (other kv item sizes) pairs too;
        # with a TP shape a peer of another TP size (other kv / state item sizes) does
        engine.register(
            "kv",
            a.kv_data_ptrs,
            a.kv_data_lens,
            a.kv_item_lens,
            item_lens_may_differ=bool(a.kv_segments) or bool(a.tp_shape),
        )
        if a.state_data_ptrs:
            engine.register(
                "state",
                a.state_data_ptrs,
                a.state_data_lens,
                a.state_item_lens,
                item_lens_may_differ=bool(a.tp_shape),
            )
        engine.register("aux", a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens)
        engine.on_message(self._on_message)
        engine.on_peer_closed(self._on_peer_closed)
        await engine.start()
        self.spawn(self._heartbeat())
        try:
            await self.side.started()
        except BaseException:
            await self.close()  # nothing half-started stays behind
            raise
        log.info("%s started on %s", self.name, self.address)
        return self

    def _make_engine(self, **override: Any) -> Any:
        from kvxfer.engine import EngineConfig, TransferEngine

        return TransferEngine(EngineConfig(**dict(self._engine_kw, **override)))

    async def connect(self, host: str, port: int) -> Any:
        """Connect our engine to the peer engine at ``host:port``; its Peer."""
        return await self.engine.connect(host, port)

    async def message_engine(self, name: str) -> Any:
        """A started engine without registered memory whose messages and peer losses reach
        this manager (decode's refusals); the caller closes it."""
        engine = self._make_engine(name=name, port=0)
        engine.on_message(self._on_message)
        engine.on_peer_closed(self._on_peer_closed)
        await engine.start()
        return engine

    def start_background(self, timeout: float = 60.0) -> "KVManager":
        """Run the manager on a private event-loop thread (``kvxfer-<name>``, a
        :class:`~kvxfer.loop_thread.LoopThread`); returns once started. A failure of
        :meth:`start` is raised here; TransferTimeout past ``timeout``."""
        lt = LoopThread(f"kvxfer-{self.name}")
        lt.start(self.start(), timeout)
        self._thread = lt
        if self.native_takes:  # on the loop: ordered with its completion queue's making
            self.call_wait(self.take_natively, True, timeout=timeout)
        return self

    def take_natively(self, on: bool) -> bool:
        """Whether (``on``) the transport's native receive thread hands what it received
        to this manager as the loop's guest (:meth:`kvxfer.transport.base.Transport.
        take_natively`, :meth:`kvxfer.loop_thread.LoopThread.take_completions`): a Done
        then reaches its room, its ``on_done`` and the hooks on that thread with no wake-up
        of the loop, when the loop waits for events (else the loop handles it, as always).
        Returns whether the transport has such a thread. Needs :meth:`start_background`.
        Runs on: the loop thread, or any thread once the transport's completion queue
        exists (a pointer swap under the GIL; a test switches it while a hook holds the
        loop)."""
        lt, engine = self._thread, self.engine
        if lt is None or engine is None:
            return False
        if not on:
            return bool(engine.transport.take_natively(None))
        me = weakref.ref(self)  # (the native queue holds the callable: no cycle through it)

        def take() -> None:  # Runs on: the native receive thread, holding the GIL
            mgr = me()
            if mgr is None or mgr._closed:
                return
            lt, engine = mgr._thread, mgr.engine
            if lt is not None and engine is not None and lt.take_completions(engine.transport):
                with mgr._direct_lock:
                    mgr.stats["native_takes"] += 1

        return bool(engine.transport.take_natively(take))

    async def close(self) -> None:
        """Fail every live room (Closed) and tell its peer; wait up to ``abort_ack_s`` for
        the peers' answers (or deaths); close peers and the engine; release what is left
        only then (see the module docstring: fenced release). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.loop is None:
            return
        cause = Closed(f"manager {self.name} closed")
        for r in self.rooms.rooms():
            self.fail(r, cause)
        self.hook("closing", -1)
        if len(self.rooms):
            self._idle = self.loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._idle), self.t.abort_ack_s)
            except asyncio.TimeoutError:
                log.warning(
                    "%s: closing with %d rooms unconfirmed by their peers after %.1fs",
                    self.name,
                    len(self.rooms),
                    self.t.abort_ack_s,
                )
        await self.side.closing()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.engine is not None:
            await self.engine.close()
        for link in list(self.held.values()):
            log.warning(
                "%s: releasing %d rooms held for %s, which never confirmed them: a peer that "
                "resumes could still write to them over a one-sided lane",
                self.name,
                len(link.rooms),
                link.name,
            )
        self.held.clear()
        for r in _with_legs(self.rooms.rooms()):  # no endpoint is left to write through
            if r.link is not None:
                r.link.fencing = False
            if is_terminal(r.state):
                self.release(r)
            else:
                self.fail(r, cause, notify=False, peer_gone=True)

    def close_background(self, timeout: float = 30.0) -> None:
        """:meth:`close` on the background loop (waits up to ``timeout``), then stop and join
        its thread; a no-op unless :meth:`start_background` started it."""
        if self._thread is None or self.loop is None:
            return
        self._thread.submit(self.close()).result(timeout)
        self._thread.stop(timeout)
        self._thread = None

    def submit(self, coro: Coroutine[Any, Any, Any]) -> "concurrent.futures.Future[Any]":
        """Run ``coro`` (e.g. a ``Peer.write`` of :attr:`engine`) on the manager's loop from
        another thread; returns a future of its outcome. On the manager's own loop thread
        (:meth:`start_background`) its first step runs right here as the loop's guest when
        the loop waits for events (:meth:`LoopThread.submit_here`: a write whose flush ends
        inline finishes before this returns), else on the loop, in submission order; on a
        foreign loop it is handed over (``run_coroutine_threadsafe``).
        Runs on: any thread but the loop's."""
        lt = self._thread
        if lt is not None:
            return lt.submit_here(coro)
        return asyncio.run_coroutine_threadsafe(coro, self._running_loop())

    def loop_cpu_seconds(self) -> float:
        """CPU time the background loop's thread has used so far (callable from any thread);
        0.0 unless :meth:`start_background` started it (``LoopThread.cpu_seconds``)."""
        lt = self._thread
        return 0.0 if lt is None else lt.cpu_seconds()

    # ------------------------------------------------------------------ loop helpers
    def in_loop(self) -> bool:
        """On the loop's thread, or in a guest run of the loop (:meth:`call`'s ``direct``)."""
        if threading.get_ident() == self._loop_tid:
            return True
        lt = self._thread
        return lt is not None and lt.in_loop()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self.loop is None:
            raise Closed(f"manager {self.name} is not started")
        if self._closed:
            raise Closed(f"manager {self.name} is closed")

    def held_rooms(self) -> int:
        """How many rooms decode failed but still holds for a peer that may still write to
        them (:meth:`_hold`): their items return once the peer confirms or is gone. A
        snapshot, readable from any thread."""
        return sum(len(link.rooms) for link in list(self.held.values()))

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            raise Closed(f"manager {self.name} is not started")
        return self.loop

    def call(self, fn: Callable[..., Any], *args: Any, direct: bool = False) -> None:
        """Run ``fn(*args)`` on the loop: now if we are on it, else soon (non-blocking).
        ``direct``: a short step the caller would wait a loop wake-up for (a small send):
        when the manager runs on its own :class:`~kvxfer.loop_thread.LoopThread`, that loop
        waits for events and every call handed over before has run, ``fn`` runs now on the
        calling thread as a guest of the loop (:meth:`LoopThread.call`); otherwise it is
        handed over as usual. Calls from one thread run in the order they were made either
        way; an exception of ``fn`` goes to the loop's exception handler either way.

        Runs on: any thread (the scheduler's, a test's, the loop's own)."""
        self._check_open()
        if self.in_loop():
            fn(*args)
            return
        lt = self._thread
        if lt is None:  # a foreign loop: no guests there, so plain hand-over keeps the order
            self._running_loop().call_soon_threadsafe(fn, *args)
        elif lt.call(fn, *args, direct=direct):
            with self._direct_lock:
                self.stats["direct_calls"] += 1

    def take_arrived(self) -> bool:
        """Handle the completions and notifications that already reached this manager's
        transport (:meth:`~kvxfer.transport.base.Transport.take_completions`: a Done
        decoded and acted on, a flush's future resolved), now, on the calling thread as the
        loop's guest; returns whether it did. Only with :attr:`poll_takes`, the manager's
        own loop thread (:meth:`start_background`) and that loop waiting for events (else
        the loop handles them on its wake-up, as always). Cheap when nothing arrived: one
        native read, no lock of the loop's. Runs on: any thread but the loop's (the
        scheduler's, from ``poll()``)."""
        lt, engine = self._thread, self.engine
        if not self.poll_takes or lt is None or engine is None or self._closed:
            return False
        if not lt.take_completions(engine.transport):
            return False
        with self._direct_lock:
            self.stats["poll_takes"] += 1
        return True

    def call_wait(self, fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        """Run ``fn(*args)`` on the loop and return its result (blocks a foreign thread).

        Runs on: any thread; ``fn`` runs on the loop thread."""
        self._check_open()
        if self.in_loop():
            return fn(*args)
        cf: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                cf.set_result(fn(*args))
            except BaseException as exc:
                cf.set_exception(exc)

        self.call(run)
        return cf.result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> "asyncio.Task[Any]":
        """A task on the loop owned by this manager (cancelled by :meth:`close`)."""
        task = self._running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        """Runs on: the loop thread (the done callback of a spawned task)."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: background task failed", self.name, exc_info=task.exception())

    def count_write(self, stats: Any, rooms: int = 0) -> None:
        """Add a completed write's TransferStats to :attr:`stats`; ``rooms`` > 0: a
        coalesced write of that many rooms (kvxfer.disagg.coalesce). Runs on: the loop
        thread (or its guest)."""
        st = self.stats
        st["writes"] += 1
        st["bytes"] += int(getattr(stats, "bytes", 0))
        st["ops"] += int(getattr(stats, "ops", 0))
        st["device_bytes"] += int(getattr(stats, "device_bytes", 0))
        st["host_bytes"] += int(getattr(stats, "host_bytes", 0))
        st["lanes"].update(getattr(stats, "lanes", ()) or ())
        if rooms:
            st["coalesced_writes"] += 1
            st["coalesced_rooms"] += rooms

    def hook(self, point: str, room: int) -> None:
        """Call :attr:`test_hook` (tests only; a no-op otherwise). Runs on: the loop thread."""
        if self.test_hook is not None:
            self.test_hook(point, room)

    def send_msg(self, link: Link, msg: wire.Message) -> None:
        """Fire-and-forget app message; a failure fails the link (and its rooms)."""
        if not link.dead:
            self.spawn(self._send(link, msg.encode()))

    async def _send(self, link: Link, payload: bytes) -> None:
        try:
            await link.peer.send(payload)
        except (KvxferError, OSError) as exc:
            self.link_failed(link, exc if isinstance(exc, KvxferError) else PeerClosed(str(exc)))

    # ------------------------------------------------------------------ rooms
    def new_room(self, room: int, on_done: Optional[OnDone]) -> Room:
        """Create the room record of this manager's handle (KVSender on prefill, KVReceiver
        on decode); non-blocking, DuplicateRoom raised here.

        Runs on: the caller's thread (the scheduler's)."""
        room = check_room(room)
        self._check_open()
        # the record exists before the room: an adoption run right away (as the loop's
        # guest) makes the legs of a room with several decode peers, each with its own
        trace = self.trace.start(room, self.mode.value) if self.trace is not None else None
        return self.side.new_room(room, on_done, trace)

    def drain_trace(self) -> List[Dict[str, Any]]:
        """The stage records of the rooms made since the last drain (at most the store's
        bound, the newest), as plain dicts; [] when tracing is off. Runs on: any thread."""
        return [] if self.trace is None else self.trace.drain()

    def advance(
        self, r: Room, state: KVPoll, exc: Optional[BaseException] = None, arm: bool = True
    ) -> bool:
        """Move ``r`` forward (or to Failed), re-arm its deadline, wake waiters on terminal.
        ``arm=False`` (a non-terminal ``state`` only): the caller arms the new state's deadline
        itself before the loop runs again, unless the room moved on by then (the old
        deadline, still armed, cannot fire in between)."""
        if not can_advance(r.state, state):
            return False
        r.state = state if type(state) is KVPoll else KVPoll(state)
        if exc is not None:
            r.exc = exc
        if arm or is_terminal(state):
            self.arm(r)
        if is_terminal(state):
            if r.parent is None:  # a leg counts through its room
                self.stats["succeeded" if state == KVPoll.Success else "failed"] += 1
            if self.integrity is not None:
                self.integrity.terminal(r)
            waiters, r.waiters = r.waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(r.state)
        if state == KVPoll.Success and r.parent is not None:
            self.side.leg_succeeded(r)  # its room succeeds once every leg did
        return True

    def arm(self, r: Room, seconds: Optional[float] = None) -> None:
        """(Re)start the deadline of ``r``'s current state; terminal rooms have none unless
        ``seconds`` is given (waiting for an abort ack). The armed timer stays when it fires
        no later than the new deadline (it re-arms itself for the rest, :meth:`_expired`);
        a room makes a new timer only when its deadline moves earlier."""
        if seconds is None:
            if is_terminal(r.state) or (r.legs is not None and r.legs.complete):
                r.due = None  # a room with all its legs: the legs carry the deadlines
                if r.timer is not None:
                    r.timer.cancel()
                    r.timer = None
                return
            t = self.t
            st = r.state
            seconds = (
                t.bootstrap_s
                if st == KVPoll.Bootstrapping
                else t.waiting_s
                if st == KVPoll.WaitingForInput
                else t.transfer_s
            )
            if r.role is RoomRole.RECEIVER and st != KVPoll.Bootstrapping:
                seconds += t.decode_grace_s + (
                    t.bootstrap_s if r.meta_sent and st == KVPoll.WaitingForInput else 0.0
                )
        loop = self._running_loop()
        when = loop.time() + seconds
        r.due = (when, r.state, seconds)
        timer = r.timer
        if timer is not None:
            if timer.when() <= when:
                return  # fires first and re-arms for the rest
            timer.cancel()
        r.timer = loop.call_at(when, self._expired, r)

    def _expired(self, r: Room) -> None:
        """A room's timer fired: its deadline passed, or (moved later since the timer was
        armed) the timer re-arms for the rest. Runs on: the loop thread (a timer)."""
        r.timer = None
        if r.released or r.due is None:
            return
        when, state, seconds = r.due
        loop = self._running_loop()
        if when - loop.time() > _EARLY_S:
            r.timer = loop.call_at(when, self._expired, r)
            return
        r.due = None
        if is_terminal(r.state):  # no abort ack: the peer may still write
            link = r.link
            if link is None or link.dead:
                self.release(r)
                return
            log.warning(
                "%s: room %d: no abort ack from %s within %.1fs; giving up on it",
                self.name,
                r.room,
                link.name,
                seconds,
            )
            self.link_failed(
                link,
                TransferTimeout(
                    f"peer {link.name}: no abort ack for room {r.room} within {seconds:g}s"
                ),
                fence=True,
            )
            return
        self.fail(
            r,
            TransferTimeout(
                f"room {r.room}: {state.name} for more than {seconds:g}s on {self.name}"
            ),
        )

    def fail(
        self, r: Room, exc: BaseException, *, notify: bool = True, peer_gone: bool = False
    ) -> None:
        """Fail ``r`` (sticky) and release it once no write can touch its pages any more.
        ``notify``: tell the peer; ``peer_gone``: the peer can no longer write (release now)."""
        if r.role is RoomRole.PENDING:
            assert isinstance(self.side, PrefillSide)  # only prefill holds pending records
            self.side.fail_pending(r, exc, notify=notify, peer_gone=peer_gone)
            return
        if is_terminal(r.state):
            if peer_gone and not r.released:
                self.release(r)
            return
        log.info("%s: room %d failed: %s", self.name, r.room, exc)
        self.hook("room_failed", r.room)
        self.advance(r, KVPoll.Failed, exc)
        self.side.after_fail(r, notify=notify, peer_gone=peer_gone)
        parent = r.parent
        if parent is not None and not is_terminal(parent.state):
            self.fail(parent, exc)  # a leg's failure is its room's; the other legs hear it

    def release(self, r: Room) -> None:
        """Terminal and safe: drop the room, run the scheduler's ``on_done`` exactly once
        (on this, the loop thread)."""
        if r.released:
            return
        # decode: prefill confirmed nothing is in flight for it (prefill's own writes are
        # what its fence waits for, whatever decode said)
        confirmed = r.peer_aborted and r.role is RoomRole.RECEIVER
        if r.link is not None and r.link.fencing and not confirmed:
            r.held = True  # released by _fence once the link is closed, or by _hold's end
            return
        if r.legs is not None and not r.legs.all_released():
            return  # released by its last leg's release (kvxfer.disagg.tp_rooms)
        r.released = True
        if r.timer is not None:
            r.timer.cancel()
            r.timer = None
        if r.link is not None:
            r.link.rooms.discard(r)
            if r.link.tp is not None and r.role is RoomRole.RECEIVER:
                r.link.peer.forget_slices(r.room)  # nothing more comes for it
            if r.link.held and not r.link.rooms:
                self._end_hold(r.link)  # every room confirmed
        if r.parent is None:
            self.rooms.remove(r, "aborted" if r.state == KVPoll.Failed else "done")
        if r.on_done is not None:
            try:
                r.on_done(r.state, r.exc)
            except Exception:
                log.exception("%s: on_done callback of room %d raised", self.name, r.room)
        self.room_gone()

    def room_gone(self) -> None:
        """A room left the table: wake close() once none is left."""
        if self._idle is not None and not self._idle.done() and not len(self.rooms):
            self._idle.set_result(None)

    # ------------------------------------------------------------------ peers
    def _on_message(self, peer: Any, payload: bytes) -> None:
        """The engines' message handler. Runs on: the loop thread."""
        try:
            msg = wire.decode(payload)
        except ProtocolError as exc:
            log.warning("%s: dropped malformed message from %s: %s", self.name, peer.id, exc)
            return
        link = self.links.get(peer.id) or self.held.get(peer.id)
        if link is not None:
            link.last_heard = time.monotonic()
        if isinstance(msg, m.Ping):
            return
        try:
            self.side.on_message(peer, link, msg)
        except KvxferError as exc:
            log.warning("%s: rejected %s from %s: %s", self.name, msg.TAG, peer.id, exc)

    def _on_peer_closed(self, peer: Any, exc: BaseException) -> None:
        """The engines' peer-lost handler. Runs on: the loop thread."""
        held = self.held.get(peer.id)
        if held is not None:  # gone at last: what it sent lands before our close returns
            log.info("%s: held peer %s is gone: %s", self.name, held.name, exc)
            self._end_hold(held)
            return
        link = self.links.get(peer.id)
        if link is not None:
            self.link_failed(
                link,
                exc
                if isinstance(exc, KvxferError)
                else PeerClosed(f"peer {link.name or peer.id} closed: {exc}"),
            )

    def link_failed(self, link: Link, exc: BaseException, *, fence: bool = False) -> None:
        """The peer behind ``link`` is gone: fail all its rooms. ``fence``: it may still be
        alive (silent, no ack, a write timed out): prefill closes its endpoints first and
        releases its rooms once that is done; decode holds them (:meth:`_hold`)."""
        if link.dead:
            return
        if fence and self.mode is DisaggMode.DECODE and not self._closed:
            self._hold(link, exc)
            return
        # decode (the side written into) always fences: the peer's last PUTs can still sit
        # unprocessed on the data endpoint when a control path reports the loss, so its
        # rooms are released only once our endpoints to it are closed (what arrived by then
        # lands in pages still held)
        fence = fence or self.mode is DisaggMode.DECODE
        link.dead = True
        link.fencing = fence
        peer_id = getattr(link.peer, "id", None)
        if peer_id is not None:
            self.links.pop(peer_id, None)
        self.side.link_lost(link)
        log.log(
            logging.WARNING if link.rooms and not self._closed else logging.INFO,
            "%s: lost peer %s (%d rooms): %s",
            self.name,
            link.name,
            len(link.rooms),
            exc,
        )
        for r in list(link.rooms):
            self.fail(r, exc, notify=False, peer_gone=True)
        if fence:
            self.spawn(self._fence(link))

    def _hold(self, link: Link, exc: BaseException) -> None:
        """Decode gives up on a peer that may still be alive: fail its rooms now, hold their
        items until it confirms each (Done, Abort or AbortAck: sent only once nothing is in
        flight for that room) or is gone (:meth:`_on_peer_closed`), then close the link. Its
        endpoints stay open meanwhile, its rooms have no deadline, and it gets no pings.
        Runs on: the loop thread."""
        link.dead = link.fencing = link.held = True
        peer_id = getattr(link.peer, "id", None)
        if peer_id is not None:
            self.links.pop(peer_id, None)
            self.held[peer_id] = link
        self.side.link_lost(link)
        log.log(
            logging.WARNING if link.rooms else logging.INFO,
            "%s: gave up on peer %s (%d rooms; their items are held until it confirms them "
            "or is gone): %s",
            self.name,
            link.name,
            len(link.rooms),
            exc,
        )
        for r in list(link.rooms):
            if is_terminal(r.state):
                self.release(r)  # held (or released: confirmed already)
            else:
                self.fail(r, exc, notify=False)
        for room in sorted({r.room for r in link.rooms if not r.peer_aborted}):
            # the peer answers each: an AbortAck, or its own Abort or Done
            abort = m.Abort(room=room, reason=str(exc), kind=type(exc).__name__)
            self.spawn(self._send(link, abort.encode()))
        if link.held and not link.rooms:  # nothing to hold (release() may have ended it)
            self._end_hold(link)

    def _end_hold(self, link: Link) -> None:
        """Nothing is left to hold (every room confirmed, or the peer is gone): close the
        link; :meth:`_fence` releases what is still held once that is done."""
        link.held = False
        self._unhold(link)
        if not self._closed:
            self.spawn(self._fence(link))

    def _unhold(self, link: Link) -> None:
        peer_id = getattr(link.peer, "id", None)
        if peer_id is not None and self.held.get(peer_id) is link:
            del self.held[peer_id]

    async def _fence(self, link: Link) -> None:
        # if close() cancels this, it releases the held rooms itself after the engine closed
        await self._close_peer(link)
        link.fencing = False
        self._unhold(link)
        for r in list(link.rooms):
            if r.held:
                self.release(r)

    async def _heartbeat(self) -> None:
        """Ping every peer each interval; fail a peer silent for ``heartbeat_timeout_s``.
        Time during which this loop itself was stalled (a busy or starved process) is not
        held against peers: their messages may be sitting unread in our own queue."""
        seq = 0
        interval = self.t.heartbeat_interval_s
        prev = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            seq += 1
            now = time.monotonic()
            stall = now - prev - interval
            prev = now
            if stall > interval:
                for link in self.links.values():
                    link.last_heard += stall
                continue
            ping = m.Ping(seq=seq)
            for link in list(self.links.values()):
                if now - link.last_heard > self.t.heartbeat_timeout_s:
                    self.link_failed(
                        link,
                        TransferTimeout(
                            f"peer {link.name}: silent for {now - link.last_heard:.1f}s"
                        ),
                        fence=True,
                    )
                else:
                    self.send_msg(link, ping)

    async def _close_peer(self, link: Link) -> None:
        try:
            await link.peer.close()
        except KvxferError:
            pass


def _with_legs(rooms: List[Room]) -> List[Room]:
    """``rooms`` with the legs of each before it (a room goes after its legs)."""
    out: List[Room] = []
    for r in rooms:
        if r.legs is not None:
            out.extend(r.legs.legs())
        out.append(r)
    return out
