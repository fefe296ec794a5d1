"""Decode-side protocol: find prefill, connect once per prefill rank, send metadata, and
accept a room only when its completion message arrived *and* its aux row names it.

Pages of a room that failed after its metadata went out are released only once prefill has
confirmed that no write for it is in flight (AbortAck, or prefill's own Abort, or Done), or
the peer is gone. When no confirmation comes within ``abort_ack_s`` (or the peer falls
silent), the link is *held* (see :mod:`kvxfer.disagg.manager`): the rooms stay failed and
their pages stay with us until one of those happens — so a late RMA write, over any lane,
never lands in pages the scheduler already reused.

A prefill whose layout differs refuses our hello; each room bound to it then sends its
refusal (an Abort of kind LayoutMismatch) over the refused link, so that prefill's KVSender
fails at once too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from kvxfer import errors as kerr
from kvxfer.disagg import bootstrap, layerwise, tp_rooms
from kvxfer.disagg import errors as derr
from kvxfer.disagg import messages as m
from kvxfer.disagg.context import DecodeContext
from kvxfer.disagg.handle import OnDone
from kvxfer.disagg.kv_args import check_compatible
from kvxfer.disagg.link import Link
from kvxfer.disagg.poll import KVPoll, is_terminal
from kvxfer.disagg.roles import RoomRole
from kvxfer.disagg.rooms import Room
from kvxfer.disagg.trace import mark, mark_recv
from kvxfer.errors import (
    Closed,
    KvxferError,
    PeerClosed,
    ProtocolError,
    ShapeMismatch,
    TransferAborted,
    TransferTimeout,
)

log = logging.getLogger(__name__)

_KINDS = {
    c.__name__: c
    for c in (
        kerr.TransferAborted,
        kerr.TransferTimeout,
        kerr.ShapeMismatch,
        kerr.IndexOutOfRange,
        kerr.InvalidArgument,
        kerr.PeerClosed,
        kerr.Closed,
        kerr.IncompatiblePeer,
        kerr.ProtocolError,
        kerr.UnknownGroup,
        kerr.UnsupportedOperation,
        derr.DuplicateRoom,
        derr.UnknownRoom,
        derr.LayoutMismatch,
        derr.TpShapeMismatch,
        derr.IntegrityError,
    )
}


def remote_error(kind: str, reason: str, who: str) -> KvxferError:
    """Rebuild the peer's typed error (unknown kinds become TransferAborted)."""
    return _KINDS.get(kind, TransferAborted)(f"{who}: {reason}")


