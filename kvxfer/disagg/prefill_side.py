"""Prefill-side protocol: accept decode's metadata, write chunks, state and the aux row.

Per room the writes form a chain (each awaits the previous one) so the final completion
message is issued only after every earlier chunk's bytes are visible on decode. The room's
source pages stay leased until the chain has settled: ``on_done`` (the scheduler's release)
runs after Success, after an abort, or after a timeout — never while a write may still read
them. Decode's metadata may arrive before the KVSender exists; it is then held as a
'pending' room with a Bootstrapping deadline.
"""
from __future__ import annotations

import asyncio
import logging

import numpy as np

from kvxfer.disagg import bootstrap
from kvxfer.disagg import messages as m
from kvxfer.disagg.errors import DuplicateRoom, LayoutMismatch, UnknownRoom
from kvxfer.disagg.kv_args import check_compatible
from kvxfer.disagg.poll import KVPoll, is_terminal
from kvxfer.disagg.rooms import SOFT_TOMBS, Room
from kvxfer.errors import (IndexOutOfRange, InvalidArgument, KvxferError, ProtocolError,
                           ShapeMismatch, TransferAborted, TransferTimeout)

log = logging.getLogger(__name__)
_ItemWrite = None


def _item_write():
    global _ItemWrite
    if _ItemWrite is None:
        from kvxfer.engine import ItemWrite
        _ItemWrite = ItemWrite
    return _ItemWrite


