"""Multi-process test harness for the PD protocol: worker processes (spawn) each host one or
more *nodes* — a real pool + real allocators + a KVManager on real UCX loopback — driven
through typed proxies (:mod:`kvxfer.procs`): ``worker["mha"].p_open(room, 4)``. Child
exceptions come back with their traceback, raised as :class:`kvxfer.errors.RemoteError`.

Content is deterministic: page ``k`` of room ``R``, descriptor ``e`` holds
``(R*31 + k*7 + e*13 + byte) % 251``; state slot ``j`` of a room uses ``k = 1000 + j``; the
aux row carries first token ``R % 1000003``. Decode verifies every byte of every page/slot.

Fences: whenever a node frees a page, state slot or aux row (in ``on_done``, or after
``verify``) it first fills it with :data:`SENTINEL`, a byte no pattern ever produces; the first
and last item of every registered buffer are never allocated and hold :data:`GUARD`.
``fence_check()`` reports every freed item (not reallocated since) or guard item whose bytes
changed: a write that landed after its room's ``on_done``, or outside any room.

Test hooks: ``hook_on(point, room, action, ...)`` arms the manager's ``test_hook`` so that a
test can force an interleaving (run a scheduler call on another thread while the loop waits
at that point, or freeze the whole process there with SIGSTOP).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from typing import Callable, Dict, Optional

from kvxfer import procs

KINDS = ("mha", "page_major", "mla", "hybrid_per_layer", "hybrid_envelope")

FAST = dict(
    bootstrap_s=10.0,
    waiting_s=20.0,
    transfer_s=20.0,
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=10.0,
    abort_ack_s=5.0,
)
TINY = dict(
    bootstrap_s=1.5,
    waiting_s=1.5,
    transfer_s=1.5,
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=5.0,
    abort_ack_s=2.0,
)

#: byte written into every freed item; patterns are ``% 251``, so they never produce it
SENTINEL = 0xFF
#: byte of the never-allocated first and last item of every registered buffer
GUARD = 0xFE
#: byte decode's pages hold before a token-keyed transfer (tests of page sizes and prefixes)
UNWRITTEN = 0xFD


# ====================================================================== child side
def _build_pool(kind: str, size: int, page_size: int, device: str = "cpu", tp=None):
    """``tp``: ``(rank, size, total kv heads)`` of a TP rank (heads and Mamba rows split);
    None: the single-rank pools."""
    import torch

    from kvxfer.pools import MHATokenToKVPool, MLATokenToKVPool, PageMajorMHATokenToKVPool

    bf = torch.bfloat16
    h, tps = 2, 1
    if tp is not None:
        from kvxfer.disagg.tp_plan import local_units

        h, tps = local_units(tp[2], tp[1]), tp[1]
    if kind in ("mha", "mismatch", "many"):
        if kind == "many":
            return MHATokenToKVPool(size, page_size, bf, 1, 8, 1, device), None
        return MHATokenToKVPool(size, page_size, bf, h, 8, 2, device), None
    if kind == "mha_hnd":  # per-layer [pages, H, page_size, D]
        return MHATokenToKVPool(size, page_size, bf, h, 8, 2, device, layout="hnd"), None
    if kind == "page_major":  # 4 layers: layer-wise writes batch several (test_pd_layerwise)
        return PageMajorMHATokenToKVPool(size, page_size, bf, h, 8, 4, device), None
    if kind == "mla":
        return MLATokenToKVPool(size, page_size, bf, 16, 8, 2, device), None
    if kind.startswith("hybrid_"):
        from kvxfer.pools.hybrid import HybridLinearKVPool
        from kvxfer.pools.mamba import MambaPool
        from kvxfer.pools.mamba_spec import MambaStateSpec

        spec = MambaStateSpec(
            conv_shapes=((4, 3),),
            temporal_shape=(2, 4, 4),
            conv_dtype=bf,
            temporal_dtype=torch.float32,
            layer_ids=(1, 3),
        )
        if tp is not None:  # Mamba2-like: conv x | B | C = 8 | 4 | 4 rows, 4 heads, split
            spec = MambaStateSpec(
                conv_shapes=((16 // tps, 3),),
                temporal_shape=(4 // tps, 4, 4),
                conv_dtype=bf,
                temporal_dtype=torch.float32,
                layer_ids=(1, 3),
                conv_parts=[(8 // tps, 4 // tps, 4 // tps)],
            )
        layout = "per_layer" if kind == "hybrid_per_layer" else "envelope"
        kv_cls = MHATokenToKVPool if layout == "per_layer" else PageMajorMHATokenToKVPool
        mamba = MambaPool(64, spec, device, layout=layout)
        return HybridLinearKVPool(
            kv_cls(size, page_size, bf, h, 8, 2, device), mamba, [0, 2]
        ), mamba
    raise ValueError(kind)


def pattern(room: int, ks, e: int, n: int):
    import torch

    ks = torch.as_tensor(ks, dtype=torch.int64)
    return ((room * 31 + e * 13 + 7 * ks[:, None] + torch.arange(n)[None, :]) % 251).to(torch.uint8)


def first_token(room: int) -> int:
    return room % 1000003


class _FakeEvent:
    """A CUDA event stand-in: ``query()`` is False ``polls`` times, then True (-1: never);
    ``synchronize()`` (the waiter thread's) completes it, except one that never completes
    (it returns at once, as if the wait had failed: the room's bound must then fail it)."""

    def __init__(self, polls: int) -> None:
        self.left = polls
        self.synced = 0

    def query(self) -> bool:
        if self.left < 0:
            return False
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        self.synced += 1
        if self.left >= 0:
            self.left = 0


class Node:
    """One pool + allocators + KVManager (background loop) in a worker process."""

    def __init__(
        self,
        kind: str,
        role: str,
        bootstrap: Optional[str],
        timeouts: dict,
        error_mode: str = "peer",
        size: int = 1024,
        page_size: int = 4,
        aux_rows: int = 256,
        name: str = "",
        device: str = "cpu",
        integrity: bool = False,
        trace: bool = False,
        tp: Optional[tuple] = None,
        tp_stage_min_ops: Optional[int] = None,
        tp_pattern: str = "auto",
        coalesce_after: Optional[int] = None,
        inline_wait_us: Optional[float] = None,
        host_copy: Optional[str] = None,
    ) -> None:
        """``inline_wait_us``: how long a write's flush + notify may be waited for on the
        thread that posted it ($KVXFER_CHAIN_INLINE_US / $KVXFER_GUEST_INLINE_US, set for
        the whole worker process before its manager starts); 0: every write returns
        through the loop, so other work queued there runs while it is in flight."""
        from kvxfer.disagg import KVArgs, KVManager, MetadataBuffer, Timeouts
        from kvxfer.disagg.kv_args import replace
        from kvxfer.pools.allocator import PagedTokenToKVPoolAllocator
        from kvxfer.pools.mamba_alloc import MambaSlotAllocator

        if kind == "mismatch":
            page_size = 8
        if inline_wait_us is not None:
            os.environ["KVXFER_CHAIN_INLINE_US"] = str(inline_wait_us)
            os.environ["KVXFER_GUEST_INLINE_US"] = str(inline_wait_us)
        self.kind, self.role, self.bootstrap = kind, role, bootstrap
        self.pool, mamba = _build_pool(kind, size, page_size, device, tp)
        self.tp, self.device = tp, device
        self.lock = threading.Lock()
        # item 0 (padding) and the last item are never allocated: guards
        self.pages = PagedTokenToKVPoolAllocator(size - page_size, page_size)
        self.slots = MambaSlotAllocator(mamba.size - 1) if mamba is not None else None
        self.aux = MetadataBuffer(aux_rows, 64)
        rows = [self.aux.alloc() for _ in range(aux_rows)]
        for row in rows[1:-1]:
            self.aux.free(row)
        rank, tps, heads = tp if tp is not None else (0, 1, None)
        args = KVArgs.from_pools(
            self.pool,
            aux=self.aux,
            state_pool=self.pool if mamba is not None else None,
            tp_rank=rank,
            tp_size=tps,
            total_kv_heads=heads,
        )
        if kind == "mismatch":  # a pool stating no token geometry: page sizes must be equal
            args = replace(args, kv_segments=[])
        self.views = self.pool.get_item_views()
        self.state_views = self.pool.get_state_item_views() if mamba is not None else []
        self.freed = {"pages": set(), "slots": set(), "rows": set()}
        for views in (self.views, self.state_views):
            for v in views:
                v[0] = GUARD
                v[-1] = GUARD
        self.aux.data[[0, -1]] = GUARD
        self.base = self._counts()
        self.hooks: Dict[tuple, tuple] = {}
        self.hooks_fired: list = []
        self.hooks_cv = threading.Condition()
        self._gate = threading.Event()
        self._hold = threading.Event()  # hold_loop
        self.widened: Optional[tuple] = None
        self.in_window: Optional[int] = None
        self._thread = None
        self.mgr = KVManager(
            args,
            role,
            bootstrap_addr=bootstrap if role == "prefill" else None,
            timeouts=Timeouts(**timeouts),
            error_mode=error_mode,
            name=f"{role}-{name or kind}",
            integrity=integrity,
            trace=trace,
            **({} if tp_stage_min_ops is None else {"tp_stage_min_ops": tp_stage_min_ops}),
            tp_pattern=tp_pattern,
            coalesce_after=coalesce_after,
            host_copy=host_copy,
        ).start_background()
        self._direct_pages = self.mgr.direct_pages
        #: exceptions the manager's loop caught in callbacks and tasks (``loop_errors``)
        self._loop_errors: list = []
        self.mgr.call_wait(self._catch_loop_errors)
        self.rooms: Dict[int, dict] = {}
        #: kv write kinds prefill's chunks issued (``kv_write_kinds``), counted on the loop
        self._kv_kinds: Dict[str, int] = {}
        if role == "prefill":
            side = self.mgr.side
            kv_part = side._kv_part

            def counted(r, src, first, _kv_part=kv_part):
                kv = _kv_part(r, src, first)
                for w in kv if isinstance(kv, list) else [kv] if kv is not None else []:
                    name = type(w).__name__
                    self._kv_kinds[name] = self._kv_kinds.get(name, 0) + 1
                return kv

            side._kv_part = counted

    def _catch_loop_errors(self) -> None:
        """Record what reaches the loop's exception handler (then handle it as before).
        Runs on: the manager's loop thread."""
        import asyncio

        loop = asyncio.get_running_loop()

        def handler(lp, context) -> None:
            exc = context.get("exception")
            self._loop_errors.append(f"{context.get('message')}: {exc!r}")
            lp.default_exception_handler(context)

        loop.set_exception_handler(handler)

    def loop_errors(self) -> list:
        """Exceptions the manager's loop caught outside any awaiting code (a callback that
        raised, a task nobody retrieved) since the last call; the list is emptied."""
        self.mgr.call_wait(lambda: None)  # callbacks handed to the loop before this ran
        out, self._loop_errors[:] = list(self._loop_errors), []
        return out

    def kv_write_kinds(self) -> Dict[str, int]:
        """Per write type (ItemWrite, RawWrite, PatternWrite, ...), how many kv writes this
        prefill node's chunks built so far (its ``_kv_part``; layer-wise chunks not)."""
        return dict(self._kv_kinds)

    def drain_trace(self) -> list:
        """The manager's stage records (``KVManager.drain_trace``)."""
        return self.mgr.drain_trace()

    def _counts(self):
        return {
            "pages": self.pages.available_size(),
            "slots": self.slots.available_size() if self.slots else 0,
            "aux": self.aux.available(),
        }

    # -- resources --
    def _alloc(self, room: int, n: int, state: bool) -> dict:
        with self.lock:
            pages = self.pages.alloc_pages(n) if n else None
            if n and pages is None:
                raise MemoryError(f"{self.kind}: no {n} pages")
            slot = None
            if state and self.slots is not None:
                got = self.slots.alloc(1)
                if got is None:
                    raise MemoryError("no mamba slot")
                slot = got[0]
            row = self.aux.alloc()
            if n:
                self.freed["pages"].difference_update(int(p) for p in pages)
            self.freed["slots"].discard(slot)
            self.freed["rows"].discard(row)
        import torch

        return {
            "pages": pages if pages is not None else torch.zeros(0, dtype=torch.int64),
            "slot": slot,
            "row": row,
            "n": n,
            "done": threading.Event(),
            "result": None,
        }

    def _free(self, rec: dict) -> None:
        """Fill the room's items with SENTINEL, then free them."""
        with self.lock:
            if rec["n"]:
                for v in self.views:
                    v[rec["pages"].to(v.device)] = SENTINEL
                self.freed["pages"].update(int(p) for p in rec["pages"])
                self.pages.free_pages(rec["pages"])
            if rec["slot"] is not None:
                for v in self.state_views:
                    v[rec["slot"]] = SENTINEL
                self.freed["slots"].add(rec["slot"])
                self.slots.free([rec["slot"]])
            self.aux.data[rec["row"]] = SENTINEL
            self.freed["rows"].add(rec["row"])
            self.aux.free(rec["row"])

    def fence_check(self) -> dict:
        """Freed items (not reallocated since) and guard items whose bytes changed."""
        import torch

        with self.lock:
            pages = sorted(self.freed["pages"])
            slots = sorted(self.freed["slots"])
            rows = sorted(self.freed["rows"])
            out = {
                "pages": [],
                "slots": [],
                "rows": [],
                "guards": [],
                "checked": {"pages": len(pages), "slots": len(slots), "rows": len(rows)},
            }
            for what, views, ids in (
                ("pages", self.views, pages),
                ("slots", self.state_views, slots),
            ):
                for v in views:
                    if ids:
                        bad = (v[torch.tensor(ids, device=v.device)] != SENTINEL).any(dim=1)
                        out[what] += [ids[i] for i in bad.nonzero().flatten().tolist()]
                    for end in (0, v.shape[0] - 1):
                        if not bool((v[end] == GUARD).all()):
                            out["guards"].append(f"{what}[{end}]")
                out[what] = sorted(set(out[what]))
            out["rows"] = [r for r in rows if not (self.aux.data[r] == SENTINEL).all()]
            for end in (0, self.aux.rows - 1):
                if not (self.aux.data[end] == GUARD).all():
                    out["guards"].append(f"rows[{end}]")
        return out

    # -- test hooks --
    def hook_on(self, point: str, room: int, action: str, *args) -> None:
        """Arm a one-shot hook: when the manager reaches ``point`` for ``room`` (on its loop
        thread), ``action`` runs there. "call": ``args[0](self, *args[1:])`` (e.g. ``Node.p_open``) runs on
        another thread while the loop waits for it (bounded) — that thread is the scheduler
        acting inside the window. "freeze": this whole process stops (SIGSTOP) until the
        test sends SIGCONT. "gate": the loop waits (bounded) until the test calls
        ``open_gate()`` (the peer acts meanwhile)."""
        self.hooks[(point, room)] = (action, args)
        self._loop_hooks()

    def _loop_hooks(self) -> None:
        """Hooks hold the thread that reaches them, and the windows of these tests are
        written for the loop's (the scheduler's call must return while the hook holds): a
        node with hooks hands every call to its loop (no direct calls)."""
        self.mgr.direct_pages = 0
        self.mgr.take_natively(False)  # (not through the loop: a hook may hold it now)
        self.mgr.test_hook = self._hook

    def widen(self, point: Optional[str], seconds: float) -> None:
        """Hold the loop ``seconds`` (half to all, at random) at ``point`` for every room —
        a slow log handler, say — to widen a race window for a hammer test; None stops it.
        While it holds, ``in_window`` names the room."""
        import random

        self.widened = (point, seconds, random.Random(0))
        self._loop_hooks()
        if point is None and not self.hooks:  # nothing holds the loop: direct calls again
            self.mgr.direct_pages = self._direct_pages
            self.mgr.take_natively(self.mgr.native_takes)

    def hammer_open(self, rooms, seed: int, jitter: float) -> None:
        """Hammer, prefill's scheduler: create a KVSender for every room of ``rooms``
        ([(room, n)]) in random order at random pacing — while the loop sits in a widened
        window for a room not opened yet, that room comes next half of the time — then (its
        forward pass done) send each room's pages, in another random order."""
        import random

        rng = random.Random(seed)
        todo = dict(rooms)
        order = rng.sample(list(todo), len(todo))
        while todo:
            r = self.in_window
            if r not in todo or rng.random() < 0.5:
                r = next(x for x in order if x in todo)
            self.p_open(r, todo.pop(r))
            time.sleep(rng.random() * jitter)
        for r, n in rng.sample(list(rooms), len(rooms)):
            self.p_send(r, 0, n)
            time.sleep(rng.random() * jitter)

    def send_from_threads(self, rooms, threads: int, seed: int, jitter: float) -> int:
        """Send every room of ``rooms`` ([(room, n)], opened before: the pool's allocator is
        not shared across threads) whole, from ``threads`` scheduler threads at once, each
        its share in random order at random pacing: direct calls of several threads race for
        the loop's gate and against calls handed over. Re-raises a thread's error; returns
        how many of the sends ran direct (``KVManager.direct_calls``)."""
        import random

        self.mgr.call_wait(lambda: None)  # the calls handed over so far (the opens) ran
        before = self.mgr.direct_calls
        shares = [rooms[i::threads] for i in range(threads)]
        errors: list = []
        go = threading.Barrier(threads)

        def run(share, rng):
            try:
                go.wait(10.0)
                for r, n in rng.sample(share, len(share)):
                    self.p_send(r, 0, n)
                    time.sleep(rng.random() * jitter)
            except BaseException as exc:
                errors.append(traceback.format_exc() or repr(exc))

        ts = [
            threading.Thread(target=run, args=(sh, random.Random(seed * 100 + i)), daemon=True)
            for i, sh in enumerate(shares)
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60.0)
        if any(t.is_alive() for t in ts) or errors:
            raise RuntimeError(f"send_from_threads: {errors or 'a thread still runs'}")
        return self.mgr.direct_calls - before

    def hammer_abort(self, rooms, seed: int, jitter: float) -> None:
        """Hammer, decode's scheduler: abort ``rooms`` in random order at random pacing."""
        import random

        rng = random.Random(seed)
        for r in rng.sample(list(rooms), len(rooms)):
            self.abort(r)
            time.sleep(rng.random() * jitter)

    def _hook(self, point: str, room: int) -> None:
        w = self.widened
        if w is not None and w[0] == point:
            self.in_window = room
            time.sleep((1 + w[2].random()) * w[1] / 2)
            self.in_window = None
        got = self.hooks.pop((point, room), None)
        if got is None:
            return
        self._fired((point, room))
        action, args = got
        if action == "freeze":
            # stop between RPCs: the call that armed this point has answered first (else the
            # parent would wait for a reply from a stopped process)
            procs.wait_idle(10.0)
            # to this thread: kill(getpid()) is process-directed, and the kernel may hand it
            # to another thread, which starts the group stop only once it runs — on a loaded
            # box this thread went on and posted the write first (CI, 2026-12-02). A
            # thread-directed SIGSTOP stops this thread on its way out of the syscall (and,
            # as any SIGSTOP, the whole process).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            self._fired(("resumed", room))
            return
        if action == "gate":
            self._gate.clear()
            self._fired(("opened", room) if self._gate.wait(30) else ("stuck", room))
            return
        err = []

        def run():
            try:
                args[0](self, *args[1:])
            except BaseException:
                err.append(traceback.format_exc())

        t = threading.Thread(target=run)
        t.start()
        t.join(10)
        self._fired(
            ("error", "".join(err))
            if err
            else ("done", room)
            if not t.is_alive()
            else ("stuck", room)
        )

    def _fired(self, what: tuple) -> None:
        with self.hooks_cv:
            self.hooks_fired.append(what)
            self.hooks_cv.notify_all()

    def wait_fired(
        self, point: str, room: int, timeout: float = 20.0, entered: bool = False
    ) -> list:
        """Wait (bounded) until the hook armed at ``point`` for ``room`` ran to its end (or,
        ``entered``, began); returns what it recorded (``[(point, room), ("done", room)]``
        when a "call" went well)."""

        def seen():
            return [x for x in self.hooks_fired if x[1] == room or x[0] == "error"]

        with self.hooks_cv:
            self.hooks_cv.wait_for(
                lambda: (point, room) in seen() and len(seen()) >= (1 if entered else 2), timeout
            )
            return seen()

    def open_gate(self) -> None:
        self._gate.set()

    def note_layers_sent(self, room: int) -> None:
        """A "call" hook action: records ``("sent", room, layers, inflight)``: the layers of
        the room's open layer-wise chunk handed to writes so far and the layer writes not yet
        complete (the loop is blocked while it runs)."""
        stream = self.rooms[room]["h"].layer_stream
        sent = tuple(sorted(stream.chunks[0].sent)) if stream.chunks else ()
        self._fired(("sent", room, sent, stream.inflight))

    def wait_record(self, what: str, room: int, timeout: float = 20.0) -> Optional[tuple]:
        """Wait (bounded) for a hook record ``(what, room, ...)``; None when none came."""

        def found():
            return next((x for x in self.hooks_fired if x[0] == what and x[1] == room), None)

        with self.hooks_cv:
            self.hooks_cv.wait_for(lambda: found() is not None, timeout)
            return found()

    def record(self, room: int, timeout: float = 10.0, role: str = "pending") -> Optional[str]:
        """Wait (bounded) until the manager's room table holds a ``role`` record for
        ``room`` (e.g. prefill holds decode's metadata); returns the role found."""
        end = time.monotonic() + timeout
        while True:
            r = self.mgr.rooms.get(room)
            got = None if r is None else r.role
            if got == role or time.monotonic() > end:
                return got
            time.sleep(0.001)

    # -- a node method on a background thread (to run both sides at once) --
    def start(self, method: Callable, *args) -> None:
        """Run ``method(self, *args)`` (e.g. ``Node.hammer_open``) on a thread; :meth:`join`."""
        res = {}

        def run():
            try:
                res["ok"] = method(self, *args)
            except BaseException as exc:
                res["err"] = (type(exc).__name__, str(exc), traceback.format_exc())

        self._thread = (threading.Thread(target=run, daemon=True), res)
        self._thread[0].start()

    def join(self, timeout: float = 60.0):
        t, res = self._thread
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{self.mgr.name}: background call still running after {timeout}s")
        self._thread = None
        if "err" in res:
            raise RuntimeError(f"{res['err'][0]}: {res['err'][1]}\n{res['err'][2]}")
        return res["ok"]

    def _on_done(self, room: int):
        def cb(state, exc):
            rec = self.rooms[room]
            rec["result"] = {
                "state": state.name,
                "exc": type(exc).__name__ if exc else None,
                "msg": str(exc) if exc else "",
                "thread": threading.current_thread().name,
            }
            if self.role == "prefill" or state.name != "Success":
                self._free(rec)
                rec["freed"] = True
            rec["done"].set()

        return cb

    # -- prefill --
    def p_open(self, room: int, n: int, state: bool = True, init: bool = True) -> None:
        from kvxfer.disagg import KVSender

        rec = self._alloc(room, n, state)
        ks = list(range(n))
        for e, v in enumerate(self.views):
            if n:
                v[rec["pages"].to(v.device)] = pattern(room, ks, e, v.shape[1]).to(v.device)
        if rec["slot"] is not None:
            for e, v in enumerate(self.state_views):
                v[rec["slot"]] = pattern(room, [1000], e, v.shape[1])[0].to(v.device)
        self.aux.set_output(rec["row"], first_token(room))
        self.rooms[room] = rec
        rec["h"] = KVSender(self.mgr, self.bootstrap, room, on_done=self._on_done(room))
        if init:
            self.p_init(room)

    def p_init(self, room: int) -> None:
        rec = self.rooms[room]
        rec["h"].init(rec["n"], rec["row"])

    def p_send(self, room: int, lo: int, hi: int, stamp_room: Optional[int] = None) -> None:
        rec = self.rooms[room]
        st = [rec["slot"]] if hi == rec["n"] and rec["slot"] is not None else None
        if stamp_room is not None:  # simulate a scheduler bug: wrong aux stamp
            aux, real = self.mgr.aux, self.mgr.aux.stamp
            aux.stamp = lambda row, _room: (real(row, stamp_room), delattr(aux, "stamp"))
        rec["h"].send(rec["pages"][lo:hi], st)

    # -- layer-wise streaming (kvxfer.disagg.layerwise) --
    def p_begin(self, room: int, lo: int, hi: int, group: int = 1) -> int:
        """``begin_chunk`` of pages ``[lo, hi)`` (state with the last); the layer count."""
        rec = self.rooms[room]
        st = [rec["slot"]] if hi == rec["n"] and rec["slot"] is not None else None
        rec["h"].begin_chunk(rec["pages"][lo:hi], st, layers_per_write=group)
        return rec["h"].num_layers

    def p_layer(self, room: int, layer: int, polls: int = 0) -> None:
        """``layer_ready(layer)``; ``polls`` > 0: with a fake CUDA event whose ``query()``
        is False that many times (-1: never True)."""
        ev = _FakeEvent(polls) if polls else None
        self.rooms[room]["h"].layer_ready(layer, ev)

    def p_send_layers(self, room: int, lo: int, hi: int, order=None, group: int = 1) -> None:
        """A whole chunk layer-wise: begin it, declare its layers (in ``order``)."""
        n = self.p_begin(room, lo, hi, group)
        for layer in order if order is not None else range(n):
            self.p_layer(room, layer)

    def p_send_layers_on_loop(self, room: int, lo: int, hi: int) -> None:
        """:meth:`p_send_layers` run on the manager's own loop (an asyncio scheduler)."""
        self.mgr.call_wait(self.p_send_layers, room, lo, hi)

    def p_layer_on_loop(self, room: int, layer: int) -> int:
        """``layer_ready(layer)`` on the manager's own loop (an asyncio scheduler); returns
        how many posts to the room's decode peer that call made before it returned: RMA PUT
        batches, and device-lane launches where the peer has a lane (CUDA pools on one
        host: the bytes may go there instead). Each is counted for the call's duration."""
        h = self.rooms[room]["h"]

        def run() -> int:
            peer = h._r.link.peer
            targets = [(peer._rma, "put")]
            if peer._dev is not None:
                targets += [(peer._dev, n) for n in ("launch", "launch_pattern", "launch_patterns")]
            posts = []

            def counted(fn):
                def call(*args):
                    posts.append(fn.__name__)
                    return fn(*args)

                return call

            for obj, name in targets:
                setattr(obj, name, counted(getattr(obj, name)))
            try:
                h.layer_ready(layer)
            finally:
                for obj, name in targets:
                    delattr(obj, name)
            return len(posts)

        return self.mgr.call_wait(run)

    def d_wait_layer(self, room: int, layer: int, timeout: float = 10.0) -> dict:
        h = self.rooms[room]["h"]
        h.wait_layer(layer, timeout)
        return {"ready": h.layers_ready(), "state": h.poll().name}

    def d_layers_ready(self, room: int) -> int:
        return self.rooms[room]["h"].layers_ready()

    def p_send_raw(self, room: int, kv, state=None) -> None:
        self.rooms[room]["h"].send(kv, state)

    # -- decode --
    def d_open(
        self,
        room: int,
        n: int,
        state: bool = True,
        meta: bool = True,
        addr: Optional[str] = None,
        init: bool = True,
    ) -> None:
        from kvxfer.disagg import KVReceiver

        rec = self._alloc(room, n, state)
        self.rooms[room] = rec
        rec["h"] = KVReceiver(self.mgr, addr or self.bootstrap, room, on_done=self._on_done(room))
        if init:
            rec["h"].init()
        if meta:
            self.d_meta(room)

    def d_init(self, room: int) -> None:
        self.rooms[room]["h"].init()

    def d_meta(self, room: int) -> None:
        rec = self.rooms[room]
        rec["h"].send_metadata(
            rec["pages"], rec["row"], [rec["slot"]] if rec["slot"] is not None else None
        )

    def d_meta_as(self, room: int, other: int) -> None:
        """``room``'s metadata naming ``other``'s kv pages (a buggy scheduler: two rooms,
        one destination); its own state slot and aux row."""
        rec = self.rooms[room]
        rec["h"].send_metadata(
            self.rooms[other]["pages"],
            rec["row"],
            [rec["slot"]] if rec["slot"] is not None else None,
        )

    def d_meta_raw(self, room: int, kv, aux, state=None) -> None:
        self.rooms[room]["h"].send_metadata(kv, aux, state)

    def verify(self, room: int) -> int:
        """Bad items of a successful room (0 = byte-exact); frees its resources."""
        rec = self.rooms[room]
        import torch

        bad = 0
        ks = list(range(rec["n"]))
        for e, v in enumerate(self.views):
            if rec["n"]:
                got = v[rec["pages"].to(v.device)].cpu()
                bad += int((got != pattern(room, ks, e, v.shape[1])).any(dim=1).sum())
        if rec["slot"] is not None:
            for e, v in enumerate(self.state_views):
                bad += int(
                    not torch.equal(v[rec["slot"]].cpu(), pattern(room, [1000], e, v.shape[1])[0])
                )
        bad += int(self.aux.first_token(rec["row"]) != first_token(room))
        if not rec.get("freed"):
            self._free(rec)
            rec["freed"] = True
        return bad

    def corrupt_before_check(
        self, room: int, group: str, index: int = 0, entry: int = 0, byte: int = 0
    ) -> None:
        """Integrity test hook: once ``room``'s bytes have landed and right before decode
        checks them, flip byte ``byte`` of the room's ``index``-th destination item of
        ``group`` ("kv": page, "state": slot, "aux": row) in descriptor ``entry``."""
        import torch

        integ = self.mgr.integrity

        def flip(r) -> None:
            if r.room != room:
                return
            integ.before_check = None
            rec = self.rooms[room]
            if group == "kv":
                view, row = self.views[entry], int(rec["pages"][index])
            elif group == "state":
                view, row = self.state_views[entry], rec["slot"]
            else:
                view, row = torch.from_numpy(self.aux.data), rec["row"]
            view[row, byte] = view[row, byte] ^ 0xFF

        integ.before_check = flip

    # -- token-keyed content (different page sizes, decode prefixes) --
    def _token_bytes(self, room: int, pages: int):
        """Per kv descriptor, ``uint8 [pages, item_len]``: the request's first ``pages``
        pages at our page size, each byte keyed by (token, segment, byte in the token row)
        through our token geometry (``kv_segments``), so any page size sees the same tokens."""
        import torch

        ps, out = self.pool.page_size, []
        for e, segs in enumerate(self.mgr.args.kv_segments):
            cols = []
            for j, tb in enumerate(segs):
                t = torch.arange(pages * ps)[:, None]
                b = torch.arange(tb)[None, :]
                cols.append(((room * 31 + e * 13 + j * 5 + 7 * t + 3 * b) % 251).reshape(pages, -1))
            out.append(torch.cat(cols, dim=1).to(torch.uint8))
        return out

    def p_open_tokens(self, room: int, tokens: int, state: bool = True) -> None:
        """Prefill a request of ``tokens`` tokens (last page partial if so) with token-keyed
        content; send with :meth:`p_send` (pages)."""
        from kvxfer.disagg import KVSender

        n = -(-tokens // self.pool.page_size)
        rec = self._alloc(room, n, state)
        rec["tokens"] = tokens
        for v, want in zip(self.views, self._token_bytes(room, n)):
            if n:
                v[rec["pages"].to(v.device)] = want.to(v.device)
        if rec["slot"] is not None:
            for e, v in enumerate(self.state_views):
                v[rec["slot"]] = pattern(room, [1000], e, v.shape[1])[0].to(v.device)
        self.aux.set_output(rec["row"], first_token(room))
        self.rooms[room] = rec
        rec["h"] = KVSender(self.mgr, self.bootstrap, room, on_done=self._on_done(room))
        rec["h"].init(n, rec["row"])

    def d_open_tokens(
        self,
        room: int,
        tokens: int,
        prefix: int = 0,
        addr: Optional[str] = None,
        declare: bool = True,
        state: bool = True,
        pages: Optional[int] = None,
    ) -> None:
        """Decode a request of ``tokens`` tokens of which we hold the first ``prefix``: every
        byte of our pages starts as UNWRITTEN; ``declare``: pass ``num_tokens``; ``pages``:
        allocate that many pages instead of the tokens' count (a scheduler bug)."""
        from kvxfer.disagg import KVReceiver

        n = -(-tokens // self.pool.page_size) if pages is None else pages
        rec = self._alloc(room, n, state)
        rec["tokens"] = tokens
        for v in self.views:
            if n:
                v[rec["pages"].to(v.device)] = UNWRITTEN
        self.rooms[room] = rec
        rec["h"] = KVReceiver(self.mgr, addr or self.bootstrap, room, on_done=self._on_done(room))
        rec["h"].init()
        rec["h"].send_metadata(
            rec["pages"],
            rec["row"],
            [rec["slot"]] if rec["slot"] is not None else None,
            prefix_len=prefix,
            num_tokens=tokens if declare else None,
        )

    def verify_tokens(self, room: int, prefix: int, upto: int) -> dict:
        """Bytes off of a successful token-keyed room: token slots ``[prefix, upto)`` must
        hold the content, every other byte of our pages must still be UNWRITTEN (``upto``:
        the request's tokens, or further when slots past them were copied too — whole pages,
        or an undeclared token count). Frees the room's resources."""
        import torch

        rec = self.rooms[room]
        ps, n, hi = self.pool.page_size, rec["n"], upto
        out = {"content": 0, "untouched": 0, "state_aux": 0}
        for v, want, segs in zip(self.views, self._token_bytes(room, n), self.mgr.args.kv_segments):
            got = v[rec["pages"].to(v.device)].cpu()
            # token index of every byte of a page, then of the request's pages
            tok = torch.cat([torch.arange(ps).repeat_interleave(tb) for tb in segs])
            tok = tok[None, :] + ps * torch.arange(n)[:, None]
            moved = (tok >= prefix) & (tok < hi)
            out["content"] += int((got[moved] != want[moved]).sum())
            out["untouched"] += int((got[~moved] != UNWRITTEN).sum())
        if rec["slot"] is not None:
            for e, v in enumerate(self.state_views):
                out["state_aux"] += int(
                    not torch.equal(v[rec["slot"]].cpu(), pattern(room, [1000], e, v.shape[1])[0])
                )
        out["state_aux"] += int(self.aux.first_token(rec["row"]) != first_token(room))
        if not rec.get("freed"):
            self._free(rec)
            rec["freed"] = True
        return out

    # -- both --
    def ids(self, room: int) -> dict:
        rec = self.rooms[room]
        return {"pages": [int(x) for x in rec["pages"]], "slot": rec["slot"], "row": rec["row"]}

    def geometry(self) -> dict:
        return {"kv_entries": len(self.views), "state_entries": len(self.state_views)}

    def new_handle(self, room: int) -> None:
        """A second handle for an existing room id (must raise DuplicateRoom)."""
        from kvxfer.disagg import KVReceiver, KVSender

        cls = KVSender if self.role == "prefill" else KVReceiver
        cls(self.mgr, self.bootstrap, room)

    def poll(self, room: int) -> str:
        return self.rooms[room]["h"].poll().name

    def poll_until(self, room: int, states, timeout: float = 10.0) -> str:
        """What a scheduler does: poll() each iteration until one of ``states``."""
        h = self.rooms[room]["h"]
        end = time.monotonic() + timeout
        while True:
            s = h.poll().name
            if s in states or time.monotonic() > end:
                return s
            time.sleep(0.0005)

    def deaf(self, on: bool, keep_native: bool = False) -> None:
        """Test hook: the manager's loop stops (``on``) or resumes watching its transport's
        completion queue, and (unless ``keep_native``) its native receive thread stops
        handing it over (``KVManager.take_natively``), so that meanwhile only ``poll()``'s
        take (``KVManager.take_arrived``) handles what arrives there (Done, flush
        completions)."""
        tr = self.mgr.engine.transport
        fd = tr._cq.fileno()
        loop, mgr = self.mgr.loop, self.mgr
        if on:
            if not keep_native:
                mgr.take_natively(False)
            mgr.call_wait(lambda: loop.remove_reader(fd))
        else:
            mgr.call_wait(lambda: loop.add_reader(fd, tr._on_completions))
            mgr.take_natively(mgr.native_takes)

    def quiet(self, within: float = 10.0) -> None:
        """Test hook: wait (bounded) until nothing of this manager is in flight on its loop
        (no spawned task but the heartbeat's, e.g. a message whose send has not completed,
        and nothing queued in its transport's completion queue) and its loop waits for
        events again (its gate free): what arrives next finds the loop idle, unless a
        timer wakes it."""
        mgr = self.mgr
        cq = mgr.engine.transport._cq
        lt = mgr._thread
        end = time.monotonic() + within

        def busy() -> list:  # (the heartbeat's task runs for the manager's life)
            names = [t.get_coro().__qualname__ for t in mgr._tasks]
            return [n for n in names if not n.endswith("._heartbeat")] + ["queued"] * cq.queued

        while True:
            left = mgr.call_wait(busy)
            if not left:
                break
            assert time.monotonic() < end, f"still in flight: {left}"
            time.sleep(0.001)  # polling another thread's state; bounded
        assert lt._gate.acquire(timeout=within), "the loop did not go back to its wait"
        lt._gate.release()

    def hold_loop(self, on: bool) -> None:
        """Test hook: the manager's loop runs (``on``) a callback that waits (bounded, 30 s)
        until ``hold_loop(False)``, so that meanwhile the loop's gate is held (no guest run:
        the native receive thread and polls leave what arrives queued). Returns once the
        loop is inside it."""
        if not on:
            self._hold.set()
            return
        self._hold.clear()
        inside = threading.Event()

        def hold() -> None:
            inside.set()
            self._hold.wait(30)

        self.mgr.loop.call_soon_threadsafe(hold)
        assert inside.wait(10), "the loop did not run the holding callback"

    def loop_thread_name(self) -> str:
        return self.mgr._thread.name

    def toggle_native_takes(self, times: int) -> None:
        """Switch the native take off and on ``times`` times (a scheduler-side thread,
        while rooms arrive); on at the end."""
        for _ in range(times):
            self.mgr.take_natively(False)
            self.mgr.take_natively(True)

    def set_poll_takes(self, on: bool) -> None:
        self.mgr.poll_takes = on

    def spin_linger_us(self) -> float:
        """The linger of the transport's own-worker thread (µs)."""
        return self.mgr.engine.transport.spin_linger_us

    def wait_queued(self, n: int, within: float = 10.0) -> int:
        """Wait (bounded) until ``n`` completions wait in the transport's queue; returns how
        many do."""
        cq = self.mgr.engine.transport._cq
        end = time.monotonic() + within
        while cq.queued < n and time.monotonic() < end:
            time.sleep(0.001)
        return cq.queued

    def poll_all_until_done(self, rooms, timeout: float = 30.0) -> Dict[int, str]:
        """A scheduler polling every room of ``rooms`` back to back (no sleep) until each is
        terminal; returns each room's last state."""
        hs = {r: self.rooms[r]["h"] for r in rooms}
        last = {r: "" for r in rooms}
        end = time.monotonic() + timeout
        todo = set(rooms)
        while todo and time.monotonic() < end:
            for r in list(todo):
                last[r] = hs[r].poll().name
                if last[r] in ("Success", "Failed"):
                    todo.discard(r)
        return last

    def abort(self, room: int) -> None:
        self.rooms[room]["h"].abort()

    def wait(self, room: int, timeout: float = 20.0) -> Optional[dict]:
        """Block until the room was released (on_done ran); returns its final result."""
        rec = self.rooms[room]
        if not rec["done"].wait(timeout):
            return None
        r = dict(rec["result"])
        r["failure"] = repr(rec["h"].failure_exception())
        return r

    def held(self, room: int, timeout: float = 30.0) -> bool:
        """Wait (bounded) until ``room`` (or a leg of it) failed and its items are held for a
        peer that may still write (kvxfer.disagg.manager: KVManager._hold): on_done has not
        run."""
        mgr = self.mgr

        def check() -> bool:
            r = mgr.rooms.get(room)
            if r is None or r.released:
                return False
            held = list(mgr.held.values())
            return any(x.held and x.link in held for x in (r.legs.legs() if r.legs else [r]))

        end = time.monotonic() + timeout
        while not mgr.call_wait(check):
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
        return not self.rooms[room]["done"].is_set()

    def held_rooms(self) -> int:
        return self.mgr.held_rooms()

    def leaks(self) -> dict:
        with self.lock:
            now = self._counts()
        out = {k: self.base[k] - now[k] for k in now}
        out["rooms"] = len(self.mgr.rooms)
        return out

    def api_waits(self, rooms) -> dict:
        """The blocking / foreign-loop / in-loop ways to wait, from this (non-loop) thread."""
        import asyncio

        from kvxfer.errors import InvalidArgument

        hs = [self.rooms[r]["h"] for r in rooms]
        out = {
            "blocking": [h.wait_blocking(20).name for h in hs],
            "foreign_loop": [asyncio.run(h.wait(20)).name for h in hs[:2]],
        }
        try:
            self.mgr.call_wait(hs[0].wait_blocking)
        except InvalidArgument as exc:
            out["in_loop_blocking"] = str(exc)
        return out

    def debug_links(self) -> list:
        return [(repr(lk), [repr(r) for r in list(lk.rooms)[:3]]) for lk in self.mgr.links.values()]

    def drained(self) -> None:
        """Return once every call handed to the manager's loop so far has run."""
        self.mgr.call_wait(lambda: None)

    def stats(self) -> dict:
        s = dict(self.mgr.stats)
        s["lanes"] = sorted(s["lanes"])
        return s

    def device_lanes(self) -> dict:
        """Per linked peer: the device lane's status and why regions stayed on UCX, and
        whether PatternWrites of kv go over it (diagnostics for assertion messages)."""
        out = {}
        for key, link in list(self.mgr.links.items()):
            peer = link.peer
            dev = getattr(peer, "_dev", None)
            out[key] = (
                peer.device_lane,
                list(getattr(dev, "failures", []) or []),
                peer.can_pattern("kv"),
            )
        return out

    # -- batches (thousands of rooms without thousands of RPCs) --
    def batch(self, calls) -> list:
        """``[(Node.method, *args), ...]``, called in order; returns their results."""
        return [method(self, *args) for method, *args in calls]

    def wait_all(self, rooms, timeout: float = 60.0) -> dict:
        end = time.monotonic() + timeout
        out: Dict[str, int] = {}
        for room in rooms:
            ok = self.rooms[room]["done"].wait(max(0.0, end - time.monotonic()))
            res = self.rooms[room]["result"] if ok else {"state": "Timeout", "exc": None}
            s = res["state"] if res["state"] == "Success" else f"{res['state']}: {res['exc']}"
            out[s] = out.get(s, 0) + 1
            if res["state"] != "Success" and "first_failure" not in out:
                out["first_failure"] = res.get("msg", "")
        return out

    def close(self) -> None:
        self.mgr.close_background()


def build_nodes(nodes_spec: dict) -> Dict[str, Node]:
    """Worker entry (in the child): one :class:`Node` per ``{name: Node kwargs}``."""
    import logging

    import torch

    torch.set_num_threads(1)  # no OpenMP spinning threads starving the managers' loops
    logging.basicConfig(level=os.environ.get("KVXFER_TEST_LOG", "WARNING"))
    nodes: Dict[str, Node] = {}
    try:
        for name, kw in nodes_spec.items():
            nodes[name] = Node(**kw)
    except BaseException:
        for node in nodes.values():
            node.close()
        raise
    return nodes


class Worker(procs.Worker):
    """A spawned worker process hosting ``nodes_spec`` ({name: Node kwargs}) with ``env``
    added to its environment; ``w[name]`` is a proxy typed as :class:`Node`."""

    def __init__(self, nodes_spec: dict, env: Optional[Dict[str, str]] = None) -> None:
        super().__init__(
            build_nodes,
            nodes_spec,
            name="+".join(f"{kw.get('role', '')}-{n}" for n, kw in nodes_spec.items()),
            env=env,
        )
        self._nodes: Dict[str, Node] = {}
        self.launch()

    def __getitem__(self, name: str) -> Node:
        if name not in self._nodes:
            self._nodes[name] = self.proxy(Node, name)
        return self._nodes[name]