class DecodeSide:
    """The decode protocol of one manager. Runs on: the manager's loop thread, except
    :meth:`new_room` (the scheduler's thread)."""

    def __init__(self, mgr: DecodeContext) -> None:
        self.mgr = mgr
        #: bootstrap addr -> Future[Tuple[Link, ...]]: the links to the prefill peers of our
        #: rank (one, or several under heterogeneous TP)
        self._links: Dict[str, asyncio.Future] = {}
        self._hello: Dict[str, asyncio.Future] = {}  # peer id -> Future[HelloAck]
        self._refusals: Optional[asyncio.Future] = None  # Future[engine without memory]

    async def started(self) -> None:
        pass

    async def closing(self) -> None:
        for fut in self._links.values():
            if not fut.done():
                fut.cancel()
        ref = self._refusals
        if ref is not None:
            if not ref.done():
                ref.cancel()
            elif not ref.cancelled() and ref.exception() is None:
                await ref.result().close()

    # ------------------------------------------------------------------ handle entry points
    def new_room(self, room: int, on_done: Optional[OnDone], trace: Optional[dict] = None) -> Room:
        """Insert the receiver's room now (duplicates raise here); its deadline starts on
        the loop. ``trace``: its stage record, or None. Runs on: the caller's thread (the
        scheduler's)."""
        r = Room(room, RoomRole.RECEIVER, on_done)
        r.trace = trace
        self.mgr.rooms.insert(r)
        self.mgr.call(self.mgr.arm, r)
        return r

    def init(self, r: Room, addr: str) -> None:
        """KVReceiver.init(), handed over. Runs on: the loop thread."""
        if is_terminal(r.state) or r.inited:
            return
        r.inited = True
        r.bootstrap_addr = addr
        self._link_future(addr).add_done_callback(lambda f: self._linked(r, f))

    def send_metadata(
        self,
        r: Room,
        dst_kv: np.ndarray,
        dst_state: np.ndarray,
        aux: int,
        span: Tuple[int, Optional[int]] = (0, None),
    ) -> None:
        """KVReceiver.send_metadata(), handed over. Nothing is written for a room that
        already ended: its aux row may be back in the scheduler's allocator (and another
        request's) by now. Runs on: the loop thread."""
        if is_terminal(r.state):
            return
        self.mgr.aux.clear(aux)  # a stale stamp in a reused row can never validate
        r.pending_meta = (dst_kv, dst_state, aux)
        r.dst_kv, r.dst_state, r.dst_span = dst_kv, dst_state, span
        r.dst_aux_row, r.expect_pages = aux, len(dst_kv)
        if r.link is not None:
            self._send_meta(r)
        elif r.legs is not None:  # several prefill peers (hetero TP): each gets it
            tp_rooms.decode_send_meta(self, r)

    def _send_meta(self, r: Room) -> None:
        assert r.pending_meta is not None and r.link is not None
        dst_kv, dst_state, aux = r.pending_meta
        prefix, tokens = r.dst_span
        r.pending_meta = None
        r.meta_sent = True
        tp_rooms.expect_slices(r.link, r.room, dst_kv)  # hetero TP: staged head slices
        self.mgr.send_msg(
            r.link,
            m.TransferInfo(
                room=r.room,
                dst_kv=m.ids_to_bytes(dst_kv),
                dst_state=m.ids_to_bytes(dst_state),
                dst_aux=aux,
                prefix=prefix or None,
                tokens=tokens,
            ),
        )
        self.mgr.arm(r)  # WaitingForInput now counts prefill's queueing + compute

    # ------------------------------------------------------------------ connection
    def _link_future(self, addr: str) -> asyncio.Future:
        fut = self._links.get(addr)
        if fut is not None and (
            not fut.done()
            or (
                not fut.cancelled()
                and fut.exception() is None
                and not any(lk.dead for lk in fut.result())
            )
        ):
            return fut
        fut = asyncio.get_running_loop().create_future()
        self._links[addr] = fut
        self.mgr.spawn(self._connect(addr, fut))
        return fut

    def link_lost(self, link: Link) -> None:
        fut = self._links.get(link.key)
        if (
            fut is not None
            and fut.done()
            and not fut.cancelled()
            and fut.exception() is None
            and link in fut.result()
        ):
            del self._links[link.key]

    async def _connect(self, addr: str, fut: asyncio.Future) -> None:
        try:
            links = await asyncio.wait_for(self._establish(addr), self.mgr.t.bootstrap_s)
        except asyncio.TimeoutError:
            exc: BaseException = TransferTimeout(
                f"decode {self.mgr.name}: no usable prefill at bootstrap {addr} within "
                f"{self.mgr.t.bootstrap_s:g}s"
            )
        except (KvxferError, OSError) as e:
            exc = e
        else:
            if not fut.done():
                fut.set_result(links)
            return
        if self._links.get(addr) is fut:
            del self._links[addr]
        if not fut.done():
            fut.set_exception(exc)

    async def _pick(self, addr: str) -> List[Dict[str, Any]]:
        """The bootstrap entries of our rank's prefill peers (the equal rank, or every rank
        of ``tp_plan.decode_peers`` under heterogeneous TP), once all are registered."""
        mgr, a = self.mgr, self.mgr.args
        delay = 0.02
        while True:
            entries = await bootstrap.lookup(addr, a.dp_rank, 5.0, mgr.secret)
            if entries:
                got = tp_rooms.check_peers(entries, a.tp_rank, a.tp_size, a.pp_rank)
                if got is not None:
                    return got
            await asyncio.sleep(delay)  # prefill not registered yet: retry
            delay = min(delay * 2, 0.5)

    async def _establish(self, addr: str) -> Tuple[Link, ...]:
        """Link to every prefill peer of our rank (:meth:`_establish_one` each)."""
        return tuple([await self._establish_one(addr, e) for e in await self._pick(addr)])

    async def _establish_one(self, addr: str, entry: Dict[str, Any]) -> Link:
        """Connect and say hello. A prefill whose layout differs refuses the hello; the link
        is kept anyway (``link.refused``) so that each room can send its refusal over it.
        Our engine cannot even connect to it when the buffer geometry differs (the engine
        handshake refuses mismatched groups), so then the connection is made by an engine
        without registered memory, which carries messages only."""
        mgr = self.mgr
        ours: Optional[derr.LayoutMismatch] = None
        try:
            check_compatible(
                mgr.fingerprint,
                entry["fingerprint"],
                us=f"decode {mgr.name}",
                them=f"prefill {entry['name']}",
                ours_is_prefill=False,
            )
        except derr.LayoutMismatch as exc:
            ours = exc
            refusals = await self._refusal_engine()
            peer = await refusals.connect(entry["host"], entry["port"])
        else:
            peer = await mgr.connect(entry["host"], entry["port"])
        link = Link(addr, peer, entry["name"])
        if ours is None and entry["tp_size"] != mgr.args.tp_size:
            link.tp = tp_rooms.TpPair.make(
                mgr.fingerprint, entry["fingerprint"], mgr.args.tp_rank, entry["tp_rank"], False
            )
        mgr.links[peer.id] = link
        ack_fut = asyncio.get_running_loop().create_future()
        self._hello[peer.id] = ack_fut
        try:
            await peer.send(
                m.Hello(
                    name=mgr.name, tp_rank=mgr.args.tp_rank, fingerprint=mgr.fingerprint
                ).encode()
            )
            ack = await ack_fut
        except BaseException:
            mgr.links.pop(peer.id, None)
            link.dead = True
            await _quiet_close(peer)
            raise
        finally:
            self._hello.pop(peer.id, None)
        if not ack.ok:
            link.refused = (
                ours
                if isinstance(ours, derr.TpShapeMismatch)
                else derr.LayoutMismatch(f"prefill {entry['name']} refused: {ack.error}")
            )
        return link

    async def _refusal_engine(self) -> Any:
        """The message-only engine (started once, shared, closed with the manager)."""
        if self._refusals is None:
            self._refusals = self.mgr.spawn(self.mgr.message_engine(f"{self.mgr.name}-refusals"))
        return await asyncio.shield(self._refusals)

    def _linked(self, r: Room, f: asyncio.Future) -> None:
        """Runs on: the loop thread (the done callback of the link's future)."""
        mgr = self.mgr
        if f.cancelled():
            mgr.fail(
                r,
                Closed(f"room {r.room}: manager closed while bootstrapping"),
                notify=False,
                peer_gone=True,
            )
            return
        exc = f.exception()
        if exc is not None:
            mgr.fail(r, exc, notify=False, peer_gone=True)
            return
        links: Tuple[Link, ...] = f.result()
        dead = [lk for lk in links if lk.dead]
        if dead:
            for lk in links:
                if not lk.dead:
                    mgr.send_msg(lk, m.Abort(room=r.room, reason="peer gone", kind="PeerClosed"))
            mgr.fail(
                r,
                PeerClosed(f"room {r.room}: prefill {dead[0].name} closed"),
                notify=False,
                peer_gone=True,
            )
            return
        if is_terminal(r.state):  # aborted while bootstrapping: tell prefill
            for lk in links:
                mgr.send_msg(lk, m.Abort(room=r.room, reason=str(r.exc), kind=type(r.exc).__name__))
            return
        refused = next((lk.refused for lk in links if lk.refused is not None), None)
        if refused is not None:  # prefill's KVSender must not wait for us
            for lk in links:
                mgr.send_msg(
                    lk, m.Abort(room=r.room, reason=str(refused), kind=type(refused).__name__)
                )
            mgr.fail(r, type(refused)(f"room {r.room}: {refused}"), notify=False, peer_gone=True)
            return
        if len(links) > 1:  # several prefill peers (hetero TP): one leg each
            tp_rooms.decode_linked(self, r, links)
            return
        (link,) = links
        r.link = link
        link.rooms.add(r)
        mgr.advance(r, KVPoll.WaitingForInput)
        if r.pending_meta is not None:
            self._send_meta(r)

    # ------------------------------------------------------------------ failure
    def after_fail(self, r: Room, *, notify: bool, peer_gone: bool) -> None:
        mgr, link = self.mgr, r.link
        if r.legs is not None:  # several prefill peers: each leg settles with its own
            tp_rooms.fail_legs(mgr, r, notify)
            return
        if (
            link is None
            and notify
            and not peer_gone
            and not r.inited
            and r.bootstrap_addr
            and not mgr.closed
        ):
            # aborted before init(): reach prefill anyway (its KVSender may be waiting)
            r.inited = True
            self._link_future(r.bootstrap_addr).add_done_callback(lambda f: self._linked(r, f))
        if link is None or link.dead or peer_gone or r.peer_aborted:
            mgr.release(r)
            return
        if notify:
            mgr.send_msg(link, m.Abort(room=r.room, reason=str(r.exc), kind=type(r.exc).__name__))
        if r.meta_sent:
            r.await_ack = True
            mgr.arm(r, mgr.t.abort_ack_s)
        else:
            mgr.release(r)

    # ------------------------------------------------------------------ messages
    def _room_of(self, link: Link, room: int, tag: str) -> Optional[Room]:
        r = self.mgr.rooms.get(room)
        if r is not None and r.legs is not None:  # the leg of that prefill peer
            r = r.legs.of(link, False)
        if r is None or r.role is not RoomRole.RECEIVER or r.link is not link:
            lvl = logging.DEBUG if self.mgr.rooms.tombstone(room) else logging.WARNING
            log.log(
                lvl,
                "%s: %s for unknown room %d from %s",
                self.mgr.name,
                tag,
                room,
                link.name if link else "?",
            )
            return None
        return r

    def on_message(self, peer: Any, link: Optional[Link], msg: Any) -> None:
        """A message from a prefill engine. Runs on: the loop thread."""
        mgr = self.mgr
        if isinstance(msg, m.HelloAck):
            fut = self._hello.get(peer.id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return
        if link is None:
            raise ProtocolError(f"{msg.TAG} from unknown peer {peer.id}")
        if isinstance(msg, m.AbortAck):
            r = mgr.rooms.get(msg.room)
            if r is not None and r.legs is not None:
                r = r.legs.of(link, False)
            if r is not None and r.link is link and (r.await_ack or link.held):
                r.peer_aborted = True  # acked only once nothing is in flight for it
                mgr.release(r)
            return
        if isinstance(msg, m.DoneMany):
            self._on_done_many(link, msg)
            return
        r = self._room_of(link, getattr(msg, "room", -1), msg.TAG)
        if r is None:
            return
        if isinstance(msg, m.Abort):
            r.peer_aborted = True  # prefill has no write in flight
            if is_terminal(r.state):
                mgr.release(r)
            else:
                mgr.fail(
                    r, remote_error(msg.kind, msg.reason, f"prefill {link.name}"), notify=False
                )
        elif isinstance(msg, m.Chunk):
            if is_terminal(r.state):
                return
            if msg.pages_done > r.expect_pages:
                mgr.fail(
                    r,
                    ProtocolError(
                        f"room {r.room}: prefill reports {msg.pages_done} "
                        f"pages done of {r.expect_pages}"
                    ),
                )
            elif r.state == KVPoll.Transferring:
                mgr.arm(r)  # lease renewed by progress
            else:
                mgr.advance(r, KVPoll.Transferring)
                if r.parent is not None:
                    mgr.advance(r.parent, KVPoll.Transferring)
        elif isinstance(msg, m.LayerDone):
            layerwise.on_layer_done(mgr, r, msg)
        elif isinstance(msg, m.Done):
            if r.trace is not None:
                mark_recv(r.trace)
            self._on_done(r, msg)
        else:
            raise ProtocolError(f"unexpected {msg.TAG} on a decode manager")

    def _on_done_many(self, link: Link, msg: m.DoneMany) -> None:
        """The Done of every room of a coalesced write (:mod:`kvxfer.disagg.coalesce`), in
        order; a room that is not this link's is skipped as a lone Done would be. Lists of
        different lengths or more than ``DONE_MANY_MAX`` rooms are refused whole (logged,
        nothing is accepted)."""
        if len(msg.rooms) != len(msg.pages):
            raise ProtocolError(
                f"{msg.TAG}: {len(msg.rooms)} rooms but {len(msg.pages)} page counts"
            )
        if len(msg.rooms) > m.DONE_MANY_MAX:
            raise ProtocolError(f"{msg.TAG}: {len(msg.rooms)} rooms (at most {m.DONE_MANY_MAX})")
        for room, pages in zip(msg.rooms, msg.pages):
            r = self._room_of(link, room, msg.TAG)
            if r is None:
                continue
            if r.trace is not None:
                mark_recv(r.trace)
            self._on_done(r, m.Done(room=room, pages=pages))

    def _on_done(self, r: Room, msg: m.Done) -> None:
        mgr = self.mgr
        r.peer_aborted = True  # final: nothing more is in flight
        if mgr.integrity is not None:
            mgr.integrity.done_arrived(r)  # prefill now waits for our verdict
        if is_terminal(r.state):
            mgr.release(r)
            return
        if msg.pages != r.expect_pages:
            mgr.fail(
                r,
                ShapeMismatch(
                    f"room {r.room}: prefill sent {msg.pages} pages, decode "
                    f"expected {r.expect_pages}"
                ),
                notify=False,
            )
            return
        if r.parent is not None:  # a leg: the room checks the aux row once all are done
            if mgr.integrity is not None:
                mgr.integrity.check(r, msg)  # this pair's bytes; Success once they match
                return
            mgr.advance(r, KVPoll.Success)
            mgr.release(r)
            return
        self._accept(r, msg)

    def leg_succeeded(self, leg: Room) -> None:
        """A leg of a room with several prefill peers succeeded (the manager's hook)."""
        tp_rooms.leg_succeeded(self.mgr, leg, lambda parent: self._accept(parent, None))

    def _accept(self, r: Room, msg: Optional[m.Done]) -> None:
        """Every byte of the room landed: accept it if its aux row names it (``msg``: the
        Done, None for a room of several prefill peers, which integrity mode refuses)."""
        mgr = self.mgr
        assert r.dst_aux_row is not None  # set by send_metadata, before any Done
        got = mgr.aux.read_room(r.dst_aux_row)
        if got != r.room:
            mgr.fail(
                r,
                derr.RoomMismatch(
                    f"room {r.room}: metadata row {r.dst_aux_row} carries "
                    f"{'no valid room stamp' if got is None else f'room {got}'}; data rejected"
                ),
                notify=False,
            )
            return
        if mgr.integrity is not None and msg is not None:
            mgr.integrity.check(r, msg)  # Success once every checksum matched
            return
        mgr.advance(r, KVPoll.Success)
        if r.trace is not None:
            mark(r.trace, "handled")
        mgr.release(r)


async def _quiet_close(peer: Any) -> None:
    try:
        await peer.close()
    except KvxferError:
        pass