class PrefillSide:
    def __init__(self, mgr) -> None:
        self.mgr = mgr

    # ------------------------------------------------------------------ lifecycle
    def _entry(self) -> m.BsRegister:
        a, (host, port) = self.mgr.args, self.mgr.address
        return m.BsRegister(name=self.mgr.name, host=str(host), port=int(port),
                            tp_rank=a.tp_rank, tp_size=a.tp_size, dp_rank=a.dp_rank,
                            pp_rank=a.pp_rank, fingerprint=self.mgr.fingerprint)

    async def started(self) -> None:
        """Register at the bootstrap server, retrying until it answers (register_s)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.mgr.t.register_s
        delay = 0.02
        while True:
            try:
                await bootstrap.request(self.mgr.bootstrap_addr, self._entry(),
                                        max(0.1, min(5.0, deadline - loop.time())),
                                        self.mgr.secret)
                return
            except (KvxferError, OSError) as exc:
                if loop.time() + delay > deadline:
                    raise TransferTimeout(f"{self.mgr.name}: could not register at bootstrap "
                                          f"{self.mgr.bootstrap_addr}: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def closing(self) -> None:
        a = self.mgr.args
        try:
            await bootstrap.request(self.mgr.bootstrap_addr, m.BsUnregister(
                name=self.mgr.name, dp_rank=a.dp_rank, tp_rank=a.tp_rank, pp_rank=a.pp_rank), 1.0,
                self.mgr.secret)
        except (KvxferError, OSError):
            pass

    def link_lost(self, link) -> None:
        pass

    # ------------------------------------------------------------------ handle entry points
    def new_room(self, room: int, role: str, on_done) -> Room:
        """Any thread: insert the sender's room now (duplicates raise here); merge decode's
        metadata that may already wait in a 'pending' record on the loop."""
        mgr = self.mgr
        tomb = mgr.rooms.tombstone(room)
        r = Room(room, "sender", on_done)
        pending = mgr.rooms.insert(r, replace_role="pending")
        if tomb in SOFT_TOMBS:
            mgr.rooms.unbury(room)
        mgr.call(self._adopt, r, pending, tomb if tomb in SOFT_TOMBS else None)
        return r

    def _adopt(self, r: Room, pending, tomb) -> None:
        mgr = self.mgr
        if tomb is not None and not is_terminal(r.state):
            cls = TransferTimeout if tomb == "pending-expired" else TransferAborted
            mgr.fail(r, cls(f"room {r.room}: decode gave up on it before the KVSender existed "
                            f"({tomb})"), notify=False)
            return
        if pending is None:
            mgr.arm(r)
            return
        if pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None
        link = pending.link
        link.rooms.discard(pending)
        if is_terminal(r.state):                 # e.g. decode's abort raced the adoption
            return
        if r.dst_kv is not None:                 # a second decode raced the adoption
            self._reject(link, r.room, DuplicateRoom(
                f"room {r.room} already has a decode destination on prefill {mgr.name}"))
            return
        r.link, r.dst_kv, r.dst_state, r.dst_aux = (link, pending.dst_kv, pending.dst_state,
                                                    pending.dst_aux)
        link.rooms.add(r)
        mgr.advance(r, KVPoll.WaitingForInput)

    def init(self, r: Room, num_kv: int, aux_index: int) -> None:
        r.num_kv, r.aux_index = num_kv, aux_index
        if not is_terminal(r.state) and r.dst_kv is not None:
            self._check_counts(r)

    def send(self, r: Room, src: np.ndarray, src_state, last: bool) -> None:
        if is_terminal(r.state):
            return
        if r.dst_kv is None:                  # decode's metadata not here yet: keep order
            r.queued.append((src, src_state, last))
            return
        self._issue(r, src, src_state, last)

    # ------------------------------------------------------------------ writes
    def _check_counts(self, r: Room) -> bool:
        if r.num_kv is not None and r.num_kv != len(r.dst_kv):
            self.mgr.fail(r, ShapeMismatch(
                f"room {r.room}: prefill sends {r.num_kv} pages, decode allocated "
                f"{len(r.dst_kv)}"))
            return False
        return True

    def _issue(self, r: Room, src, src_state, last: bool) -> None:
        mgr = self.mgr
        start = r.pages_queued
        dst = r.dst_kv[start:start + len(src)]
        n_state = 0 if src_state is None else len(src_state)
        if last and len(r.dst_state) != n_state:
            mgr.fail(r, ShapeMismatch(f"room {r.room}: prefill sends {n_state} state slots, "
                                      f"decode allocated {len(r.dst_state)}"))
            return
        r.pages_queued += len(src)
        if r.state != KVPoll.Transferring:
            mgr.advance(r, KVPoll.Transferring)
        prev = r.chain
        r.chain = mgr.spawn(self._write(r, prev, src, dst, src_state, last))

    async def _write(self, r: Room, prev, src, dst, src_state, last: bool) -> None:
        if prev is not None and not prev.done():
            await asyncio.wait([prev])
        if is_terminal(r.state) or r.link is None or r.link.dead:
            return
        mgr, ItemWrite = self.mgr, _item_write()
        items = [ItemWrite("kv", src, dst)] if len(src) else []
        if last:
            if len(r.dst_state):
                items.append(ItemWrite("state", src_state, r.dst_state))
            mgr.aux.stamp(r.aux_index, r.room)
            items.append(ItemWrite("aux", [r.aux_index], [r.dst_aux]))
            notify = m.Done(room=r.room, pages=len(r.dst_kv)).encode()
        else:
            notify = m.Chunk(room=r.room, pages_done=r.pages_done + len(src)).encode()
        try:
            stats = await r.link.peer.write(items, notify=notify, timeout=mgr.t.transfer_s)
        except KvxferError as exc:
            mgr.fail(r, exc)
            return
        st = mgr.stats
        st["writes"] += 1
        st["bytes"] += int(getattr(stats, "bytes", 0))
        st["ops"] += int(getattr(stats, "ops", 0))
        st["lanes"].update(getattr(stats, "lanes", ()) or ())
        r.pages_done += len(src)
        if is_terminal(r.state):
            return
        if last:
            mgr.advance(r, KVPoll.Success)
            mgr.release(r)
        else:
            mgr.arm(r)                           # lease renewed by progress

    def after_fail(self, r: Room, *, notify: bool, peer_gone: bool) -> None:
        mgr = self.mgr

        def settle(_=None) -> None:
            link = r.link
            if link is not None and not link.dead and not peer_gone:
                if r.peer_aborted:
                    mgr.send_msg(link, m.AbortAck(room=r.room))
                elif notify:
                    mgr.send_msg(link, m.Abort(room=r.room, reason=str(r.exc),
                                               kind=type(r.exc).__name__))
            if r.role == "pending":
                r.released = True
                if link is not None:
                    link.rooms.discard(r)
                mgr.rooms.remove(r, "aborted-by-peer" if r.peer_aborted else "pending-expired")
            else:
                mgr.release(r)

        if r.chain is None or r.chain.done():
            settle()
        else:
            r.chain.add_done_callback(settle)

    # ------------------------------------------------------------------ messages
    def on_message(self, peer, link, msg) -> None:
        if isinstance(msg, m.Hello):
            self._on_hello(peer, msg)
            return
        if link is None:
            raise ProtocolError(f"{msg.TAG} from {peer.id} before its hello")
        if isinstance(msg, m.TransferInfo):
            self._on_info(link, msg)
        elif isinstance(msg, m.Abort):
            self._on_abort(link, msg)
        else:
            raise ProtocolError(f"unexpected {msg.TAG} on a prefill manager")

    def _on_hello(self, peer, msg: m.Hello) -> None:
        from kvxfer.disagg.manager import Link
        mgr = self.mgr
        try:
            check_compatible(mgr.fingerprint, msg.fingerprint, us=f"prefill {mgr.name}",
                             them=f"decode {msg.name}")
            if msg.tp_rank != mgr.args.tp_rank:
                raise LayoutMismatch(f"tp_rank: prefill {mgr.name} is {mgr.args.tp_rank}, "
                                     f"decode {msg.name} wants {msg.tp_rank}")
        except LayoutMismatch as exc:
            log.warning("%s: refused decode %s: %s", mgr.name, msg.name, exc)
            mgr.spawn(self._reply(peer, m.HelloAck(ok=False, error=str(exc), name=mgr.name)))
            return
        link = mgr.links.get(peer.id)
        if link is None:
            link = mgr.links[peer.id] = Link(peer.id, peer, msg.name)
        mgr.send_msg(link, m.HelloAck(ok=True, name=mgr.name))

    async def _reply(self, peer, msg) -> None:
        try:
            await peer.send(msg.encode())
        except KvxferError:
            pass

    def _reject(self, link, room: int, exc: KvxferError) -> None:
        log.warning("%s: room %d from %s rejected: %s", self.mgr.name, room, link.name, exc)
        self.mgr.send_msg(link, m.Abort(room=room, reason=str(exc), kind=type(exc).__name__))

    def _on_info(self, link, msg: m.TransferInfo) -> None:
        mgr = self.mgr
        room = msg.room
        try:
            dst_kv = m.ids_from_bytes(msg.dst_kv, "dst_kv")
            dst_state = m.ids_from_bytes(msg.dst_state, "dst_state")
            for what, ids, group in (("dst kv page", dst_kv, "kv"),
                                     ("dst state slot", dst_state, "state"),
                                     ("dst aux row", np.array([msg.dst_aux]), "aux")):
                lim = link.remote_items.get(group)
                if lim is not None and ids.size:
                    bad = ids[(ids < 0) | (ids >= lim)]
                    if bad.size:
                        raise IndexOutOfRange(f"room {room}: {what} {int(bad[0])} not in "
                                              f"[0, {lim}) on decode {link.name}")
            if len(dst_state) and not mgr.args.state_data_ptrs:
                raise ShapeMismatch(f"room {room}: decode sends {len(dst_state)} state slots, "
                                    f"prefill {mgr.name} has no state buffers")
        except (ProtocolError, InvalidArgument) as exc:
            self._reject(link, room, exc)
            r = mgr.rooms.get(room)
            if r is not None and r.role == "sender" and r.link is None:
                mgr.fail(r, exc, notify=False)
            return
        r = mgr.rooms.get(room)
        if r is None:
            tomb = mgr.rooms.tombstone(room)
            if tomb is not None:
                self._reject(link, room, UnknownRoom(f"room {room} is no longer live on "
                                                     f"prefill {mgr.name} ({tomb})"))
                return
            try:
                mgr.rooms.insert(Room(room, "pending"))
            except DuplicateRoom:                # a KVSender was created meanwhile
                pass
            r = mgr.rooms.get(room)
            if r is None:
                self._reject(link, room, UnknownRoom(f"room {room} is not live on prefill "
                                                     f"{mgr.name}"))
                return
            if r.role == "pending":
                mgr.arm(r)
        if r.dst_kv is not None or is_terminal(r.state):
            self._reject(link, room, DuplicateRoom(
                f"room {room} already has a decode destination on prefill {mgr.name}"))
            return
        r.link, r.dst_kv, r.dst_state, r.dst_aux = link, dst_kv, dst_state, msg.dst_aux
        link.rooms.add(r)
        if r.role != "sender":
            return
        if r.num_kv is not None and not self._check_counts(r):
            return
        mgr.advance(r, KVPoll.WaitingForInput)
        queued, r.queued = r.queued, []
        for src, st, last in queued:
            if is_terminal(r.state):
                break
            self._issue(r, src, st, last)

    def _on_abort(self, link, msg: m.Abort) -> None:
        mgr = self.mgr
        r = mgr.rooms.get(msg.room)
        if r is None or (r.link is not None and r.link is not link):
            if r is None and mgr.rooms.tombstone(msg.room) is None:
                mgr.rooms.bury(msg.room, "aborted-by-peer")
            mgr.send_msg(link, m.AbortAck(room=msg.room))
            return
        r.peer_aborted = True
        if r.link is None:
            r.link = link
            link.rooms.add(r)
        if is_terminal(r.state):                 # already failing: ack once settled
            return
        mgr.fail(r, TransferAborted(f"room {r.room} aborted by decode {link.name}: "
                                    f"{msg.reason}"), notify=False)
