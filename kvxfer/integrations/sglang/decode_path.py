"""Decode side of the SGLang backend: what it tells prefill, and when a room succeeds.

A room succeeds only on :class:`~.messages.SglDone` arriving over the kvxfer engine - an
authenticated peer, after all of the room's writes completed - from *every* prefill rank the
room was bootstrapped with (SGLang's ``required_prefill_response_num``: several under
heterogeneous TP, each counted once by its endpoint). Prefill's ZMQ status messages
(unauthenticated) can only fail a room; any prefill rank's failure fails it. A prefill
engine that goes away fails its rooms at once (no waiting for SGLang's HTTP heartbeat, which
does not notice a dead scheduler behind a live bootstrap server).

Staged head slices (heterogeneous MHA TP to a peer without a device lane): before a room's
metadata leaves, decode registers with each of the room's prefill peers that is connected
and was granted landing slots (``Peer.expect_slices`` under the room id) the runs it
derives itself (:func:`~.tp_pairs.decode_sides`) of the room's pages, and the metadata
names those peers (``SglRoom.slices``); only they may send the room's chunks as
SliceWrites, into exactly those pages and bytes (anything else closes the peer before a byte
of it is written). A prefill rank not connected yet (its first room) writes direct.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional, Tuple

import msgpack
import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll

from kvxfer import wire
from kvxfer.disagg.errors import TpShapeMismatch
from kvxfer.errors import KvxferError, ProtocolError
from kvxfer.integrations.sglang.messages import (
    FRAME_TAG,
    SglDone,
    SglRegister,
    SglRoom,
    ids_to_bytes,
)
from kvxfer.integrations.sglang.tp_pairs import (
    Sides,
    decode_sides,
    shape,
    state_tp_fields,
    total_kv_heads,
)

log = logging.getLogger(__name__)


def _prefill_endpoint(peer_name: str) -> Optional[str]:
    """``sglang-prefill@ip:port`` (the engine name a prefill rank uses) -> ``ip:port``."""
    head, sep, ep = peer_name.partition("@")
    return ep if sep and head == "sglang-prefill" else None


class DecodePath:
    def __init__(self, mgr) -> None:
        self.mgr = mgr
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: room -> its prefill endpoints ("ip:port") -> a per-room index of that endpoint
        self._rooms: Dict[int, Dict[str, int]] = {}
        self._meta_t: Dict[int, float] = {}  # room -> when its metadata went out
        #: room -> its prefill endpoints -> their TP rank, and prefill's TP size
        self._tp: Dict[int, Tuple[Dict[str, int], int]] = {}
        #: room -> the prefill endpoints whose staged slices of it we registered
        self._slices: Dict[int, List[str]] = {}
        self._sides: Dict[Tuple[int, int], Optional[Sides]] = {}  # (prefill tp, rank)
        self._lock = threading.Lock()
        #: test hook: the protocol version this rank's control messages claim (None:
        #: kvxfer's own) - a decode of another kvxfer, as its prefill peers see it
        self.claim_version: Optional[int] = None

    def _frames(self, msg: wire.Message) -> List[bytes]:
        data = msg.encode()
        if self.claim_version is not None:
            body = msgpack.unpackb(data, raw=False)
            body["v"] = self.claim_version
            data = msgpack.packb(body, use_bin_type=True)
        return [FRAME_TAG, data]

    def start(self) -> None:
        eng = self.mgr.engine.engine
        eng.on_message(self._on_engine_message)
        eng.on_peer_closed(self._peer_closed)
        self._thread = threading.Thread(
            target=self._listen, daemon=True, name=f"kvxfer-sgl-listen-{self.mgr.rank_port}"
        )
        self._thread.start()
        self.mgr._start_heartbeat_checker_thread()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ messages out
    def registration_message(self) -> List[bytes]:
        mgr, a = self.mgr, self.mgr.kv_args
        host, port = mgr.engine.address
        reg = SglRegister(
            endpoint=mgr.local_ip,
            port=mgr.rank_port,
            engine_host=str(host),
            engine_port=int(port),
            name=mgr.engine.config.name,
            tp_size=mgr.attn_tp_size,
            tp_rank=int(a.engine_rank) % mgr.attn_tp_size,
            page_size=int(a.page_size),
            dtype=str(a.kv_cache_dtype_str),
            kv_item_lens=[int(x) for x in a.kv_item_lens],
            aux_item_lens=[int(x) for x in a.aux_item_lens],
            state_types=[str(getattr(s, "value", s)) for s in a.state_types or []],
            state_item_lens=[[int(x) for x in lens] for lens in a.state_item_lens or []],
            total_kv_heads=total_kv_heads(a, mgr.attn_tp_size, derive=False),
            mla=bool(mgr.is_mla_backend),
            **state_tp_fields(a),
        )
        return self._frames(reg)

    def metadata_message(
        self,
        room,
        required_dst_info_num,
        kv_indices,
        aux_index,
        state_indices,
        decode_prefix_len,
        is_dummy,
    ) -> List[bytes]:
        mgr = self.mgr
        states = []
        for s in (state_indices or []) if not is_dummy else []:
            states.append(None if s is None else ids_to_bytes(np.asarray(s).reshape(-1)))
        msg = SglRoom(
            room=int(room),
            endpoint=mgr.local_ip,
            port=mgr.rank_port,
            dst_kv=b"" if is_dummy else ids_to_bytes(kv_indices),
            dst_aux=int(aux_index if aux_index is not None else 0),
            required_dst_info_num=int(required_dst_info_num),
            dst_state=states,
            decode_prefix_len=int(decode_prefix_len or 0),
            is_dummy=bool(is_dummy),
        )
        with self._lock:
            self._meta_t[int(room)] = time.perf_counter()
            if not is_dummy:
                msg.slices = list(self._slices.get(int(room), ()))
        return self._frames(msg)

    # ------------------------------------------------------------------ room tracking
    def track(self, room: int, bootstrap_infos, tp_ranks=None, prefill_tp=None) -> None:
        """The prefill ranks ``room`` bootstrapped with (dummies excluded): each one's SglDone
        counts once towards SGLang's ``required_prefill_response_num`` (heterogeneous TP:
        several), under an index derived from the authenticated sender's endpoint - never
        from what the message says. ``tp_ranks`` (SGLang's ``target_tp_ranks``, in the
        order of ``bootstrap_infos``) and ``prefill_tp``: what the staged path needs."""
        infos = list(bootstrap_infos or [])
        eps = sorted({f"{i['rank_ip']}:{i['rank_port']}" for i in infos if not i.get("is_dummy")})
        ranks: Dict[str, int] = {}
        if tp_ranks is not None and prefill_tp and len(tp_ranks) == len(infos):
            for i, r in zip(infos, tp_ranks):
                if not i.get("is_dummy"):
                    ranks[f"{i['rank_ip']}:{i['rank_port']}"] = int(r)
        with self._lock:
            self._rooms[room] = {ep: k for k, ep in enumerate(eps)}
            if ranks:
                self._tp[room] = (ranks, int(prefill_tp))

    def untrack(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)
            self._meta_t.pop(room, None)
            self._tp.pop(room, None)
            eps = self._slices.pop(room, None)
        if eps:
            names = {f"sglang-prefill@{ep}" for ep in eps}
            try:
                self.mgr.engine.call_soon(self._forget, room, names)
            except KvxferError:
                pass  # closed: the peers are gone

    def _forget(self, room: int, names) -> None:
        """Runs on: the engine's loop thread."""
        for peer in self.mgr.engine.engine.peers.values():
            if peer.name in names:
                peer.forget_slices(room)

    # ------------------------------------------------------------------ staged slices
    def _decode_sides(self, prefill_tp: int, prefill_rank: int) -> Optional[Sides]:
        """Our runs of the pair with that prefill rank (cached; None: whole pages or
        nothing, or a shape we cannot derive them for - then that peer writes direct)."""
        key = (prefill_tp, prefill_rank)
        if key not in self._sides:
            mgr, a = self.mgr, self.mgr.kv_args
            ours = shape(
                mgr.attn_tp_size,
                int(a.engine_rank) % mgr.attn_tp_size,
                a.page_size,
                a.kv_item_lens,
                total_kv_heads(a, mgr.attn_tp_size, derive=False),
                bool(mgr.is_mla_backend),
            )
            try:
                self._sides[key] = decode_sides(ours, prefill_tp, prefill_rank)
            except TpShapeMismatch as exc:
                log.info("%r: no staged slices from prefill tp %d/%d: %s", mgr, *key[::-1], exc)
                self._sides[key] = None
        return self._sides[key]

    def expect_slices(self, room: int, kv_indices) -> None:
        """Register, with every prefill peer of ``room`` that is connected and was granted
        landing slots, the staged head slices of the room's pages ``kv_indices`` (bounded
        wait on the engine loop, so they are in place before the metadata leaves).

        Runs on: the scheduler thread."""
        mgr = self.mgr
        with self._lock:
            tp = self._tp.get(room)
        if not mgr.tp_stage_min_ops or tp is None:
            return
        ranks, prefill_tp = tp
        ids = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        wanted = {}
        for ep, rank in ranks.items():
            sides = self._decode_sides(prefill_tp, rank)
            if sides is not None and ids.size:
                wanted[f"sglang-prefill@{ep}"] = (ep, sides)
        if not wanted:
            return
        try:
            eps = mgr.engine.run(self._expect(room, ids, wanted), 5.0)
        except KvxferError as exc:
            log.warning("%r: room %d: staged slices not registered: %s", mgr, room, exc)
            return
        with self._lock:
            self._slices[room] = eps

    async def _expect(self, room: int, ids, wanted) -> List[str]:
        """Runs on: the engine's loop thread."""
        eps = []
        for peer in self.mgr.engine.engine.peers.values():
            got = wanted.get(peer.name)
            if got is None or peer.closed or not peer.accepts_slices("kv"):
                continue
            peer.expect_slices(room, "kv", ids, got[1])
            eps.append(got[0])
        return sorted(eps)

    # ------------------------------------------------------------------ messages in
    def _listen(self) -> None:
        """The decode rank's ZMQ control listener (prefill's failure reports, abort acks).

        Runs on: the listener thread ``kvxfer-sgl-listen-<port>``."""
        mgr = self.mgr
        sock = mgr.server_socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            msg = sock.recv_multipart()
            try:
                if mgr.handle_abort_ack_message(msg):
                    continue
                parsed = mgr.parse_kv_status_message(msg)
                if parsed is None:
                    log.warning("%r: unexpected control message %r", mgr, msg[0][:20])
                    continue
                room, status, rank, reason = parsed
                if status != KVPoll.Failed:
                    log.warning(
                        "%r: room %d: ignored status %d over ZMQ (only the "
                        "authenticated engine reports success)",
                        mgr,
                        room,
                        status,
                    )
                    continue
                self._failed(
                    room, reason or mgr.DEFAULT_PREFILL_FAILURE_REASON, rank, "PrefillFailed"
                )
            except Exception:
                log.exception("%r: control message failed", mgr)

    def _on_engine_message(self, peer, payload: bytes) -> None:
        """Prefill's authenticated completion (SglDone). Runs on: the engine's loop thread."""
        mgr = self.mgr
        try:
            msg = wire.decode(payload)
        except ProtocolError as exc:
            log.warning(
                "%r: dropped engine message from %s: %s: %s",
                mgr,
                peer.name,
                type(exc).__name__,
                exc,
            )
            return
        if not isinstance(msg, SglDone):
            log.warning("%r: unexpected %s from %s", mgr, msg.TAG, peer.name)
            return
        ep = _prefill_endpoint(peer.name)
        with self._lock:
            eps = self._rooms.get(msg.room)
            t_meta = self._meta_t.get(msg.room)
        if eps is None or ep not in eps:
            log.warning(
                "%r: room %d: completion from %s, which this room was not "
                "bootstrapped with; ignored",
                mgr,
                msg.room,
                peer.name,
            )
            return
        was = mgr.request_status.get(msg.room)
        # SGLang counts distinct responders: a sender counts once whatever rank it claims
        mgr.apply_prefill_status(
            bootstrap_room=msg.room, status=KVPoll.Success, prefill_rank=eps[ep]
        )
        if (
            was not in (KVPoll.Success, KVPoll.Failed)
            and mgr.request_status.get(msg.room) == KVPoll.Success
        ):
            mgr.metrics.succeeded(None if t_meta is None else time.perf_counter() - t_meta)

    def _failed(self, room: int, reason: str, rank: int, cause: str) -> None:
        """Runs on: the listener thread or the engine's loop thread."""
        mgr = self.mgr
        was = mgr.request_status.get(room)
        mgr.apply_prefill_status(
            bootstrap_room=room, status=KVPoll.Failed, prefill_rank=rank, failure_reason=reason
        )
        if was not in (None, KVPoll.Success, KVPoll.Failed):
            mgr.metrics.failed(cause)

    def _peer_closed(self, peer, exc) -> None:
        """A prefill engine went away: fail its live rooms. Runs on: the engine's loop
        thread."""
        ep = _prefill_endpoint(peer.name)
        if ep is None:
            return
        with self._lock:
            rooms = [r for r, eps in self._rooms.items() if ep in eps]
        for room in rooms:
            if self.mgr.request_status.get(room) not in (None, KVPoll.Success):
                self._failed(room, f"prefill {peer.name} gone: {exc}", -1, "PeerClosed")
