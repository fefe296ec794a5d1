"""Node processes of ``bench/sgl_latency.py``: the SGLang integration tests' nodes
(tests/sglang_pd/sgl_nodes.py: SGLang's real pools, ``KVArgs``, metadata buffers and the
classes of ``get_kv_class(TransferBackend("kvxfer"), ...)`` on CPU) plus the benchmark's
batch calls, so a request costs no command round trip.

Stamps: prefill's ``KVSender.send`` call (``time.monotonic_ns`` just before it), and the
moment each manager's ``update_status`` makes a room ``Success`` (decode: prefill's SglDone
was handled; prefill: its last write settled and SglDone was handed to UCX) - a wrapper of
the manager instance's ``update_status``, so no scheduler poll interval is in the figures.
The raw comparison writes the same request's items with the backend's own planner
(``PrefillPath._writes``) and peer, notifying a ``Ping`` that decode stamps on arrival.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List

import numpy as np
import sgl_nodes as N

from kvxfer.pd_demo.bench import RAW_SEQ, raw_ping_seq


def room_pages(room: int, n: int, side: int) -> List[int]:
    """``n`` distinct page ids (1..60) of ``room`` on prefill (``side`` 0) or decode (1)."""
    first = room % 60 if side == 0 else (room * 7) % 60
    return [1 + (first + k) % 60 for k in range(n)]


def _stamp_success(mgr, stamps: Dict[int, int], cv: threading.Condition) -> None:
    """Wrap ``mgr.update_status`` (this instance) to stamp rooms reaching Success/Failed."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    inner = mgr.update_status

    def update_status(room, status):
        inner(room, status)
        if status in (KVPoll.Success, KVPoll.Failed) and mgr.request_status.get(room) == status:
            t = time.monotonic_ns()
            with cv:
                stamps.setdefault(int(room), t if status == KVPoll.Success else -t)
                cv.notify_all()

    mgr.update_status = update_status


class BenchPrefill(N.PrefillNode):
    def setup(self, name: str) -> bool:
        self.stamps: Dict[int, int] = {}
        self.cv = threading.Condition()
        self.name = name
        self.direct = 0  # chunks of the latency runs that ran direct
        _stamp_success(self.scen[name]["mgr"], self.stamps, self.cv)
        return True

    def direct_sends(self) -> int:
        """How many of the latency runs' sends ran direct (as the engine loop's guest) so
        far, and resets the count."""
        out, self.direct = self.direct, 0
        return out

    def open_many(self, name: str, rooms: List[int], port: int) -> bool:
        for room in rooms:
            self.sender(name, room, "127.0.0.1", port)
        return True

    def arm_many(self, name: str, rooms: List[int], timeout: float = 60.0, pages: int = 1) -> bool:
        """Wait until every room is WaitingForInput, then ``init`` it (``pages`` pages)."""
        for room in rooms:
            st = self.wait(room, [2, 0], timeout, 0.0005)  # WaitingForInput, Failed
            if st != 2:
                raise RuntimeError(f"room {room}: state {st}, not WaitingForInput")
            self.start(name, room, pages * N.PAGE, room % N.META_ROWS, 7)
        return True

    def _send_one(self, room: int, n: int) -> int:
        h = self.handles[room]
        pages = np.asarray(room_pages(room, n, 0), dtype=np.int32)
        t = time.monotonic_ns()
        h.send(pages, None, num_kv_tokens=n * N.PAGE)
        return t

    def latency(self, rooms: List[int], timeout: float = 10.0, pages: int = 1) -> Dict[int, int]:
        """One request of ``pages`` pages at a time: the next is sent once this rank's manager made the
        last one Success. Returns {room: send stamp}."""
        out = {}
        eng = self.scen[self.name]["mgr"].engine
        d0 = getattr(eng, "direct_calls", 0)  # (0: a tree before direct calls)
        for room in rooms:
            out[room] = self._send_one(room, pages)
            with self.cv:
                if not self.cv.wait_for(lambda r=room: r in self.stamps, timeout):
                    raise RuntimeError(f"room {room}: no terminal state within {timeout}s")
            if self.stamps[room] < 0:
                raise RuntimeError(f"room {room} failed: {self.failure(room)}")
        self.direct += getattr(eng, "direct_calls", 0) - d0
        return out

    def success_stamps(self, rooms: List[int]) -> Dict[int, int]:
        """This rank's terminal stamps of ``rooms`` (ns; negative: Failed; 0: none yet)."""
        with self.cv:
            return {r: self.stamps.get(r, 0) for r in rooms}

    def throughput(self, rooms: List[int], timeout: float = 60.0, pages: int = 1) -> Dict[str, int]:
        """Every room sent back to back; returns the first send's stamp (ns) and how many
        rooms failed or did not end here within ``timeout``."""
        t0 = time.monotonic_ns()
        for room in rooms:
            self._send_one(room, pages)
        with self.cv:
            self.cv.wait_for(lambda: all(r in self.stamps for r in rooms), timeout)
        ends = [self.stamps.get(r) for r in rooms]
        return {"t0": t0, "failed": sum(1 for e in ends if e is None or e < 0)}

    def raw(
        self, name: str, room: int, n: int, notify: bool, timeout: float = 10.0, pages: int = 1
    ):
        """``n`` raw engine writes of ``room``'s request (the backend's planner and
        peer, outside its protocol), one at a time from this thread through the engine loop
        (as :meth:`EngineLoop.run` hands any call over). With ``notify`` each carries a Ping
        that decode stamps. Returns [(start ns, end ns, seq or None)]."""
        from kvxfer.disagg.messages import Ping
        from kvxfer.integrations.sglang.prefill_path import Chunk

        mgr = self.scen[name]["mgr"]
        path = mgr.path
        with mgr.room_lock:
            info = list(mgr.transfer_infos[room].values())[0]
        d, peer = mgr.engine.run(path._peer(info.key), timeout)
        chunk = Chunk(room_pages(room, pages, 0), slice(0, pages), True, room % N.META_ROWS, None)
        writes = path._writes(room, chunk, info, d.plan)
        out = []
        for i in range(n):
            seq = RAW_SEQ + room * 100000 + i if notify else None
            note = None if seq is None else Ping(seq=seq).encode()
            t0 = time.monotonic_ns()
            mgr.engine.run(peer.write(writes, notify=note), timeout)
            out.append((t0, time.monotonic_ns(), seq))
        return out

    def clear_many(self, rooms: List[int]) -> bool:
        for room in rooms:
            self.clear(room)
        return True


