"""One prefill or decode worker process of the demo (and of ``kvxfer bench pd``).

A worker owns a :class:`~kvxfer.pd_demo.model.DemoModel` (pools, allocators, aux rows) and a
:class:`~kvxfer.disagg.KVManager` running on its private event-loop thread; its main thread
acts as the scheduler: it allocates with the real allocators, drives ``KVSender`` /
``KVReceiver`` handles, and frees every page, slot and row when the room's ``on_done`` has
fired (``on_done`` only queues the event; all allocator calls stay on the main thread).

The parent drives a worker through a typed proxy (:mod:`kvxfer.procs`, :class:`~kvxfer.pd_demo.pair.Pair`);
a worker's traceback comes back to the parent as :class:`kvxfer.errors.RemoteError`.
Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the
host), so decode's completion time minus prefill's send time is an end-to-end latency.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Dict, List, Optional, Tuple

from kvxfer.pd_demo.spec import ModelSpec

log = logging.getLogger(__name__)

Request = Tuple[int, int]  # (room id, prompt length in tokens)


class SchedulerError(RuntimeError):
    """The demo scheduler could not make progress (a request larger than the pool, or no
    room finished within the deadline)."""


class PDWorker:
    """Scheduler of one side (``role`` = ``"prefill"`` or ``"decode"``)."""

    def __init__(self, role: str, spec: dict, bootstrap: str, opts: dict) -> None:
        from kvxfer.disagg import KVManager, Timeouts
        from kvxfer.pd_demo.model import DemoModel  # torch: in the worker process only

        self.role, self.bootstrap, self.opts = role, bootstrap, opts
        if role == "decode" and opts.get("decode_page_size"):
            spec = dict(spec, page_size=int(opts["decode_page_size"]))
        if role == "decode" and opts.get("decode_post_capture"):
            spec = dict(spec, post_capture=True)
        #: decode: tokens of each request it already holds (its prefix cache), at most all
        self.prefix = int(opts.get("decode_prefix", 0))
        #: decode declares prefix and token count (else SGLang's plain call)
        self.shaped = self.prefix > 0 or bool(opts.get("decode_page_size"))
        self.model = DemoModel(ModelSpec(**spec))
        self.deadline_s = float(opts.get("deadline_s", 120.0))
        self.max_inflight = int(opts.get("max_inflight", 16))
        self.mgr = KVManager(
            self.model.kv_args,
            role,
            bootstrap_addr=bootstrap if role == "prefill" else None,
            secret=opts.get("secret"),
            error_mode=opts.get("error_mode", "peer"),
            timeouts=Timeouts(**opts.get("timeouts", {})),
            integrity=bool(opts.get("integrity", False)),
            trace=opts.get("trace"),  # None: $KVXFER_TRACE
            **{
                k: opts[k]
                for k in ("tp_stage_min_ops", "tp_pattern", "coalesce_after", "host_copy")
                if k in opts
            },
            name=f"demo-{role}",
        ).start_background()
        self.done_q: "queue.SimpleQueue" = queue.SimpleQueue()
        self.open: Dict[int, dict] = {}
        self.finished: Dict[int, dict] = {}
        #: prefill, ``opts["wait_decode"]`` (tests): room -> set once decode's metadata is
        #: attached to its KVSender (or the room failed); the scheduler computes a request
        #: only then, as SGLang's bootstrap queue does (``_wait_decode``)
        self._attached: Optional[Dict[int, threading.Event]] = None
        #: ``opts["poll_scheduler"]`` ("yield" / "spin"; None: off): waiting for rooms, the
        #: scheduler polls every open room, sweep after sweep (SGLang's loop between
        #: batches), instead of blocking on ``done_q`` (then a room's Done can be handled by
        #: its poll: KVManager.take_arrived); "yield": between sweeps it lets other threads
        #: run once (``time.sleep(0)``, as that loop's non-blocking socket reads do); "spin":
        #: never (a scheduler that stays in the interpreter)
        mode = opts.get("poll_scheduler")
        if mode not in (None, "yield", "spin"):
            raise ValueError(f"poll_scheduler must be None, 'yield' or 'spin', got {mode!r}")
        self.poll_scheduler: Optional[str] = mode
        if role == "prefill" and opts.get("wait_decode"):
            self._attached = {}
            self.mgr.test_hook = self._on_hook

    # ------------------------------------------------------------------ plumbing
    def _on_done(self, room: int):
        q = self.done_q

        def cb(state, exc) -> None:  # manager loop thread: record and hand over
            q.put(
                (
                    room,
                    int(state),
                    None if exc is None else f"{type(exc).__name__}: {exc}",
                    time.monotonic(),
                )
            )

        return cb

    def _on_hook(self, point: str, room: int) -> None:
        """The manager's test hook (``wait_decode``). Runs on: the manager's loop thread."""
        if point in ("decode_attached", "room_failed") and self._attached is not None:
            ev = self._attached.get(room)
            if ev is not None:
                ev.set()

    def _wait_decode(self, room: int, ev: threading.Event) -> None:
        """Block until decode's metadata for ``room`` is attached (or the room failed):
        bounded by ``deadline_s``."""
        assert self._attached is not None
        try:
            if not ev.wait(self.deadline_s):
                raise SchedulerError(
                    f"prefill: decode's metadata for room {room} did not come within "
                    f"{self.deadline_s}s"
                )
        finally:
            self._attached.pop(room, None)

    def _next_done(self, block: bool) -> Optional[tuple]:
        if block and self.poll_scheduler:
            return self._poll_for_done()
        try:
            return self.done_q.get(timeout=self.deadline_s) if block else self.done_q.get_nowait()
        except queue.Empty:
            if block:
                raise SchedulerError(
                    f"{self.role}: no room finished within {self.deadline_s}s "
                    f"({len(self.open)} open)"
                ) from None
            return None

    def _poll_for_done(self) -> tuple:
        """:meth:`_next_done` of a polling scheduler: poll every open room until one was
        released (bounded by ``deadline_s``)."""
        end = time.monotonic() + self.deadline_s
        while True:
            try:
                return self.done_q.get_nowait()
            except queue.Empty:
                pass
            for rec in list(self.open.values()):
                h = rec.get("h")
                if h is not None:
                    h.poll()
            if self.poll_scheduler == "yield":
                time.sleep(0)  # the GIL and the CPU to the loop thread, if it waits for them
            if time.monotonic() > end:
                raise SchedulerError(
                    f"{self.role}: no room finished within {self.deadline_s}s "
                    f"({len(self.open)} open)"
                )

    def _settle(self, item: tuple) -> None:
        """A room is terminal and released by the manager: verify (decode), then free."""
        from kvxfer.disagg import KVPoll

        room, state, exc, t = item
        rec = self.open.pop(room)
        rec.update(state=KVPoll(state).name, exc=exc, t_done=t)
        if self.role == "decode" and state == KVPoll.Success and rec.get("verify", True):
            rec["problems"] = self.model.verify(room, rec["res"], rec["length"])
        self.model.free(rec["res"])
        rec.pop("res")
        rec.pop("h", None)
        self.finished[room] = rec

    def _drain(self) -> None:
        while (item := self._next_done(False)) is not None:
            self._settle(item)

    def _alloc(self, n_pages: int) -> dict:
        """Allocate, settling finished rooms until it fits and fewer than ``max_inflight``
        rooms are open (the scheduler's admission: decode announces a bounded window ahead
        of prefill, which holds announced rooms only ``bootstrap_s`` before their KVSender)."""
        while True:
            if len(self.open) < self.max_inflight:
                res = self.model.alloc(n_pages)
                if res is not None:
                    return res
            if not self.open:
                raise SchedulerError(
                    f"{self.role}: a request of {n_pages} pages does not fit "
                    f"an empty pool ({self.model.pages.num_pages} pages)"
                )
            self._settle(self._next_done(True))

    def _begin(self) -> None:
        self.finished = {}
        self._stats0 = {k: v for k, v in self.mgr.stats.items() if k != "lanes"}
        self._stats0["guest_wakes"] = self.mgr.guest_wakes

    def _finish(self) -> dict:
        """Settle every open room; stats are this command's (deltas of the manager's)."""
        while self.open:
            self._settle(self._next_done(True))
        st = {k: v - self._stats0.get(k, 0) for k, v in self.mgr.stats.items() if k != "lanes"}
        st["lanes"] = sorted(self.mgr.stats["lanes"])
        st["guest_wakes"] = self.mgr.guest_wakes - self._stats0["guest_wakes"]
        return {
            "rooms": self.finished,
            "stats": st,
            "leaks": self.model.leaks(),
            "live_rooms": len(self.mgr.rooms),
        }

    # ------------------------------------------------------------------ prefill
    def _open_sender(self, room: int, length: int, res: dict):
        from kvxfer.disagg import KVSender

        h = KVSender(self.mgr, self.bootstrap, room, on_done=self._on_done(room))
        h.init(int(res["pages"].numel()), res["row"])
        return h

    def prefill(self, requests: List[Request], chunk_tokens: int) -> dict:
        """Compute and send every request in order, chunk by chunk (chunked prefill)."""
        m, ps = self.model, self.model.ps
        self._begin()
        for room, length in requests:
            n = m.pages_for(length)
            res = self._alloc(n)
            self._drain()
            m.write_aux(room, res["row"])
            attached = None
            if self._attached is not None:  # armed before the KVSender exists: no race
                attached = self._attached[room] = threading.Event()
            h = self._open_sender(room, length, res)
            rec = self.open[room] = {"res": res, "length": length, "h": h, "chunks": 0}
            if attached is not None:
                self._wait_decode(room, attached)
            n_tok = n * ps
            for lo in range(0, n_tok, chunk_tokens):
                hi = min(lo + chunk_tokens, n_tok)
                last = hi == n_tok
                state = [res["slot"]] if last and res["slot"] is not None else None
                rec["chunks"] += 1
                if self.opts.get("layerwise"):
                    self._chunk_layerwise(h, rec, room, res, lo, hi, length, state)
                    continue
                m.write_tokens(room, res["pages"], lo, hi, length)
                if state is not None:
                    m.write_state(room, res["slot"])
                m.ready()
                rec["t_send"] = time.monotonic()
                h.send(res["pages"][lo // ps : hi // ps], state)
        return self._finish()

    def _chunk_layerwise(self, h, rec, room, res, lo, hi, length, state) -> None:
        """One chunk streamed layer by layer (kvxfer.disagg.layerwise): each kv layer is
        'computed' (written), then declared ready — on CUDA with an event recorded after
        its stores, which the manager's loop polls; the Mamba state, final only after the
        chunk's last token, is written before the last layer is declared."""
        import torch

        m, ps = self.model, self.model.ps
        h.begin_chunk(res["pages"][lo // ps : hi // ps], state)
        n_layers = len(m.attn_ids)
        for i in range(n_layers):
            m.write_tokens(room, res["pages"], lo, hi, length, layers=[i])
            if i == n_layers - 1 and state is not None:
                m.write_state(room, res["slot"])
            ev = None
            if m.pages.device.type == "cuda":
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(m.pages.device))
            if i == n_layers - 1:
                rec["t_send"] = time.monotonic()
            h.layer_ready(i, ev)

    # ------------------------------------------------------------------ decode
    def _open_receiver(self, room: int, res: dict, length: int):
        from kvxfer.disagg import KVReceiver

        h = KVReceiver(self.mgr, self.bootstrap, room, on_done=self._on_done(room))
        h.init()
        state = None if res["slot"] is None else [res["slot"]]
        if not self.shaped:
            h.send_metadata(res["pages"], res["row"], state)
            return h
        # we hold tokens [0, prefix) ourselves (as a prefix cache would) and our slots past
        # the request (zeros): prefill writes exactly the tokens in between
        m, k = self.model, min(self.prefix, length)
        for lo, hi in ((0, k), (length, res["pages"].numel() * m.ps)):
            if lo < hi:
                m.write_tokens(room, res["pages"], lo, hi, length)
        m.ready()
        h.send_metadata(res["pages"], res["row"], state, prefix_len=k, num_tokens=length)
        return h

    def decode(self, requests: List[Request], verify: bool = True) -> dict:
        """Pre-allocate and announce every request in order; verify and free each one that
        finishes. Returns per-room results and the allocator / room-table leak counts."""
        m = self.model
        self._begin()
        for room, length in requests:
            res = self._alloc(m.pages_for(length))
            self._drain()
            self.open[room] = {"res": res, "length": length, "verify": verify}
            self.open[room]["h"] = self._open_receiver(room, res, length)
        return self._finish()

    def info(self) -> dict:
        m = self.model
        return {
            "page_bytes": m.page_bytes(),
            "slot_bytes": m.slot_bytes(),
            "aux_bytes": m.kv_args.aux_item_lens[0],
            "num_pages": m.pages.num_pages,
            "page_size": m.ps,
            "kv_entries": len(m.kv_args.kv_data_ptrs),
            "state_entries": len(m.kv_args.state_data_ptrs),
        }

    def device_lanes(self) -> Dict[str, str]:
        """Each linked peer's device-lane status (``Peer.device_lane``: why it is off, or
        where it is active), by peer name."""
        out: Dict[str, str] = {}
        for link in list(self.mgr.links.values()):
            peer = getattr(link.peer, "_peer", link.peer)
            out[link.name or link.key] = str(getattr(peer, "device_lane", "?"))
        return out

    def loop_cpu(self, window_s: float) -> Dict[str, float]:
        """Cores the manager's loop thread (``loop``) and this whole process (``process``)
        used over the next ``window_s`` (this thread sleeps through the window): ~0 while
        idle, since the loop sleeps in epoll between events (bench/results/quiet-cpu.md)."""
        clock = self.mgr.loop_cpu_seconds
        c0, p0, w0 = clock(), time.process_time(), time.monotonic()
        time.sleep(window_s)
        c1, p1, w1 = clock(), time.process_time(), time.monotonic()
        return {"loop": (c1 - c0) / (w1 - w0), "process": (p1 - p0) / (w1 - w0)}

    def close(self) -> None:
        self.mgr.close_background()


def build_worker(cls: type, role: str, spec: dict, bootstrap: Optional[str], opts: dict):
    """Worker process entry (:class:`kvxfer.procs.Worker`, in the child): set the process up
    for a scheduler next to a manager's loop thread, then build ``cls(role, spec, bootstrap,
    opts)`` (:class:`PDWorker` or another worker class with that constructor)."""
    import sys

    import torch

    torch.set_num_threads(1)  # no OpenMP threads starving the manager's event loop
    # the scheduler thread computes while the manager's loop thread moves data: hand the GIL
    # over often so a completion is not held up by a 5 ms switch interval
    sys.setswitchinterval(float(opts.get("switch_interval_s", 0.0005)))
    logging.basicConfig(level=opts.get("log_level", "WARNING"))
    if opts.get("busy_thread"):
        _start_busy_thread()
    return cls(role, spec, bootstrap, opts)


def _start_busy_thread() -> None:
    """A Python thread that never leaves the interpreter (``kvxfer bench pd --busy-thread``):
    the worst case of a scheduler busy in Python next to the manager's loop thread. It holds
    the GIL until the interpreter takes it away at the switch interval, so every time the
    loop thread gave the GIL up (epoll, a native call) it waits up to one interval to get it
    back."""
    import threading

    def spin() -> None:
        x = 0
        while True:
            x += 1

    threading.Thread(target=spin, name="kvxfer-busy-scheduler", daemon=True).start()
