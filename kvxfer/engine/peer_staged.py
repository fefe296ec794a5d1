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
    Protocol,
    Set,
    Tuple,
    TypeVar,
)

import numpy as np

from kvxfer import plan
from kvxfer.engine import messages as m
from kvxfer.engine import slices
from kvxfer.engine.groups import LocalGroups
from kvxfer.engine.staging import GroupStage
from kvxfer.engine.types import TransferStats
from kvxfer.errors import InvalidArgument, KvxferError, ProtocolError
from kvxfer.transport.base import Channel, RmaEndpoint

log = logging.getLogger(__name__)
_U64 = np.uint64
T = TypeVar("T")

#: packs one chunk into a staging slot: ``gather(staging slot) -> bytes``
Gather = Callable[[int], int]
#: the chunk's message: ``make_msg(landing slot, bytes) -> encoded``
MakeMsg = Callable[[int, int], bytes]
#: a validated scatter plan: (stage, landing slot, byte offset, destination item ids)
ScatterPlan = Tuple[GroupStage, int, int, np.ndarray]


@dataclass(frozen=True)
class SliceScatter:
    """A validated slice chunk: unpack landing slot ``slot`` of ``stage`` into ``items``
    by ``runs`` (this side's own plan, from :meth:`StagedPath.expect_slices`)."""

    stage: GroupStage
    slot: int
    items: np.ndarray
    runs: slices.SliceRuns


