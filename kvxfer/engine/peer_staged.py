"""The staged path of one :class:`kvxfer.engine.peer.Peer` (see :mod:`kvxfer.engine.staging`):
the target side validates and scatters plans, the initiator side gathers chunks into staging
slots, PUTs each into a landing slot the peer granted and sends its plan.

The peer owns one :class:`StagedPath` and hands it a :class:`StagedLink`: exactly what the
path uses of the peer (its loop, channel, RMA endpoint, bounded waits, death). Everything
here runs on the asyncio loop thread (see the threads table in docs/engine.md).

Invariants
- A landing slot is reused only after the peer's SlotFree for it; a plan is validated
  before anything of it is written, and a slot is never scattered twice concurrently.
- Landing slot first, then a staging slot (a fixed order: no deadlock); if the PUT was
  never posted the landing slot returns at once; after a failed PUT it is not reused.
"""

from __future__ import annotations

import asyncio
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
    Protocol,
    Set,
    Tuple,
    TypeVar,
)

import numpy as np

from kvxfer.engine import messages as m
from kvxfer.engine.groups import LocalGroups
from kvxfer.engine.staging import GroupStage
from kvxfer.engine.types import TransferStats
from kvxfer.errors import KvxferError, ProtocolError
from kvxfer.transport.base import Channel, RmaEndpoint

log = logging.getLogger(__name__)
_U64 = np.uint64
T = TypeVar("T")

#: a validated scatter plan: (stage, landing slot, byte offset, destination item ids)
ScatterPlan = Tuple[GroupStage, int, int, np.ndarray]


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
    transfer_timeout_s: float  # bound on sending a slot credit back
    bounded: Bounded
    left: Callable[[float, str], float]  # seconds left to a deadline, or TransferTimeout
    mark_dead: Callable[[Exception], None]  # the peer is gone (idempotent)


