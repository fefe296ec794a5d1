"""Heterogeneous TP in the protocol: rooms with several peers (*legs*) and the byte plan of
one prefill → decode pair.

Peers. A decode rank ``d`` of ``Td`` takes a room from the prefill ranks
``decode_peers(d, Tp, Td)`` and a prefill rank ``p`` serves it to the decode ranks
``prefill_peers(p, Tp, Td)`` (:mod:`kvxfer.disagg.tp_plan`): several on decode when
``Tp > Td``, several on prefill when ``Tp < Td``. Decode finds every peer of its rank through
the bootstrap server and links to each; prefill accepts a decode rank's hello when the rank is
one of its peers (:class:`TpPair` on the link: both ranks, both TP sizes, both sides' item
geometries, validated at the handshake).

Legs. A room whose rank has one peer runs the protocol as before (``room.link``). A room with
``k > 1`` peers keeps its record (the *parent*: the scheduler's handle, the room table's entry)
and gets one *leg* per peer link: a :class:`~kvxfer.disagg.rooms.Room` of the same id and role,
not in the table, that runs the unchanged single-link protocol with that peer (its writes or
its receipt, Chunk/Done, Abort/AbortAck, its deadlines, the fenced release of its link). The
parent (:class:`Legs`) joins them:

* Success once every expected leg succeeded (decode then checks the aux row, which one prefill
  peer wrote: :meth:`TpPair.writes_aux`);
* the first leg that fails fails the parent, and the parent's failure fails every other leg
  (each tells its peer: Abort, then AbortAck or a fenced link before its release);
* the parent is released (its ``on_done``) only once every leg is released: no peer can
  still write into (decode) or read from (prefill) the room's items.

On prefill, decode's metadata comes once per decode peer; metadata that arrives before the
KVSender exists waits in one 'pending' record holding every peer's part (``Legs.pending``);
chunks sent before every peer's metadata arrived are kept (``Legs.history``) and replayed to
each leg as it attaches. A prefill rank with no units for a decode rank (a replica that is
not the room's sender) still sends Chunk/Done, writing no byte. Whole replicated items (the
MLA latent) are shared out instead: each replica writes its blocks of the room's pages
(:meth:`TpPair.replica_blocks`), so one whose blocks hold none of a chunk's pages writes no
byte of it.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from kvxfer.disagg import messages as m
from kvxfer.disagg.errors import DuplicateRoom, TpShapeMismatch, UnknownRoom
from kvxfer.disagg.link import Link
from kvxfer.disagg.poll import KVPoll, is_terminal
from kvxfer.disagg.roles import RoomRole
from kvxfer.disagg.rooms import Room
from kvxfer.disagg.runs import Runs
from kvxfer.disagg.tp_plan import (
    ItemGeometry,
    PagePlan,
    decode_peers,
    item_runs,
    item_salt_period,
    page_plan,
    prefill_peers,
)
from kvxfer.disagg.tp_shape import groups_of
from kvxfer.disagg.tp_tokens import plan_of
from kvxfer.engine.hostcopy import lands_whole
from kvxfer.loop_thread import in_guest, settle_after

#: how a room's decode legs' writes start (:func:`prefill_send`): 1, back to back, each but
#: the last waiting for its copy and flush in its task; 2, every leg so, the last too; 0,
#: each leg's write waiting inline as a single write does. ``$KVXFER_OVERLAP_LEGS`` (the A/B
#: of bench/results/tp-pattern-h200.md)
_OVERLAP_ENV = os.environ.get("KVXFER_OVERLAP_LEGS", "").strip()
OVERLAP_LEGS = int(_OVERLAP_ENV) if _OVERLAP_ENV in ("0", "1", "2") else 1
if _OVERLAP_ENV not in ("", "0", "1", "2"):
    logging.getLogger(__name__).warning(
        "KVXFER_OVERLAP_LEGS=%r is not 0, 1 or 2: using 1", _OVERLAP_ENV
    )

#: whether a send run as the manager loop's guest (a scheduler's thread) ends by running,
#: on that thread, what its earlier legs left for the loop: their completions that arrived
#: meanwhile and the steps those make ready (:func:`kvxfer.loop_thread.settle_after`), so
#: that the room's Success does not wait for the loop thread's wake-up and a hand-over back
#: (bench/results/tp-pattern-h200.md, eleventh session). ``$KVXFER_SETTLE_LEGS=0``: off (A/B)
SETTLE_LEGS = os.environ.get("KVXFER_SETTLE_LEGS", "1").strip() != "0"

#: the prefill / decode protocol object calling in (PrefillSide / DecodeSide; typed loosely:
#: they import this module)
PrefillSide = Any
DecodeSide = Any
#: a prefill chunk as KVSender.send hands it over: (src pages, state slots, last)
Chunk = Tuple[np.ndarray, Optional[np.ndarray], bool]
#: one decode peer's metadata for a room: (link, dst_kv, dst_state, dst_aux, (prefix, tokens))
Meta = Tuple[Link, np.ndarray, np.ndarray, int, Tuple[int, Optional[int]]]


@dataclass(frozen=True)
class TpPair:
    """One prefill rank and one decode rank of different TP sizes, with both sides' item
    geometries per group (prefill's ``src``, decode's ``dst``), as validated at the
    handshake. Lives on the link (``link.tp``) on both sides."""

    prefill_rank: int
    prefill_tp: int
    decode_rank: int
    decode_tp: int
    src: Dict[str, List[ItemGeometry]]
    dst: Dict[str, List[ItemGeometry]]
    #: both sides' kv page sizes (from the fingerprints; 0: not stated)
    src_page_size: int = 0
    dst_page_size: int = 0

    @classmethod
    def make(
        cls,
        ours: Dict[str, Any],
        theirs: Dict[str, Any],
        our_rank: int,
        their_rank: int,
        ours_is_prefill: bool,
    ) -> "TpPair":
        """From both fingerprints (checked by ``check_compatible`` already) and ranks."""
        a, b = groups_of(ours["tp"]), groups_of(theirs["tp"])
        tp_a, tp_b = int(ours["tp_size"]), int(theirs["tp_size"])
        ps_a, ps_b = int(ours.get("page_size") or 0), int(theirs.get("page_size") or 0)
        if ours_is_prefill:
            return cls(our_rank, tp_a, their_rank, tp_b, a, b, ps_a, ps_b)
        return cls(their_rank, tp_b, our_rank, tp_a, b, a, ps_b, ps_a)

    def decode_peers(self) -> Tuple[int, ...]:
        return decode_peers(self.decode_rank, self.prefill_tp, self.decode_tp)

    def prefill_peers(self) -> Tuple[int, ...]:
        return prefill_peers(self.prefill_rank, self.prefill_tp, self.decode_tp)

    def writes_aux(self, salt: int) -> bool:
        """Whether this prefill rank writes the room's aux row (one of the decode rank's
        peers does: the ``salt % k``-th, as the replicated units' sender)."""
        peers = self.decode_peers()
        return peers[int(salt) % len(peers)] == self.prefill_rank

    def tokens(
        self, src_pages: Any, dst_pages: Any, start: int, end: int, first_page: int, salt: int
    ) -> Runs:
        """The kv runs moving this pair's heads of the token window ``[start, end)``
        (:class:`kvxfer.disagg.tp_tokens.TokenPlan`: any two page sizes, any window);
        ``src_pages`` hold tokens from page ``first_page`` on, ``dst_pages`` from token 0."""
        plan = self.__dict__.get("_tokens")
        if plan is None:  # (frozen: cached by hand)
            plan = self.__dict__["_tokens"] = plan_of(self, "kv")
        return plan.runs(src_pages, dst_pages, start, end, src_first_page=first_page, salt=salt)

    def token_patterns(
        self, src_pages: Any, dst_pages: Any, start: int, end: int, first_page: int, salt: int
    ) -> List[Any]:
        """:meth:`tokens` as PatternWrites, one per piece class
        (:meth:`kvxfer.disagg.tp_tokens.TokenPlan.patterns`): the same bytes, one device-lane
        launch each."""
        from kvxfer.engine.types import PatternWrite

        plan = self.__dict__.get("_tokens")
        if plan is None:  # (frozen: cached by hand)
            plan = self.__dict__["_tokens"] = plan_of(self, "kv")
        return [
            PatternWrite("kv", s, d, runs)
            for s, d, runs in plan.patterns(
                src_pages, dst_pages, start, end, src_first_page=first_page, salt=salt
            )
        ]

    def write(
        self,
        group: str,
        src_items: Any,
        dst_items: Any,
        salt: int,
        stage_min_ops: int = 0,
        stage_blocks: bool = False,
        pattern: bool = False,
        split: Optional[Tuple[int, int]] = None,
    ) -> Any:
        """The RawWrite moving this pair's share of items ``src_items[k] -> dst_items[k]``
        of ``group``, or None when this prefill rank moves no byte of them; an ItemWrite
        when that share is every whole item (a replicated MLA latent, equal shares: what
        equal TP sends, planned as it is, without a run per item here). ``split = (first,
        pages)``: the items are the room's destination pages ``first, first + 1, ...`` of
        ``pages``; where the group's items are whole and held by several of the decode
        rank's peers (:meth:`replicas`), each of those replicas sends its blocks of the
        room's pages (:meth:`replica_blocks`) instead of one replica sending them all. With
        ``pattern`` (the peer's device lane copies PatternWrites: ``peer.can_pattern``), a
        share that is not whole items is one PatternWrite (one launch, however many runs).
        Else with ``stage_min_ops > 0``, a plan of more runs than that which costs more than
        one run per item and descriptor (head slices inside token rows; with
        ``stage_blocks`` any plan) is a SliceWrite under key ``salt`` instead (the decode
        side expects it: :meth:`dst_slice_sides`)."""
        if group not in self.src or not len(src_items):
            return None
        if split is not None and self.replicas(group) > 1:
            from kvxfer.engine.types import ItemWrite

            ranges = self.replica_ranges(group, salt, split[0], len(src_items), split[1])
            if not ranges:
                return None
            s, d = np.asarray(src_items), np.asarray(dst_items)
            if len(ranges) == 1:  # (the usual case: one block of the chunk, as views)
                ((lo, hi),) = ranges
                return ItemWrite(group, s[lo:hi], d[lo:hi])
            take = np.concatenate([np.arange(lo, hi) for lo, hi in ranges])
            return ItemWrite(group, s[take], d[take])
        if self.page_plan(group, salt).whole:
            from kvxfer.engine.types import ItemWrite

            return ItemWrite(group, src_items, dst_items)
        if pattern:
            runs = self.pattern_runs(group, salt)
            if runs is not None:
                from kvxfer.engine.types import PatternWrite

                return PatternWrite(group, src_items, dst_items, runs)
        if stage_min_ops > 0:
            sides = self.slice_sides(group, salt, src=True)
            n_runs = 0 if sides is None else sum(len(n) for _, n in sides)
            whole = self._moves_whole(group, salt)
            if sides is not None and not whole and (stage_blocks or n_runs > len(sides)):
                from kvxfer.engine.types import SliceWrite

                if len(src_items) * n_runs > stage_min_ops:  # (an upper bound: unmerged)
                    return SliceWrite(group, src_items, dst_items, sides, int(salt))
        runs = self.page_plan(group, salt).runs(src_items, dst_items)
        return runs.raw_write(group) if len(runs) else None

    def replicas(self, group: str) -> int:
        """How many of a decode rank's peers hold this pair's items of ``group`` whole, as
        replicas (the MLA latent at more prefill than decode ranks): the group's salt
        period when every salt class's plan is every whole item or nothing, else 1."""
        key = f"_replicas/{group}"
        got = self.__dict__.get(key)
        if got is None:  # (frozen: cached by hand)
            period = self._period(group)
            plans = [self.page_plan(group, c) for c in range(period)]
            got = period if all(p.whole or not p.classes for p in plans) else 1
            self.__dict__[key] = got
        return got

    def replica_blocks(
        self, group: str, salt: int, first: int, count: int, pages: int
    ) -> np.ndarray:
        """Which of the room's destination pages ``first .. first + count - 1`` (of
        ``pages``) this prefill rank sends, as a mask, where :meth:`replicas` ``R > 1``: the
        room's pages are cut into ``R`` blocks of ``ceil(pages / R)``, and block ``b`` goes
        from the replica whose salt class is ``(salt + b) % R`` — one replica per page (the
        plans of one class have exactly one sender), the replicas copying at once."""
        mine = np.zeros(int(count), dtype=bool)
        for lo, hi in self.replica_ranges(group, salt, first, count, pages):
            mine[lo:hi] = True
        return mine

    def replica_ranges(
        self, group: str, salt: int, first: int, count: int, pages: int
    ) -> List[Tuple[int, int]]:
        """:meth:`replica_blocks` as sorted chunk-relative ``[lo, hi)`` ranges: block ``b``
        is this rank's where ``(salt + b) % R`` is one of its :meth:`sending_classes`, so
        each such class gives the one block ``(class - salt) % R`` (the room has at most
        ``R`` blocks), cut to the chunk."""
        r = self.replicas(group)
        block = max(1, -(-int(pages) // r))
        first, end = int(first), int(first) + int(count)
        out = []
        for c in self.sending_classes(group):
            b = (c - int(salt)) % r
            lo, hi = max(b * block, first), min((b + 1) * block, end)
            if lo < hi:
                out.append((lo - first, hi - first))
        return sorted(out)

    def sending_classes(self, group: str) -> Tuple[int, ...]:
        """The salt classes in which this pair sends every whole item of ``group`` (one per
        replica where :meth:`replicas` > 1); resolved once."""
        key = f"_sends/{group}"
        got = self.__dict__.get(key)
        if got is None:  # (frozen: cached by hand)
            period = self._period(group)
            got = tuple(c for c in range(period) if self.page_plan(group, c).whole)
            self.__dict__[key] = got
        return got

    def _period(self, group: str) -> int:
        """The group's salt period (:meth:`salt_class`)."""
        key = f"_period/{group}"
        period = self.__dict__.get(key)
        if period is None:  # (frozen: cached by hand)
            period = 1
            for s, t in zip(self.src[group], self.dst[group]):
                p = item_salt_period(s, t, self.prefill_tp, self.decode_tp)
                period = math.lcm(period, p)
            self.__dict__[key] = period
        return period

    def salt_class(self, group: str, salt: int) -> int:
        """``salt`` reduced to its class for ``group``: salts of one class give the same runs
        (the least common multiple of the descriptors'
        :func:`~kvxfer.disagg.tp_plan.item_salt_period`; every salt is class 0 where no unit
        has replicas to pick from). The caches below keep one entry per class, so a pair
        without replicas plans once, and the device lane, which keeps its run table per
        pattern object, builds it once."""
        return int(salt) % self._period(group)

    def page_plan(self, group: str, salt: int) -> PagePlan:
        """The :class:`~kvxfer.disagg.tp_plan.PagePlan` of this pair's share of ``group``
        (what :func:`~kvxfer.disagg.tp_plan.plan_pages` computes per request), resolved once
        per :meth:`salt_class`."""
        salt = self.salt_class(group, salt)
        key = f"_pages/{group}/{salt}"
        plan = self.__dict__.get(key)
        if plan is None:  # (frozen: cached by hand)
            plan = self.__dict__[key] = page_plan(
                self.src[group],
                self.dst[group],
                self.prefill_rank,
                self.decode_rank,
                self.prefill_tp,
                self.decode_tp,
                salt=salt,
            )
        return plan

    def pattern_runs(self, group: str, salt: int) -> Any:
        """The validated :class:`~kvxfer.engine.slices.PatternRuns` of this pair's share of
        one item of ``group`` (both sides' runs), None when it moves nothing or whole items
        (those go as ItemWrites). Cached per :meth:`salt_class` (the same object each
        time: the device lane keeps its run table per pattern object)."""
        salt = self.salt_class(group, salt)
        key = f"_pattern/{group}/{salt}"
        if key not in self.__dict__:  # (frozen: cached by hand)
            from kvxfer.engine.slices import PatternRuns

            out = None
            runs = [
                item_runs(
                    s,
                    t,
                    self.prefill_rank,
                    self.decode_rank,
                    self.prefill_tp,
                    self.decode_tp,
                    salt,
                )
                for s, t in zip(self.src[group], self.dst[group])
            ]
            moved = sum(int(n.sum()) for _, _, n in runs)
            whole = all(
                moved == sum(g.item_bytes for g in side)
                for side in (self.src[group], self.dst[group])
            )
            if moved and not whole:
                out = PatternRuns.make(
                    runs,
                    [g.item_bytes for g in self.src[group]],
                    [g.item_bytes for g in self.dst[group]],
                )
            self.__dict__[key] = out
        return self.__dict__[key]

    def _moves_whole(self, group: str, salt: int) -> bool:
        """Whether this pair moves whole pages of ``group`` on both sides (replicated: MLA;
        then as equal TP), cached per :meth:`salt_class`."""
        salt = self.salt_class(group, salt)
        key = f"_whole/{group}/{salt}"
        if key not in self.__dict__:  # (frozen: cached by hand)
            sides = self.slice_sides(group, salt, src=True)
            moved = 0 if sides is None else sum(int(n.sum()) for _, n in sides)
            self.__dict__[key] = all(
                moved == sum(g.item_bytes for g in side)
                for side in (self.src[group], self.dst[group])
            )
        return self.__dict__[key]

    def dst_lands_whole(self, group: str, salt: int) -> bool:
        """Whether decode's runs of this pair's share of each item of ``group`` follow each
        other (:func:`kvxfer.engine.hostcopy.lands_whole`: one-to-many head slices), so the
        host lane writes them as long segments."""
        salt = self.salt_class(group, salt)
        key = f"_lands/{group}/{salt}"
        if key not in self.__dict__:  # (frozen: cached by hand, as slice_sides)
            sides = self.slice_sides(group, salt, src=False)
            self.__dict__[key] = sides is not None and lands_whole(sides)
        return self.__dict__[key]

    def slice_sides(self, group: str, salt: int, src: bool) -> Optional[List[Tuple[Any, Any]]]:
        """One side's item-relative runs ``(offs, lens)`` per descriptor of what this pair
        moves of each item of ``group`` (prefill's with ``src``, else decode's: both sides
        derive them from the geometries validated at the handshake), None if nothing."""
        salt = self.salt_class(group, salt)
        key = f"_sides/{group}/{salt}/{bool(src)}"
        if key in self.__dict__:  # (frozen: cached by hand; the runs are read-only)
            return self.__dict__[key]
        out = []
        for s, t in zip(self.src[group], self.dst[group]):
            ro, rd, rn = item_runs(
                s, t, self.prefill_rank, self.decode_rank, self.prefill_tp, self.decode_tp, salt
            )
            out.append((ro if src else rd, rn))
        got = out if any(len(n) for _, n in out) else None
        self.__dict__[key] = got
        return got

    def dst_slice_sides(self, group: str, salt: int) -> Optional[List[Tuple[Any, Any]]]:
        """Decode's runs of :meth:`slice_sides` (what it registers: :func:`expect_slices`)."""
        return self.slice_sides(group, salt, src=False)


def expect_slices(link: Link, room: int, dst_kv: Any) -> None:
    """Decode, before its metadata goes to the prefill peer behind ``link``: accept that
    peer's staged head slices of the room's pages, unpacked by the runs decode derives
    itself (the peer only names pages). No-op unless the engine takes slice writes.

    Registered whenever prefill *may* send SliceWrites, even where it then sends
    PatternWrites (which never use it): decode cannot tell which it will be. Prefill picks
    per chunk in ``PrefillSide._kv_part`` / :meth:`TpPair.write`: a PatternWrite when its
    ``KVManager(tp_pattern=)`` is "always", or "auto" and *its* Peer's device lane covers
    kv (``Peer.can_pattern``: prefill's own lane to this decode, opened and mapped on
    prefill's side); else a SliceWrite when the chunk's run count passes prefill's
    ``tp_stage_min_ops``. Neither prefill's ``tp_pattern`` nor its lane's state reaches
    decode (the engines' Hello / HelloAck have one capability flag, ``stage``; the PD
    HelloAck has ``ok`` / ``error`` / ``name``; decode's own lane toward prefill is another
    object, opened on decode's side), and the run count depends on chunk sizes decode
    never sees. Narrowing this needs prefill to state its kv path per link (e.g. a PD
    HelloAck field: "patterns kv"), a protocol change. An unused registration costs one
    ``SliceRuns`` check and a table entry, dropped at the room's release
    (``forget_slices``)."""
    tp: Optional[TpPair] = link.tp
    peer = link.peer
    if tp is None or not len(dst_kv) or not peer.accepts_slices("kv"):
        return
    if tp.src_page_size and tp.dst_page_size and tp.src_page_size != tp.dst_page_size:
        return  # pages do not pair one to one: prefill sends token runs (TpPair.tokens)
    try:
        sides = tp.dst_slice_sides("kv", room)
    except TpShapeMismatch:  # items that do not pair whole: never a slice write either
        return
    if sides is not None:
        peer.expect_slices(room, "kv", dst_kv, sides)


def peer_rank(link: Link, ours_is_prefill: bool) -> int:
    """The TP rank of the peer behind a hetero-TP link."""
    tp: TpPair = link.tp
    return tp.decode_rank if ours_is_prefill else tp.prefill_rank


def fanout(link: Link, ours_is_prefill: bool) -> int:
    """How many peers of the link's kind a room of ours has (1: the single-link protocol)."""
    tp: Optional[TpPair] = link.tp
    if tp is None:
        return 1
    return len(tp.prefill_peers() if ours_is_prefill else tp.decode_peers())


class Legs:
    """The legs of a parent room (see the module docstring). Runs on: the loop thread."""

    __slots__ = ("parent", "expect", "by_rank", "pending", "aborted", "history", "ok", "gone")

    def __init__(self, parent: Room, expect: int) -> None:
        self.parent = parent
        self.expect = expect
        #: peer TP rank -> leg
        self.by_rank: Dict[int, Room] = {}
        #: prefill, before the KVSender exists: peer TP rank -> that peer's metadata
        self.pending: Dict[int, Meta] = {}
        #: prefill, pending: links whose decode aborted the room (owed an AbortAck)
        self.aborted: Set[Link] = set()
        #: prefill: chunks sent so far, replayed to legs that attach later (None once all did)
        self.history: Optional[List[Chunk]] = []
        self.ok = 0  # legs that succeeded
        self.gone = 0  # legs released

    @property
    def complete(self) -> bool:
        """Every expected peer has its leg."""
        return len(self.by_rank) >= self.expect

    def all_released(self) -> bool:
        return self.gone >= len(self.by_rank)

    def of(self, link: Link, ours_is_prefill: bool) -> Optional[Room]:
        if link.tp is None:
            return None
        leg = self.by_rank.get(peer_rank(link, ours_is_prefill))
        return leg if leg is not None and leg.link is link else None

    def legs(self) -> List[Room]:
        return list(self.by_rank.values())


def new_leg(mgr: Any, parent: Room, rank: int, link: Link) -> Room:
    """A leg of ``parent`` for the peer of TP rank ``rank`` behind ``link`` (not attached to
    the link yet). Its release counts towards the parent's (:func:`leg_released`)."""
    legs: Legs = parent.legs
    leg = Room(parent.room, parent.role, lambda _s, _e: leg_released(mgr, parent))
    leg.parent = parent
    if parent.trace is not None and mgr.trace is not None:  # its own stages, same room id
        leg.trace = mgr.trace.start(parent.room, f"{parent.trace['role']}.leg{rank}")
    legs.by_rank[rank] = leg
    return leg


def leg_released(mgr: Any, parent: Room) -> None:
    """A leg's ``on_done``: the parent goes once it is terminal and every leg went."""
    legs: Legs = parent.legs
    legs.gone += 1
    if is_terminal(parent.state) and legs.all_released():
        mgr.release(parent)


def leg_succeeded(mgr: Any, leg: Room, on_all: Callable[[Room], Any]) -> None:
    """A leg reached Success; ``on_all(parent)`` once every expected leg did."""
    parent = leg.parent
    assert parent is not None
    legs: Legs = parent.legs
    legs.ok += 1
    if legs.ok >= legs.expect and not is_terminal(parent.state):
        on_all(parent)


def fail_legs(mgr: Any, parent: Room, notify: bool) -> None:
    """The parent failed: fail every live leg (each tells its peer when ``notify``), and
    release the parent now if no leg is left to wait for."""
    legs: Legs = parent.legs
    for leg in legs.legs():
        if not is_terminal(leg.state):
            mgr.fail(leg, parent.exc, notify=notify)
    if legs.all_released():
        mgr.release(parent)


# ====================================================================== prefill
def prefill_info(
    side: PrefillSide,
    link: Link,
    room: int,
    meta: Meta,
) -> None:
    """TransferInfo from one of several decode peers of a room (``Tp < Td``)."""
    mgr = side.mgr
    rank = peer_rank(link, True)
    r = mgr.rooms.get(room)
    if r is None:
        tomb = mgr.rooms.tombstone(room)
        if tomb is not None:
            side._reject(
                link,
                room,
                UnknownRoom(f"room {room} is no longer live on prefill {mgr.name} ({tomb})"),
            )
            return
        p = Room(room, RoomRole.PENDING)
        p.legs = Legs(p, fanout(link, True))
        try:
            mgr.rooms.insert(p)
        except DuplicateRoom:  # a KVSender was created meanwhile
            r = mgr.rooms.get(room)
        else:
            p.legs.pending[rank] = meta
            link.rooms.add(p)
            mgr.arm(p)
            return
    if r is not None and r.role is RoomRole.PENDING and r.legs is not None:
        if rank in r.legs.pending or is_terminal(r.state):
            side._reject(link, room, DuplicateRoom(f"room {room}: decode rank {rank} twice"))
            return
        r.legs.pending[rank] = meta
        link.rooms.add(r)
        return
    if r is None or r.role is not RoomRole.SENDER or r.link is not None or r.dst_kv is not None:
        side._reject(
            link,
            room,
            DuplicateRoom(f"room {room} already has a decode destination on prefill {mgr.name}"),
        )
        return
    if is_terminal(r.state):
        exc = r.exc
        side._reject(link, room, UnknownRoom(f"room {room} ended on prefill {mgr.name}: {exc}"))
        return
    if r.legs is None:
        r.legs = Legs(r, fanout(link, True))
        assert r.legs.history is not None
        r.legs.history.extend(r.queued)
        r.queued = []
    if rank in r.legs.by_rank:
        side._reject(link, room, DuplicateRoom(f"room {room}: decode rank {rank} twice"))
        return
    attach_leg(side, r, rank, meta)


def attach_leg(side: PrefillSide, r: Room, rank: int, meta: Meta) -> None:
    """Give the sender's room ``r`` its leg to the decode rank ``rank``; replay the chunks
    sent so far to it."""
    mgr, legs = side.mgr, r.legs
    link, dst_kv, dst_state, dst_aux, span = meta
    leg = new_leg(mgr, r, rank, link)
    leg.num_kv, leg.aux_index = r.num_kv, r.aux_index
    leg.queued = list(legs.history or ())
    if legs.complete:
        legs.history = None
    side._attach(leg, link, dst_kv, dst_state, dst_aux, span)
    if legs.complete and r.state == KVPoll.Bootstrapping and not is_terminal(leg.state):
        mgr.advance(r, KVPoll.WaitingForInput)


def prefill_adopt(side: PrefillSide, r: Room, pending: Room) -> None:
    """The KVSender ``r`` claimed a pending record of several decode peers."""
    mgr, plegs = side.mgr, pending.legs
    for link, *_ in plegs.pending.values():
        link.rooms.discard(pending)
    if is_terminal(r.state):  # our scheduler aborted it first: no write was issued
        for link, *_ in plegs.pending.values():
            if not link.dead:
                mgr.send_msg(
                    link, m.Abort(room=r.room, reason=str(r.exc), kind=type(r.exc).__name__)
                )
        return
    if r.legs is None:  # (another peer's metadata may have come between claim and adoption)
        r.legs = Legs(r, plegs.expect)
        assert r.legs.history is not None
        r.legs.history.extend(r.queued)
        r.queued = []
    for rank, meta in sorted(plegs.pending.items()):
        if is_terminal(r.state) or rank in r.legs.by_rank:  # failed meanwhile / twice
            link = meta[0]
            exc = (
                r.exc
                if is_terminal(r.state)
                else DuplicateRoom(f"room {r.room}: rank {rank} twice")
            )
            if not link.dead:
                mgr.send_msg(link, m.Abort(room=r.room, reason=str(exc), kind=type(exc).__name__))
            continue
        attach_leg(side, r, rank, meta)


def prefill_send(side: PrefillSide, r: Room, chunk: Chunk) -> None:
    """KVSender.send on a room with legs: every attached leg sends the chunk; the chunk is
    kept for the legs still to come.

    Every leg's write but the last starts with ``inline=False`` (:data:`OVERLAP_LEGS`):
    it plans, launches and posts on this stack, then waits for its copy and flush in its
    task instead of spinning here, so the next leg's host work overlaps them; the last leg
    waits inline as a single write does (bench/results/tp-pattern-h200.md). Run as the
    loop's guest, the send then finishes on this thread what those earlier legs left
    (:data:`SETTLE_LEGS`)."""
    legs: Legs = r.legs
    if legs.history is not None:
        legs.history.append(chunk)
    if legs.complete and r.state != KVPoll.Transferring:
        side.mgr.advance(r, KVPoll.Transferring)
    todo = legs.legs()
    for i, leg in enumerate(todo):
        inline = OVERLAP_LEGS == 0 or (OVERLAP_LEGS == 1 and i == len(todo) - 1)
        side.send(leg, *chunk, inline=inline)
    if SETTLE_LEGS and OVERLAP_LEGS and len(todo) > 1 and in_guest():
        engine = side.mgr.engine
        if engine is not None:
            settle_after(engine.transport)


def prefill_fail_pending(side: PrefillSide, p: Room, exc: BaseException) -> None:
    """A pending record of several decode peers failed: every peer still connected hears it
    (an AbortAck for a peer that aborted, else an Abort: no write was ever issued)."""
    mgr = side.mgr
    if not mgr.rooms.retire(p, exc):  # the KVSender claimed it: the failure becomes its
        r = mgr.rooms.get(p.room)
        if r is not None and r.role is RoomRole.SENDER and not is_terminal(r.state):
            mgr.fail(r, exc, notify=False)
        return
    p.state, p.exc = KVPoll.Failed, exc
    if p.timer is not None:
        p.timer.cancel()
        p.timer = None
    legs: Legs = p.legs
    links = {meta[0] for meta in legs.pending.values()} | legs.aborted
    for link in links:
        link.rooms.discard(p)
        if link.dead:
            continue
        if link in legs.aborted:
            mgr.send_msg(link, m.AbortAck(room=p.room))
        else:
            mgr.send_msg(link, m.Abort(room=p.room, reason=str(exc), kind=type(exc).__name__))
    mgr.room_gone()


def prefill_abort(side: PrefillSide, link: Link, r: Room, cause: BaseException) -> None:
    """Decode peer ``link`` aborted room ``r`` (parent or pending) of several peers."""
    mgr = side.mgr
    if r.role is RoomRole.PENDING:
        r.legs.aborted.add(link)
        if not is_terminal(r.state):
            mgr.fail(r, cause, notify=False)
        return
    leg = r.legs.of(link, True)
    if leg is None:  # no leg to it (its metadata never came): nothing in flight to it
        mgr.send_msg(link, m.AbortAck(room=r.room))
        if not is_terminal(r.state):
            mgr.fail(r, cause)
        return
    leg.peer_aborted = True
    if not is_terminal(leg.state):
        mgr.fail(leg, cause, notify=False)


# ====================================================================== decode
def decode_linked(side: DecodeSide, r: Room, links: Tuple[Link, ...]) -> None:
    """The receiver's room ``r`` has several prefill peers: one leg per link."""
    mgr = side.mgr
    r.legs = Legs(r, len(links))
    for link in links:
        leg = new_leg(mgr, r, peer_rank(link, False), link)
        leg.link = link
        link.rooms.add(leg)
        mgr.advance(leg, KVPoll.WaitingForInput)
    mgr.advance(r, KVPoll.WaitingForInput)
    if r.pending_meta is not None:
        decode_send_meta(side, r)


def decode_send_meta(side: DecodeSide, r: Room) -> None:
    """Decode's metadata goes to every prefill peer of the room."""
    meta, r.pending_meta = r.pending_meta, None
    r.meta_sent = True
    for leg in r.legs.legs():
        if is_terminal(leg.state):
            continue
        leg.pending_meta = meta
        leg.dst_kv, leg.dst_state, leg.dst_span = r.dst_kv, r.dst_state, r.dst_span
        leg.dst_aux_row, leg.expect_pages = r.dst_aux_row, r.expect_pages
        side._send_meta(leg)


def check_peers(entries: List[Dict[str, Any]], rank: int, tp: int, pp: int) -> Any:
    """The bootstrap entries of the prefill ranks a decode rank ``rank`` of ``tp`` pairs
    with (every one of ``decode_peers``), None while some are not registered yet;
    TpShapeMismatch when the TP sizes cannot pair."""
    sizes = {int(e["tp_size"]) for e in entries}
    if len(sizes) != 1:
        return None  # registrations in flux (a rank restarting with another TP size)
    (tp_p,) = sizes
    by_rank = {int(e["tp_rank"]): e for e in entries if int(e["pp_rank"]) == pp}
    if tp_p == tp:
        return [by_rank[rank]] if rank in by_rank else None
    try:
        want = decode_peers(rank, tp_p, tp)
    except TpShapeMismatch as exc:
        raise TpShapeMismatch(f"prefill tp {tp_p}, decode tp {tp}: {exc}") from None
    if any(p not in by_rank for p in want):
        return None
    return [by_rank[p] for p in want]


__all__ = [
    "Legs",
    "TpPair",
    "attach_leg",
    "check_peers",
    "decode_linked",
    "decode_send_meta",
    "expect_slices",
    "fail_legs",
    "fanout",
    "leg_succeeded",
    "prefill_abort",
    "prefill_adopt",
    "prefill_fail_pending",
    "prefill_info",
    "prefill_send",
]