class Expected:
    """The slices a peer may write under one key (target role): ``items`` (sorted unique
    ids) of ``group`` by ``runs``; ``got[i]``: item ``items[i]`` arrived (each once)."""

    __slots__ = ("group", "items", "runs", "got")

    def __init__(self, group: str, items: np.ndarray, runs: slices.SliceRuns):
        self.group, self.items, self.runs = group, items, runs
        self.got = np.zeros(items.size, dtype=bool)


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
        #: target role: slices the peer may write, by key (Peer.expect_slices)
        self.expected: Dict[int, Expected] = {}

    def can_stage(self, group: str) -> bool:
        """Whether writes of ``group`` to this peer may go staged (it granted us slots)."""
        return group in self.landing

    # ------------------------------------------------------- staged: target side
    def check_plan(self, msg: m.StagedWrite) -> ScatterPlan:
        """Validate a scatter plan off the wire (ProtocolError: the reader closes the peer
        and nothing of it is written)."""
        stage = self._granted_stage(msg.group, msg.slot)
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
        await self._slot_free(stage, slot)

    async def _slot_free(self, stage: GroupStage, slot: int) -> None:
        """The slot is drained: send its credit back (SlotFree)."""
        link = self._link
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

    # ------------------------------------------------------- slices: target side
    def expect_slices(self, key: int, group: str, items: Any, runs: Any) -> None:
        """Let the peer write the slices ``runs`` (ours: ``runs[d] = (offs, lens)`` per
        item of descriptor ``d``) of ``items`` of ``group`` under ``key``. Validated here
        (InvalidArgument / IndexOutOfRange / UnknownGroup); replaces an earlier key."""
        stage = self._groups.stages.get(group)
        if stage is None or group not in self.granted:
            raise InvalidArgument(
                f"no landing slots of group {group!r} granted to {self._link.name}: slice "
                f"writes need stage_slice_min_ops > 0 on both engines"
            )
        ids = plan.as_ids(items, "expected items")
        plan.check_ids(ids, stage.group.num_items, "expected items")
        ids = np.unique(ids)
        if ids.size == 0:
            raise InvalidArgument("expect_slices: no items")
        sr = runs if isinstance(runs, slices.SliceRuns) else None
        if sr is None:
            sr = slices.SliceRuns.make(runs, stage.group.item_lens, exclusive=True)
        elif sr.descriptors != len(stage.group.item_lens):
            raise InvalidArgument(f"slice plan of {sr.descriptors} descriptors for {group!r}")
        self.expected[int(key)] = Expected(group, ids, sr)

    def forget_slices(self, key: int) -> None:
        """Stop accepting slices under ``key`` (idempotent)."""
        self.expected.pop(int(key), None)

    def check_slice(self, msg: m.SliceChunk) -> SliceScatter:
        """Validate a slice chunk off the wire against what we expect under its key
        (ProtocolError: the reader closes the peer and nothing of it is written)."""
        stage = self._granted_stage(msg.group, msg.slot)
        exp = self.expected.get(msg.key)
        if exp is None or exp.group != msg.group:
            raise ProtocolError(f"slice chunk for {msg.group!r} under unexpected key {msg.key}")
        raw = bytes(msg.dst)
        if len(raw) == 0 or len(raw) % 8:
            raise ProtocolError(f"slice chunk: dst ids field of {len(raw)} bytes")
        dst = np.frombuffer(raw, dtype="<i8").astype(np.int64)
        want = int(dst.size) * exp.runs.per_item
        if msg.nbytes != want or want > stage.slot_bytes:
            raise ProtocolError(
                f"slice chunk of {msg.group!r}: {msg.nbytes} bytes for {dst.size} items "
                f"(we expect {want}, landing slot {stage.slot_bytes})"
            )
        pos = np.searchsorted(exp.items, dst)
        inside = pos < exp.items.size
        inside[inside] = exp.items[pos[inside]] == dst[inside]
        if not inside.all():
            raise ProtocolError(
                f"slice chunk under key {msg.key}: item {int(dst[~inside][0])} not expected"
            )
        if np.unique(pos).size != pos.size or exp.got[pos].any():
            raise ProtocolError(f"slice chunk under key {msg.key}: an item written twice")
        exp.got[pos] = True
        if exp.got.all():
            del self.expected[msg.key]
        self.busy.add((msg.group, msg.slot))
        return SliceScatter(stage, msg.slot, dst, exp.runs)

    async def scatter_slice(self, p: SliceScatter) -> None:
        """Unpack a validated slice chunk, then give the slot back to the peer."""
        try:
            p.stage.scatter_slices(p.items, p.runs, p.slot)
        except Exception:  # internal: the chunk was validated
            log.exception("peer %s: slice scatter into %r failed", self._link.name, p.stage)
            self._link.mark_dead(ProtocolError(f"scatter into {p.stage.group.name!r} failed"))
            return
        await self._slot_free(p.stage, p.slot)

    def _granted_stage(self, group: str, slot: int) -> GroupStage:
        stage = self._groups.stages.get(group)
        if stage is None or group not in self.granted:
            raise ProtocolError(f"staged write to group {group!r} without a landing grant")
        if slot not in self.granted[group]:
            raise ProtocolError(
                f"staged write to landing slot {slot} of {group!r}, not granted to this peer"
            )
        if (group, slot) in self.busy:
            raise ProtocolError(f"landing slot {slot} of {group!r} reused before it was freed")
        return stage

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

        def part(i: int, j: int):
            s, d = src[i:j], dst[i:j]

            def msg(rslot: int, nbytes: int) -> bytes:
                ids = np.ascontiguousarray(d, dtype="<i8").tobytes()
                return m.StagedWrite(
                    group=group, slot=rslot, offset=0, nbytes=nbytes, dst=ids
                ).encode()

            return functools.partial(stage.gather, s), msg

        ranges = [(i, min(i + per, int(src.size))) for i in range(0, int(src.size), per)]
        futs = await self._chunks(stage, land, [part(i, j) for i, j in ranges], deadline)
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
    ) -> List[asyncio.Future]:
        """One SliceWrite (validated): chunks of whole items of at most a slot, pipelined
        over the granted slots; one future per chunk, resolved by the peer's SlotFree."""
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

        futs = await self._chunks(stage, land, [part(i, j) for i, j in ranges], deadline)
        nbytes = int(src.size) * runs.per_item
        stats.staged = True
        stats.staged_bytes += nbytes
        stats.bytes += nbytes
        stats.ops += len(ranges)
        stats.staged_direct_ops += slices.direct_ops(runs, stage.group.item_lens, src)
        return futs

    async def _chunks(
        self, stage: GroupStage, land: "Landing", parts: List[Tuple[Gather, MakeMsg]], deadline
    ) -> List[asyncio.Future]:
        """Run the chunks concurrently (bounded by the granted slots); their futures."""
        tasks = [
            self._link.loop.create_task(self._stage_chunk(stage, land, g, mk, deadline))
            for g, mk in parts
        ]
        try:
            return [await t for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stage_chunk(
        self, stage: GroupStage, land: "Landing", gather: Gather, make_msg: MakeMsg, deadline
    ) -> asyncio.Future:
        """Landing slot first, then a staging slot (a fixed order: no deadlock), gather, one
        PUT, flush, then the chunk's message (``make_msg(landing slot, bytes)``). The
        landing slot returns with the peer's SlotFree; if the PUT was never posted it
        returns at once; after a failed PUT it is not reused (its bytes may still land)."""
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
                nbytes = gather(lslot)
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
            await link.bounded(link.channel.send(make_msg(rslot, nbytes), t), t, "scatter plan")
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
