"""TransferEngine: registration, listener, peers, handshake, handlers, close.

Lifecycle: ``register()`` groups → ``await start()`` (UCX registrations + listener) →
``connect()`` / accept peers → ``write`` / ``send`` on peers → ``await close()``, which
closes every peer (keys and endpoints), then the listener and completion queue, then the
memory registrations, in that order; idempotent.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import uuid
from typing import Any, Callable, Coroutine, Dict, List, Optional, Sequence, Set, Tuple

from kvxfer import memtune
from kvxfer.config import EngineConfig, malloc_policy, own_worker
from kvxfer.engine import devcopy, handshake, vmm_share
from kvxfer.engine.groups import LocalGroups
from kvxfer.engine.host import PeerHost, resolved
from kvxfer.engine.notes import NoteBox
from kvxfer.engine.peer import Peer
from kvxfer.errors import Closed, InvalidArgument, KvxferError
from kvxfer.transport.base import Channel, RmaEndpoint, Transport

log = logging.getLogger(__name__)

#: lanes that mean "same host, fast": shared memory or CUDA IPC
FAST_LOCAL_LANES = ("cma", "knem", "xpmem", "posix", "sysv", "cuda_ipc")

MessageHandler = Callable[[Peer, bytes], object]
ClosedHandler = Callable[[Peer, Exception], None]
PeerHandler = Callable[[Peer], object]


class TransferEngine:
    """Asyncio transfer engine; see the package docstring for the API."""

    def __init__(self, config: EngineConfig, transport: Optional[Transport] = None):
        if not isinstance(config, EngineConfig):
            raise InvalidArgument(f"expected EngineConfig, got {type(config).__name__}")
        self.config = config
        self.id = uuid.uuid4().hex
        self.address: Optional[Tuple[str, int]] = None
        self._transport = transport
        self._groups = LocalGroups()
        self._peers: Dict[str, Peer] = {}
        self._msg_handlers: List[MessageHandler] = []
        self._closed_handlers: List[ClosedHandler] = []
        self._peer_handlers: List[PeerHandler] = []
        self._pending: Set[asyncio.Task] = set()
        self._background: Set[asyncio.Task] = set()
        self._state = "new"  # new -> started -> closed
        #: all a peer uses of the engine
        self._host: PeerHost[Peer] = PeerHost(
            config, self._groups, self._spawn, self._peer_gone, self._dispatch, self._dispatch_now
        )

    def __repr__(self):
        return (
            f"TransferEngine({self.config.name or self.id[:8]}, {self.address}, "
            f"{self.config.error_mode}, {self._state}, peers={len(self._peers)})"
        )

    # ---------------------------------------------------------- registration
    def register(
        self,
        name: str,
        ptrs: Sequence[int],
        lens: Sequence[int],
        item_lens: Sequence[int],
        *,
        item_lens_may_differ: bool = False,
    ) -> None:
        """Add a named descriptor group (before :meth:`start`). Item ``i`` is
        ``[ptrs[d] + i*item_lens[d], +item_lens[d])`` in every descriptor ``d``.

        The handshake refuses a peer whose group of the same name has other item sizes,
        unless ``item_lens_may_differ`` (set on our side): then only the descriptor counts
        must match, :class:`RawWrite` addresses the group by bytes, and an
        :class:`ItemWrite` between different item sizes fails when planned."""
        if self._state != "new":
            raise Closed("register() must come before start()")
        self._groups.add(name, ptrs, lens, item_lens, item_lens_may_differ=item_lens_may_differ)

    @property
    def groups(self) -> Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        return {n: (g.lens, g.item_lens) for n, g in self._groups.groups.items()}

    @property
    def group_info(self) -> Dict[str, dict]:
        """Diagnostics per registered group (``kvxfer info``-style): ``lens``,
        ``item_lens``, ``mem_types`` (per descriptor registration), ``ipc_capable``
        (False: CUDA memory UCX can only reach by emulated PUTs, see kvxfer.engine.ipc;
        None: host memory, or not started yet) and ``vmm_shared`` (such memory offered to
        same-host peers' device lanes instead: kvxfer.engine.vmm_share)."""
        g = self._groups
        return {
            n: {
                "lens": grp.lens,
                "item_lens": grp.item_lens,
                "mem_types": g.desc_mem_types(n) if n in g.desc_region else [],
                "ipc_capable": g.ipc.get(n),
                "vmm_shared": n in g.vmm_groups,
            }
            for n, grp in g.groups.items()
        }

    @property
    def registrations(self) -> int:
        """Number of UCX memory registrations of the groups (after merging; the staged
        path's staging and landing rings are not counted)."""
        return self._groups.group_regions

    # -------------------------------------------------------------- handlers
    def on_message(self, handler: MessageHandler) -> None:
        """``handler(peer, payload)`` (may return an awaitable) for every app message and
        write notification, in arrival order per peer. Runs on: the engine's loop thread."""
        self._msg_handlers.append(handler)

    def on_peer_closed(self, handler: ClosedHandler) -> None:
        """``handler(peer, exc)``, once per peer, whatever ended it (``exc`` says why).
        Runs on: the engine's loop thread."""
        self._closed_handlers.append(handler)

    def on_peer(self, handler: PeerHandler) -> None:
        """``handler(peer)`` for every peer that connected to us (after its handshake).
        Runs on: the engine's loop thread."""
        self._peer_handlers.append(handler)

    @property
    def peers(self) -> Dict[str, Peer]:
        return dict(self._peers)

    @property
    def transport(self) -> Optional[Transport]:
        """The transport while the engine is started, else None."""
        return self._transport if self._state == "started" else None

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> Tuple[str, int]:
        if self._state != "new":
            raise Closed(f"engine already {self._state}")
        if malloc_policy() == "keep":  # (a bad value raises before anything starts)
            memtune.keep_heap()
        self._state = "started"
        cfg = self.config
        if self._transport is None:
            from kvxfer.transport.ucx import UcxTransport

            own = own_worker(
                str(cfg.own_worker), str(cfg.error_mode), self._groups.all_device_memory()
            )
            self._transport = UcxTransport(
                cfg.ucx_options, resolved(cfg.progress_mode, "progress_mode"), own_rma=own
            )
        stage = (
            (
                cfg.stage_slot_bytes,
                cfg.stage_slots,
                cfg.stage_peer_slots,
                cfg.stage_host_memory or cfg.stage_slice_min_ops > 0,
                cfg.stage_groups,
            )
            if cfg.stage_min_ops > 0 or cfg.stage_slice_min_ops > 0
            else None
        )
        self._groups.export_ipc = cfg.device_copy == "auto"
        self._groups.freeze(self._transport, cfg.merge_adjacent, stage)
        try:
            self.address = await self._transport.listen(
                self.config.host, self.config.port, self._accept
            )
        except BaseException:
            self._groups.release()
            raise
        log.info("%r listening", self)
        return self.address

    def _check_started(self) -> Transport:
        """The transport of the started engine; Closed before start() and after close()."""
        if self._state != "started" or self._transport is None:
            raise Closed(f"engine is {self._state}")
        return self._transport

    async def connect(self, host: str, port: int, timeout: Optional[float] = None) -> Peer:
        """Connect, authenticate and exchange layouts; returns the ready :class:`Peer`."""
        transport = self._check_started()
        if timeout is None:
            timeout = resolved(self.config.connect_timeout_s, "connect_timeout_s")
        ch = await transport.connect(host, port, timeout)
        return await self._establish(ch, handshake.connect_side, timeout)

    async def _accept(self, ch: Channel) -> None:
        if self._state != "started":
            await ch.close(self.config.close_timeout_s)
            return
        task = asyncio.current_task()
        assert task is not None  # the transport runs on_accept as a task
        self._pending.add(task)
        try:
            peer = await self._establish(
                ch,
                handshake.accept_side,
                resolved(self.config.connect_timeout_s, "connect_timeout_s"),
            )
        except asyncio.CancelledError:
            return
        except KvxferError as exc:
            log.warning("%r: incoming connection rejected: %s: %s", self, type(exc).__name__, exc)
            return
        finally:
            self._pending.discard(task)
        for h in self._peer_handlers:
            await self._call(h, peer)

    async def _establish(self, ch: Channel, side, timeout: float) -> Peer:
        cfg = self.config
        rma: Optional[RmaEndpoint] = None
        res: Optional[handshake.HandshakeResult] = None
        notes: Optional[NoteBox] = None
        shares: Optional[list] = None  # the peer's VMM regions for the device lane
        try:
            transport = self._transport
            if transport is None:  # set by start(), kept after close()
                raise Closed("engine not started")
            notes = NoteBox(transport)
            res = await side(
                ch,
                self._groups,
                cfg.secret,
                self.id,
                cfg.name,
                transport.local_address(),
                timeout,
                cfg.refuse_emulated_destinations,
                note_token=notes.token,
                bulk_only=transport.own_rma,
                peer_errors=cfg.error_mode == "peer",
                host_lane=cfg.host_copy == "auto" and "host" in self._groups.mem_types,
            )
            # a bulk endpoint in error_mode "none", and whenever either side's keys are
            # valid only there (kvxfer's own UCP context: Layout.bulk_only)
            bulk = cfg.error_mode == "none" or transport.own_rma or res.remote.bulk_only
            bulk_addr = res.remote.address if bulk else None
            # a bulk endpoint has peer error handling when both engines are in error_mode
            # "peer" (both ends of a worker pair must agree: Layout.peer_errors), else error
            # mode NONE + a handler (shared-memory lanes)
            rma = await transport.rma_endpoint(
                ch,
                bulk_addr,
                timeout,
                peer_errors=cfg.error_mode == "peer" and res.remote.peer_errors,
            )
            rma.add_remote_regions(res.remote.bases, res.remote.lens, res.remote.keys)
            shares = await devcopy.fetch_shares(
                cfg, self._groups, res.hostname, res.remote, timeout
            )
            peer = Peer(
                self._host,
                ch,
                rma,
                res.engine_id,
                res.name,
                res.hostname,
                res.remote,
                res.granted,
                notes,
                shares,
                res.host,
                res.host_why,
            )
        except BaseException:
            vmm_share.close_shares(shares)  # mapped for a Peer that never came to be
            if res is not None and res.host is not None:  # the host lane's pidfd (Peer takes it)
                res.host.close()
            if notes is not None:
                notes.close()
            self._groups.release_landing(res.granted if res is not None else {})
            if rma is not None:
                await rma.close(cfg.close_timeout_s)
            await ch.close(cfg.close_timeout_s)
            raise
        if self._state != "started":
            await peer.close()
            raise Closed("engine closed during the handshake")
        old = self._peers.get(peer.id)
        if old is not None:
            log.warning(
                "%r: second connection with engine %s; the new one replaces it", self, peer.id
            )
        self._peers[peer.id] = peer
        peer.start()
        self._check_lanes(peer)
        log.info("%r: peer %s ready, lanes %s", self, peer.name or peer.id, peer.lanes)
        return peer

    def _check_lanes(self, peer: Peer) -> None:
        if not self.config.warn_slow_lanes or peer.hostname != socket.gethostname():
            return
        if any(lane.startswith(FAST_LOCAL_LANES) for lane in peer.lanes):
            if "cuda" in self._groups.mem_types and not any(
                lane.startswith("cuda_ipc") for lane in peer.lanes
            ):
                log.warning(
                    "%r: CUDA memory registered but no cuda_ipc lane to same-host "
                    "peer %s (lanes %s): device data will be staged or emulated",
                    self,
                    peer.name or peer.id,
                    peer.lanes,
                )
            return
        hint = (
            " error_mode='peer' excludes shared-memory lanes for host memory; "
            "error_mode='none' keeps them (see docs/engine.md)"
            if self.config.error_mode == "peer"
            else ""
        )
        log.warning(
            "%r: bulk data to same-host peer %s goes over %s although shared memory "
            "or CUDA IPC was possible.%s",
            self,
            peer.name or peer.id,
            ",".join(peer.lanes) or "unknown lanes",
            hint,
        )

    # --------------------------------------------------------------- events
    async def _call(self, handler, *args) -> None:
        try:
            res = handler(*args)
            if inspect.isawaitable(res):
                await res
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%r: handler %r failed", self, handler)

    async def _dispatch(self, peer: Peer, payload: bytes) -> None:
        for h in self._msg_handlers:
            await self._call(h, peer, payload)

    def _dispatch_now(self, peer: Peer, payload: bytes) -> Optional[Coroutine[Any, Any, None]]:
        """:meth:`_dispatch` without a task: every handler called here, in order; a handler
        that returns an awaitable leaves a coroutine (awaiting it, then the handlers after
        it) for the caller to run before anything that arrived later."""
        handlers = list(self._msg_handlers)
        for i, h in enumerate(handlers):
            try:
                res = h(peer, payload)
            except Exception:
                log.exception("%r: handler %r failed", self, h)
                continue
            if res is not None and inspect.isawaitable(res):  # (most return None)
                return self._dispatch_rest(res, handlers[i + 1 :], peer, payload)
        return None

    async def _dispatch_rest(self, res: Any, rest: list, peer: Peer, payload: bytes) -> None:
        await self._call(lambda: res)
        for h in rest:
            await self._call(h, peer, payload)

    def _spawn(self, coro) -> None:
        """Run a background coroutine owned by the engine (awaited by close())."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        """Owned background task finished: forget it and retrieve (log) its failure."""
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if isinstance(exc, KvxferError):
                log.debug("%r: background task %s: %s", self, task.get_name(), exc)
            else:
                log.error("%r: background task %s failed", self, task.get_name(), exc_info=exc)

    def _peer_gone(self, peer: Peer, exc: Exception) -> None:
        if self._peers.get(peer.id) is peer:
            del self._peers[peer.id]
        for h in self._closed_handlers:
            try:
                h(peer, exc)
            except Exception:
                log.exception("%r: peer-closed handler failed", self)

    async def close(self) -> None:
        """Close peers (keys, endpoints), then the listener, then registrations."""
        if self._state == "closed":
            return
        started = self._state == "started"
        self._state = "closed"
        for t in list(self._pending):
            t.cancel()
        if started:
            await asyncio.gather(
                *(p.close() for p in list(self._peers.values())),
                *list(self._background),
                return_exceptions=True,
            )
            if self._transport is not None:
                await self._transport.close()
        self._groups.release()
        log.info("%r closed", self)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