class BenchDecode(N.DecodeNode):
    def setup(self, name: str) -> bool:
        self.stamps: Dict[int, int] = {}
        self.cv = threading.Condition()
        self.raw_rx: Dict[int, int] = {}
        mgr = self.scen[name]["mgr"]
        _stamp_success(mgr, self.stamps, self.cv)
        mgr.engine.engine.on_message(self._on_raw)
        # the backend's own handler warns about each Ping (not a message of its protocol)
        logging.getLogger("kvxfer.integrations.sglang.decode_path").setLevel(logging.ERROR)
        return True

    def _on_raw(self, peer, payload: bytes) -> None:
        """Runs on: the engine loop (an engine message handler)."""
        t = time.monotonic_ns()
        seq = raw_ping_seq(payload)
        if seq is not None:
            self.raw_rx[seq] = t

    def open_many(self, name: str, rooms: List[int], port: int, pages: int = 1) -> bool:
        for room in rooms:
            self.receiver(name, room, f"127.0.0.1:{port}")
            self.metadata(name, room, room_pages(room, pages, 1), room % N.META_ROWS)
        return True

    def wait_all(self, rooms: List[int], timeout: float = 60.0) -> Dict[int, int]:
        """Block until every room is terminal; {room: Success stamp (negative: Failed)}."""
        with self.cv:
            self.cv.wait_for(lambda: all(r in self.stamps for r in rooms), timeout)
        return {r: self.stamps.get(r, 0) for r in rooms}

    def raw_receipts(self) -> Dict[int, int]:
        out, self.raw_rx = self.raw_rx, {}
        return out

    def clear_many(self, rooms: List[int]) -> bool:
        for room in rooms:
            self.clear(room)
        return True


def bench_node(role: str) -> N.Node:
    """What a bench worker hosts (as ``sgl_nodes.node``, with the bench calls)."""
    sa = N._setup_process(role)
    cls = BenchPrefill if role == "prefill" else BenchDecode
    return cls(sa)
