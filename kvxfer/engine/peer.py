"""One authenticated connection to a remote engine (symmetric after the handshake).

Invariants
- ``write`` validates every part (groups exist on both sides, ids in range, unique
  destinations, addresses inside the peer's registered regions) before one byte moves;
  then posts one native batch, flushes, and only then sends ``notify``: the peer's message
  handler therefore runs after the bytes are visible there.
- Every await is bounded (``timeout`` or the engine's ``transfer_timeout_s``) and also
  ends as soon as the peer is known dead (``PeerClosed``), whichever comes first.
- Messages from the peer reach the engine's handlers in arrival order, one at a time; those
  that arrived before the peer closed or died are still delivered (bounded by close grace).
- ``close()`` is idempotent: goodbye (best effort, bounded), stop tasks, destroy remote
  keys and endpoints; the engine's peer-closed handlers run exactly once per peer.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from kvxfer import plan, wire
from kvxfer.engine import messages as m
from kvxfer.engine.groups import RemoteGroups
from kvxfer.engine.types import ItemWrite, RawWrite, TransferStats
from kvxfer.errors import (Closed, InvalidArgument, KvxferError, PeerClosed, ProtocolError,
                           TransferTimeout, UnknownGroup)
from kvxfer.transport.base import Channel, RmaEndpoint

if TYPE_CHECKING:  # pragma: no cover
    from kvxfer.engine.engine import TransferEngine

log = logging.getLogger(__name__)
_U64 = np.uint64


class Peer:
    def __init__(self, engine: "TransferEngine", channel: Channel, rma: RmaEndpoint,
                 engine_id: str, name: str, hostname: str, remote: RemoteGroups):
        self._engine = engine
        self._channel = channel
        self._rma = rma
        self.id = engine_id
        self.name = name
        self.hostname = hostname
        self._remote = remote
        self._loop = asyncio.get_running_loop()
        self._dead: asyncio.Future = self._loop.create_future()
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._tasks: List[asyncio.Task] = []
        self._closing = False
        self._notified = False
        self.lanes: List[str] = rma.lanes()

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
    def _start(self) -> None:
        self._channel.on_closed(self._on_channel_closed)
        self._rma.on_failed(self._on_channel_closed)
        self._dead.add_done_callback(lambda f: f.exception())  # never "never retrieved"
        self._tasks = [self._loop.create_task(self._reader(), name=f"kvxfer-recv-{self.id[:8]}"),
                       self._loop.create_task(self._dispatcher(),
                                              name=f"kvxfer-dispatch-{self.id[:8]}")]

    def _on_channel_closed(self, exc: Exception) -> None:
        self._mark_dead(exc if isinstance(exc, KvxferError) else PeerClosed(str(exc)))

    def _mark_dead(self, exc: Exception) -> None:
        if self._dead.done():
            return
        self._dead.set_exception(exc)
        if not self._closing:  # died under us: release in the background (engine awaits it)
            self._engine._spawn(self._teardown(send_bye=False))
        self._engine._peer_gone(self, exc)

    async def _reader(self) -> None:
        try:
            while True:
                raw = await self._channel.recv(None)
                msg = wire.decode(raw)
                if isinstance(msg, m.AppMessage):
                    self._inbox.put_nowait(bytes(msg.payload))
                elif isinstance(msg, m.Bye):
                    self._mark_dead(PeerClosed(
                        f"peer {self.name or self.id} closed{': ' + msg.reason if msg.reason else ''}"))
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

    async def _dispatcher(self) -> None:
        while True:
            payload = await self._inbox.get()
            if payload is None:  # teardown: everything received before it was delivered
                return
            await self._engine._dispatch(self, payload)

    # ------------------------------------------------------------------ data
    def _check_open(self) -> None:
        if self._dead.done():
            exc = self._dead.exception()
            if isinstance(exc, Closed):
                raise Closed(f"peer {self.name or self.id} is closed")
            raise PeerClosed(f"peer {self.name or self.id} is gone: {exc}")

    def plan(self, writes: Iterable[Union[ItemWrite, RawWrite]]):
        """Validate and plan ``writes`` (nothing is posted). Returns the native arrays
        ``(laddr, raddr, nbytes, lmemh, ridx)``."""
        local = self._engine._groups
        if isinstance(writes, (ItemWrite, RawWrite)):
            writes = [writes]
        parts, memhs, ridxs = [], [], []
        for w in writes:
            if not isinstance(w, (ItemWrite, RawWrite)):
                raise InvalidArgument(f"expected ItemWrite or RawWrite, got {type(w).__name__}")
            lg = local.groups.get(w.group)
            if lg is None:
                raise UnknownGroup(f"no local group {w.group!r} (have {sorted(local.groups)})")
            rg = self._remote.groups.get(w.group)
            if rg is None:
                raise UnknownGroup(f"peer {self.name or self.id} has no group {w.group!r} "
                                   f"(has {sorted(self._remote.groups)})")
            if isinstance(w, ItemWrite):
                ops = plan.plan_items(lg, rg, w.src_items, w.dst_items)
            else:
                ops = plan.plan_raw(lg, rg, w.desc, w.src_off, w.dst_off, w.nbytes)
            d = ops.desc.astype(np.intp)
            parts.append(ops)
            memhs.append(local.desc_memh[w.group][d])
            ridxs.append(self._remote.desc_region[w.group][d])
        ops = plan.concat(parts)
        lmemh = np.concatenate(memhs).astype(_U64) if memhs else np.zeros(0, _U64)
        ridx = np.concatenate(ridxs).astype(_U64) if ridxs else np.zeros(0, _U64)
        return ops.laddr, ops.raddr, ops.nbytes, lmemh, ridx

    async def _bounded(self, coro, timeout: float, what: str):
        """Await ``coro`` until done, ``timeout``, or the peer's death, whichever first."""
        task = self._loop.create_task(coro)
        try:
            done, _ = await asyncio.wait({task, self._dead}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        if self._dead in done:
            self._check_open()
        raise TransferTimeout(f"{what} to {self.name or self.id} not done after {timeout:.3g} s")

    async def write(self, writes: Iterable[Union[ItemWrite, RawWrite]], notify: Optional[bytes] = None,
                    timeout: Optional[float] = None) -> TransferStats:
        """Move the items, flush, then deliver ``notify`` to the peer's message handlers.
        Raises (before any byte moves) UnknownGroup / IndexOutOfRange / InvalidArgument;
        afterwards PeerClosed / TransferTimeout / TransportError."""
        self._check_open()
        timeout = self._engine.config.transfer_timeout_s if timeout is None else timeout
        if notify is not None and not isinstance(notify, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"notify must be bytes, got {type(notify).__name__}")
        laddr, raddr, nbytes, lmemh, ridx = self.plan(writes)
        stats = TransferStats(bytes=int(nbytes.sum(dtype=_U64)) if nbytes.size else 0,
                              ops=int(laddr.size), lanes=list(self.lanes))
        t0 = time.perf_counter()
        try:
            if laddr.size:
                self._rma.put(laddr, raddr, nbytes, lmemh, ridx)
            t1 = time.perf_counter()
            if laddr.size:
                await self._bounded(self._rma.flush(timeout), timeout, "flush")
        except PeerClosed as exc:  # the endpoint failed: this peer is gone
            self._mark_dead(exc)
            raise
        if notify is not None:
            await self._bounded(self._channel.send(m.AppMessage(payload=bytes(notify)).encode(),
                                                   timeout), timeout, "notify")
        stats.post_s, stats.complete_s = t1 - t0, time.perf_counter() - t1
        return stats

    async def send(self, payload: bytes, timeout: Optional[float] = None) -> None:
        """Application message (no RMA), delivered in order to the peer's handlers."""
        self._check_open()
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"payload must be bytes, got {type(payload).__name__}")
        timeout = self._engine.config.transfer_timeout_s if timeout is None else timeout
        await self._bounded(self._channel.send(m.AppMessage(payload=bytes(payload)).encode(),
                                               timeout), timeout, "send")

    async def close(self) -> None:
        """Say goodbye (bounded), release keys and endpoints; idempotent."""
        if self._closing:
            return
        await self._teardown(send_bye=not self._dead.done())

    async def _teardown(self, send_bye: bool) -> None:
        if self._closing:
            return
        self._closing = True
        grace = self._engine.config.close_timeout_s
        if send_bye:
            try:
                await self._channel.send(m.Bye(reason="closed").encode(), grace)
            except KvxferError:
                pass
        self._mark_dead(Closed(f"peer {self.name or self.id} closed locally"))
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
        await asyncio.gather(*(t for t in self._tasks if t is not current),
                             return_exceptions=True)
        await self._rma.close(grace)
        await self._channel.close(grace)
