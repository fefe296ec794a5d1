"""Prefill-side protocol: accept decode's metadata, write chunks, state and the aux row.

Per room the writes form a chain (each awaits the previous one) so the final completion
message is issued only after every earlier chunk's bytes are visible on decode. The room's
source pages stay leased until the chain has settled: ``on_done`` (the scheduler's release)
runs after Success, after an abort, or after a timeout — never while a write may still read
them. Abort/AbortAck go to decode only once the chain settled, so they mean "no write for
this room is in flight"; a write that timed out may still be in flight, so instead of that
message the link is fenced (``link_failed(..., fence=True)``).

Decode's metadata may arrive before the KVSender exists; it is then held as a 'pending'
record with a Bootstrapping deadline. The KVSender claims it and a failure retires it, under
the room table's lock (see :mod:`kvxfer.disagg.rooms`): a pending record that failed is never
adopted — the KVSender fails at once with the cause (TransferAborted, TransferTimeout,
PeerClosed, LayoutMismatch) — and a claimed one turns its failure into the KVSender's.
A room never attaches to a dead link: it fails with PeerClosed instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional, Tuple

import numpy as np

from kvxfer import eager
from kvxfer.disagg import bootstrap, tp_rooms
from kvxfer.disagg import messages as m
from kvxfer.disagg.coalesce import Coalescer
from kvxfer.disagg.context import PrefillContext
from kvxfer.disagg.errors import DuplicateRoom, LayoutMismatch, TpShapeMismatch, UnknownRoom
from kvxfer.disagg.handle import OnDone
from kvxfer.disagg.kv_args import check_compatible
from kvxfer.disagg.link import Link
from kvxfer.disagg.outbox import Ticket
from kvxfer.disagg.page_map import RoomPages
from kvxfer.disagg.poll import KVPoll, is_terminal
from kvxfer.disagg.roles import RoomRole
from kvxfer.disagg.rooms import Room
from kvxfer.disagg.trace import mark, mark_write
from kvxfer.errors import (
    Closed,
    IndexOutOfRange,
    InvalidArgument,
    KvxferError,
    PeerClosed,
    ProtocolError,
    ShapeMismatch,
    TransferAborted,
    TransferTimeout,
    UnsupportedOperation,
)
from kvxfer.wire import is_int

log = logging.getLogger(__name__)
_ItemWrite: Any = None


def _item_write() -> Any:
    """``ItemWrite``, imported on first use (the engine pulls in UCX)."""
    global _ItemWrite
    if _ItemWrite is None:
        from kvxfer.engine import ItemWrite

        _ItemWrite = ItemWrite
    return _ItemWrite


class PrefillSide:
    """The prefill protocol of one manager. Runs on: the manager's loop thread, except
    :meth:`new_room` (the scheduler's thread)."""

    def __init__(self, mgr: PrefillContext) -> None:
        self.mgr = mgr
        self.coalesce = Coalescer(mgr, mgr.coalesce_after, self._write_alone)

    # ------------------------------------------------------------------ lifecycle
    def _entry(self) -> m.BsRegister:
        a, address = self.mgr.args, self.mgr.address
        assert address is not None  # called once the engine listens
        host, port = address
        return m.BsRegister(
            name=self.mgr.name,
            host=str(host),
            port=int(port),
            tp_rank=a.tp_rank,
            tp_size=a.tp_size,
            dp_rank=a.dp_rank,
            pp_rank=a.pp_rank,
            fingerprint=self.mgr.fingerprint,
        )

    async def started(self) -> None:
        """Register at the bootstrap server, retrying until it answers (register_s)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.mgr.t.register_s
        delay = 0.02
        addr = self.mgr.bootstrap_addr
        assert addr is not None  # KVManager refuses a prefill without one
        while True:
            try:
                await bootstrap.request(
                    addr, self._entry(), max(0.1, min(5.0, deadline - loop.time())), self.mgr.secret
                )
                return
            except (KvxferError, OSError) as exc:
                if loop.time() + delay > deadline:
                    raise TransferTimeout(
                        f"{self.mgr.name}: could not register at bootstrap "
                        f"{self.mgr.bootstrap_addr}: {exc}"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def closing(self) -> None:
        a, addr = self.mgr.args, self.mgr.bootstrap_addr
        assert addr is not None
        try:
            await bootstrap.request(
                addr,
                m.BsUnregister(
                    name=self.mgr.name, dp_rank=a.dp_rank, tp_rank=a.tp_rank, pp_rank=a.pp_rank
                ),
                1.0,
                self.mgr.secret,
            )
        except (KvxferError, OSError):
            pass

    def link_lost(self, link: Link) -> None:
        pass

    # ------------------------------------------------------------------ handle entry points
    def new_room(self, room: int, on_done: Optional[OnDone], trace: Optional[dict] = None) -> Room:
        """Insert the sender's room now (duplicates raise here), claiming decode's metadata
        if a 'pending' record holds it; the loop adopts it (or fails the room). ``trace``:
        its stage record (``KVManager(trace=True)``), set before anything can adopt it.

        Runs on: the caller's thread (the scheduler's)."""
        r = Room(room, RoomRole.SENDER, on_done)
        r.trace = trace
        pending, cause = self.mgr.rooms.claim(r)
        self.mgr.call(self._adopt, r, pending, cause, direct=self.mgr.direct_pages > 0)
        return r

    def _adopt(self, r: Room, pending: Optional[Room], cause: Optional[BaseException]) -> None:
        mgr = self.mgr
        if cause is not None:
            mgr.fail(
                r,
                type(cause)(
                    f"room {r.room}: decode's side ended before the KVSender existed: {cause}"
                ),
                notify=False,
            )
            return
        if pending is None:
            mgr.arm(r)
            return
        if pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None
        if pending.legs is not None:  # metadata of several decode peers (hetero TP)
            tp_rooms.prefill_adopt(self, r, pending)
            return
        link = pending.link
        assert link is not None  # a pending record is made with its link
        link.rooms.discard(pending)
        if is_terminal(r.state):  # our scheduler aborted it first
            if r.link is None and not link.dead:  # decode never heard: no write was issued
                mgr.send_msg(
                    link, m.Abort(room=r.room, reason=str(r.exc), kind=type(r.exc).__name__)
                )
            return
        if r.dst_kv is not None:  # a second decode raced the adoption
            self._reject(
                link,
                r.room,
                DuplicateRoom(
                    f"room {r.room} already has a decode destination on prefill {mgr.name}"
                ),
            )
            return
        self._attach(r, link, pending.dst_kv, pending.dst_state, pending.dst_aux, pending.dst_span)

    def _attach(
        self,
        r: Room,
        link: Link,
        dst_kv: np.ndarray,
        dst_state: np.ndarray,
        dst_aux: Optional[int],
        dst_span: Tuple[int, Optional[int]],
    ) -> None:
        """Give the sender's room its decode destination; flush chunks queued before it."""
        mgr = self.mgr
        if link.dead:
            mgr.fail(
                r,
                PeerClosed(f"room {r.room}: decode {link.name} is gone"),
                notify=False,
                peer_gone=True,
            )
            return
        r.link, r.dst_kv, r.dst_state, r.dst_aux = link, dst_kv, dst_state, dst_aux
        r.dst_span = dst_span
        # the Done goes with the last chunk; encoded here, off the send's path (without the
        # integrity mode's checksums, which only the write knows)
        r.done_note = m.Done(room=r.room, pages=len(dst_kv)).encode()
        link.rooms.add(r)
        if r.num_kv is not None and not self._check_counts(r):
            return
        mgr.advance(r, KVPoll.WaitingForInput)
        mgr.hook("decode_attached", r.room)  # before the chunks queued meanwhile are issued
        queued, r.queued = r.queued, []
        for src, st, last in queued:
            if is_terminal(r.state):
                break
            self._issue(r, src, st, last)
        stream = getattr(r.handle, "layer_stream", None)
        if stream is not None:  # layers declared before decode's metadata (layerwise.py)
            stream.pump()

    def fail_pending(self, p: Room, exc: BaseException, *, notify: bool, peer_gone: bool) -> None:
        """A 'pending' record failed (decode aborted, its deadline passed, the link died,
        the manager closes). Retire it — or, if the KVSender claimed it first, make the
        failure the KVSender's (an expiry is moot then: the sender came in time)."""
        mgr = self.mgr
        mgr.hook("room_failed", p.room)
        if p.legs is not None:
            tp_rooms.prefill_fail_pending(self, p, exc)
            return
        if not mgr.rooms.retire(p, exc):
            r = mgr.rooms.get(p.room)
            if (
                r is None
                or r.role is not RoomRole.SENDER
                or is_terminal(r.state)
                or r.link not in (None, p.link)
            ):
                return
            if p.peer_aborted:
                r.peer_aborted = True
                if r.link is None and p.link is not None:
                    r.link = p.link
                    p.link.rooms.add(r)
                mgr.fail(r, exc, notify=False)
            elif peer_gone:
                mgr.fail(r, exc, notify=False, peer_gone=True)
            return
        mgr.hook("pending_retired", p.room)
        log.info("%s: decode's metadata for room %d dropped: %s", mgr.name, p.room, exc)
        p.state, p.exc = KVPoll.Failed, exc
        if p.timer is not None:
            p.timer.cancel()
            p.timer = None
        link = p.link
        assert link is not None  # a pending record is made with its link
        link.rooms.discard(p)
        if not link.dead and not peer_gone:
            if p.peer_aborted:
                mgr.send_msg(link, m.AbortAck(room=p.room))
            elif notify:
                mgr.send_msg(link, m.Abort(room=p.room, reason=str(exc), kind=type(exc).__name__))
        mgr.room_gone()

    def init(self, r: Room, num_kv: int, aux_index: int) -> None:
        """KVSender.init(), handed over. Runs on: the loop thread."""
        r.num_kv, r.aux_index = num_kv, aux_index
        if r.legs is not None:
            for leg in r.legs.legs():
                self.init(leg, num_kv, aux_index)
            return
        if not is_terminal(r.state) and r.dst_kv is not None:
            self._check_counts(r)

    def send(
        self,
        r: Room,
        src: np.ndarray,
        src_state: Optional[np.ndarray],
        last: bool,
        inline: bool = True,
    ) -> None:
        """KVSender.send(), handed over. ``inline=False``: the write waits for nothing on
        this stack (a room's decode legs: the next leg's write starts at once, see
        :func:`kvxfer.disagg.tp_rooms.prefill_send`). Runs on: the loop thread."""
        if last and r.trace is not None:
            mark(r.trace, "loop")
        if is_terminal(r.state):
            return
        if r.legs is not None:  # several decode peers (hetero TP)
            tp_rooms.prefill_send(self, r, (src, src_state, last))
            return
        if r.dst_kv is None:  # decode's metadata not here yet: keep order
            r.queued.append((src, src_state, last))
            return
        self._issue(r, src, src_state, last, inline=inline)

    # ------------------------------------------------------------------ writes
    def _check_counts(self, r: Room) -> bool:
        """Both sides' page counts are known: check them against the token count and decide
        how the room's tokens travel (``r.pages_map``); fail the room if they cannot."""
        mgr, link = self.mgr, r.link
        assert r.num_kv is not None and link is not None
        prefix, tokens = r.dst_span
        try:
            r.pages_map = RoomPages.make(
                num_src=r.num_kv,
                num_dst=len(r.dst_kv),
                src_page_size=mgr.args.page_size,
                dst_page_size=link.page_size or mgr.args.page_size,
                prefix=prefix,
                tokens=tokens,
                geom=None if link.tp is not None else mgr.kv_geometry,
                exact=mgr.integrity is not None,
                who=f"room {r.room}",
                # hetero TP: whole items when they pair one to one, else its token runs
                tp=link.tp,
                salt=r.room,
            )
        except (InvalidArgument, UnsupportedOperation) as exc:
            mgr.fail(r, exc)
            return False
        return True

    def _kv_part(self, r: Room, src: np.ndarray, first: int) -> Any:
        """The kv write of a chunk of source pages starting at page ``first``: an ItemWrite
        of whole pages, a RawWrite of byte runs (``r.pages_map``), with heterogeneous TP a
        PatternWrite; byte runs (different page sizes, a prefix that is not page-aligned, at
        any TP) under :meth:`_pattern` a list of PatternWrites, one per piece class; None if
        nothing moves."""
        pm = r.pages_map
        if not pm.by_runs:
            s, d = pm.whole_pages(src, first, r.dst_kv)
            link = r.link
            if link is not None and link.tp is not None:  # this pair's heads of them
                # a same-host CUDA peer: one pattern launch on the device lane, whatever the
                # layout; else head slices inside token rows are staged, one-run-per-page
                # slices (HND) stay direct (bench/results/tp-pd-h200.md)
                # (host memory on one host, each decode item getting one whole share: the
                # host lane copies the runs in a few calls, faster than staging them,
                # bench/results/host-lane-cpu.md; as a PatternWrite, whose runs the planner
                # expands once for every descriptor alike)
                peer = link.peer
                lane = peer.host_lane_covers("kv") and link.tp.dst_lands_whole("kv", r.room)
                pattern = self._pattern(link) or (lane and self.mgr.tp_pattern != "never")
                stage = self.mgr.tp_stage_min_ops if peer.can_slice("kv") and not lane else 0
                # replicated whole pages (MLA at more prefill ranks): each replica sends its
                # blocks of the room's pages
                split = (first + len(src) - len(s), len(r.dst_kv))
                return link.tp.write(
                    "kv", s, d, r.room, stage_min_ops=stage, pattern=pattern, split=split
                )
            return _item_write()("kv", s, d) if len(s) else None
        link = r.link
        if link is not None and self._pattern(link):
            if self.mgr.tp_pattern == "auto":  # a few long runs: PUTs beat the launches
                few = pm.few_runs(src, first, r.dst_kv, self.mgr.pattern_min_runs)
                if few is not None:
                    return few.raw_write("kv") if len(few) else None
            return pm.patterns(src, first, r.dst_kv) or None  # one launch per piece class
        runs = pm.runs(src, first, r.dst_kv)
        if not len(runs):
            return None
        return runs.raw_write("kv")

    def _pattern(self, link: Link, group: str = "kv") -> bool:
        """Whether this link's split pages of ``group`` (a heterogeneous-TP pair's slices, or
        kv byte runs at any TP) go as PatternWrites (``KVManager(tp_pattern=)``)."""
        mode = self.mgr.tp_pattern
        return mode == "always" or (mode == "auto" and link.peer.can_pattern(group))

    def _issue(
        self,
        r: Room,
        src: np.ndarray,
        src_state: Optional[np.ndarray],
        last: bool,
        kv_part: Optional[Callable[[Room, np.ndarray, int], Any]] = None,
        inline: bool = True,
    ) -> None:
        """Chain the write of a chunk. ``kv_part``: builds its kv write instead of
        :meth:`_kv_part` (layer-wise streaming: the chunk's last layers only); ``inline``:
        as :meth:`send`."""
        mgr = self.mgr
        start = r.pages_queued
        kv = (kv_part or self._kv_part)(r, src, start)
        if last and r.trace is not None:
            mark(r.trace, "plan")
        n_state = 0 if src_state is None else len(src_state)
        if last and len(r.dst_state) != n_state:
            mgr.fail(
                r,
                ShapeMismatch(
                    f"room {r.room}: prefill sends {n_state} state slots, "
                    f"decode allocated {len(r.dst_state)}"
                ),
            )
            return
        r.pages_queued += len(src)
        # the Transferring lease is armed once the write is under way (below): a write that
        # ends on this stack (most small ones) takes the room to Success first, and neither
        # makes nor cancels a timer for it
        fresh = r.state != KVPoll.Transferring and mgr.advance(r, KVPoll.Transferring, arm=False)
        prev = r.chain
        if last and kv_part is None and self.coalesce.wants(r, kv, prev):
            r.chain = self.coalesce.add(r, src, kv, src_state)  # its link is busy
            if fresh:
                mgr.arm(r)
            return
        # counted in flight to its link (kvxfer.disagg.coalesce) until it returned
        ticket = self.coalesce.begin(r.link) if r.link is not None else None
        if not self.coalesce.inline_ok(r) and inline:  # a burst: in flight, the next coalesce
            inline = False
            mgr.stats["burst_writes"] += 1
        # started on this stack (kvxfer.eager): no loop iteration before the write is
        # planned and posted; a write waiting for the previous chunk's continues in a task
        r.chain = eager.start(
            mgr.spawn, self._write(r, prev, src, kv, src_state, last, ticket, inline)
        )
        self.coalesce.watch(ticket, r.chain)
        if fresh and r.state == KVPoll.Transferring and not r.chain.done():
            mgr.arm(r)  # (a write that ended here armed or ended the room itself)

    def _write_alone(
        self, r: Room, src: np.ndarray, kv: Any, src_state: Optional[np.ndarray]
    ) -> "asyncio.Future[Any]":
        """A room's own write of its last chunk (a coalesced write that was refused)."""
        return eager.start(self.mgr.spawn, self._write(r, None, src, kv, src_state, True))

    async def _write(
        self,
        r: Room,
        prev: Optional[asyncio.Future],
        src: np.ndarray,
        kv: Any,
        src_state: Optional[np.ndarray],
        last: bool,
        ticket: Optional[Ticket] = None,
        inline: bool = True,
    ) -> None:
        """Write one chunk: ``kv`` (its ItemWrite/RawWrite, or None), then with the last
        chunk the state slots and the aux row. ``src``: the chunk's source pages;
        ``ticket``: the write's count in flight to its link, ended as soon as it returned;
        ``inline=False``: the engine waits on this stack for nothing (``Peer.write``)."""
        if prev is not None and not prev.done():
            await asyncio.wait([prev])
        mgr, ItemWrite = self.mgr, _item_write()
        if is_terminal(r.state):
            return
        link = r.link
        assert link is not None  # _attach set it before the first _issue
        if link.dead:
            mgr.fail(
                r,
                PeerClosed(f"room {r.room}: decode {link.name} is gone"),
                notify=False,
                peer_gone=True,
            )
            return
        items = list(kv) if isinstance(kv, list) else [kv] if kv is not None else []
        tp = link.tp
        if last and tp is not None and len(r.dst_state):  # this pair's rows of the state
            items += self._state_part(r, link, items, src_state)
        elif last and len(r.dst_state):
            items.append(ItemWrite("state", src_state, r.dst_state))
        if last and (tp is None or tp.writes_aux(r.room)):  # the aux row (from one rank)
            assert r.aux_index is not None  # init() came before the last chunk
            mgr.aux.stamp(r.aux_index, r.room)
            items.append(ItemWrite("aux", [r.aux_index], [r.dst_aux]))
        sums = None
        if mgr.integrity is not None:  # checksums of exactly what is about to go
            sums = await mgr.integrity.source(r, src, src_state, last)
            if is_terminal(r.state) or r.link is None or r.link.dead:
                return
        if last and sums is None and r.done_note is not None:
            notify = r.done_note  # (_attach)
        elif last:
            notify = m.Done(room=r.room, pages=len(r.dst_kv), sums=sums).encode()
        else:
            done = r.pages_map.dst_pages_done(r.pages_done + len(src))
            notify = m.Chunk(room=r.room, pages_done=done).encode()
        mgr.hook("before_write", r.room)
        t_call = time.monotonic_ns() if last and r.trace is not None else 0
        try:
            try:
                stats = await link.peer.write(
                    items, notify=notify, timeout=mgr.t.transfer_s, inline=inline
                )
            finally:  # no longer in flight, before the room is reported done
                self.coalesce.end(ticket)
        except TransferTimeout as exc:
            # the write may still be in flight: only closing the link's endpoints stops it
            mgr.link_failed(link, exc, fence=True)
            mgr.fail(r, exc, notify=False, peer_gone=True)  # if the link was gone already
            return
        except KvxferError as exc:
            mgr.fail(r, exc)
            return
        mgr.hook("written", r.room)  # (tests: the write returned, its room not yet done)
        if t_call:
            assert r.trace is not None
            mark_write(r.trace, t_call, time.monotonic_ns(), stats)
        mgr.count_write(stats)
        r.pages_done += len(src)
        if is_terminal(r.state):
            return
        if last:
            if mgr.integrity is not None:
                mgr.integrity.sent(r)  # ends the room on decode's verdict
                return
            mgr.advance(r, KVPoll.Success)
            mgr.release(r)
        else:
            mgr.arm(r)  # lease renewed by progress

    def _state_part(self, r: Room, link: Link, kv: list, src_state: Any) -> list:
        """The write of this pair's rows of the state (heterogeneous TP): in the kv pages'
        device-lane launch where they take one and the state's slices fit it
        (``Peer.joins_launch``: a pattern of its slices instead of its runs as PUTs), else
        its runs."""
        from kvxfer.engine.types import PatternWrite

        tp = link.tp
        assert tp is not None
        launch = [w for w in kv if isinstance(w, PatternWrite) and len(w.src_items)]
        st = tp.write(
            "state",
            src_state,
            r.dst_state,
            r.room,
            pattern=bool(launch) and self._pattern(link, "state"),
        )
        if (
            isinstance(st, PatternWrite)
            and self.mgr.tp_pattern != "always"
            and not link.peer.joins_launch(launch, st)
        ):
            st = tp.write("state", src_state, r.dst_state, r.room)
        return [st] if st is not None else []

    def leg_succeeded(self, leg: Room) -> None:
        """A leg of a room with several decode peers succeeded (the manager's hook)."""
        tp_rooms.leg_succeeded(self.mgr, leg, lambda r: self.mgr.advance(r, KVPoll.Success))

    def after_fail(self, r: Room, *, notify: bool, peer_gone: bool) -> None:
        mgr = self.mgr
        if r.legs is not None:  # several decode peers: each leg settles with its own
            tp_rooms.fail_legs(mgr, r, notify)
            return

        def settle(_: Any = None) -> None:
            """Runs on: the loop thread (now, or as the write chain's done callback)."""
            link = r.link
            if link is not None and not link.dead and not peer_gone:
                if r.peer_aborted:
                    mgr.send_msg(link, m.AbortAck(room=r.room))
                elif notify:
                    mgr.send_msg(
                        link, m.Abort(room=r.room, reason=str(r.exc), kind=type(r.exc).__name__)
                    )
            mgr.release(r)

        self.coalesce.withdraw(r)  # a last chunk still waiting is never written
        if r.chain is None or r.chain.done():
            settle()
        else:
            r.chain.add_done_callback(settle)

    # ------------------------------------------------------------------ messages
    def on_message(self, peer: Any, link: Optional[Link], msg: Any) -> None:
        """A message from a decode engine. Runs on: the loop thread."""
        if isinstance(msg, m.Hello):
            self._on_hello(peer, msg)
            return
        if link is None:
            raise ProtocolError(f"{msg.TAG} from {peer.id} before its hello")
        if isinstance(msg, m.TransferInfo):
            self._on_info(link, msg)
        elif isinstance(msg, m.Abort):
            self._on_abort(link, msg)
        elif isinstance(msg, m.Verdict) and self.mgr.integrity is not None:
            self.mgr.integrity.on_verdict(link, msg)
        else:
            raise ProtocolError(f"unexpected {msg.TAG} on a prefill manager")

    def _on_hello(self, peer: Any, msg: m.Hello) -> None:
        """Accept the decode, or refuse it (LayoutMismatch) but keep the connection as a
        *refused* link: decode sends each of its rooms' refusal over it, so our KVSenders
        fail at once instead of holding their pages until ``bootstrap_s``."""
        mgr = self.mgr
        refused = None
        tp = None
        page_size: Any = msg.fingerprint.get("page_size")
        try:
            check_compatible(
                mgr.fingerprint,
                msg.fingerprint,
                us=f"prefill {mgr.name}",
                them=f"decode {msg.name}",
                ours_is_prefill=True,
            )
            if msg.fingerprint.get("tp_size") != mgr.args.tp_size:
                tp = tp_rooms.TpPair.make(
                    mgr.fingerprint, msg.fingerprint, mgr.args.tp_rank, msg.tp_rank, True
                )
                if msg.tp_rank not in tp.prefill_peers():
                    raise TpShapeMismatch(
                        f"decode {msg.name} rank {msg.tp_rank} of tp {tp.decode_tp} is no "
                        f"peer of prefill {mgr.name} rank {mgr.args.tp_rank} of tp "
                        f"{tp.prefill_tp} (its peers: {list(tp.prefill_peers())})"
                    )
            elif msg.tp_rank != mgr.args.tp_rank:
                raise LayoutMismatch(
                    f"tp_rank: prefill {mgr.name} is {mgr.args.tp_rank}, "
                    f"decode {msg.name} wants {msg.tp_rank}"
                )
            if not is_int(page_size) or int(page_size) <= 0:
                raise LayoutMismatch(f"decode {msg.name}: page_size {page_size!r}")
        except LayoutMismatch as exc:
            log.warning("%s: refused decode %s: %s", mgr.name, msg.name, exc)
            refused = exc
        link = mgr.links.get(peer.id)
        if link is None:
            link = mgr.links[peer.id] = Link(peer.id, peer, msg.name)
        link.refused = refused
        link.page_size = int(page_size) if refused is None else 0
        link.tp = tp if refused is None else None
        link.layer_notify = refused is None and msg.fingerprint.get("layer_notify") is True
        link.done_many = refused is None and msg.fingerprint.get("done_many") is True
        mgr.send_msg(link, m.HelloAck(ok=refused is None, error=str(refused or ""), name=mgr.name))

    def _reject(self, link: Link, room: int, exc: KvxferError) -> None:
        log.warning("%s: room %d from %s rejected: %s", self.mgr.name, room, link.name, exc)
        self.mgr.send_msg(link, m.Abort(room=room, reason=str(exc), kind=type(exc).__name__))

    def _on_info(self, link: Link, msg: m.TransferInfo) -> None:
        mgr = self.mgr
        room = msg.room
        try:
            if link.refused is not None:
                raise type(link.refused)(str(link.refused))
            if mgr.closed:
                raise Closed(f"prefill {mgr.name} is closing")
            dst_kv = m.ids_from_bytes(msg.dst_kv, "dst_kv")
            dst_state = m.ids_from_bytes(msg.dst_state, "dst_state")
            for what, v in (("prefix", msg.prefix), ("tokens", msg.tokens)):
                if v is not None and v < 0:
                    raise ProtocolError(f"room {room}: {what} {v} < 0")
            span = (msg.prefix or 0, msg.tokens)
            for what, ids, group in (
                ("dst kv page", dst_kv, "kv"),
                ("dst state slot", dst_state, "state"),
                ("dst aux row", np.array([msg.dst_aux]), "aux"),
            ):
                lim = link.remote_items.get(group)
                if lim is not None and ids.size:
                    bad = ids[(ids < 0) | (ids >= lim)]
                    if bad.size:
                        raise IndexOutOfRange(
                            f"room {room}: {what} {int(bad[0])} not in "
                            f"[0, {lim}) on decode {link.name}"
                        )
            if len(dst_state) and not mgr.args.state_data_ptrs:
                raise ShapeMismatch(
                    f"room {room}: decode sends {len(dst_state)} state slots, "
                    f"prefill {mgr.name} has no state buffers"
                )
        except (ProtocolError, InvalidArgument, LayoutMismatch, Closed) as exc:
            self._reject(link, room, exc)
            r = mgr.rooms.get(room)
            if r is not None and r.role is RoomRole.SENDER and r.link is None:
                mgr.fail(r, exc, notify=False)
            return
        if tp_rooms.fanout(link, True) > 1:  # one of several decode peers of the room
            tp_rooms.prefill_info(self, link, room, (link, dst_kv, dst_state, msg.dst_aux, span))
            return
        r = mgr.rooms.get(room)
        if r is None:
            tomb = mgr.rooms.tombstone(room)
            if tomb is not None:
                self._reject(
                    link,
                    room,
                    UnknownRoom(f"room {room} is no longer live on prefill {mgr.name} ({tomb})"),
                )
                return
            p = Room(room, RoomRole.PENDING)
            p.link, p.dst_kv, p.dst_state, p.dst_aux = link, dst_kv, dst_state, msg.dst_aux
            p.dst_span = span
            try:
                mgr.rooms.insert(p)
            except DuplicateRoom:  # a KVSender was created meanwhile
                r = mgr.rooms.get(room)
            else:
                link.rooms.add(p)
                mgr.arm(p)
                return
        if (
            r is None
            or r.role is not RoomRole.SENDER
            or r.dst_kv is not None
            or is_terminal(r.state)
        ):
            self._reject(
                link,
                room,
                DuplicateRoom(
                    f"room {room} already has a decode destination on prefill {mgr.name}"
                ),
            )
            return
        self._attach(r, link, dst_kv, dst_state, msg.dst_aux, span)

    def _on_abort(self, link: Link, msg: m.Abort) -> None:
        """Decode gave up on a room (or refused it: LayoutMismatch). Acked once no write for
        it is in flight; before the KVSender exists the cause is kept as a soft tombstone."""
        mgr = self.mgr
        mgr.hook("abort_received", msg.room)
        cls = {c.__name__: c for c in (LayoutMismatch, TpShapeMismatch)}.get(
            msg.kind, TransferAborted
        )
        cause = cls(f"room {msg.room} aborted by decode {link.name}: {msg.reason}")
        r = mgr.rooms.bury_unless_live(msg.room, cause)
        if r is not None and r.legs is not None:  # a room of several decode peers
            tp_rooms.prefill_abort(self, link, r, cause)
            return
        if r is None or (r.link is not None and r.link is not link):
            mgr.send_msg(link, m.AbortAck(room=msg.room))
            return
        r.peer_aborted = True
        if r.link is None:
            r.link = link
            link.rooms.add(r)
        if is_terminal(r.state):  # already failing: ack once settled
            return
        mgr.fail(r, cause, notify=False)