class StagedPath:
    """Staged writes with one peer, in both roles.

    Target role: ``granted`` (group -> landing slots we granted the peer) and ``busy``
    ((group, slot) plans received and not yet drained). Initiator role: ``landing``
    (group -> the slots the peer granted us)."""

    def __init__(
        self,
        link: StagedLink,
        groups: LocalGroups,
        granted: Mapping[str, dict],
        landing: Mapping[str, tuple],
    ):
        self._link = link
        self._groups = groups  # its ``stages`` are read live (emptied when released)
        self.granted: Dict[str, Set[int]] = {g: set(b["slots"]) for g, b in granted.items()}
        self.busy: Set[Tuple[str, int]] = set()
        self.landing: Dict[str, Landing] = {
            g: Landing(*v) for g, v in landing.items() if g in groups.stages
        }

    def can_stage(self, group: str) -> bool:
        """Whether writes of ``group`` to this peer may go staged (it granted us slots)."""
        return group in self.landing

    # ------------------------------------------------------- staged: target side
    def check_plan(self, msg: m.StagedWrite) -> ScatterPlan:
        """Validate a scatter plan off the wire (ProtocolError: the reader closes the peer
        and nothing of it is written)."""
        stage = self._groups.stages.get(msg.group)
        if stage is None or msg.group not in self.granted:
            raise ProtocolError(f"staged write to group {msg.group!r} without a landing grant")
        if msg.slot not in self.granted[msg.group]:
            raise ProtocolError(
                f"staged write to landing slot {msg.slot} of {msg.group!r}, "
                f"not granted to this peer"
            )
        if (msg.group, msg.slot) in self.busy:
            raise ProtocolError(
                f"landing slot {msg.slot} of {msg.group!r} reused before it was freed"
            )
        dst = stage.check_plan(msg.slot, msg.offset, msg.nbytes, bytes(msg.dst))
        self.busy.add((msg.group, msg.slot))
        return (stage, msg.slot, msg.offset, dst)

    async def scatter(self, stage: GroupStage, slot: int, offset: int, dst: np.ndarray) -> None:
        """Scatter a validated plan, then give the slot back to the peer (SlotFree)."""
        link = self._link
        try:
            stage.scatter(dst, slot, offset)
        except Exception:  # internal: the plan was validated
            log.exception("peer %s: scatter into %r failed", link.name, stage)
            link.mark_dead(ProtocolError(f"scatter into {stage.group.name!r} failed"))
            return
        self.busy.discard((stage.group.name, slot))
        try:
            await link.bounded(
                link.channel.send(
                    m.SlotFree(group=stage.group.name, slot=slot).encode(), link.transfer_timeout_s
                ),
                link.transfer_timeout_s,
                "slot credit",
            )
        except KvxferError:
            pass  # the peer is gone; nothing to give back

    # ---------------------------------------------------- staged: initiator side
    def slot_freed(self, msg: m.SlotFree) -> None:
        """The peer drained one of the landing slots it granted us: it is free again."""
        land = self.landing.get(msg.group)
        if land is None or msg.slot not in land.out:
            raise ProtocolError(f"slot_free for {msg.group!r} slot {msg.slot}, not in flight")
        land.out.discard(msg.slot)
        fut = land.waiters.pop(msg.slot, None)
        if fut is not None and not fut.done():
            fut.set_result(None)
        land.free.put_nowait(msg.slot)

    async def write(
        self, group: str, src: np.ndarray, dst: np.ndarray, deadline: float, stats: TransferStats
    ) -> List[asyncio.Future]:
        """One staged part: chunks of at most a slot, pipelined over the granted slots.
        Returns once every chunk's plan is sent: one future per chunk, resolved when the
        peer reports the slot drained (its items scattered)."""
        stage = self._groups.stages[group]
        land = self.landing[group]
        per = min(stage.items_per_slot, land.slot_bytes // stage.group.item_bytes)
        tasks = [
            self._link.loop.create_task(
                self._stage_chunk(stage, land, src[i : i + per], dst[i : i + per], deadline)
            )
            for i in range(0, int(src.size), per)
        ]
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

    async def _stage_chunk(
        self, stage: GroupStage, land: Landing, src: np.ndarray, dst: np.ndarray, deadline: float
    ) -> asyncio.Future:
        """Landing slot first, then a staging slot (a fixed order: no deadlock), gather, one
        PUT, flush, then the scatter plan. The landing slot returns with the peer's
        SlotFree; if the PUT was never posted it returns at once; after a failed PUT it is
        not reused (its bytes may still land)."""
        link = self._link
        t = link.left(deadline, "staged write")
        rslot = await link.bounded(land.free.get(), t, "landing slot")
        land.out.add(rslot)
        posted = False
        try:
            lslot = await link.bounded(
                stage.staging_free.get(), link.left(deadline, "staged write"), "staging slot"
            )
            try:
                nbytes = stage.gather(src, lslot)
                posted = True
                link.rma.put(
                    _one(stage.staging_addr(lslot)),
                    _one(land.base + rslot * land.slot_bytes),
                    _one(nbytes),
                    _one(stage.staging_handle),
                    _one(land.region),
                )
                t = link.left(deadline, "staged flush")
                await link.bounded(link.rma.flush(t, link.spin), t, "staged flush")
            finally:
                stage.staging_free.put_nowait(lslot)
            t = link.left(deadline, "scatter plan")
            # registered before the plan leaves: its SlotFree may come back at once
            fut = land.waiters[rslot] = link.loop.create_future()
            await link.bounded(
                link.channel.send(
                    m.StagedWrite(
                        group=stage.group.name,
                        slot=rslot,
                        offset=0,
                        nbytes=nbytes,
                        dst=np.ascontiguousarray(dst, dtype="<i8").tobytes(),
                    ).encode(),
                    t,
                ),
                t,
                "scatter plan",
            )
        except BaseException:
            if not posted:
                land.out.discard(rslot)
                land.free.put_nowait(rslot)
            raise
        return fut


def _one(v: int) -> np.ndarray:
    """A one-op column of a native PUT batch."""
    return np.asarray([v], dtype=_U64)


class Landing:
    """Landing slots a peer granted us for one group: ``free`` (an asyncio.Queue) and
    ``out`` (slots whose plan was sent, awaiting the peer's SlotFree)."""

    def __init__(self, region: int, base: int, slot_bytes: int, slots: List[int]):
        self.region, self.base, self.slot_bytes = region, base, slot_bytes
        self.slots = list(slots)
        self.free: asyncio.Queue = asyncio.LifoQueue()  # the warm (recently used) slot first
        for s in slots:
            self.free.put_nowait(s)
        self.out: Set[int] = set()
        self.waiters: Dict[int, asyncio.Future] = {}  # slot -> resolved by its SlotFree
