"""``kvxfer bench pd``, on the demo's workers: the prefill/decode protocol end to end, against the raw engine.

One prefill and one decode process (the demo's workers, :mod:`kvxfer.pd_demo.worker`) with
the demo's synthetic hybrid model (page-major KV + Mamba envelope state + aux row; every
request moves its pages, one state slot and one aux row), on UCX loopback, for each engine
error mode (lane configuration). Three measurements per mode:

* **latency**: 1-page requests one at a time; decode has announced the room (metadata sent)
  and prefill's ``KVSender`` sees ``WaitingForInput``; latency = decode's ``Success`` (bytes
  visible, completion received, aux stamp checked) minus prefill's ``send()``, both on
  CLOCK_MONOTONIC. p50 / p99 over ``--latency-requests``; next to it the prefill-side p50
  (``send()`` to prefill's own ``Success``: write flushed) and the engine alone: the same
  bytes (page, state slot, aux row) by a raw ``Peer.write`` + flush, one at a time, started
  from the bench's thread as a scheduler's would be (``KVManager.submit``: as the loop's
  guest when it idles, like the PD sends).
* **throughput**: ``--throughput-requests`` 1-page requests announced by decode, all senders
  ``WaitingForInput``, then prefill sends them back to back; requests/s = requests / (last
  decode ``Success`` - first ``send()``).
* **bandwidth**: ``--large-pages``-page requests, one at a time; each is followed in the
  same loop by the *raw* engine transfer of the same bytes (``Peer.write`` of the same kv
  pages, state slot and aux row to the same destinations, no protocol) over the same
  connection. PD time = decode's ``Success`` - prefill's ``send()``; raw time = the write
  until its flush completed (bytes visible). GB/s (1 GB = 1e9 B) from the best and the median
  of ``--iters`` (after a warm-up); ratio = raw time / PD time.

With ``--integrity`` every mode runs twice in the same invocation (a fresh worker pair each),
with ``KVManager(integrity=False)`` and then ``True``, and a second table gives the check's
cost, off → on: the 1-page and prefill-side latencies, requests/s, the large request's time
and GB/s. With the check on, prefill's ``Success`` waits for decode's verdict, so the
prefill-side figures include decode's check and one message back.

With ``--prefill-page-size A --decode-page-size B --decode-prefix K`` (any of them) it measures
shapes instead (docs/shapes.md), per mode: ``--shape-tokens``-token requests one at a time,
PD time as for the bandwidth above, for two fresh worker pairs in the same run — prefill and
decode both at page size A, then decode at B — both with decode holding the first K tokens;
the rows give ops per request and GB/s of each and the ratio to the equal-page-size row.

With ``--prefill-tp N --decode-tp M`` it measures heterogeneous TP instead (docs/shapes.md),
per mode and per ``--kv-layout`` (a comma list): ``--shape-tokens``-token requests one at a
time through one worker process per TP rank, first with equal TP — ``N:N`` (as many
senders) and ``M:M`` (as many receivers; both move the same bytes) — then ``N:M``, fresh
processes each, same run; PD time =
the last decode rank's ``Success`` - the first prefill rank's ``send()`` (every prefill rank
sends at one agreed monotonic time, :meth:`BenchWorker.fire`, as the ranks of a prefill
instance finish a forward pass together; ``send_skew_us`` in the rows is the largest
spread of their sends); bytes and ops are
summed over the prefill ranks (ops per request: the RMA ops every rank posted); the ratios
are the GB/s of ``N:M`` over that of ``N:N`` and of ``M:M``. Each pair's timed requests come
after prefill's TP of warm-up rooms (:func:`tp_warm_rooms`: every salt class planned once).
The model's KV heads (``--tp-heads``) and Mamba heads split over both TP sizes. With ``--decode-page-size B`` / ``--decode-prefix K`` as well,
the three run first with equal page sizes and no prefix (the equal shape), then with the
asked shape (decode at B holding the first K tokens), and a last ratio gives each row's GB/s
over the equal shape's of the same TP sizes. With ``--tp-paths`` the ``N:M`` pair runs twice,
the kv head slices ``direct`` (``KVManager(tp_stage_min_ops=0)``: one PUT per run; host
memory on one host: the host lane's few calls) and ``staged`` (``tp_stage_min_ops=1``,
``host_copy="off"``: every slice write gathered, one PUT per chunk, scattered
by decode; layouts whose slices are already one run per page, HND, stay direct on host
memory), both without the device lane's pattern launch, and on CUDA a third time ``pattern``
(``KVManager(tp_pattern="auto")``, the default: one PatternWrite launch per kv write); on
CUDA with a shape whose tokens go as byte runs (other page sizes, an unaligned prefix) the
equal pairs of it run twice too: ``equal`` (the default: byte runs as one PatternWrite per
piece class) and ``equal-runs`` (``tp_pattern="off"``: one PUT per run).

With ``--stages`` both managers trace (``KVManager(trace=True)``, :mod:`kvxfer.disagg.trace`)
and a table per mode gives the sequential 1-page requests' stages (p50/p90/p99 µs: thread and task
hops, planning, post, flush, wake-up, notify, decode's handling, the scheduler's poll), their
sum against the end-to-end p50, the raw engine write with and without a notification (the
latter until prefill handed it to UCX and until decode's loop had it), and
``ucx_perftest`` ``ucp_put_lat`` / ``ucp_am_lat`` of the same size on loopback, run in the
same invocation (``perftest_put_lat_us`` / ``perftest_am_lat_us`` in the ``--json`` rows;
None when the libucx wheel has no ucx_perftest). A second table gives the same stages of the
large requests (``large_stages`` in the rows), with the raw write of the same bytes beside
them (its native post and its post → flush, ``raw_large_post_p50_us`` /
``raw_large_flush_p50_us``): what a large request pays over its raw write, stage by stage.

With ``--mixed N``, after the large requests, N 1-page requests go one at a time while
``--mixed-depth`` (default 2) requests of ``--large-pages`` stay in flight: the latency of
the small requests sent behind large ones, of those sent after the large ones ran out and of
the sequential ones, and how many rooms went in coalesced writes (``mixed_*`` in the rows).
``--coalesce-after 2,0`` runs every mode once per ``KVManager(coalesce_after=)`` value, so
coalescing on and off are compared in the same run.

Nothing here writes or verifies content (the demo and tests/disagg do): the numbers are the
protocol and the transfer, not the synthetic compute.
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from kvxfer import clitools
from kvxfer.disagg.manager import TP_STAGE_MIN_OPS
from kvxfer.pd_demo.run import percentile, start_pair
from kvxfer.pd_demo.spec import KV_LAYOUTS, ModelSpec
from kvxfer.pd_demo.worker import PDWorker

#: How far ahead of now the TP bench sets its ranks' common send time (s): past one command
#: round trip to every worker process
FIRE_LEAD_S = 0.02

#: Ping sequence numbers of the raw writes' notifications (above any heartbeat's)
RAW_SEQ = 1 << 40


def raw_ping_seq(payload: bytes) -> Optional[int]:
    """The seq of a raw write's notification (a ``Ping`` numbered from :data:`RAW_SEQ`), else
    None (anything else, malformed included: the receiver's own handler reports those)."""
    from kvxfer import wire
    from kvxfer.disagg.messages import Ping
    from kvxfer.errors import ProtocolError

    if Ping.TAG.encode() not in payload:  # (every PD message comes here too: no decode;
        return None  # msgpack writes the tag's UTF-8 bytes as they are)
    try:
        msg = wire.decode(payload)
    except ProtocolError:
        return None
    return msg.seq if isinstance(msg, Ping) and msg.seq >= RAW_SEQ else None


class BenchWorker(PDWorker):
    """PDWorker plus the benchmark's timing loops (run in the worker's scheduler thread)."""

    def __init__(self, role: str, spec: dict, bootstrap: str, opts: dict) -> None:
        super().__init__(role, spec, bootstrap, opts)
        self._raw_seq = RAW_SEQ
        #: cProfile of the latency runs' and the TP rows' sends ($KVXFER_BENCH_PROFILE)
        self._prof: Any = None
        #: decode: Ping seq -> monotonic_ns its arrival was handled (raw write + notify)
        self._raw_recv: Dict[int, int] = {}
        if role == "decode":
            self.mgr.engine.on_message(self._on_raw_notify)

    def _on_raw_notify(self, peer, payload: bytes) -> None:
        """Stamp a raw write's notification (the manager drops it). Runs on: the manager's
        loop thread (an engine message handler)."""
        t = time.monotonic_ns()
        seq = raw_ping_seq(payload)
        if seq is not None:
            self._raw_recv[seq] = t

    def raw_receipts(self) -> Dict[int, int]:
        """Decode: the raw notifications' arrival stamps since the last call."""
        out, self._raw_recv = self._raw_recv, {}
        return out

    # ------------------------------------------------------------------ decode
    def announce(self, rooms: List[int], n_pages: int) -> List[dict]:
        """Allocate and send metadata for ``rooms`` (no verification); returns their ids."""
        self._begin()
        out = []
        for room in rooms:
            res = self.model.alloc(n_pages)
            if res is None:
                raise RuntimeError(f"decode pool too small for {len(rooms)} x {n_pages} pages")
            self.open[room] = {"res": res, "length": n_pages * self.model.ps, "verify": False}
            self.open[room]["h"] = self._open_receiver(room, res, n_pages * self.model.ps)
            out.append(
                {"pages": [int(p) for p in res["pages"]], "slot": res["slot"], "row": res["row"]}
            )
        return out

    def settle(self) -> dict:
        return self._finish()

    def announce_tokens(self, rooms: List[int], tokens: int) -> None:
        """Allocate and send metadata for ``rooms`` of ``tokens`` tokens each (no
        verification; with a shape, our prefix and slots past the end written first)."""
        self._begin()
        for room in rooms:
            res = self.model.alloc(self.model.pages_for(tokens))
            if res is None:
                raise RuntimeError(f"decode pool too small for {len(rooms)} x {tokens} tokens")
            self.open[room] = {"res": res, "length": tokens, "verify": False}
            self.open[room]["h"] = self._open_receiver(room, res, tokens)

    # ------------------------------------------------------------------ prefill
    def _senders(self, rooms: List[int], n_pages: int) -> list:
        from kvxfer.disagg import KVPoll

        hs = []
        for room in rooms:
            res = self._alloc(n_pages)
            _host_ids(res)
            h = self._open_sender(room, n_pages * self.model.ps, res)
            self.open[room] = {"res": res, "length": n_pages * self.model.ps, "h": h}
            hs.append((room, h, res))
        end = time.monotonic() + self.deadline_s
        for _, h, _ in hs:  # a scheduler loop polling its rooms
            while h.poll() != KVPoll.WaitingForInput:
                if h.poll() == KVPoll.Failed or time.monotonic() > end:
                    raise RuntimeError(f"{h!r}: {h.failure_exception()}")
                time.sleep(0.0002)
        return hs

    def _settle(self, item: tuple) -> None:
        """Poll the room's handle once first: the scheduler seeing its terminal state (the
        ``seen`` stage of a traced room)."""
        h = self.open[item[0]].get("h")
        if h is not None:
            h.poll()
        super()._settle(item)

    def drain_trace(self) -> List[dict]:
        """The manager's stage records (``KVManager.drain_trace``)."""
        return self.mgr.drain_trace()

    def _send(self, room: int, h, res: dict) -> None:
        self.open[room]["t_send"] = time.monotonic()
        pages, slots, _ = _host_ids(res)
        h.send(pages, slots)

    def _profiler(self) -> Any:
        """The worker's cProfile when ``$KVXFER_BENCH_PROFILE`` is set (made on first use),
        else None. On Python 3.12 a profile enabled on one thread sees every thread's
        Python calls (PEP 669), so a profiled send includes the manager loop's share."""
        if os.environ.get("KVXFER_BENCH_PROFILE") and self._prof is None:
            import cProfile

            self._prof = cProfile.Profile()
        return self._prof

    def latency(self, rooms: List[int]) -> dict:
        """One 1-page request at a time (the next starts when prefill released the last),
        once decode's metadata for all of ``rooms`` arrived: the requests do not overlap
        decode announcing the batch (a send that did would wait behind that burst on decode,
        and prefill, which does not wait for decode, would queue the next ones behind it).
        With ``$KVXFER_BENCH_PROFILE`` set to a path, the sends (with direct calls: the
        request's path up to its post and the inline flush wait) run under cProfile and its
        statistics go to ``<path>.prof`` (``python3 -m pstats``)."""
        prof = self._profiler()
        self._begin()
        for room, h, res in self._senders(rooms, 1):
            if prof is not None:
                prof.enable()
            self._send(room, h, res)
            if prof is not None:
                prof.disable()
            self._settle(self._next_done(True))
        if prof is not None:  # every batch so far (the warm-up's too)
            prof.dump_stats(f"{os.environ['KVXFER_BENCH_PROFILE']}.prof")
        return self._finish()

    def throughput(self, rooms: List[int]) -> dict:
        self._begin()
        hs = self._senders(rooms, 1)
        for room, h, res in hs:
            self._send(room, h, res)
        return self._finish()

    def _raw_write(self, res: dict, dst: dict, notify: bool = False) -> tuple:
        """The engine alone: the request's kv pages, state slot and aux row written to
        decode's ``dst`` ids over the manager's connection (no protocol; with ``notify`` a
        Ping that decode's manager drops, as the notification), from this thread as a
        scheduler would (``KVManager.submit``: started here when the loop idles, as the
        PD sends are). Returns (seconds until the
        flush completed and any notification was handed to UCX, TransferStats, the Ping's
        seq or None, monotonic_ns at the start)."""
        from kvxfer.disagg.messages import Ping
        from kvxfer.engine import ItemWrite

        pages, slots, rows = _host_ids(res)
        items = [ItemWrite("kv", pages, dst["pages"])]
        if slots is not None:
            items.append(ItemWrite("state", slots, [dst["slot"]]))
        items.append(ItemWrite("aux", rows, [dst["row"]]))
        peer = next(iter(self.mgr.links.values())).peer
        seq = None
        if notify:
            seq, self._raw_seq = self._raw_seq, self._raw_seq + 1
        t0_ns = time.monotonic_ns()
        t0 = time.monotonic()
        stats = self.mgr.submit(  # as a scheduler would: started here when the loop idles
            peer.write(
                items,
                notify=None if seq is None else Ping(seq=seq).encode(),
                timeout=self.mgr.t.transfer_s,
            )
        ).result(120)
        return time.monotonic() - t0, stats, seq, t0_ns

    def large(self, room: int, n_pages: int, dst: dict) -> dict:
        """One PD request of ``n_pages`` then the raw engine write of the same bytes to the
        same destinations; returns the send time (PD) and the raw write's duration."""
        self._begin()
        ((_, h, res),) = self._senders([room], n_pages)
        self._send(room, h, res)
        self._settle(self._next_done(True))
        raw_s, stats, _, _ = self._raw_write(res, dst)
        out = self._finish()
        out.update(
            raw_s=raw_s,
            raw_bytes=int(stats.bytes),
            raw_ops=int(stats.ops),
            raw_post_s=stats.post_s,
            raw_flush_s=stats.flush_s,
        )
        return out

    def large_tokens(self, room: int, tokens: int) -> dict:
        """One PD request of ``tokens`` tokens (all its pages in one send)."""
        self._begin()
        ((_, h, res),) = self._senders([room], self.model.pages_for(tokens))
        self._send(room, h, res)
        self._settle(self._next_done(True))
        return self._finish()

    def arm_tokens(self, room: int, tokens: int) -> None:
        """Prefill: open the sender of a ``tokens``-token room until it is
        ``WaitingForInput``; :meth:`fire` sends it."""
        self._begin()
        ((_, h, res),) = self._senders([room], self.model.pages_for(tokens))
        self._armed = (room, h, res)

    def fire(self, t_at: float, timed: bool = True) -> dict:
        """Prefill: send the armed room at ``time.monotonic() >= t_at`` (the last 2 ms
        spinning), then settle it. The TP bench gives every prefill rank the same ``t_at``: the
        ranks of one prefill instance end a forward pass together, so their sends start
        together too, not a command round trip apart. ``timed=False``: a warm-up room (left
        out of ``$KVXFER_BENCH_PROFILE``'s profile)."""
        room, h, res = self._armed
        prof = self._profiler() if timed else None
        time.sleep(max(0.0, t_at - time.monotonic() - 0.002))  # the last 2 ms spinning
        while time.monotonic() < t_at:
            pass
        if prof is not None:
            prof.enable()
        self._send(room, h, res)
        self._settle(self._next_done(True))
        if prof is not None:  # every timed request so far
            prof.disable()
            prof.dump_stats(f"{os.environ['KVXFER_BENCH_PROFILE']}.{os.getpid()}.prof")
        return self._finish()

    def mixed(self, small: List[int], large: List[int], n_pages: int, depth: int) -> dict:
        """1-page requests one at a time (the next when prefill released the last) while
        ``depth`` requests of ``n_pages`` are kept in flight (a finished one replaced by the
        next of ``large`` until they run out): what large writes in flight do to a small
        request's latency (with coalescing, a small room's write may wait for one of them,
        at most ``outbox.MAX_WAIT_S``). Returns the rooms (``t_send``, ``t_done``), the
        stats, and ``busy``: per small room, the large requests in flight at its send."""
        from collections import deque

        self._begin()
        waiting = deque(self._senders(large, n_pages))
        big, inflight, busy = set(large), 0, {}
        for room, h, res in self._senders(small, 1):
            while waiting and inflight < depth:
                self._send(*waiting.popleft())
                inflight += 1
            busy[room] = inflight
            self._send(room, h, res)
            while True:  # settle until this small room is done, refilling the large ones
                item = self._next_done(True)
                self._settle(item)
                if item[0] not in big:
                    break
                inflight -= 1
                while waiting and inflight < depth:
                    self._send(*waiting.popleft())
                    inflight += 1
        out = self._finish()
        out["busy"] = busy
        return out

    def raw_small(self, room: int, dst: dict, n: int) -> dict:
        """``n`` raw engine writes of a 1-page request's bytes (one at a time), then the PD
        request itself (so decode's announced room completes)."""
        self._begin()
        ((_, h, res),) = self._senders([room], 1)
        times = [self._raw_write(res, dst)[0] for _ in range(n)]
        notified = [self._raw_write(res, dst, notify=True) for _ in range(n)]
        self._send(room, h, res)
        self._settle(self._next_done(True))
        out = self._finish()
        out.update(
            raw_times=times,
            raw_notify_times=[w[0] for w in notified],
            raw_notify_starts={w[2]: w[3] for w in notified},
        )
        return out


def _host_ids(res: dict) -> tuple:
    """A request's ids as a scheduler hands them to ``KVSender.send`` (SGLang: numpy arrays
    and ints): its pages as an int64 array, its state slot and aux row as 1-element lists
    (None: no slot); made once per request, outside the timed path. A CUDA tensor of ids
    would cost the send a synchronising device-to-host copy (``as_ids``; on CUDA pools the
    allocator's pages are such a tensor)."""
    ids = res.get("ids")
    if ids is None:
        pages = res["pages"]
        pages = pages.cpu().numpy() if hasattr(pages, "cpu") else np.asarray(pages)
        slot = None if res["slot"] is None else [int(res["slot"])]
        ids = res["ids"] = (pages.astype(np.int64, copy=False), slot, [int(res["row"])])
    return ids


#: rooms of the warm-up; rooms decode announces at once in the latency run
WARM_ROOMS, LATENCY_BATCH = 20, 50

#: the 1-page request's path, as (row label, from stamp, to stamp); prefill's stamps, then
#: decode's (``d:``) — consecutive, so the rows add up to ``seen`` - ``send``
#: (kvxfer.disagg.trace names the stamps)
STAGES = (
    ("send → loop pickup (thread hop)", "send", "loop"),
    ("page map (plan)", "loop", "plan"),
    ("room → write call (state, items, notify encode)", "plan", "write"),
    ("engine plan (Peer.write called → post starts)", "write", "planned"),
    ("native post (+ device launch)", "planned", "posted"),
    # a chained write (kvxfer.engine.notes) sends the notify from the flush's completion:
    # decode may have it before prefill's loop resumes, so the path goes post -> receipt
    ("flush + notify → arrives at decode (cross-process, native)", "posted", "d:arrived"),
    ("decode's loop takes it (native arrival → Done decoded)", "d:arrived", "d:recv"),
    ("protocol handling (→ Success)", "d:recv", "d:handled"),
    ("scheduler sees Success (poll)", "d:handled", "d:seen"),
)
#: prefill's own stamps after the post, beside the path (they overlap the receipt)
SIDE_STAGES = (
    ("flush (+ chained notify): post → UCX reports it", "posted", "flushed"),
    ("completion wake-up (loop resumes)", "flushed", "woken"),
    ("notify send (woken → handed to UCX; 0 when chained)", "woken", "notified"),
)


def stage_table(prefill: List[dict], decode: List[dict], rooms: List[int]) -> dict:
    """Per stage, p50/p90/p99 µs over ``rooms`` from both sides' trace records; ``sum_p50_us``
    over the path's stages and ``path_p50_us`` (``seen`` - ``send``) beside them."""
    p = {r["room"]: r for r in prefill}
    d = {r["room"]: {f"d:{k}": v for k, v in r.items()} for r in decode}
    for x in d.values():  # a Done not delivered inline from its notification: no native
        if "d:recv" in x:  # arrival stamp, the receipt counts as the arrival
            x.setdefault("d:arrived", x["d:recv"])
    recs = [dict(p[r], **d[r]) for r in rooms if r in p and r in d]
    rows = []
    for name, a, b in STAGES + SIDE_STAGES:
        xs = [(x[b] - x[a]) / 1e3 for x in recs if a in x and b in x]
        rows.append(
            {
                "stage": name,
                "n": len(xs),
                "p50_us": percentile(xs, 50) if xs else float("nan"),
                "p90_us": percentile(xs, 90) if xs else float("nan"),
                "p99_us": percentile(xs, 99) if xs else float("nan"),
                "on_path": (name, a, b) in STAGES,
            }
        )
    path = [(x["d:seen"] - x["send"]) / 1e3 for x in recs if "d:seen" in x and "send" in x]
    return {
        "rows": rows,
        "requests": len(recs),
        "sum_p50_us": sum(r["p50_us"] for r in rows if r["on_path"]),
        "path_p50_us": percentile(path, 50) if path else float("nan"),
        "path_p99_us": percentile(path, 99) if path else float("nan"),
    }


def perftest_lat(test: str, size: int, device: str) -> Optional[float]:
    """``ucx_perftest -t test`` (ucp_put_lat / ucp_am_lat: half a ping-pong) of ``size`` bytes
    on loopback, memory on ``device`` (cpu: host, else cuda); its p50 µs, or None when the
    libucx wheel's ucx_perftest is missing or fails."""
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError:
        return None
    root = os.path.dirname(libucx.__file__)
    exe = os.path.join(root, "bin", "ucx_perftest")
    if not os.path.exists(exe):
        return None
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(root, "lib"), UCX_WARN_UNUSED_ENV_VARS="n")
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    mem = [] if device == "cpu" else ["-m", "cuda,cuda"]
    srv = subprocess.Popen(
        [exe, "-p", str(port), *mem],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1.0)  # the server listens
        cmd = [exe, "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size)]
        cmd += ["-n", "2000", "-w", "100", "-f", *mem]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None
    finally:
        srv.kill()
        srv.wait()
    rows = [ln.split() for ln in res.stdout.splitlines() if re.match(r"^\s+\d+\s+[\d.]+\s", ln)]
    return float(rows[-1][1]) if rows else None


def format_stages(rows: List[dict]) -> str:
    """One table per mode: the stages of the sequential 1-page requests, with the
    end-to-end p50, the raw engine write (+ notify) and ucx_perftest beside them."""
    out = []
    for r in rows:
        st = r.get("stages")
        if not st:
            continue
        label = r["mode"] + (", integrity" if r.get("integrity") else "")
        out += [
            f"\n{','.join(r['lanes'])} ({label}), {st['requests']} sequential 1-page requests "
            f"({r['request_bytes_1page']} B):\n",
        ]
        out += _stage_rows(st)
        pt = [r.get("perftest_put_lat_us"), r.get("perftest_am_lat_us")]
        floor = "n/a" if None in pt else f"{pt[0]:.1f} + {pt[1]:.1f} = {pt[0] + pt[1]:.1f}"
        out += [
            f"| **sum of the path's p50s** | {st['sum_p50_us']:.1f} | | |",
            f"| path (decode poll sees Success − prefill send) | {st['path_p50_us']:.1f} | "
            f"| {st.get('path_p99_us', float('nan')):.1f} |",
            f"| end-to-end p50 (decode on_done − prefill send) | {r['p50_us']:.1f} | | {r['p99_us']:.1f} |",
            f"| raw engine write p50 (no notify) | {r['raw_p50_us']:.1f} | | {r['raw_p99_us']:.1f} |",
            f"| raw engine write + notify p50 (notify handed to UCX) "
            f"| {r['raw_notify_p50_us']:.1f} | | {r['raw_notify_p99_us']:.1f} |",
            f"| raw engine write + notify p50, until decode's handler has it "
            f"| {r['raw_receipt_p50_us']:.1f} | | |",
            f"| ucx_perftest ucp_put_lat + ucp_am_lat p50 (same size, loopback) | {floor} | | |",
            f"| prefill calls run as the loop's guest per request (≤ 3), sequential / "
            f"concurrent | {r.get('direct_calls_1page', float('nan')):.2f} / "
            f"{r.get('direct_calls_tput', float('nan')):.2f} | | |",
            f"| … of them, sequential, after which prefill's loop had to be woken "
            f"| {r.get('guest_wakes_1page', float('nan')):.2f} | | |",
            f"| decode polls that took the Done themselves per request (--poll-scheduler) "
            f"| {r.get('poll_takes_1page', float('nan')):.2f} | | |",
            f"| receipts handled on the native receive thread per request, decode / prefill "
            f"| {r.get('native_takes_1page', float('nan')):.2f} / "
            f"{r.get('p_native_takes_1page', float('nan')):.2f} | | |",
            f"| prefill writes per request, concurrent (rooms per coalesced write) "
            f"| {r.get('tput_writes_per_req', float('nan')):.3f} "
            f"({r.get('tput_rooms_per_coalesced', float('nan')):.1f}); "
            f"of them started without an inline wait (a burst): "
            f"{r.get('tput_burst_writes', 0)} | | |",
        ]
        out += _large_stage_lines(r)
    return "\n".join(out)


def _stage_rows(st: dict) -> List[str]:
    """A stage table's header and one row per stage (those off the path in parentheses)."""
    out = ["| stage | p50 µs | p90 µs | p99 µs |", "|---|---|---|---|"]
    for s in st["rows"]:
        name = s["stage"] if s["on_path"] else f"({s['stage']}, off the path)"
        p99 = s.get("p99_us", float("nan"))
        out.append(f"| {name} | {s['p50_us']:.1f} | {s['p90_us']:.1f} | {p99:.1f} |")
    return out


def _large_stage_lines(r: dict) -> List[str]:
    """The stages of the large requests (same names as the 1-page table), with the raw
    write of the same bytes (its post and its flush) beside them."""
    st = r.get("large_stages")
    if not st:
        return []
    out = [
        f"\nthe same run's {st['requests']} requests of {r['large_pages']} pages "
        f"({r['large_bytes'] / 2**20:.1f} MiB, {r['large_ops']} ops):\n",
    ]
    out += _stage_rows(st)
    out += [
        f"| **sum of the path's p50s** | {st['sum_p50_us']:.1f} | | |",
        f"| path (decode poll sees Success − prefill send) | {st['path_p50_us']:.1f} | | |",
        f"| end-to-end median (decode on_done − prefill send) | {r['pd_us_median']:.1f} | | |",
        f"| raw engine write median (no notify) | {r['large_bytes'] / r['raw_gbps_median'] / 1e3:.1f}"
        " | | |",
        f"| raw write: native post p50 / post → flush reported p50 "
        f"| {r['raw_large_post_p50_us']:.1f} / {r['raw_large_flush_p50_us']:.1f} | | |",
    ]
    return out


def _ids(start: int, n: int) -> List[int]:
    return list(range(start, start + n))


def mixed_large_rooms(args) -> int:
    """Large requests the mixed phase needs (``--mixed``): enough to keep ``--mixed-depth``
    of them in flight while its small requests go, each a few times the small one."""
    return 0 if not args.mixed else max(2 * args.mixed_depth, args.mixed // 4)


def bench_mode(args, mode: str, integrity: bool = False, coalesce: Optional[int] = None) -> dict:
    # every room announced at once holds a state slot and an aux row: the warm-up's, a
    # latency batch's or the throughput run's, whichever is most
    rooms_at_once = max(WARM_ROOMS, LATENCY_BATCH, args.throughput_requests)
    mixed_large = mixed_large_rooms(args)
    rooms_at_once = max(rooms_at_once, args.mixed + mixed_large)
    pool_pages = max(
        4096, 2 * args.large_pages + 64, mixed_large * args.large_pages + args.mixed + 64
    )
    spec = ModelSpec(
        pool_tokens=pool_pages * 16,
        mamba_slots=rooms_at_once + 8,
        aux_rows=rooms_at_once + 8,
        device=args.device,
    )
    opts = {
        "error_mode": mode,
        "deadline_s": 120.0,
        "max_inflight": 1 << 30,
        "integrity": integrity,
        "trace": True if args.stages else None,
        "busy_thread": bool(getattr(args, "busy_thread", False)),
        "poll_scheduler": getattr(args, "poll_scheduler", None),
        "decode_post_capture": bool(getattr(args, "decode_post_capture", False)),
    }
    if coalesce is not None:
        opts["coalesce_after"] = coalesce
    if getattr(args, "switch_interval", None) is not None:
        opts["switch_interval_s"] = args.switch_interval
    pair = start_pair(spec, opts, BenchWorker)
    info = pair.prefill.info()
    out = {
        "mode": mode,
        "integrity": integrity,
        "coalesce_after": coalesce,
        "page_bytes": info["page_bytes"],
        "request_bytes_1page": info["page_bytes"] + info["slot_bytes"] + info["aux_bytes"],
    }
    try:
        # warm-up: connect, and run the code paths once
        warm = _ids(1, WARM_ROOMS)
        pair.decode.announce(warm, 1)
        pair.both((pair.prefill.latency, warm), (pair.decode.settle,))
        if args.stages:  # only the latency requests' records
            pair.prefill.drain_trace()
            pair.decode.drain_trace()
        # latency: decode announces a batch ahead of prefill (prefill holds announced rooms
        # only bootstrap_s before its KVSender must exist), prefill sends one at a time
        rooms = _ids(1000, args.latency_requests)
        p_rooms, d_rooms, ops, direct, lat_coalesced, takes = {}, {}, 0, 0, 0, 0
        native = p_native = 0
        wakes = bursts = 0
        for lo in range(0, len(rooms), LATENCY_BATCH):
            batch = rooms[lo : lo + LATENCY_BATCH]
            pair.decode.announce(batch, 1)
            p, d = pair.both((pair.prefill.latency, batch), (pair.decode.settle,))
            p_rooms.update(p["rooms"])
            d_rooms.update(d["rooms"])
            ops += p["stats"]["ops"]
            direct += p["stats"].get("direct_calls", 0)
            wakes += p["stats"].get("guest_wakes", 0)
            lat_coalesced += p["stats"].get("coalesced_rooms", 0)
            bursts += p["stats"].get("burst_writes", 0)
            takes += d["stats"].get("poll_takes", 0)
            native += d["stats"].get("native_takes", 0)
            p_native += p["stats"].get("native_takes", 0)
        ok = [r for r in rooms if d_rooms[r]["state"] == "Success"]
        lat = [(d_rooms[r]["t_done"] - p_rooms[r]["t_send"]) * 1e6 for r in ok]
        p_lat = [(p_rooms[r]["t_done"] - p_rooms[r]["t_send"]) * 1e6 for r in ok]
        out.update(
            lat_ok=len(lat),
            lat_n=len(rooms),
            p50_us=percentile(lat, 50),
            p99_us=percentile(lat, 99),
            prefill_p50_us=percentile(p_lat, 50),
            ops_1page=ops / len(rooms),
            # prefill's calls that ran as its loop's guest, per request (its adoption, init
            # and send: at most 3)
            direct_calls_1page=direct / len(rooms),
            # of them, those after which prefill's loop had to be woken (LoopThread.run_here)
            guest_wakes_1page=wakes / len(rooms),
            # decode's polls that handled an arrived Done themselves (KVManager.take_arrived:
            # only with --poll-scheduler), per request
            poll_takes_1page=takes / len(rooms),
            # receipts handled by the native receive thread as the loop's guest
            # (KVManager.take_natively), per request: decode's (its Done), prefill's (its
            # flush completions: none when the write ended inline)
            native_takes_1page=native / len(rooms),
            p_native_takes_1page=p_native / len(rooms),
            # sequential requests that went in a coalesced write (should be none)
            lat_coalesced_rooms=lat_coalesced,
            # ... or started without an inline wait as a burst's (should be none)
            lat_burst_writes=bursts,
            lanes=p["stats"]["lanes"],
        )
        if args.stages:
            out["stages"] = stage_table(pair.prefill.drain_trace(), pair.decode.drain_trace(), ok)
        dst = pair.decode.announce([999], 1)[0]
        p, _ = pair.both(
            (pair.prefill.raw_small, 999, dst, args.latency_requests), (pair.decode.settle,)
        )
        raw = [t * 1e6 for t in p["raw_times"]]
        raw_n = [t * 1e6 for t in p["raw_notify_times"]]
        got = pair.decode.raw_receipts()
        starts = p["raw_notify_starts"]
        raw_rx = [(got[q] - t0) / 1e3 for q, t0 in starts.items() if q in got]
        out.update(
            raw_p50_us=percentile(raw, 50),
            raw_p99_us=percentile(raw, 99),
            raw_notify_p50_us=percentile(raw_n, 50),
            raw_notify_p99_us=percentile(raw_n, 99),
            raw_receipt_p50_us=percentile(raw_rx, 50) if raw_rx else float("nan"),
        )
        if args.stages:
            size = out["request_bytes_1page"]
            out["perftest_put_lat_us"] = perftest_lat("ucp_put_lat", size, args.device)
            out["perftest_am_lat_us"] = perftest_lat("ucp_am_lat", size, args.device)
        # throughput
        rooms = _ids(100000, args.throughput_requests)
        pair.decode.announce(rooms, 1)
        p, d = pair.both((pair.prefill.throughput, rooms), (pair.decode.settle,))
        ok = [r for r in rooms if d["rooms"][r]["state"] == "Success"]
        span = max(d["rooms"][r]["t_done"] for r in ok) - min(p["rooms"][r]["t_send"] for r in ok)
        out.update(
            tput_ok=len(ok),
            tput_n=len(rooms),
            req_per_s=len(ok) / span,
            # the scheduler's send loop alone (first to last send) and prefill's last Success
            tput_sends_s=max(p["rooms"][r]["t_send"] for r in ok)
            - min(p["rooms"][r]["t_send"] for r in ok),
            tput_prefill_s=max(p["rooms"][r]["t_done"] for r in ok)
            - min(p["rooms"][r]["t_send"] for r in ok),
            direct_calls_tput=p["stats"].get("direct_calls", 0) / len(rooms),
            # prefill's writes per request and rooms per coalesced write (kvxfer.disagg.coalesce)
            tput_writes_per_req=p["stats"].get("writes", 0) / len(rooms),
            tput_rooms_per_coalesced=p["stats"].get("coalesced_rooms", 0)
            / max(1, p["stats"].get("coalesced_writes", 0)),
            # of them, started with no inline wait: a burst's (kvxfer.disagg.bursts)
            tput_burst_writes=p["stats"].get("burst_writes", 0),
        )
        # bandwidth vs raw
        if args.stages:  # only the large requests' records
            pair.prefill.drain_trace()
            pair.decode.drain_trace()
        pd_s, pf_s, raw_s, nbytes, ops = [], [], [], 0, 0
        raw_post, raw_flush, large_rooms = [], [], []
        for i in range(args.iters + 1):
            room = 10**6 + i
            dst = pair.decode.announce([room], args.large_pages)[0]
            p, d = pair.both(
                (pair.prefill.large, room, args.large_pages, dst), (pair.decode.settle,)
            )
            if d["rooms"][room]["state"] != "Success":
                raise RuntimeError(f"large request failed: {d['rooms'][room]}")
            nbytes, ops = p["stats"]["bytes"], p["stats"]["ops"]
            if p["raw_bytes"] != nbytes:
                raise RuntimeError(f"raw write moved {p['raw_bytes']} B, PD {nbytes} B")
            if i:  # i == 0: warm-up
                pd_s.append(d["rooms"][room]["t_done"] - p["rooms"][room]["t_send"])
                pf_s.append(p["rooms"][room]["t_done"] - p["rooms"][room]["t_send"])
                raw_s.append(p["raw_s"])
                raw_post.append(p["raw_post_s"] * 1e6)
                raw_flush.append(p["raw_flush_s"] * 1e6)
                large_rooms.append(room)
        out.update(
            large_pages=args.large_pages,
            large_bytes=nbytes,
            large_ops=ops,
            pd_gbps_best=nbytes / min(pd_s) / 1e9,
            pd_gbps_median=nbytes / statistics.median(pd_s) / 1e9,
            pd_us_median=statistics.median(pd_s) * 1e6,
            pd_prefill_us_median=statistics.median(pf_s) * 1e6,
            pd_prefill_gbps_median=nbytes / statistics.median(pf_s) / 1e9,
            raw_gbps_best=nbytes / min(raw_s) / 1e9,
            raw_gbps_median=nbytes / statistics.median(raw_s) / 1e9,
            ratio_best=min(raw_s) / min(pd_s),
            ratio_median=statistics.median(raw_s) / statistics.median(pd_s),
        )
        if args.stages:
            out["large_stages"] = stage_table(
                pair.prefill.drain_trace(), pair.decode.drain_trace(), large_rooms
            )
            out["raw_large_post_p50_us"] = percentile(raw_post, 50)
            out["raw_large_flush_p50_us"] = percentile(raw_flush, 50)
        if args.mixed:
            out.update(bench_mixed(args, pair, mixed_large))
    finally:
        pair.close()
    return out


def bench_mixed(args, pair, n_large: int) -> dict:
    """The mixed phase (``--mixed``): 1-page requests one at a time while ``--mixed-depth``
    large requests are in flight (:meth:`BenchWorker.mixed`); their latency (decode
    ``on_done`` - prefill send) beside the sequential 1-page requests' of the same run, and
    how many of them went in a coalesced write."""
    small = _ids(2 * 10**6, args.mixed)
    large = _ids(3 * 10**6, n_large)
    pair.decode.announce(large, args.large_pages)
    pair.decode.announce(small, 1)
    p, d = pair.both(
        (pair.prefill.mixed, small, large, args.large_pages, args.mixed_depth),
        (pair.decode.settle,),
    )
    bad = [r for r in small + large if d["rooms"][r]["state"] != "Success"]
    if bad:
        raise RuntimeError(f"mixed phase: {len(bad)} rooms failed, e.g. {d['rooms'][bad[0]]}")
    lat = {r: (d["rooms"][r]["t_done"] - p["rooms"][r]["t_send"]) * 1e6 for r in small}
    behind = [lat[r] for r in small if p["busy"][r] > 0]  # sent with large ones in flight
    free = [lat[r] for r in small if p["busy"][r] == 0]  # (after the large ones ran out)
    return {
        "mixed_n": len(small),
        "mixed_depth": args.mixed_depth,
        "mixed_large": n_large,
        "mixed_behind": len(behind),
        "mixed_p50_us": percentile(behind, 50) if behind else float("nan"),
        "mixed_p90_us": percentile(behind, 90) if behind else float("nan"),
        "mixed_p99_us": percentile(behind, 99) if behind else float("nan"),
        "mixed_max_us": max(behind, default=float("nan")),
        "mixed_free_p50_us": percentile(free, 50) if free else float("nan"),
        "mixed_coalesced_rooms": p["stats"].get("coalesced_rooms", 0),
        "mixed_coalesced_writes": p["stats"].get("coalesced_writes", 0),
    }


def format_mixed(rows: List[dict]) -> str:
    """One line per row with a mixed phase: the latency of the small requests sent while
    large ones were in flight, of the others (sent after the large ones ran out), and of
    the same run's sequential 1-page requests."""
    lines = [
        "| lanes (mode) | coalesce_after | large in flight (pages) | small requests (sent "
        "behind large ones) | behind: p50 / p90 / p99 / max µs | the others' p50 µs "
        "| sequential p50 / p99 µs | rooms coalesced, small and large (writes) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "mixed_n" not in r:
            continue
        co = r["coalesce_after"]
        lines.append(
            f"| {','.join(r['lanes'])} ({r['mode']}) | {'default' if co is None else co} "
            f"| {r['mixed_depth']} ({r['large_pages']}) | {r['mixed_n']} ({r['mixed_behind']}) "
            f"| {r['mixed_p50_us']:.0f} / {r['mixed_p90_us']:.0f} / {r['mixed_p99_us']:.0f} / "
            f"{r['mixed_max_us']:.0f} | {r['mixed_free_p50_us']:.0f} "
            f"| {r['p50_us']:.0f} / {r['p99_us']:.0f} "
            f"| {r['mixed_coalesced_rooms']} ({r['mixed_coalesced_writes']}) |"
        )
    return "\n".join(lines)


def bench_shapes(args, mode: str) -> List[dict]:
    """Equal page sizes, then decode's own page size, same requests and prefix (module doc)."""
    ps = args.prefill_page_size or ModelSpec().page_size
    dps, k, tokens = args.decode_page_size or ps, args.decode_prefix, args.shape_tokens
    unit = max(ps, dps)
    pool = (-(-(2 * tokens) // unit) + 4) * unit
    rows = []
    for d_ps in dict.fromkeys((ps, dps)):
        spec = ModelSpec(
            kv_layout=args.kv_layout, page_size=ps, pool_tokens=pool, device=args.device
        )
        opts = {
            "error_mode": mode,
            "deadline_s": 120.0,
            "max_inflight": 1 << 30,
            "decode_page_size": d_ps if d_ps != ps else None,
            "decode_prefix": k,
        }
        pair = start_pair(spec, opts, BenchWorker)
        try:
            times, nbytes, ops, lanes = [], 0, 0, []
            for i in range(args.iters + 1):
                room = 10**6 + i
                pair.decode.announce_tokens([room], tokens)
                p, d = pair.both((pair.prefill.large_tokens, room, tokens), (pair.decode.settle,))
                if d["rooms"][room]["state"] != "Success":
                    raise RuntimeError(f"request failed: {d['rooms'][room]}")
                nbytes, ops, lanes = p["stats"]["bytes"], p["stats"]["ops"], p["stats"]["lanes"]
                if i:  # i == 0: warm-up (connects)
                    times.append(d["rooms"][room]["t_done"] - p["rooms"][room]["t_send"])
        finally:
            pair.close()
        rows.append(
            {
                "mode": mode,
                "lanes": lanes,
                "kv_layout": args.kv_layout,
                "prefill_page_size": ps,
                "decode_page_size": d_ps,
                "decode_prefix": k,
                "tokens": tokens,
                "bytes": nbytes,
                "ops": ops,
                "us_median": statistics.median(times) * 1e6,
                "gbps_best": nbytes / min(times) / 1e9,
                "gbps_median": nbytes / statistics.median(times) / 1e9,
            }
        )
    return rows


def tp_run_list(
    tp_p: int, tp_d: int, ps: int, dps: int, k: int, *, paths: bool, cuda: bool
) -> List[Tuple[Tuple[int, int], Tuple[int, int], Optional[str]]]:
    """:func:`bench_tp`'s worker pairs in order, as ``((prefill tp, decode tp), (decode page
    size, decode prefix), path)``: the equal shape (page ``ps``, no prefix), then the asked
    one (``dps``, ``k``) if it differs; per shape ``N:N``, ``M:M``, ``N:M``. Path None: the
    defaults. ``paths`` (--tp-paths): ``N:M`` as ``direct`` and ``staged``, on CUDA also
    ``pattern``; on CUDA a shape whose tokens go as byte runs (``dps != ps`` or ``k`` not a
    multiple of ``ps``) runs its equal pairs once more as ``equal-runs`` (no pattern
    launch). Every row a ratio refers to comes before it (:func:`format_tp_row`)."""
    hetero: Tuple[Optional[str], ...] = (None,)
    if paths:  # pattern: the device lane's, CUDA only
        hetero = ("direct", "staged") + (("pattern",) if cuda else ())
    out: List[Tuple[Tuple[int, int], Tuple[int, int], Optional[str]]] = []
    for shape in dict.fromkeys(((ps, 0), (dps, k))):
        by_runs = shape[0] != ps or shape[1] % ps != 0
        equal: Tuple[Optional[str], ...] = (None,)
        if paths and cuda and by_runs:
            equal = (None, "equal-runs")
        for pair_tp in dict.fromkeys(((tp_p, tp_p), (tp_d, tp_d), (tp_p, tp_d))):
            for path in hetero if pair_tp[0] != pair_tp[1] else equal:
                out.append((pair_tp, shape, path))
    return out


def bench_tp(
    args, mode: str, kv_layout: str, on_row: Optional[Callable[[dict], None]] = None
) -> List[dict]:
    """Equal TP (prefill's size, then decode's, on both sides), then the asked
    prefill:decode ratio, same requests (module doc). ``on_row(row)`` as each pair is done
    (every row comes after the rows its ratios refer to: :func:`format_tp_row`)."""
    tp_p, tp_d, tokens = args.prefill_tp, args.decode_tp, args.shape_tokens
    ps = args.prefill_page_size or ModelSpec().page_size
    dps, k = args.decode_page_size or ps, args.decode_prefix
    unit = max(ps, dps)
    pool = (-(-(2 * tokens) // unit) + 4) * unit
    rows = []
    # the equal shape first (equal page sizes, no prefix), then the asked one, if it differs;
    runs = tp_run_list(
        tp_p,
        tp_d,
        ps,
        dps,
        k,
        paths=getattr(args, "tp_paths", False),
        cuda=args.device.startswith("cuda"),
    )
    for pair_tp, (d_ps, kk), path in runs:
        spec = ModelSpec(
            kv_layout=kv_layout,
            heads=args.tp_heads,
            ssm_heads=args.tp_heads,
            page_size=ps,
            pool_tokens=pool,
            device=args.device,
        )
        opts: Dict[str, Any] = {
            "error_mode": mode,
            "deadline_s": 120.0,
            "max_inflight": 1 << 30,
            "decode_page_size": d_ps if d_ps != ps else None,
            "decode_prefix": kk,
            "poll_scheduler": getattr(args, "poll_scheduler", None),
            "busy_thread": bool(getattr(args, "busy_thread", False)),
        }
        if path is not None:  # direct: never staged; staged: every slice write staged;
            # pattern: one device-lane launch per write (the others, equal-runs too, without)
            opts["tp_stage_min_ops"] = {"direct": 0, "staged": 1}.get(path, TP_STAGE_MIN_OPS)
            opts["tp_pattern"] = "auto" if path == "pattern" else "off"
            if path == "staged":  # else host memory on one host goes direct (the host lane)
                opts["host_copy"] = "off"
        if getattr(args, "stages", False):
            opts["trace"] = True
        t_start = time.perf_counter()
        pair = start_pair(spec, opts, BenchWorker, *pair_tp)
        t_up = time.perf_counter()
        stages: Dict[str, float] = {}
        try:
            times, p_times, skews, nbytes, ops, lanes = [], [], [], 0, 0, []
            warm = tp_warm_rooms(pair_tp[0])
            for i in range(warm + args.iters):
                room = 10**6 + i
                pair.each(None, ("announce_tokens", [room], tokens))
                pair.each(("arm_tokens", room, tokens), None)
                p, d = pair.each(("fire", time.monotonic() + FIRE_LEAD_S, i >= warm), ("settle",))
                bad = [x["rooms"][room] for x in d if x["rooms"][room]["state"] != "Success"]
                if bad:
                    raise RuntimeError(f"request failed: {bad[0]}")
                nbytes = sum(x["stats"]["bytes"] for x in p)
                ops = sum(x["stats"]["ops"] for x in p)
                lanes = sorted({ln for x in p for ln in x["stats"]["lanes"]})
                if i >= warm:
                    sends = [x["rooms"][room]["t_send"] for x in p]
                    times.append(max(x["rooms"][room]["t_done"] for x in d) - min(sends))
                    # prefill's side: every prefill rank's scheduler saw its room succeed
                    p_times.append(max(x["rooms"][room]["t_done"] for x in p) - min(sends))
                    skews.append(max(sends) - min(sends))
            if "trace" in opts:
                stages = tp_stages(
                    [x.drain_trace() for x in pair.prefills],
                    [x.drain_trace() for x in pair.decodes],
                    [10**6 + i for i in range(warm, warm + args.iters)],
                )
        finally:
            t_req = time.perf_counter()
            pair.close()
        row = {
            "mode": mode,
            "lanes": lanes,
            "kv_layout": kv_layout,
            "prefill_tp": pair_tp[0],
            "decode_tp": pair_tp[1],
            "path": path or ("equal" if pair_tp[0] == pair_tp[1] else "default"),
            "prefill_page_size": ps,
            "decode_page_size": d_ps,
            "decode_prefix": kk,
            "tokens": tokens,
            "bytes": nbytes,
            "ops": ops,
            "us_median": statistics.median(times) * 1e6,
            "prefill_us_median": statistics.median(p_times) * 1e6,
            "gbps_best": nbytes / min(times) / 1e9,
            "gbps_median": nbytes / statistics.median(times) / 1e9,
            # prefill ranks' send() spread (fire(): one start time for all), max over requests
            "send_skew_us": max(skews) * 1e6,
            # where the run's wall time went (most of it: starting the worker processes)
            "workers_up_s": t_up - t_start,
            "requests_s": t_req - t_up,
            "close_s": time.perf_counter() - t_req,
        }
        if stages:
            row["stages"] = stages
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def tp_warm_rooms(prefill_tp: int) -> int:
    """Warm-up rooms of a TP row: the first connects; ``prefill_tp`` consecutive rooms plan
    every salt class of a heterogeneous pair once (``tp_plan.salt_period`` divides it), so
    the timed rooms measure a server's steady state, not each class's first room."""
    return max(1, int(prefill_tp))


def tp_stages(prefill: List[List[dict]], decode: List[List[dict]], rooms: List[int]) -> dict:
    """Per stage of every rank's trace records (``prefill[r]`` / ``decode[r]``: a rank's
    drained records), the p50 over ``rooms`` of its time after the room's first prefill
    ``send``, µs; keys ``p<rank>.<stage>`` / ``d<rank>.<stage>``, a room's further records
    on a rank (its legs) as ``p<rank>.leg<i>.<stage>``, and the latest ``notified`` /
    ``recv`` of a rank's legs as ``p<rank>.last_notified`` / ``d<rank>.last_recv``. Rooms
    without a ``send`` stamp are left out."""
    per: Dict[str, List[float]] = {}
    for room in rooms:
        recs = []
        for side, ranks in (("p", prefill), ("d", decode)):
            for rank, records in enumerate(ranks):
                mine = [x for x in records if x.get("room") == room]
                for i, rec in enumerate(mine):
                    recs.append((f"{side}{rank}" + (f".leg{i}" if i else ""), rec))
        sends = [rec["send"] for _, rec in recs if isinstance(rec.get("send"), int)]
        if not sends:
            continue
        t0 = min(sends)
        last: Dict[str, int] = {}  # a rank's latest leg notify / receipt of the room
        for who, rec in recs:
            for stage, t in rec.items():
                if stage not in ("room", "role") and isinstance(t, int) and t >= t0:
                    per.setdefault(f"{who}.{stage}", []).append((t - t0) / 1e3)
                    if ".leg" in who and stage in ("notified", "recv"):
                        k = f"{who.split('.')[0]}.last_{stage}"
                        last[k] = max(last.get(k, t), t)
        for k, t in last.items():
            per.setdefault(k, []).append((t - t0) / 1e3)
    return {
        k: statistics.median(v)
        for k, v in sorted(per.items(), key=lambda kv: statistics.median(kv[1]))
    }


def format_tp_stages(rows: List[dict]) -> str:
    """One line per row with stages (``--stages``): each rank's stage p50s after the first
    prefill send, in time order."""
    out = []
    for r in rows:
        st = r.get("stages")
        if not st:
            continue
        cells = ", ".join(f"{k} {v:.0f}" for k, v in st.items())
        out.append(
            f"- {r['kv_layout']} {r['prefill_tp']} → {r['decode_tp']} ({r['path']}), "
            f"µs after the first send, p50: {cells}"
        )
    return "\n".join(out)


TP_HEADER = (
    "| lanes (mode) | KV layout | prefill TP → decode TP | path | page prefill → decode "
    "| decode prefix | tokens | MiB | ops/request | µs median | prefill-side µs median "
    "| GB/s best (median) | × N:N (median) | × M:M (median) | × equal shape (median) "
    "| send skew µs (max) | s: workers up / requests |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_tp(rows: List[dict]) -> str:
    """The table of :func:`format_tp_row` rows under :data:`TP_HEADER`."""
    return "\n".join([TP_HEADER] + [format_tp_row(r, rows) for r in rows])


def format_tp_row(r: dict, rows: List[dict]) -> str:
    """One row; ratios against ``rows`` (those of the run so far are enough: bench_tp runs
    the rows a ratio refers to first): against equal TP of the same page sizes and prefix
    (``N:N``, ``M:M``) and against the same TP sizes with equal page sizes and no prefix
    (the equal shape)."""

    def shape(r: dict) -> tuple:
        return (r.get("decode_page_size", 0), r.get("decode_prefix", 0))

    def ratio(r: dict, b: Optional[float]) -> float:
        return r["gbps_median"] / b if b else float("nan")

    gbps = {
        (r["mode"], r["kv_layout"], r["prefill_tp"], r["decode_tp"], shape(r), r.get("path")): r[
            "gbps_median"
        ]
        for r in rows
    }
    key = (r["mode"], r["kv_layout"])
    ratios = [
        ratio(r, gbps.get((*key, t, t, shape(r), "equal")))
        for t in (r["prefill_tp"], r["decode_tp"])
    ]
    equal = (r.get("prefill_page_size", 0), 0)
    path = "equal" if r.get("path") == "equal-runs" else r.get("path")  # (against the default)
    same = (*key, r["prefill_tp"], r["decode_tp"], equal, path)
    ratios.append(ratio(r, gbps.get(same)))
    return (
        f"| {','.join(r['lanes'])} ({r['mode']}) | {r['kv_layout']} | "
        f"{r['prefill_tp']} → {r['decode_tp']} | {r.get('path', '')} | "
        f"{r.get('prefill_page_size')} → {r.get('decode_page_size')} | "
        f"{r.get('decode_prefix', 0)} | {r['tokens']} | "
        f"{r['bytes'] / 2**20:.1f} | {r['ops']} | {r['us_median']:.0f} | "
        f"{r.get('prefill_us_median', float('nan')):.0f} | "
        f"{r['gbps_best']:.2f} ({r['gbps_median']:.2f}) | {ratios[0]:.2f} | "
        f"{ratios[1]:.2f} | {ratios[2]:.2f} | {r.get('send_skew_us', float('nan')):.0f} | "
        f"{r.get('workers_up_s', float('nan')):.1f} / {r.get('requests_s', float('nan')):.1f} |"
    )


def format_shapes(rows: List[dict]) -> str:
    lines = [
        "| lanes (mode) | KV layout | prefill → decode page | decode prefix | tokens | MiB | ops/request "
        "| µs median | GB/s best (median) | × equal pages (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {}
    for r in rows:
        if r["prefill_page_size"] == r["decode_page_size"]:
            base[r["mode"], r["kv_layout"]] = r["gbps_median"]
        key = (r["mode"], r["kv_layout"])
        ratio = r["gbps_median"] / base[key] if key in base else float("nan")
        lines.append(
            f"| {','.join(r['lanes'])} ({r['mode']}) | {r['kv_layout']} | "
            f"{r['prefill_page_size']} → "
            f"{r['decode_page_size']} | {r['decode_prefix']} | {r['tokens']} | "
            f"{r['bytes'] / 2**20:.1f} | {r['ops']} | {r['us_median']:.0f} | "
            f"{r['gbps_best']:.2f} ({r['gbps_median']:.2f}) | {ratio:.2f} |"
        )
    return "\n".join(lines)


def format_rows(rows: List[dict]) -> str:
    lines = [
        "| lanes (mode) | 1-page p50 µs | p99 µs | prefill-side p50 µs "
        "| raw 1-page write p50 µs (p99) | req/s | ops/req "
        "| large MiB | ops | PD GB/s best (median) | PD prefill-side GB/s (median) "
        "| raw GB/s best (median) | × raw best (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        label = r["mode"] + (", integrity" if r.get("integrity") else "")
        if r.get("coalesce_after") is not None:
            label += f", coalesce_after {r['coalesce_after']}"
        lines.append(
            f"| {','.join(r['lanes'])} ({label}) | {r['p50_us']:.0f} | {r['p99_us']:.0f} | "
            f"{r['prefill_p50_us']:.0f} | {r['raw_p50_us']:.0f} ({r['raw_p99_us']:.0f}) | "
            f"{r['req_per_s']:.0f} | {r['ops_1page']:.0f} | "
            f"{r['large_bytes'] / 2**20:.1f} | "
            f"{r['large_ops']} | {r['pd_gbps_best']:.2f} ({r['pd_gbps_median']:.2f}) | "
            f"{r['pd_prefill_gbps_median']:.2f} | "
            f"{r['raw_gbps_best']:.2f} ({r['raw_gbps_median']:.2f}) | "
            f"{r['ratio_best']:.2f} ({r['ratio_median']:.2f}) |"
        )
    return "\n".join(lines)


def format_integrity(rows: List[dict]) -> str:
    """Off vs on, per mode, from the same run: what the integrity check costs."""
    lines = [
        "| lanes (mode) | 1-page p50 µs off → on (Δ) | prefill-side p50 µs off → on "
        "| req/s off → on (×) | large request µs off → on (Δ) "
        "| large PD GB/s off → on (×) | large prefill-side GB/s off → on |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["mode"], r.get("coalesce_after"), bool(r.get("integrity"))): r for r in rows}
    for mode, co in dict.fromkeys((r["mode"], r.get("coalesce_after")) for r in rows):
        off, on = by.get((mode, co, False)), by.get((mode, co, True))
        if off is None or on is None:
            continue
        label = mode if co is None else f"{mode}, coalesce_after {co}"
        lines.append(
            f"| {','.join(off['lanes'])} ({label}) "
            f"| {off['p50_us']:.0f} → {on['p50_us']:.0f} ({on['p50_us'] - off['p50_us']:+.0f}) "
            f"| {off['prefill_p50_us']:.0f} → {on['prefill_p50_us']:.0f} "
            f"| {off['req_per_s']:.0f} → {on['req_per_s']:.0f} "
            f"({on['req_per_s'] / off['req_per_s']:.2f}) "
            f"| {off['pd_us_median']:.0f} → {on['pd_us_median']:.0f} "
            f"({on['pd_us_median'] - off['pd_us_median']:+.0f}) "
            f"| {off['pd_gbps_median']:.2f} → {on['pd_gbps_median']:.2f} "
            f"({on['pd_gbps_median'] / off['pd_gbps_median']:.2f}) "
            f"| {off['pd_prefill_gbps_median']:.2f} → {on['pd_prefill_gbps_median']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = clitools.parser("kvxfer bench pd", __doc__)
    ap.add_argument("--device", default="cpu", help="torch device of the pools (cpu, cuda)")
    ap.add_argument("--modes", default="none,peer", help="engine error modes (lane configs)")
    ap.add_argument("--latency-requests", type=int, default=300)
    ap.add_argument("--throughput-requests", type=int, default=1000)
    ap.add_argument(
        "--large-pages",
        type=int,
        default=1024,
        help="pages of a large request (32 KiB each with the default model)",
    )
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument(
        "--mixed",
        type=int,
        default=0,
        help="after the large requests, this many 1-page requests one at a time while "
        "--mixed-depth requests of --large-pages stay in flight; their latency against the "
        "sequential ones (0: no mixed phase)",
    )
    ap.add_argument("--mixed-depth", type=int, default=2, help="mixed: large requests in flight")
    ap.add_argument(
        "--coalesce-after",
        default=None,
        help="comma list of KVManager(coalesce_after=) values: every mode runs once per value "
        "(0: no coalescing; default: the manager's default, once)",
    )
    ap.add_argument(
        "--integrity",
        action="store_true",
        help="run every mode twice, with KVManager(integrity=False) then True, and "
        "print what the integrity check costs (off vs on, same run)",
    )
    ap.add_argument("--prefill-page-size", type=int, default=None, help="shapes: see above")
    ap.add_argument("--decode-page-size", type=int, default=None, help="shapes: see above")
    ap.add_argument("--decode-prefix", type=int, default=0, help="shapes: see above")
    ap.add_argument("--shape-tokens", type=int, default=16000, help="shapes: tokens per request")
    ap.add_argument(
        "--kv-layout",
        default=ModelSpec().kv_layout,
        help=f"shapes / TP: KV layout ({', '.join(KV_LAYOUTS)}; TP: a comma list)",
    )
    ap.add_argument("--prefill-tp", type=int, default=None, help="TP: see above")
    ap.add_argument("--decode-tp", type=int, default=None, help="TP: see above")
    ap.add_argument("--tp-heads", type=int, default=8, help="TP: the model's KV / Mamba heads")
    ap.add_argument(
        "--tp-paths",
        action="store_true",
        help="TP: N:M twice, direct (tp_stage_min_ops=0: one PUT per run) and staged "
        "(tp_stage_min_ops=1: head slices gathered, one PUT per chunk), and on CUDA a third "
        "time, pattern (one device-lane launch per write), beside equal TP (on CUDA with "
        "byte-run shapes also as equal-runs: tp_pattern=off)",
    )
    ap.add_argument(
        "--stages",
        action="store_true",
        help="trace the sequential 1-page requests (KVManager(trace=True)) and print their "
        "per-stage p50/p90/p99 µs beside the end-to-end p50, the raw engine write (+ notify) and "
        "ucx_perftest ucp_put_lat / ucp_am_lat of the same size, then the large requests' "
        "stages beside their raw write; with --prefill-tp / "
        "--decode-tp: every rank's stages of the TP requests, after the first prefill send",
    )
    ap.add_argument(
        "--busy-thread",
        action="store_true",
        help="each worker process runs one more Python thread that "
        "spins in the interpreter (the worst case of a scheduler busy in Python beside the "
        "manager's loop thread): what the GIL costs the path",
    )
    ap.add_argument(
        "--decode-post-capture",
        action="store_true",
        help="decode's kv pool is reserved at construction and backed afterwards "
        "(post_capture_active=True, finalize_backing: on CUDA VMM memory, which UCX reaches "
        "only by emulated PUTs and a same-host device lane maps: docs/engine.md)",
    )
    ap.add_argument(
        "--poll-scheduler",
        nargs="?",
        const="yield",
        default=None,
        choices=("yield", "spin"),
        help="each worker's scheduler waits for its rooms by polling them sweep after sweep, "
        "as SGLang's does between batches, instead of blocking on their on_done (with "
        "KVManager(poll_takes=), the default, a poll then handles an arrived Done itself); "
        "yield (default): one time.sleep(0) per sweep; spin: none (a scheduler that stays in "
        "the interpreter)",
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="the workers' sys.setswitchinterval in seconds (default 0.0005; Python's own "
        "default is 0.005)",
    )
    clitools.add_json_args(ap)
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    layouts = [x.strip() for x in a.kv_layout.split(",") if x.strip()]
    bad = [x for x in layouts if x not in KV_LAYOUTS]
    if bad or not layouts or (len(layouts) > 1 and not (a.prefill_tp or a.decode_tp)):
        ap.error(f"--kv-layout {a.kv_layout!r}: one of {KV_LAYOUTS} (a comma list with TP)")
    try:
        coalesce_values: List[Optional[int]] = (
            [None]
            if a.coalesce_after is None
            else [int(v) for v in a.coalesce_after.split(",") if v.strip()]
        )
    except ValueError:
        ap.error(f"--coalesce-after: a comma list of ints, got {a.coalesce_after!r}")
    if a.mixed < 0 or a.mixed_depth < 1 or any(v is not None and v < 0 for v in coalesce_values):
        ap.error("--mixed >= 0, --mixed-depth >= 1 and --coalesce-after values >= 0")
    if a.prefill_tp or a.decode_tp:
        a.prefill_tp, a.decode_tp = a.prefill_tp or 1, a.decode_tp or 1
        return _tp_main(a, modes, layouts)
    if a.prefill_page_size or a.decode_page_size or a.decode_prefix:
        return _shapes_main(a, modes)
    print(
        f"PD bench: device={a.device}, demo model (page-major KV + Mamba envelope), "
        f"{a.latency_requests} sequential + {a.throughput_requests} concurrent 1-page "
        f"requests, {a.large_pages}-page requests best/median of {a.iters}"
        f"{', integrity off and on' if a.integrity else ''}"
        f"{', a busy Python thread per worker' if a.busy_thread else ''}"
        f"{f', polling schedulers ({a.poll_scheduler})' if a.poll_scheduler else ''}"
        f"{f', switch interval {a.switch_interval * 1e3:g} ms' if a.switch_interval else ''}"
        f"{', decode pool backed after construction (post-capture)' if a.decode_post_capture else ''}",
        flush=True,
    )
    t0 = time.perf_counter()
    rows = []
    runs = [
        (m, integ, co)
        for m in modes
        for integ in ((False, True) if a.integrity else (False,))
        for co in coalesce_values
    ]
    with clitools.Progress(len(runs), "bench pd", enabled=False if a.json else None) as pr:
        for m, integ, co in runs:
            label = f"mode {m}{' (integrity)' if integ else ''}"
            label += "" if co is None else f" (coalesce_after {co})"
            pr.show(label)
            rows.append(bench_mode(a, m, integ, co))
            pr.step(f"{label} done")
    print(format_rows(rows))
    if a.mixed:
        print(
            f"\n1-page requests with large ones in flight (same run; {a.mixed} one at a "
            f"time, {a.mixed_depth} requests of {a.large_pages} pages kept in flight):\n"
        )
        print(format_mixed(rows))
    if a.stages:
        print("\nStages of a PD request (same run; kvxfer.disagg.trace names them):")
        print(format_stages(rows))
    if a.integrity:
        print("\nIntegrity check cost (same run; Δ = on - off, × = on / off):\n")
        print(format_integrity(rows))
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")
    clitools.emit_json(a, {"args": vars(a), "rows": rows})
    return 0


def _tp_main(a, modes: List[str], layouts: List[str]) -> int:
    print(
        f"PD bench, heterogeneous TP {a.prefill_tp} → {a.decode_tp} vs equal TP "
        f"{a.prefill_tp} → {a.prefill_tp} and {a.decode_tp} → {a.decode_tp}: device={a.device}, demo model ({a.tp_heads} KV heads, "
        f"Mamba envelope), {a.shape_tokens}-token requests, best/median of {a.iters}"
        + (
            f"; prefill page {a.prefill_page_size or ModelSpec().page_size}, decode page "
            f"{a.decode_page_size or 'equal'}, decode prefix {a.decode_prefix}"
            if a.decode_page_size or a.decode_prefix
            else ""
        ),
        flush=True,
    )
    t0 = time.perf_counter()
    rows: List[dict] = []
    runs = [(m, lay) for m in modes for lay in layouts]
    # rows print as each worker pair is done (a run cut short by a timeout keeps them)
    print(TP_HEADER, flush=True)

    def row_done(r: dict) -> None:
        rows.append(r)
        pr.close()
        print(format_tp_row(r, rows), flush=True)

    with clitools.Progress(len(runs), "bench pd", enabled=False if a.json else None) as pr:
        for m, lay in runs:
            pr.show(f"mode {m}, {lay}")
            bench_tp(a, m, lay, on_row=row_done)
            pr.step(f"mode {m}, {lay} done")
    if a.stages:
        print("\nStages (KVManager(trace=True), every rank):\n" + format_tp_stages(rows))
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")
    clitools.emit_json(a, {"args": vars(a), "rows": rows})
    return 0


def _shapes_main(a, modes: List[str]) -> int:
    print(
        f"PD bench, shapes: device={a.device}, demo model ({a.kv_layout} KV + Mamba envelope), "
        f"{a.shape_tokens}-token requests, best/median of {a.iters}",
        flush=True,
    )
    t0 = time.perf_counter()
    rows: List[dict] = []
    with clitools.Progress(len(modes), "bench pd", enabled=False if a.json else None) as pr:
        for m in modes:
            pr.show(f"mode {m}")
            rows += bench_shapes(a, m)
            pr.step(f"mode {m} done")
    print(format_shapes(rows))
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")
    clitools.emit_json(a, {"args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
