"""The staged path of one :class:`kvxfer.engine.peer.Peer` (see :mod:`kvxfer.engine.staging`):
the target side here (validate and scatter plans, give landing slots back), the initiator
side in :mod:`kvxfer.engine.staged_send` (gather, one PUT per chunk, the plan).

The peer owns one :class:`StagedPath` (both roles) and hands it a
:class:`~kvxfer.engine.staged_send.StagedLink`: exactly what the path uses of the peer (its
loop, channel, RMA endpoint, bounded waits, death). Everything here runs on the asyncio
loop thread (see the threads table in docs/engine.md).

Invariants (target side)
- A plan is validated before anything of it is written, and a slot is never scattered
  twice concurrently (``busy``); every plan is answered by exactly one SlotFree, after
  its scatter, or without one if the peer abandoned it first.
- A SlotAbandon (read in channel order, so after the slot's plan if that was sent) drops
  the slot's plan if it is not scattered yet, and is answered by SlotReclaimed from the
  dispatcher, i.e. after that plan's SlotFree: the peer reuses the slot only then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Set, Tuple

import numpy as np

from kvxfer import plan
from kvxfer.engine import messages as m
from kvxfer.engine import slices
from kvxfer.engine.groups import LocalGroups
from kvxfer.engine.staged_send import StagedLink, StagedSender
from kvxfer.engine.staging import GroupStage
from kvxfer.errors import InvalidArgument, KvxferError, ProtocolError
from kvxfer.kernels.ids import sorted_unique

log = logging.getLogger(__name__)

#: a validated scatter plan: (stage, landing slot, byte offset, destination item ids)
ScatterPlan = Tuple[GroupStage, int, int, np.ndarray]


@dataclass(frozen=True)
class Reclaim:
    """Target side: answer SlotReclaimed for landing slot ``slot`` of ``stage`` (queued
    behind every plan of the slot that arrived before the peer's SlotAbandon)."""

    stage: GroupStage
    slot: int


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


class StagedPath(StagedSender):
    """Staged writes with one peer, in both roles (the initiator's: :class:`StagedSender`).

    Target role: ``granted`` (group -> landing slots we granted the peer), ``busy``
    ((group, slot) plans received and not yet drained), ``dropped`` (of those, abandoned
    by the peer: not to be scattered), ``expected`` (slices the peer may write, by key)."""

    def __init__(
        self,
        link: StagedLink,
        groups: LocalGroups,
        granted: Mapping[str, dict],
        landing: Mapping[str, tuple],
    ):
        super().__init__(link, groups, landing)
        self.granted: Dict[str, Set[int]] = {g: set(b["slots"]) for g, b in granted.items()}
        self.busy: Set[Tuple[str, int]] = set()
        self.expected: Dict[int, Expected] = {}
        self.dropped: Set[Tuple[str, int]] = set()

    # ------------------------------------------------------- staged: target side
    def check_plan(self, msg: m.StagedWrite) -> ScatterPlan:
        """Validate a scatter plan off the wire (ProtocolError: the reader closes the peer
        and nothing of it is written)."""
        stage = self._granted_stage(msg.group, msg.slot)
        dst = stage.check_plan(msg.slot, msg.offset, msg.nbytes, bytes(msg.dst))
        self.busy.add((msg.group, msg.slot))
        return (stage, msg.slot, msg.offset, dst)

    async def scatter(self, stage: GroupStage, slot: int, offset: int, dst: np.ndarray) -> None:
        """Scatter a validated plan (not if the peer abandoned it), then give the slot back
        to the peer (SlotFree)."""
        link = self._link
        if await self._drop(stage, slot):
            return
        try:
            stage.scatter(dst, slot, offset)
        except Exception:  # internal: the plan was validated
            log.exception("peer %s: scatter into %r failed", link.name, stage)
            link.mark_dead(ProtocolError(f"scatter into {stage.group.name!r} failed"))
            return
        await self._slot_free(stage, slot)

    async def _drop(self, stage: GroupStage, slot: int) -> bool:
        """Before scattering slot ``slot``: if the peer abandoned its plan, free the slot
        unscattered (SlotFree; its SlotReclaimed follows) and return True."""
        await self.at("scatter")
        key = (stage.group.name, slot)
        if key not in self.dropped:
            return False
        self.dropped.discard(key)
        await self._slot_free(stage, slot)
        return True

    def abandon_received(self, msg: m.SlotAbandon) -> Reclaim:
        """The peer gave up the chunk of a slot (reader, in channel order): a plan of it not
        scattered yet is dropped. Returns what the dispatcher answers, after that plan."""
        stage = self._groups.stages.get(msg.group)
        if (
            stage is None
            or msg.group not in self.granted
            or msg.slot not in self.granted[msg.group]
        ):
            raise ProtocolError(f"slot_abandon for {msg.group!r} slot {msg.slot}, not granted")
        if (msg.group, msg.slot) in self.busy:
            self.dropped.add((msg.group, msg.slot))
        return Reclaim(stage, msg.slot)

    async def reclaim(self, r: Reclaim) -> None:
        """Dispatcher: every plan of the slot before the abandon was handled: answer."""
        link = self._link
        try:
            await link.bounded(
                link.channel.send(
                    m.SlotReclaimed(group=r.stage.group.name, slot=r.slot).encode(),
                    link.transfer_timeout_s,
                ),
                link.transfer_timeout_s,
                "slot reclaim",
            )
        except KvxferError:
            pass  # the peer is gone; nothing to give back

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
        ids = sorted_unique(ids)
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
        if plan.has_duplicates(pos) or exp.got[pos].any():
            raise ProtocolError(f"slice chunk under key {msg.key}: an item written twice")
        exp.got[pos] = True
        if exp.got.all():
            del self.expected[msg.key]
        self.busy.add((msg.group, msg.slot))
        return SliceScatter(stage, msg.slot, dst, exp.runs)

    async def scatter_slice(self, p: SliceScatter) -> None:
        """Unpack a validated slice chunk (not if the peer abandoned it), then give the slot
        back to the peer. An abandoned chunk's items stay counted as arrived under its key:
        to write them again, register the key again (expect_slices replaces it)."""
        if await self._drop(p.stage, p.slot):
            return
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
