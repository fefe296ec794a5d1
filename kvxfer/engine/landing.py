"""The initiator's view of the landing slots one peer granted it for one group (staged
path, :mod:`kvxfer.engine.peer_staged`): which are free, which carry a chunk, and how a
slot whose chunk was given up comes back.

Slot lifecycle (initiator side; ``out`` holds every slot that is not ``free``)::

    free --take--> taken --PUT posted--> posted --flushed--> flushed --plan sent--> sent
      ^                |                     |                   |                    |
      |  (not posted)  |  (flush, then)      |  (at once)        |   SlotFree         |
      +----------------+---------------------+-------------------+--------------------+
                                                                 |
    given up while the plan was sending or sent (not yet drained): abandoning
      --SlotAbandon--> ... --SlotReclaimed--> free   (a SlotFree meanwhile only
                                                      resolves the chunk's future)

Invariants
- A slot is in ``free`` xor ``out``; it goes back to ``free`` only when no byte of an
  earlier chunk can still land in it (its PUT was never posted, or was flushed) AND the
  peer will not scatter it later (no plan was sent, or the peer answered SlotFree or,
  after an abandon, SlotReclaimed).
- ``waiters[slot]``: the chunk's ``drained`` future, resolved by the peer's SlotFree
  (also while abandoning: the peer scattered it before it saw the abandon); cancelled by
  SlotReclaimed when nothing resolved it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Dict, List, Set

from kvxfer.errors import ProtocolError

#: where a chunk was when it was given up (see the module docstring)
TAKEN, POSTED, FLUSHED, SENDING, SENT = "taken", "posted", "flushed", "sending", "sent"


@dataclass(frozen=True)
class Chunk:
    """One staged chunk whose plan was sent: ``drained`` resolves when the peer scattered
    it (SlotFree of landing slot ``slot`` of ``group``)."""

    group: str
    slot: int
    drained: asyncio.Future


class Landing:
    """Landing slots a peer granted us for one group: ``free`` (an asyncio.Queue), ``out``
    (taken: a chunk uses them or they wait to come back), ``abandoning`` (subset of ``out``:
    SlotAbandon sent or about to be, waiting for SlotReclaimed), ``reclaiming`` (subset of
    ``out``: a posted PUT being flushed before the slot returns)."""

    def __init__(self, region: int, base: int, slot_bytes: int, slots: List[int]):
        self.region, self.base, self.slot_bytes = region, base, slot_bytes
        self.slots = list(slots)
        self.free: asyncio.Queue = asyncio.LifoQueue()  # the warm (recently used) slot first
        for s in slots:
            self.free.put_nowait(s)
        self.out: Set[int] = set()
        self.abandoning: Set[int] = set()
        self.reclaiming: Set[int] = set()
        self.waiters: Dict[int, asyncio.Future] = {}  # slot -> resolved by its SlotFree
        self._idle: List[asyncio.Future] = []  # resolved when every slot is free

    def __repr__(self):
        return (
            f"Landing({len(self.slots)} slots: {self.free.qsize()} free, {len(self.out)} out, "
            f"{len(self.abandoning)} abandoning, {len(self.reclaiming)} reclaiming)"
        )

    def taken(self, slot: int) -> None:
        self.out.add(slot)

    def give_back(self, slot: int) -> None:
        """``slot`` is reusable (see the invariants): back to ``free``."""
        assert slot in self.out and slot not in self.abandoning, (slot, self)
        self.out.discard(slot)
        self.reclaiming.discard(slot)
        w = self.waiters.pop(slot, None)
        if w is not None and not w.done():
            w.cancel()
        self.free.put_nowait(slot)
        if not self.out:
            idle, self._idle = self._idle, []
            for f in idle:
                if not f.done():
                    f.set_result(None)

    async def idle(self) -> None:
        """Until every slot is free (no chunk in flight, none coming back): bound it."""
        if self.out:
            fut = asyncio.get_running_loop().create_future()
            self._idle.append(fut)
            await fut

    def freed(self, group: str, slot: int) -> None:
        """The peer's SlotFree: the chunk was scattered (or, abandoned, dropped)."""
        if slot not in self.out or slot in self.reclaiming:
            raise ProtocolError(f"slot_free for {group!r} slot {slot}, not in flight")
        fut = self.waiters.pop(slot, None)
        if fut is not None and not fut.done():
            fut.set_result(None)
        if slot not in self.abandoning:  # else SlotReclaimed follows and returns it
            self.give_back(slot)

    def reclaimed(self, group: str, slot: int) -> None:
        """The peer's SlotReclaimed: nothing of the abandoned chunk comes any more."""
        if slot not in self.abandoning:
            raise ProtocolError(f"slot_reclaimed for {group!r} slot {slot}, not abandoned")
        self.abandoning.discard(slot)
        self.give_back(slot)
