"""The initiator side of the staged path with one peer (:mod:`kvxfer.engine.staging`):
gather chunks into staging slots, PUT each into a landing slot the peer granted, send its
plan; give every landing slot back, whatever happens to its chunk
(:mod:`kvxfer.engine.landing`). The target side is :mod:`kvxfer.engine.peer_staged`, whose
:class:`~kvxfer.engine.peer_staged.StagedPath` (one per peer, both roles) extends
:class:`StagedSender`.

Invariants
- A landing slot is reused only after the peer's SlotFree (or SlotReclaimed) for it.
- Landing slot first, then a staging slot (a fixed order: no deadlock); a wait for either
  that is cancelled or times out keeps no slot.
- A chunk given up (its write cancelled, timed out or failed) always gives its landing slot
  back: at once if its PUT was never posted or was flushed and no plan was sent; after a
  flush in the background if its PUT may still be in flight (so no late byte lands in the
  slot's next chunk); after the peer's SlotReclaimed if its plan was (or may have been)
  sent: a SlotAbandon follows the plan on the ordered channel, the target drops a plan it
  has not scattered yet (no abandoned byte reaches its items after that) and answers once
  every earlier message of the slot was handled. A background reclaim that fails (the
  endpoint or channel broke) closes the peer.
- Background reclaims are owned (``close()`` cancels them) and bounded
  (``transfer_timeout_s`` per flush attempt / message).
- Everything here runs on the asyncio loop thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import (
    Any,
    Awaitable,
    Callable,
    Coroutine,
    Dict,
    List,
    Mapping,
    Optional,
    Protocol,
    Set,
    Tuple,
    TypeVar,
)

import numpy as np

from kvxfer.engine import messages as m
from kvxfer.engine import slices
from kvxfer.engine.groups import LocalGroups
from kvxfer.engine.landing import FLUSHED, POSTED, SENDING, SENT, TAKEN, Chunk, Landing
from kvxfer.engine.staging import GroupStage
from kvxfer.engine.types import TransferStats
from kvxfer.errors import KvxferError, ProtocolError, TransferTimeout
from kvxfer.transport.base import Channel, RmaEndpoint

log = logging.getLogger(__name__)
_U64 = np.uint64
T = TypeVar("T")

#: packs one chunk into a staging slot: ``gather(staging slot) -> bytes``
Gather = Callable[[int], int]
#: the chunk's message: ``make_msg(landing slot, bytes) -> encoded``
MakeMsg = Callable[[int, int], bytes]
#: test hook: ``await hook(point)`` at named points (see StagedSender.hook)
Hook = Callable[[str], Awaitable[None]]


class Bounded(Protocol):
    """``await bounded(coro, timeout, what)``: ``coro``'s result, or TransferTimeout after
    ``timeout`` s, or PeerClosed as soon as the peer is known dead."""

    def __call__(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> Awaitable[T]: ...


@dataclass(frozen=True)
class StagedLink:
    """What the staged path uses of its peer (the peer builds it)."""

    name: str  # the peer's name, for logs
    loop: asyncio.AbstractEventLoop
    channel: Channel
    rma: RmaEndpoint
    spin: bool  # flushes progressed by the native poller
    transfer_timeout_s: float  # bound on a control message (credit, abandon) or reclaim flush
    bounded: Bounded
    left: Callable[[float, str], float]  # seconds left to a deadline, or TransferTimeout
    mark_dead: Callable[[Exception], None]  # the peer is gone (idempotent)


class StagedSender:
    """The initiator role of staged writes with one peer: ``landing`` (group -> the slots
    the peer granted us)."""

    def __init__(self, link: StagedLink, groups: LocalGroups, landing: Mapping[str, tuple]):
        self._link = link
        self._groups = groups  # its ``stages`` are read live (emptied when released)
        self.landing: Dict[str, Landing] = {
            g: Landing(*v) for g, v in landing.items() if g in groups.stages
        }
        #: tests only: ``await hook(point)`` at "landing", "put", "plan", "sending", "sent"
        #: (one chunk), "drain" (a write's plans and notify are out, before it waits for the
        #: peer's SlotFrees), "reclaim" (before the flush that returns a slot whose PUT was
        #: given up); target side: "scatter" (before a plan is scattered or dropped) and
        #: "abandon" (the reader handled a SlotAbandon)
        self.hook: Optional[Hook] = None
        self._bg: Set[asyncio.Task] = set()  # owned background reclaims
        self._closed = False

    async def at(self, point: str) -> None:
        """Run the test hook at ``point`` (nothing without one)."""
        if self.hook is not None:
            await self.hook(point)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._closed:
            coro.close()
            return
        task = self._link.loop.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg_done)

    def _bg_done(self, task: asyncio.Task) -> None:
        self._bg.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("peer %s: staged reclaim failed", self._link.name, exc_info=task.exception())

    async def close(self) -> None:
        """Cancel the background reclaims (the peer is dead or closing); idempotent."""
        self._closed = True
        tasks, self._bg = list(self._bg), set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def can_stage(self, group: str) -> bool:
        """Whether writes of ``group`` to this peer may go staged (it granted us slots)."""
        return group in self.landing

    # ---------------------------------------------------- staged: initiator side
    def slot_freed(self, msg: m.SlotFree) -> None:
        """The peer drained one of the landing slots it granted us: it is free again
        (abandoned: once SlotReclaimed follows)."""
        land = self.landing.get(msg.group)
        if land is None:
            raise ProtocolError(f"slot_free for {msg.group!r} slot {msg.slot}, not in flight")
        land.freed(msg.group, msg.slot)

    def slot_reclaimed(self, msg: m.SlotReclaimed) -> None:
        """The peer answered our SlotAbandon: the slot is free again."""
        land = self.landing.get(msg.group)
        if land is None:
            raise ProtocolError(f"slot_reclaimed for {msg.group!r}: no landing slots")
        land.reclaimed(msg.group, msg.slot)

    def abandon(self, chunks: List[Chunk]) -> None:
        """Give up chunks whose plans were sent (their write was cancelled or failed): those
        not drained yet are abandoned (the peer drops them if not scattered yet; the slots
        come back with SlotReclaimed). Synchronous; the messages leave in the background."""
        for c in chunks:
            if c.drained.done():  # scattered and freed already
                continue
            land = self.landing[c.group]
            land.abandoning.add(c.slot)
            self._spawn(self._send_abandon(c.group, land, c.slot, None))

    async def write(
        self, group: str, src: np.ndarray, dst: np.ndarray, deadline: float, stats: TransferStats
    ) -> List[Chunk]:
        """One staged part: chunks of at most a slot, pipelined over the granted slots.
        Returns once every chunk's plan is sent: its chunks, each with a future resolved
        when the peer reports the slot drained (its items scattered). Cancelled or failed,
        every chunk of it is given up (see the module docstring)."""
        stage = self._groups.stages[group]
        land = self.landing[group]
        per = min(stage.items_per_slot, land.slot_bytes // stage.group.item_bytes)

        def part(i: int, j: int):
            s, d = src[i:j], dst[i:j]

            def msg(rslot: int, nbytes: int) -> bytes:
                ids = np.ascontiguousarray(d, dtype="<i8").tobytes()
                return m.StagedWrite(
                    group=group, slot=rslot, offset=0, nbytes=nbytes, dst=ids
                ).encode()

            return functools.partial(stage.gather, s), msg

        ranges = [(i, min(i + per, int(src.size))) for i in range(0, int(src.size), per)]
        futs = await self._chunks(group, stage, land, [part(i, j) for i, j in ranges], deadline)
        stats.staged = True
        stats.staged_bytes += int(src.size) * stage.group.item_bytes
        stats.bytes += int(src.size) * stage.group.item_bytes
        stats.ops += len(ranges)
        return futs

    def slice_cap(self, group: str) -> int:
        """Bytes one slice chunk may hold to this peer (staging and landing slot)."""
        return min(self._groups.stages[group].slot_bytes, self.landing[group].slot_bytes)

    async def write_slices(
        self,
        group: str,
        src: np.ndarray,
        dst: np.ndarray,
        runs: slices.SliceRuns,
        key: int,
        deadline: float,
        stats: TransferStats,
    ) -> List[Chunk]:
        """One SliceWrite (validated): chunks of whole items of at most a slot, pipelined
        over the granted slots; its chunks, as :meth:`write`'s."""
        stage = self._groups.stages[group]
        land = self.landing[group]
        ranges = slices.chunks(int(src.size), runs.per_item, self.slice_cap(group))

        def part(i: int, j: int):
            s, d = src[i:j], dst[i:j]

            def msg(rslot: int, nbytes: int) -> bytes:
                ids = np.ascontiguousarray(d, dtype="<i8").tobytes()
                return m.SliceChunk(
                    group=group, slot=rslot, key=key, nbytes=nbytes, dst=ids
                ).encode()

            return functools.partial(stage.gather_slices, s, runs), msg

        futs = await self._chunks(group, stage, land, [part(i, j) for i, j in ranges], deadline)
        nbytes = int(src.size) * runs.per_item
        stats.staged = True
        stats.staged_bytes += nbytes
        stats.bytes += nbytes
        stats.ops += len(ranges)
        stats.staged_direct_ops += slices.direct_ops(runs, stage.group.item_lens, src)
        return futs

    async def _chunks(
        self,
        group: str,
        stage: GroupStage,
        land: Landing,
        parts: List[Tuple[Gather, MakeMsg]],
        deadline,
    ) -> List[Chunk]:
        """Run the chunks concurrently (bounded by the granted slots). Cancelled or failed:
        every chunk is given up (those whose plans are out: :meth:`abandon`)."""
        tasks = [
            self._link.loop.create_task(self._stage_chunk(group, stage, land, g, mk, deadline))
            for g, mk in parts
        ]
        try:
            return [await t for t in tasks]
        except BaseException:
            # a task done by now has its plan out; the others give their slot up themselves
            sent = [
                t.result() for t in tasks if t.done() and not t.cancelled() and not t.exception()
            ]
            for t in tasks:
                t.cancel()
            self.abandon(sent)
            raise
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stage_chunk(
        self,
        group: str,
        stage: GroupStage,
        land: Landing,
        gather: Gather,
        make_msg: MakeMsg,
        deadline,
    ) -> Chunk:
        """Landing slot first, then a staging slot (a fixed order: no deadlock), gather, one
        PUT, flush, then the chunk's message (``make_msg(landing slot, bytes)``). The
        landing slot returns with the peer's SlotFree; given up on the way, by
        :meth:`_give_up` (whatever the state)."""
        link = self._link
        rslot = await self._take(land.free, deadline, "landing slot")
        land.taken(rslot)
        state, send, fut = TAKEN, None, None
        try:
            await self.at("landing")
            lslot = await self._take(stage.staging_free, deadline, "staging slot")
            try:
                nbytes = gather(lslot)
                state = POSTED  # from here its bytes may land in the slot
                link.rma.put(
                    _one(stage.staging_addr(lslot)),
                    _one(land.base + rslot * land.slot_bytes),
                    _one(nbytes),
                    _one(stage.staging_handle),
                    _one(land.region),
                )
                await self.at("put")
                t = link.left(deadline, "staged flush")
                await link.bounded(link.rma.flush(t, link.spin), t, "staged flush")
                state = FLUSHED
            finally:
                stage.staging_free.put_nowait(lslot)
            await self.at("plan")
            t = link.left(deadline, "scatter plan")
            # registered before the plan leaves: its SlotFree may come back at once
            fut = land.waiters[rslot] = link.loop.create_future()
            assert fut is not None
            # owned, so that an abandon waits until it was posted or never will be
            send = link.loop.create_task(link.channel.send(make_msg(rslot, nbytes), t))
            state = SENDING
            await self.at("sending")
            await link.bounded(_shielded(send), t, "scatter plan")
            state = SENT
            await self.at("sent")
        except BaseException:
            self._give_up(group, land, rslot, state, send, fut)
            raise
        return Chunk(group, rslot, fut)

    async def _take(self, q: asyncio.Queue, deadline: float, what: str) -> int:
        """A slot off ``q`` by ``deadline``; cancelled or timed out, none is kept (a slot
        the get took just before the cancel goes back)."""
        link = self._link
        t = link.left(deadline, "staged write")
        get = link.loop.create_task(q.get())
        try:
            return await link.bounded(_shielded(get), t, what)
        except BaseException:
            if not get.cancel() and not get.cancelled() and get.exception() is None:
                q.put_nowait(get.result())
            raise

    def _give_up(
        self,
        group: str,
        land: Landing,
        slot: int,
        state: str,
        send: Optional[asyncio.Task],
        fut: Optional[asyncio.Future],
    ) -> None:
        """A chunk in ``state`` ends unfinished: its landing slot comes back (see the
        module docstring), now or through a background reclaim."""
        if state in (TAKEN, FLUSHED):  # nothing in flight, no plan sent
            land.give_back(slot)
        elif state == POSTED:  # the PUT may still land: flush first
            land.reclaiming.add(slot)
            self._spawn(self._flush_reclaim(land, slot))
        else:
            assert state in (SENDING, SENT)
            if fut is not None and fut.done():
                return  # drained and freed already (the peer's SlotFree)
            if send is not None:
                send.cancel()  # not posted yet: never will be; posted: the plan still leaves
            land.abandoning.add(slot)
            self._spawn(self._send_abandon(group, land, slot, send))

    async def _flush_reclaim(self, land: Landing, slot: int) -> None:
        """Flush the endpoint until the abandoned PUT into ``slot`` completed, then give
        the slot back (no plan was sent: the peer never scatters it). Each attempt is
        bounded; a failed flush closes the peer."""
        link = self._link
        await self.at("reclaim")
        while True:
            try:
                t = link.transfer_timeout_s
                await link.bounded(link.rma.flush(t, link.spin), t, "staged reclaim flush")
            except TransferTimeout:
                log.warning("peer %s: flush before reclaiming slot %d timed out", link.name, slot)
                continue
            except KvxferError as exc:
                link.mark_dead(exc)
                return
            land.give_back(slot)
            return

    async def _send_abandon(
        self, group: str, land: Landing, slot: int, send: Optional[asyncio.Task]
    ) -> None:
        """SlotAbandon for ``slot``, after the chunk's plan (``send``) was posted or never
        will be; SlotReclaimed then gives the slot back. A failed send closes the peer."""
        link = self._link
        t = link.transfer_timeout_s
        try:
            if send is not None:  # cancelled by _give_up: wait until it ended
                await link.bounded(asyncio.wait([send]), t, "scatter plan")
            await link.bounded(
                link.channel.send(m.SlotAbandon(group=group, slot=slot).encode(), t),
                t,
                "slot abandon",
            )
        except KvxferError as exc:
            link.mark_dead(exc)


async def _shielded(task: asyncio.Task):
    """Await ``task`` without cancelling it when the awaiter is."""
    return await asyncio.shield(task)


def _one(v: int) -> np.ndarray:
    """A one-op column of a native PUT batch."""
    return np.asarray([v], dtype=_U64)
