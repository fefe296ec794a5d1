"""Prefill side of the SGLang backend: decode registrations, room metadata, ordered writes.

Threads: SGLang's scheduler calls :meth:`PrefillPath.add_transfer_request` (never blocks);
one control thread reads the manager's ZMQ socket (registrations, room metadata, aborts);
the engine loop runs the writes; one notifier thread does the ZMQ sends that could block on
an unreachable decode (failure statuses, abort acks), so neither the loop nor the control
thread ever waits on a dead peer.

Each decode registration is checked and planned once (:mod:`.tp_pairs`: equal TP and MLA
move whole pages, heterogeneous MHA TP one PatternWrite of head-slice runs per chunk). A
chunk goes to every decode rank of the room (several when decode TP > prefill TP)
concurrently, and counts as settled only when all of those writes did.

Per room the chunks form a chain (each waits for the previous one), so the completion
message :class:`~.messages.SglDone` goes out only after every byte of the room is visible at
decode, and only if the room has not failed meanwhile. A room counts as *outstanding* from
the moment a chunk is accepted until its write settled; SGLang's drained-abort ack (decode's
pages are released only after it) is sent when that count reaches zero - never while a
write may still land. A write that timed out is not known to have settled: its room is
poisoned (no ack, decode keeps its pages until its own release timeout).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

from kvxfer import config, eager
from kvxfer.disagg.errors import TpShapeMismatch
from kvxfer.engine.hostcopy import lands_whole
from kvxfer.errors import (
    IncompatiblePeer,
    KvxferError,
    PeerClosed,
    ProtocolError,
    ShapeMismatch,
    TransferTimeout,
)
from kvxfer.integrations.sglang.messages import (
    SglDone,
    SglRegister,
    SglRoom,
    decode_frames,
    refused_sender,
)
from kvxfer.integrations.sglang.tp_pairs import (
    PairPlan,
    pair_plan,
    shape,
    state_shapes,
    total_kv_heads,
)

log = logging.getLogger(__name__)


class Decode:
    """A decode rank registered with this prefill rank (by its ZMQ endpoint ``key``):
    refused (``reason``) or served by ``plan`` (what this rank writes into it)."""

    __slots__ = ("key", "reg", "reason", "plan", "task")

    def __init__(
        self, key: str, reg: SglRegister, reason: Optional[str], plan: Optional[PairPlan]
    ) -> None:
        self.key, self.reg, self.reason, self.plan = key, reg, reason, plan
        self.task: Optional[asyncio.Task] = None  # connect, on the engine loop

    def __repr__(self) -> str:
        return f"Decode({self.key}, {self.reason or 'ok'})"


class RoomInfo:
    """Destination of one room on one decode rank (from :class:`SglRoom`)."""

    __slots__ = (
        "key",
        "endpoint",
        "port",
        "dst_kv",
        "dst_state",
        "dst_aux",
        "required_dst_info_num",
        "decode_prefix_len",
        "is_dummy",
        "slices",
    )

    def __init__(self, key: str, msg: SglRoom) -> None:
        self.key, self.endpoint, self.port = key, msg.endpoint, msg.port
        self.dst_kv, self.dst_state = msg.arrays()
        self.dst_aux = msg.dst_aux
        self.required_dst_info_num = msg.required_dst_info_num
        self.decode_prefix_len = msg.decode_prefix_len
        self.is_dummy = msg.is_dummy
        self.slices = frozenset(msg.slices)  # prefill endpoints decode takes SliceWrites of


class Chunk:
    __slots__ = ("kv", "index_slice", "last", "aux_index", "state")

    def __init__(self, kv, index_slice, last, aux_index, state) -> None:
        self.kv = np.asarray(kv, dtype=np.int64).reshape(-1).copy()
        self.index_slice, self.last, self.aux_index = index_slice, bool(last), aux_index
        self.state = (
            None
            if state is None
            else [
                None if s is None else np.asarray(s, dtype=np.int64).reshape(-1).copy()
                for s in state
            ]
        )


class PrefillPath:
    def __init__(self, mgr) -> None:
        self.mgr = mgr
        self.decodes: Dict[str, Decode] = {}  # guarded by mgr.room_lock
        self.chains: Dict[int, asyncio.Future] = {}  # engine loop (or its guest) only
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.notifier = concurrent.futures.ThreadPoolExecutor(1, "kvxfer-sgl-notify")
        #: test hook: awaited on the loop right before each write of a room (None: off;
        #: while set, no chunk runs direct)
        self.before_write = None
        #: chunks of at most this many pages run on the scheduler's thread as the engine
        #: loop's guest when it is idle ($KVXFER_DIRECT_PAGES, as kvxfer.disagg's managers)
        self.direct_pages = config.direct_pages()

    def start(self) -> None:
        self.mgr.engine.engine.on_peer_closed(self._peer_closed)
        self._thread = threading.Thread(
            target=self._control, daemon=True, name=f"kvxfer-sgl-control-{self.mgr.rank_port}"
        )
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the control thread, then cancel (and await) every task this path owns on the
        engine loop: room chains and decode connects."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self.mgr.engine.run(self._cancel_tasks(), timeout)
        except KvxferError:
            pass  # the loop is already closed
        self.notifier.shutdown(wait=True, cancel_futures=True)

    async def _cancel_tasks(self) -> None:
        with self.mgr.room_lock:
            tasks = [d.task for d in self.decodes.values() if d.task is not None]
        tasks += list(self.chains.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ control thread
    def _control(self) -> None:
        """Runs on: the control thread ``kvxfer-sgl-control-<port>`` (ZMQ), as do
        :meth:`on_frames` and the ``_on_*`` handlers it calls."""
        sock = self.mgr.server_socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = sock.recv_multipart()
            try:
                self.on_frames(frames)
            except ProtocolError as exc:  # VersionMismatch: a decode of another kvxfer
                self._refused(frames, exc)
            except Exception:
                log.exception("%r: control message failed", self.mgr)

    def on_frames(self, frames: List[bytes]) -> None:
        if frames and frames[0] == ABORT_TAG:
            self._on_abort(frames)
            return
        msg = decode_frames(frames)
        if isinstance(msg, SglRegister):
            self._on_register(msg)
        elif isinstance(msg, SglRoom):
            self._on_room(msg)
        else:
            raise ProtocolError(f"unexpected {msg.TAG} on a prefill rank")

    def _refused(self, frames: List[bytes], exc: ProtocolError) -> None:
        """A control message :meth:`on_frames` refused (:class:`VersionMismatch`: a decode
        of another kvxfer protocol version; or malformed): answered, not only logged, where
        it names its room and sender (:func:`~.messages.refused_sender`) - the room fails
        here and a failure status naming the error (both versions) goes to that decode rank,
        which fails the room at once instead of at SGLang's bootstrap/waiting timeouts. The
        status is SGLang's own ZMQ format (no kvxfer wire message), so a decode of any
        kvxfer version reads it. Nothing else is kept of the message: no RoomInfo, no
        registration (a later valid one still registers the rank).

        A registration (no room) cannot be answered - a status is per room - and need not
        be: every room of that decode rank arrives in a message of the same version, and
        fails here as it does.

        Runs on: the control thread."""
        mgr = self.mgr
        what = f"{type(exc).__name__}: {exc}"
        sender = refused_sender(frames)
        if sender is None or sender.room is None:
            log.warning(
                "%r: refused control message %s: %s",
                mgr,
                f"from decode {sender.key}" if sender else "(sender unknown)",
                what,
            )
            return
        room, target = sender.room, (sender.endpoint, sender.port)
        reason = f"decode {sender.key}: {sender.tag or 'control message'} refused: {what}"
        status = mgr.request_status.get(room)
        if status == KVPoll.Success:  # (unauthenticated: never undoes a completed room)
            log.warning("%r: room %d completed; ignored: %s", mgr, room, reason)
            return
        if status == KVPoll.Failed:
            # failed already (another rank's message): this decode rank still hears why
            if not self._stop.is_set():
                self.notifier.submit(
                    mgr.send_kv_status_message,
                    targets=[target],
                    bootstrap_room=room,
                    status=KVPoll.Failed,
                    failure_reason=reason,
                )
            return
        # the opening status creates the room if its sender is not there yet (as _on_room)
        mgr.update_status(room, KVPoll.WaitingForInput)
        self._fail(room, reason, type(exc).__name__, notify=[target])

    def _incompatible(self, reg: SglRegister) -> Tuple[Optional[str], Optional[PairPlan]]:
        """``(reason, None)`` when this prefill rank cannot serve the decode rank ``reg``
        describes, else ``(None, plan)``: the pair's TP plan (:mod:`.tp_pairs`), built once
        per registration. Layout fields must match exactly; the TP shapes may differ where a
        head mapping joins them (MHA pages, NHD; MLA: whole items) and the state tensors'
        rows join (:class:`~.tp_pairs.StatePlan`)."""
        mgr, a = self.mgr, self.mgr.kv_args
        ours = {
            "page_size": a.page_size,
            "dtype": str(a.kv_cache_dtype_str),
            "aux_item_lens": list(a.aux_item_lens),
            "state_types": [str(getattr(s, "value", s)) for s in a.state_types or []],
        }
        theirs = {
            "page_size": reg.page_size,
            "dtype": reg.dtype,
            "aux_item_lens": reg.aux_item_lens,
            "state_types": reg.state_types,
        }
        if reg.tp_size == mgr.attn_tp_size:
            ours["kv_item_lens"] = list(a.kv_item_lens)
            theirs["kv_item_lens"] = reg.kv_item_lens
            ours["state_item_lens"] = [list(x) for x in a.state_item_lens or []]
            theirs["state_item_lens"] = reg.state_item_lens
        for k, v in ours.items():
            if theirs[k] != v:
                return (
                    f"decode {reg.endpoint}:{reg.port} has {k}={theirs[k]!r}, prefill "
                    f"has {v!r}: layouts differ"
                ), None
        mla = bool(mgr.is_mla_backend)
        if reg.tp_size != mgr.attn_tp_size:
            what = (
                f"prefill attention tp {mgr.attn_tp_size}, decode {reg.endpoint}:{reg.port} "
                f"tp {reg.tp_size}"
            )
            layout = getattr(a, "swa_kv_cache_layout", None)
            if not mla and layout not in (None, "nhd"):
                return f"{what}: head slicing needs NHD KV pages, prefill has {layout!r}", None
        try:
            plan = pair_plan(
                shape(
                    mgr.attn_tp_size,
                    mgr.attn_tp_rank,
                    a.page_size,
                    a.kv_item_lens,
                    total_kv_heads(a, mgr.attn_tp_size),
                    mla,
                    state_shapes(
                        a.state_item_lens or [],
                        getattr(a, "state_dim_per_tensor", None) or [],
                        getattr(a, "state_slice_outer_counts", None) or [],
                        getattr(a, "state_conv_shard_groups", None) or [],
                    ),
                ),
                shape(
                    reg.tp_size,
                    reg.tp_rank,
                    reg.page_size,
                    reg.kv_item_lens,
                    reg.total_kv_heads,
                    reg.mla,
                    state_shapes(
                        reg.state_item_lens, reg.state_dims, reg.state_outer, reg.state_groups
                    ),
                ),
            )
        except TpShapeMismatch as exc:
            return f"decode {reg.endpoint}:{reg.port}: {type(exc).__name__}: {exc}", None
        return None, plan

    def _on_register(self, reg: SglRegister) -> None:
        key = f"{reg.endpoint}:{reg.port}"
        reason, plan = self._incompatible(reg)
        if reason is not None:
            log.warning("%r: refused decode %s: %s", self.mgr, key, reason)
        d = Decode(key, reg, reason, plan)
        with self.mgr.room_lock:
            old = self.decodes.get(key)
            self.decodes[key] = d
        self.mgr.engine.call_soon(self._connect_soon, d, old)

    def _connect_soon(self, d: Decode, old: Optional[Decode]) -> None:
        """Runs on: the engine's loop thread (handed over by the control thread)."""
        if old is not None and old.task is not None:
            old.task.cancel()
        if d.reason is None:
            d.task = asyncio.get_running_loop().create_task(self._connect(d))
            d.task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _connect(self, d: Decode):
        eng = self.mgr.engine
        peer = await eng.engine.connect(
            d.reg.engine_host, d.reg.engine_port, eng.config.connect_timeout_s
        )
        if peer.name != d.reg.name:
            await peer.close()
            raise IncompatiblePeer(
                f"decode {d.key} registered engine {d.reg.name!r}, "
                f"{d.reg.engine_host}:{d.reg.engine_port} is {peer.name!r}"
            )
        return peer

    def _on_room(self, msg: SglRoom) -> None:
        mgr, room = self.mgr, msg.room
        key = f"{msg.endpoint}:{msg.port}"
        info = RoomInfo(key, msg)
        with mgr.room_lock:
            d = self.decodes.get(key)
            infos = mgr.transfer_infos.setdefault(room, {})
            infos[key] = info
            complete = len(infos) == info.required_dst_info_num
            if complete:
                mgr.req_to_decode_prefix_len[room] = info.decode_prefix_len
        reason = "decode sent room metadata before registering" if d is None else d.reason
        if reason is not None and not info.is_dummy:
            mgr.update_status(room, KVPoll.WaitingForInput)
            self._fail(room, reason, "IncompatiblePeer", notify=[(info.endpoint, info.port)])
        elif complete:
            mgr.update_status(room, KVPoll.WaitingForInput)

    def _on_abort(self, frames: List[bytes]) -> None:
        n = AbortNotification.from_zmq(frames)
        if n is None:
            return
        mgr, room = self.mgr, n.room
        if room in mgr.request_status and mgr.check_status(room) not in (
            KVPoll.Success,
            KVPoll.Failed,
        ):
            mgr.record_failure(room, "Aborted by decode")
            mgr.update_status(room, KVPoll.Failed)
            mgr.metrics.failed("TransferAborted")
        target = n.deferred_ack_target() if mgr.enable_deferred_decode_kv_release else None
        if target is not None:
            mgr.register_deferred_ack_target(room, target)
            self.notifier.submit(mgr._maybe_ack_drained_abort, room)

    # ------------------------------------------------------------------ scheduler thread
    def add_transfer_request(
        self, room, kv_indices, index_slice, last, aux_index, state_indices
    ) -> None:
        """Runs on: the scheduler thread (the writes run on the engine's loop)."""
        mgr = self.mgr
        with mgr.room_lock:
            infos = mgr.transfer_infos.get(room)
            if not infos:
                return  # cleared, or a dummy rank
            infos = list(infos.values())
            mgr._staging_outstanding[room] += 1
            stats = mgr.room_stats.get(room)
        chunk = Chunk(kv_indices, index_slice, last, aux_index, state_indices)
        # the chunk's write is planned and posted right here when the engine loop is idle
        # (its guest; test hooks must run on the loop itself; several decode peers: the
        # same bound unless $KVXFER_LEG_DIRECT_PAGES sets one, config.direct_limit)
        limit = config.direct_limit(self.direct_pages, len(infos))
        direct = len(chunk.kv) <= limit and self.before_write is None
        mgr.engine.call_soon(self._enqueue, room, chunk, infos, stats, direct=direct)

    def targets(self, room: int):
        with self.mgr.room_lock:
            infos = list((self.mgr.transfer_infos.get(room) or {}).values())
        return [(i.endpoint, i.port) for i in infos if not i.is_dummy]

    def report_abort(self, room: int, targets) -> None:
        """The scheduler aborted ``room`` (already Failed): tell decode once no write of the
        room is in flight (a decode that has its pages back must never see a late byte).

        Runs on: the scheduler thread."""
        self.mgr.metrics.failed("TransferAborted")
        self.mgr.engine.call_soon(self._report_after_chain, room, targets)

    def _report_after_chain(self, room: int, targets) -> None:
        """Runs on: the engine's loop thread; ``send`` too (now, or as the chain's done
        callback)."""
        prev = self.chains.get(room)

        def send(_=None):
            self.notifier.submit(
                self.mgr.send_kv_status_message,
                targets=targets,
                bootstrap_room=room,
                status=KVPoll.Failed,
                failure_reason="Aborted by prefill",
            )

        if prev is None or prev.done():
            send()
        else:
            prev.add_done_callback(send)

    # ------------------------------------------------------------------ engine loop
    def _enqueue(self, room: int, chunk: Chunk, infos, stats) -> None:
        """Runs on: the engine's loop thread (handed over by the scheduler thread), or the
        scheduler thread as the loop's guest. A chunk whose room has no write in flight
        starts on this stack (:mod:`kvxfer.eager`: planned and posted before this returns,
        no loop iteration first); one behind another chunk of its room waits in a task."""
        prev = self.chains.get(room)
        coro = self._run(room, chunk, infos, stats, None if prev is None or prev.done() else prev)
        if prev is None or prev.done():
            task = eager.start(_spawn, coro)
        else:
            task = _spawn(coro)
        self.chains[room] = task
        task.add_done_callback(lambda t: self._settled(room, t))

    async def _run(self, room, chunk, infos, stats, prev) -> None:
        if prev is not None:
            await asyncio.wait([prev])
        mgr = self.mgr
        if mgr.request_status.get(room, KVPoll.Failed) == KVPoll.Failed:
            return  # failed or cleared: nothing is sent
        mgr.update_status(room, KVPoll.Transferring)
        live = [i for i in infos if not i.is_dummy]
        try:
            # one write per decode rank, concurrently; every one settles before the task
            # ends (the room's outstanding count, hence the drained-abort ack, waits for all)
            if len(live) == 1:  # no gather: its task per write would cost a loop iteration
                done_or_exc = [await _outcome(self._write_one(room, chunk, live[0], stats))]
            else:
                done_or_exc = await asyncio.gather(
                    *(self._write_one(room, chunk, i, stats) for i in live),
                    return_exceptions=True,
                )
            excs = [r for r in done_or_exc if isinstance(r, BaseException)]
            if excs:  # a timed-out write first: it poisons the room's ack (below)
                raise next((e for e in excs if isinstance(e, TransferTimeout)), excs[0])
            peers = done_or_exc
            if not chunk.last or mgr.request_status.get(room) != KVPoll.Transferring:
                return
            done = SglDone(room=room, prefill_rank=mgr._prefill_unique_rank()).encode()
            # alone in flight, the notification lane (Peer.notify: decode has it sooner);
            # with other rooms' writes in flight, the channel (more rooms/s there:
            # bench/results/sgl-latency-cpu.md)
            lane = len(self.chains) <= 1
            for peer in peers:
                await (peer.notify(done) if lane else peer.send(done))
            mgr.update_status(room, KVPoll.Success)
            mgr.metrics.succeeded(stats.latency_s if stats is not None else None)
        except (KvxferError, OSError) as exc:
            targets = (
                []
                if isinstance(exc, (PeerClosed, TransferTimeout))
                else [(i.endpoint, i.port) for i in infos if not i.is_dummy]
            )
            if isinstance(exc, TransferTimeout):
                mgr.poison_deferred_ack_room(room)  # a write may still land: no ack
            self._fail(room, f"{type(exc).__name__}: {exc}", type(exc).__name__, notify=targets)

    async def _write_one(self, room, chunk, info, stats):
        """Write one chunk to one decode rank (nothing where the pair moves no bytes of it);
        returns the peer."""
        d, peer = await self._peer(info.key)
        writes = self._writes(room, chunk, info, d.plan, self._staged(info, d.plan, peer))
        if self.before_write is not None:
            await self.before_write(room)
        if writes:  # none: a prefill replica whose heads another peer sends
            t0 = time.perf_counter()
            st = await peer.write(writes)
            if stats is not None:
                stats.t_first = t0 if stats.t_first is None else min(stats.t_first, t0)
                stats.t_last = time.perf_counter()
                stats.bytes += st.bytes
                stats.ops += st.ops
                stats.writes += 1
            self.mgr.metrics.add_bytes(st.bytes)
        return peer

    async def _peer(self, key: str):
        """``(Decode, its connected peer)``; IncompatiblePeer / PeerClosed otherwise."""
        d = self.decodes.get(key)
        if d is None or d.reason is not None or d.plan is None:
            raise IncompatiblePeer(d.reason if d else f"decode {key} never registered")
        if d.task is None:
            raise PeerClosed(f"decode {key}: no connection")
        return d, await asyncio.shield(d.task)

    def _staged(self, info: RoomInfo, plan: PairPlan, peer) -> int:
        """The PUT count above which this room's head-slice chunks to ``peer`` go staged
        (0: never): only where the pair splits pages, the peer has no device lane for them
        (another host) nor a host lane that writes each decode item's share as one segment
        (host memory on one host, one-to-many: its few calls beat staging), it granted us
        landing slots, and decode registered this room's slices from us (its SglRoom names
        our endpoint)."""
        mgr = self.mgr
        if not mgr.tp_stage_min_ops or plan.src_sides is None:
            return 0
        if f"{mgr.local_ip}:{mgr.rank_port}" not in info.slices:
            return 0
        if peer.can_pattern("kv") or not peer.can_slice("kv"):
            return 0
        if plan.dst_sides is not None and lands_whole(plan.dst_sides):
            if peer.host_lane_covers("kv"):
                return 0
        return int(mgr.tp_stage_min_ops)

    def _writes(self, room: int, chunk: Chunk, info: RoomInfo, plan: PairPlan, stage: int = 0):
        """The engine writes of one chunk to one decode rank: its pages as one ItemWrite
        (equal TP, MLA) or one PatternWrite of the pair's head-slice runs (``plan``, built
        at registration) - one SliceWrite of the same runs under key ``room`` instead where
        that PatternWrite would be more than ``stage`` > 0 PUTs (:meth:`_staged`); on the
        last chunk the state items (whole slots at equal TP, else one PatternWrite per state
        type of the pair's slices, none where this rank holds nothing the decode rank takes
        from it) and, from the one peer that sends it, the metadata row.
        Page counts are checked against decode's allocation."""
        from kvxfer.engine import ItemWrite, PatternWrite, SliceWrite

        dst = info.dst_kv[chunk.index_slice]
        if len(dst) != len(chunk.kv):
            raise ShapeMismatch(
                f"room {room}: chunk of {len(chunk.kv)} pages for decode "
                f"pages {chunk.index_slice} of {len(info.dst_kv)}"
            )
        writes: list = []
        if len(dst) and plan.whole:
            writes.append(ItemWrite("kv", chunk.kv, dst))
        elif len(dst) and plan.kv_runs is not None:
            if stage and len(dst) * plan.runs_per_page > stage:  # (unmerged: an upper bound)
                writes.append(SliceWrite("kv", chunk.kv, dst, plan.src_sides, int(room)))
            else:
                writes.append(PatternWrite("kv", chunk.kv, dst, plan.kv_runs))
        if not chunk.last:
            return writes
        if chunk.index_slice.stop != len(info.dst_kv):
            raise ShapeMismatch(
                f"room {room}: prefill sent {chunk.index_slice.stop} pages, "
                f"decode allocated {len(info.dst_kv)}"
            )
        for i in range(len(self.mgr.kv_args.state_types or [])):
            src = chunk.state[i] if chunk.state and i < len(chunk.state) else None
            dst_s = info.dst_state[i] if i < len(info.dst_state) else None
            n_src = 0 if src is None else len(src)
            n_dst = 0 if dst_s is None else len(dst_s)
            if n_src != n_dst:
                raise ShapeMismatch(
                    f"room {room}: state {i}: prefill sends {n_src} items, decode allocated {n_dst}"
                )
            sp = plan.state[i] if i < len(plan.state) else None
            if not n_src:
                continue
            if sp is None or sp.whole:
                writes.append(ItemWrite(f"state{i}", src, dst_s))
            elif sp.runs is not None:  # other TP: this rank's slices of every tensor
                writes.append(PatternWrite(f"state{i}", src, dst_s, sp.runs))
        if chunk.aux_index is None:
            raise ShapeMismatch(f"room {room}: last chunk without an aux (metadata) row")
        if plan.sends_aux:
            writes.append(ItemWrite("aux", [int(chunk.aux_index)], [info.dst_aux]))
        return writes

    def _settled(self, room: int, task: asyncio.Task) -> None:
        """The done callback of a room's write task. Runs on: the engine's loop thread."""
        mgr = self.mgr
        if not task.cancelled() and task.exception() is not None:
            log.error("%r: room %d: write task failed", mgr, room, exc_info=task.exception())
        with mgr.room_lock:
            n = mgr._staging_outstanding.get(room, 0) - 1
            if n > 0:
                mgr._staging_outstanding[room] = n
            else:
                mgr._staging_outstanding.pop(room, None)
        if self.chains.get(room) is task:
            del self.chains[room]
        if not self._stop.is_set():
            self.notifier.submit(mgr._maybe_ack_drained_abort, room)

    def _fail(self, room: int, reason: str, cause: str, notify) -> None:
        """Runs on: the control thread or the engine's loop thread."""
        mgr = self.mgr
        if mgr.request_status.get(room) == KVPoll.Failed:
            return
        log.warning("%r: room %d failed: %s", mgr, room, reason)
        mgr.record_failure(room, reason)
        mgr.update_status(room, KVPoll.Failed)
        mgr.metrics.failed(cause)
        if notify and not self._stop.is_set():
            self.notifier.submit(
                mgr.send_kv_status_message,
                targets=notify,
                bootstrap_room=room,
                status=KVPoll.Failed,
                failure_reason=reason,
            )

    def _peer_closed(self, peer, exc) -> None:
        """A decode engine went away: fail its live rooms (nothing to notify).

        Runs on: the engine's loop thread."""
        mgr = self.mgr
        with mgr.room_lock:
            keys = {k for k, d in self.decodes.items() if d.reg.name == peer.name}
            rooms = [r for r, infos in mgr.transfer_infos.items() if keys & set(infos)]
        for room in rooms:
            if mgr.request_status.get(room) not in (None, KVPoll.Success):
                self._fail(room, f"decode {peer.name} gone: {exc}", "PeerClosed", notify=[])

    # ------------------------------------------------------------------ (unused on prefill)
    def registration_message(self):
        raise NotImplementedError("prefill ranks do not register with other ranks")

    def metadata_message(self, *args):
        raise NotImplementedError("prefill ranks do not send room metadata")


def _spawn(coro) -> "asyncio.Task":
    """A room chain's task (or an eager chain's continuation / follower): its failure is
    reported by :meth:`PrefillPath._settled`, so it is retrieved here. Runs on: the loop
    (or its guest)."""
    task = asyncio.get_running_loop().create_task(coro)
    task.add_done_callback(_retrieve)
    return task


def _retrieve(task: "asyncio.Future") -> None:
    if not task.cancelled():
        task.exception()


async def _outcome(coro):
    """``await coro``, its exception returned instead of raised (as ``gather``'s
    ``return_exceptions``); cancellation still propagates."""
    try:
        return await coro
    except Exception as exc:
        return exc


__all__ = ["PrefillPath"]
