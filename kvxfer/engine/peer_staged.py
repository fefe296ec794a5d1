"""The staged path of :class:`kvxfer.engine.peer.Peer` (see :mod:`kvxfer.engine.staging`),
as a mixin: the target side validates and scatters plans, the initiator side gathers chunks
into staging slots, PUTs each into a landing slot the peer granted and sends its plan.

Contract with the class it is mixed into (Peer): ``_engine``, ``_loop``, ``_rma``,
``_channel``, ``spin``, ``_granted`` / ``_busy`` (target role), ``_rland`` (initiator role),
and the methods ``_bounded``, ``_left`` and ``_mark_dead``.

Invariants
- A landing slot is reused only after the peer's SlotFree for it; a plan is validated
  before anything of it is written, and a slot is never scattered twice concurrently.
- Landing slot first, then a staging slot (a fixed order: no deadlock); if the PUT was
  never posted the landing slot returns at once; after a failed PUT it is not reused.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Dict

import numpy as np

from kvxfer.engine import messages as m
from kvxfer.engine.types import TransferStats
from kvxfer.errors import KvxferError, ProtocolError

log = logging.getLogger(__name__)
_U64 = np.uint64


class StagedPeer:
    """Staged-path methods of Peer (see the module doc for what they need from it)."""

    # ------------------------------------------------------- staged: target side
    def _check_plan(self, msg: m.StagedWrite) -> tuple:
        """Validate a scatter plan off the wire (ProtocolError: the reader closes the peer
        and nothing of it is written)."""
        stage = self._engine._groups.stages.get(msg.group)
        if stage is None or msg.group not in self._granted:
            raise ProtocolError(f"staged write to group {msg.group!r} without a landing grant")
        if msg.slot not in self._granted[msg.group]:
            raise ProtocolError(f"staged write to landing slot {msg.slot} of {msg.group!r}, "
                                f"not granted to this peer")
        if (msg.group, msg.slot) in self._busy:
            raise ProtocolError(f"landing slot {msg.slot} of {msg.group!r} reused before it "
                                f"was freed")
        dst = stage.check_plan(msg.slot, msg.offset, msg.nbytes, bytes(msg.dst))
        self._busy.add((msg.group, msg.slot))
        return (stage, msg.slot, msg.offset, dst)

    async def _scatter(self, stage, slot: int, offset: int, dst) -> None:
        try:
            stage.scatter(dst, slot, offset)
        except Exception:  # internal: the plan was validated
            log.exception("peer %s: scatter into %r failed", self, stage)
            self._mark_dead(ProtocolError(f"scatter into {stage.group.name!r} failed"))
            return
        self._busy.discard((stage.group.name, slot))
        try:
            await self._bounded(self._channel.send(
                m.SlotFree(group=stage.group.name, slot=slot).encode(),
                self._engine.config.transfer_timeout_s),
                self._engine.config.transfer_timeout_s, "slot credit")
        except KvxferError:
            pass  # the peer is gone; nothing to give back

    # ---------------------------------------------------- staged: initiator side
    def _slot_freed(self, msg: m.SlotFree) -> None:
        land = self._rland.get(msg.group)
        if land is None or msg.slot not in land.out:
            raise ProtocolError(f"slot_free for {msg.group!r} slot {msg.slot}, not in flight")
        land.out.discard(msg.slot)
        fut = land.waiters.pop(msg.slot, None)
        if fut is not None and not fut.done():
            fut.set_result(None)
        land.free.put_nowait(msg.slot)

    async def _write_staged(self, group: str, src: np.ndarray, dst: np.ndarray,
                            deadline: float, stats: TransferStats) -> list:
        """One staged part: chunks of at most a slot, pipelined over the granted slots.
        Returns once every chunk's plan is sent: one future per chunk, resolved when the
        peer reports the slot drained (its items scattered)."""
        stage = self._engine._groups.stages[group]
        land = self._rland[group]
        per = min(stage.items_per_slot, land.slot_bytes // stage.group.item_bytes)
        tasks = [self._loop.create_task(self._stage_chunk(stage, land, src[i:i + per],
                                                          dst[i:i + per], deadline))
                 for i in range(0, int(src.size), per)]
        try:
            futs = [await t for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        stats.staged = True
        stats.staged_bytes += int(src.size) * stage.group.item_bytes
        stats.bytes += int(src.size) * stage.group.item_bytes
        stats.ops += len(tasks)
        return futs

    async def _stage_chunk(self, stage, land: "_Landing", src, dst,
                           deadline: float) -> asyncio.Future:
        """Landing slot first, then a staging slot (a fixed order: no deadlock), gather, one
        PUT, flush, then the scatter plan. The landing slot returns with the peer's
        SlotFree; if the PUT was never posted it returns at once; after a failed PUT it is
        not reused (its bytes may still land)."""
        t = self._left(deadline, "staged write")
        rslot = await self._bounded(land.free.get(), t, "landing slot")
        land.out.add(rslot)
        posted = False
        try:
            lslot = await self._bounded(stage.staging_free.get(),
                                        self._left(deadline, "staged write"), "staging slot")
            try:
                nbytes = stage.gather(src, lslot)
                arr = lambda v: np.asarray([v], dtype=_U64)  # noqa: E731
                posted = True
                self._rma.put(arr(stage.staging_addr(lslot)),
                              arr(land.base + rslot * land.slot_bytes), arr(nbytes),
                              arr(stage.staging_region.handle), arr(land.region))
                t = self._left(deadline, "staged flush")
                await self._bounded(self._rma.flush(t, self.spin), t, "staged flush")
            finally:
                stage.staging_free.put_nowait(lslot)
            t = self._left(deadline, "scatter plan")
            # registered before the plan leaves: its SlotFree may come back at once
            fut = land.waiters[rslot] = self._loop.create_future()
            await self._bounded(self._channel.send(m.StagedWrite(
                group=stage.group.name, slot=rslot, offset=0, nbytes=nbytes,
                dst=np.ascontiguousarray(dst, dtype="<i8").tobytes()).encode(), t), t,
                "scatter plan")
        except BaseException:
            if not posted:
                land.out.discard(rslot)
                land.free.put_nowait(rslot)
            raise
        return fut


async def _all(futures) -> None:
    await asyncio.gather(*futures)


class _Landing:
    """Landing slots a peer granted us for one group: ``free`` (an asyncio.Queue) and
    ``out`` (slots whose plan was sent, awaiting the peer's SlotFree)."""

    def __init__(self, region: int, base: int, slot_bytes: int, slots):
        self.region, self.base, self.slot_bytes = region, base, slot_bytes
        self.slots = list(slots)
        self.free: asyncio.Queue = asyncio.LifoQueue()  # the warm (recently used) slot first
        for s in slots:
            self.free.put_nowait(s)
        self.out: set = set()
        self.waiters: Dict[int, asyncio.Future] = {}  # slot -> resolved by its SlotFree
