"""Coalesced last chunks (prefill side): rooms that finish while their decode peer's link
is busy go to it as one write with one notification.

Every write of a room costs a fixed amount of host time on prefill (plan, post, a flush and
its completion, the notification) and on decode (the notification's receipt). When rooms
finish faster than one link's writes complete, each of them paying it bounds requests/s by
that host time (bench/results/stages-h200.md). A :class:`Coalescer` counts the writes of its
manager's rooms in flight to each decode peer (:mod:`kvxfer.disagg.outbox`); a room's last
chunk that finds the link busy (``after`` writes in flight, or a burst of returned ones the
loop has not settled yet) waits in the peer's outbox instead, and when it no longer is,
everything waiting goes as **one** ``Peer.write`` — the rooms' kv pages, state
slots and aux rows as one ItemWrite per group — whose notification is one
:class:`~kvxfer.disagg.messages.DoneMany` naming every room. A room that finds the link not
busy is written at once, as before: one request at a time never waits.

Only the simplest last chunks coalesce: whole pages (an ItemWrite or nothing) to a decode
of the same TP size that advertised ``done_many`` in its hello, no integrity check, no
earlier chunk of the room still in flight. Everything else keeps its own write.

Invariants
- A room's ``chain`` (the future :meth:`add` returns) is done only once no write of it can
  be in flight: after its coalesced write settled, or once it left the outbox unwritten
  (:meth:`withdraw`, a room that failed while waiting), so ``after_fail`` releases its
  source pages only then — as for a room's own write.
- The outbox only holds rooms while the link is busy (:mod:`kvxfer.disagg.outbox`: writes
  in flight, or a backlog of returned writes the loop has not settled); each write that
  returns or settles drains it once the link no longer is, and a room never waits longer
  than ``max_wait_s`` (1 ms, plus the loop's timer resolution) for that: a long write in flight (a large request) does not hold a
  small one back for its whole duration.
- A coalesced write that the engine refuses before any byte moves (a room's ids out of
  range, two rooms naming one destination) is split: every room is written on its own, so
  only the offending room fails. A failure after the bytes started moving (timeout, peer
  gone) fails every room of it, as it would each room's own write.
- A polling scheduler's burst (:mod:`kvxfer.disagg.bursts`) does not serialise on inline
  waits: a write that a burst starts goes without the transport's inline flush wait
  (:meth:`Coalescer.inline_ok`). Writes that end inline are never in flight when the next
  send looks, so a burst of them would never find its link busy and every room would pay
  its own write and wait; left in flight, that write makes the sends behind it coalesce.
- At most :data:`MAX_ROOMS` rooms per write (the DoneMany stays far below a chained
  notification's size limit); more wait for the next completion.

Runs on: the manager's loop thread, or a scheduler thread running a direct call as the
loop's guest (kvxfer.loop_thread) — never two at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, List, Optional

import numpy as np

from kvxfer import eager
from kvxfer.disagg import messages as m
from kvxfer.disagg.bursts import Bursts
from kvxfer.disagg.context import PrefillContext
from kvxfer.disagg.link import Link
from kvxfer.disagg.outbox import MAX_WAIT_S, Outboxes, Ticket
from kvxfer.disagg.poll import KVPoll, is_terminal
from kvxfer.disagg.rooms import Room
from kvxfer.disagg.trace import mark_write
from kvxfer.errors import (
    IndexOutOfRange,
    InvalidArgument,
    KvxferError,
    PeerClosed,
    TransferTimeout,
    UnknownGroup,
)

#: rooms in one coalesced write at most (a DoneMany of this many rooms is ~10 KB)
MAX_ROOMS = m.DONE_MANY_MAX
#: what the engine raises for a write's parts before any byte moves
_REFUSED = (IndexOutOfRange, InvalidArgument, UnknownGroup)


class Pending:
    """A room's last chunk waiting in its link's outbox."""

    __slots__ = ("room", "src", "kv", "src_state", "fut")

    def __init__(
        self, room: Room, src: np.ndarray, kv: Any, src_state: Any, fut: asyncio.Future
    ) -> None:
        self.room, self.src, self.kv, self.src_state, self.fut = room, src, kv, src_state, fut


class Coalescer:
    """The coalescing of one prefill manager (see the module docstring). ``after``: a last
    chunk waits once this many writes of the link are in flight (0: never);
    ``write_alone(r, src, kv, src_state)`` starts a room's own write of its last chunk and
    returns its future (the path a refused coalesced write falls back to); a last chunk
    waits ``max_wait_s`` at most (then it goes even though no write of its link completed)."""

    def __init__(
        self,
        mgr: PrefillContext,
        after: int,
        write_alone: Callable[[Room, np.ndarray, Any, Any], "asyncio.Future[Any]"],
        max_wait_s: float = MAX_WAIT_S,
    ) -> None:
        self.mgr = mgr
        self._write_alone = write_alone
        self._item_cls: Any = None
        #: per link (kvxfer.disagg.link.Link): writes in flight, last chunks waiting
        self.boxes: Outboxes[Pending] = Outboxes(after, self._start, MAX_ROOMS, max_wait_s)
        self._bursts = Bursts()  # of the writes started here (inline_ok)

    def _item_write(self) -> Any:
        """``ItemWrite``, imported on first use (the engine pulls in UCX)."""
        if self._item_cls is None:
            from kvxfer.engine import ItemWrite

            self._item_cls = ItemWrite
        return self._item_cls

    def begin(self, link: Link) -> Optional[Ticket]:
        """Count a write of one of our rooms to ``link``: in flight until :meth:`end` (its
        writer, the moment the write returned), unsettled until its future is done
        (:meth:`watch`)."""
        return self.boxes.begin(link)

    def watch(self, ticket: Optional[Ticket], fut: "asyncio.Future[Any]") -> None:
        self.boxes.watch(ticket, fut)

    def end(self, ticket: Optional[Ticket]) -> None:
        self.boxes.end(ticket)

    def inline_ok(self, r: Room) -> bool:
        """Whether the write room ``r`` starts now may wait inline for its flush: not in a
        burst of writes (:class:`~kvxfer.disagg.bursts.Bursts`; module docstring). Call
        once per write started."""
        return not self._bursts.burst(r.room, self.mgr.polled_at)

    def wants(self, r: Room, kv: Any, prev: Optional[asyncio.Future]) -> bool:
        """Whether room ``r``'s last chunk (its kv write ``kv``) should wait for a coalesced
        write: the link is busy and the chunk is of the simple kind (module docstring)."""
        link = r.link
        return (
            link is not None
            and self.boxes.busy(link)
            and link.done_many
            and link.tp is None
            and not link.dead
            and self.mgr.integrity is None
            and (prev is None or prev.done())
            and (kv is None or isinstance(kv, self._item_write()))
            and r.aux_index is not None
        )

    def add(self, r: Room, src: np.ndarray, kv: Any, src_state: Any) -> "asyncio.Future[Any]":
        """Queue ``r``'s last chunk on its link; returns the room's new ``chain``."""
        fut = asyncio.get_running_loop().create_future()
        self.boxes.add(r.link, Pending(r, src, kv, src_state, fut))
        return fut

    def withdraw(self, r: Room) -> None:
        """``r`` failed: if its last chunk is still waiting, it leaves the outbox unwritten
        and its chain ends now (its pages can be released)."""
        if r.link is None:
            return
        p = self.boxes.withdraw(r.link, lambda p: p.room is r)
        if p is not None and not p.fut.done():
            p.fut.set_result(None)

    def _start(
        self, link: Link, batch: List[Pending], ticket: Optional[Ticket]
    ) -> "asyncio.Future[Any]":
        return eager.start(self.mgr.spawn, self._write(link, batch, ticket))

    async def _write(self, link: Link, batch: List[Pending], ticket: Optional[Ticket]) -> None:
        """One write of ``batch``'s last chunks with one DoneMany; every room's chain ends
        once it settled (finally)."""
        try:
            live = [p for p in batch if not is_terminal(p.room.state)]
            await self._write_rooms(link, live, ticket)
        finally:
            for p in batch:
                if not p.fut.done():
                    p.fut.set_result(None)

    async def _write_rooms(self, link: Link, live: List[Pending], ticket: Optional[Ticket]) -> None:
        mgr = self.mgr
        if not live:
            return
        if link.dead:
            for p in live:
                exc = PeerClosed(f"room {p.room.room}: decode {link.name} is gone")
                mgr.fail(p.room, exc, notify=False, peer_gone=True)
            return
        ItemWrite = self._item_write()
        kv_s, kv_d, st_s, st_d, aux_s, aux_d = [], [], [], [], [], []
        for p in live:
            r = p.room
            assert r.aux_index is not None  # wants() checked it
            if p.kv is not None:
                kv_s.append(np.asarray(p.kv.src_items))
                kv_d.append(np.asarray(p.kv.dst_items))
            if len(r.dst_state):
                st_s.append(np.asarray(p.src_state))
                st_d.append(np.asarray(r.dst_state))
            mgr.aux.stamp(r.aux_index, r.room)
            aux_s.append(r.aux_index)
            aux_d.append(r.dst_aux)
            mgr.hook("before_write", r.room)
        items = [ItemWrite("aux", aux_s, aux_d)]
        if st_s:
            items.insert(0, ItemWrite("state", np.concatenate(st_s), np.concatenate(st_d)))
        if kv_s:
            items.insert(0, ItemWrite("kv", np.concatenate(kv_s), np.concatenate(kv_d)))
        notify = m.DoneMany(
            rooms=[p.room.room for p in live], pages=[len(p.room.dst_kv) for p in live]
        ).encode()
        t_call = time.monotonic_ns()
        try:
            try:
                stats = await link.peer.write(items, notify=notify, timeout=mgr.t.transfer_s)
            finally:  # no longer in flight, before any room of it is reported done
                self.boxes.end(ticket)
        except _REFUSED:
            # one room's parts (or two rooms' destinations) refused before any byte moved:
            # each room on its own, so only the offending one fails
            mgr.stats["coalesce_refused"] += 1
            alone = [self._write_alone(p.room, p.src, p.kv, p.src_state) for p in live]
            await asyncio.wait(alone)
            return
        except TransferTimeout as exc:
            # the write may still be in flight: only closing the link's endpoints stops it
            mgr.link_failed(link, exc, fence=True)
            for p in live:
                mgr.fail(p.room, exc, notify=False, peer_gone=True)
            return
        except KvxferError as exc:
            for p in live:
                mgr.fail(p.room, exc)
            return
        t_end = time.monotonic_ns()
        mgr.count_write(stats, rooms=len(live))
        for p in live:
            r = p.room
            if r.trace is not None:
                mark_write(r.trace, t_call, t_end, stats)
            r.pages_done += len(p.src)
            if is_terminal(r.state):
                continue
            mgr.advance(r, KVPoll.Success)
            mgr.release(r)
