"""Decode side of the SGLang backend: what it tells prefill, and when a room succeeds.

A room succeeds only on :class:`~.messages.SglDone` arriving over the kvxfer engine - an
authenticated peer, after all of the room's writes completed - from *every* prefill rank the
room was bootstrapped with (SGLang's ``required_prefill_response_num``: several under
heterogeneous TP, each counted once by its endpoint). Prefill's ZMQ status messages
(unauthenticated) can only fail a room; any prefill rank's failure fails it. A prefill
engine that goes away fails its rooms at once (no waiting for SGLang's HTTP heartbeat, which
does not notice a dead scheduler behind a live bootstrap server).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional

import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll

from kvxfer import wire
from kvxfer.errors import ProtocolError
from kvxfer.integrations.sglang.messages import (
    FRAME_TAG,
    SglDone,
    SglRegister,
    SglRoom,
    ids_to_bytes,
)
from kvxfer.integrations.sglang.tp_pairs import total_kv_heads

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
        self._lock = threading.Lock()

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
        )
        return [FRAME_TAG, reg.encode()]

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
        return [FRAME_TAG, msg.encode()]

    # ------------------------------------------------------------------ room tracking
    def track(self, room: int, bootstrap_infos) -> None:
        """The prefill ranks ``room`` bootstrapped with (dummies excluded): each one's SglDone
        counts once towards SGLang's ``required_prefill_response_num`` (heterogeneous TP:
        several), under an index derived from the authenticated sender's endpoint - never
        from what the message says."""
        eps = sorted(
            {
                f"{i['rank_ip']}:{i['rank_port']}"
                for i in bootstrap_infos or []
                if not i.get("is_dummy")
            }
        )
        with self._lock:
            self._rooms[room] = {ep: k for k, ep in enumerate(eps)}

    def untrack(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)
            self._meta_t.pop(room, None)

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
            log.warning("%r: dropped engine message from %s: %s", mgr, peer.name, exc)
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
