"""One worker of the reliability scenarios: real pools, real allocators and a KVManager on real
UCX, used only through the public API (KVManager, KVSender, KVReceiver, KVPoll,
BootstrapServer). A spawned child (:func:`kvxfer.pd_demo.worker.build_worker`) builds it; the
parent drives it through a typed proxy (:mod:`kvxfer.procs`), or hands it a whole
soak plan (:meth:`RelNode.soak`).

Pools come from the demo's synthetic model (:class:`kvxfer.pd_demo.model.DemoModel`), but
content is written and checked per *registered item* (one page of every descriptor, one state
slot, one aux row), which is what the transfer layer moves. Every registered item is always
in one of three places, and each is checked:

* **guard items** — page 0 (the pool's padding page), the last ``guard`` pages, slot 0 and the
  last ``guard`` state slots, ``guard`` aux rows at each end. Registered with UCX like the
  others but never given to any request; they hold this side's sentinel for the whole run.
* **free items** hold this side's sentinel (``0x5A`` on prefill, ``0xA5`` on decode): written at
  start and by ``on_done`` (on the manager's loop, *before* the items go back to their
  allocator), re-checked whenever an allocator hands an item out again and, for every free
  item, by ``check``. A changed byte in a free item is a write that landed after the release
  of its room was reported: a **late write** (counted per group, with the room that last
  owned the item). Prefill's ``on_done`` overwrites its source items (the scheduler reusing
  them), so a write that still reads them afterwards delivers sentinel bytes to decode.
* **a request's items**: prefill fills them with a pattern of (room, page, descriptor, byte);
  decode compares every byte of every page, the state slot and the aux row's payload and
  first token when the room reports ``Success`` (a mismatch is **corruption**); for a failed
  room it counts how many pages had fully landed (evidence of a write cut mid-way).

``on_done`` calls are counted per room (a second call is counted, never acted upon); leaks
are allocator counts and live rooms; RSS and open fds are sampled for the report.
"""

from __future__ import annotations

import collections
import ctypes
import os
import queue
import threading
import time
from typing import Dict, List, Optional

SENTINEL = {"prefill": 0x5A, "decode": 0xA5}
TERMINAL = ("Success", "Failed")
_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 1 << 14, 1 << 19, 2


def enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` the way ``ip netns exec`` does: join
    the namespace, then, in a private mount namespace, mount a sysfs of it on /sys (UCX finds
    its network devices there). Threads started afterwards (the manager's loop, UCX's progress
    thread) inherit both."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} (netns {name}): {os.strerror(err)}")

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def secret_kw() -> dict:
    """``secret=`` for KVManager / BootstrapServer: ``KVXFER_SECRET`` when set (the parent
    sets it for its children), else nothing (the library's default)."""
    s = os.environ.get("KVXFER_SECRET")
    return {"secret": s.encode()} if s else {}


def bootstrap_server(host: str = "127.0.0.1"):
    """A started BootstrapServer (background thread) on ``host``, port 0; given the shared
    secret when this version of the server takes one."""
    import inspect

    from kvxfer.disagg import BootstrapServer

    kw = secret_kw() if "secret" in inspect.signature(BootstrapServer).parameters else {}
    return BootstrapServer(host, 0, **kw).start_in_thread()


_TABLES: Dict[int, "object"] = {}


def pattern(room: int, ks, e: int, nbytes: int):
    """``uint8 [len(ks), nbytes]``: item ``k`` of ``room`` in descriptor ``e``, byte ``j`` =
    ``((room % 251) * 31 + 13 e + 7 k + j) % 251``. Consecutive bytes differ, so no row equals
    a sentinel row. Rows are gathered from a table of the 251 possible rows (one per start
    value), so building 2048 pages of 16 KiB costs one 32 MiB copy."""
    import torch

    table = _TABLES.get(nbytes)
    if table is None:
        table = _TABLES[nbytes] = (
            (torch.arange(251)[:, None] + torch.arange(nbytes)[None, :]) % 251
        ).to(torch.uint8)
    ks = torch.as_tensor(ks, dtype=torch.int64)
    return table[((room % 251) * 31 + e * 13 + 7 * ks) % 251]


def first_token(room: int) -> int:
    return room % 1000003


class Stuck(RuntimeError):
    """No room of this worker was released within the scheduler's deadline."""


class RelNode:
    """Pools + allocators + KVManager of one side (``role``), see the module docstring.

    ``opts``: ``timeouts`` (Timeouts kwargs), ``error_mode``, ``guard`` (items per end),
    ``host`` (engine listener, default 127.0.0.1), ``netns`` (enter this namespace first),
    ``env`` (set before UCX starts, e.g. ``UCX_TLS``), ``serve_bootstrap`` (prefill: host the
    bootstrap server in this process on ``host``; its address is in ``info``)."""

    def __init__(self, role: str, spec: dict, bootstrap: Optional[str], opts: dict) -> None:
        import torch

        from kvxfer.disagg import KVManager, Timeouts
        from kvxfer.pd_demo.model import DemoModel
        from kvxfer.pd_demo.spec import ModelSpec
        from kvxfer.pools.allocator import PagedTokenToKVPoolAllocator
        from kvxfer.pools.mamba_alloc import MambaSlotAllocator

        if opts.get("netns"):
            enter_netns(opts["netns"])
        os.environ.update(opts.get("env", {}))
        self.role, self.opts = role, opts
        self.host = opts.get("host", "127.0.0.1")
        self.bs = None
        if opts.get("serve_bootstrap"):
            self.bs = bootstrap_server(self.host)
            bootstrap = self.bs.address
        self.bootstrap = bootstrap
        self.sentinel = SENTINEL[role]
        self.model = m = DemoModel(ModelSpec(**spec))
        g = int(opts.get("guard", 2))
        self.views = m.pool.get_item_views()
        self.state_views = m.pool.get_state_item_views() if m.mamba is not None else []
        n_pages = self.views[0].shape[0] - 1  # ids 1..n_pages, 0 = padding
        n_slots = self.state_views[0].shape[0] - 1 if self.state_views else 0
        n_rows = m.aux.rows
        self.pages = PagedTokenToKVPoolAllocator((n_pages - g) * m.ps, m.ps)
        self.slots = MambaSlotAllocator(n_slots - g) if n_slots else None
        self.aux = m.aux
        rows = [self.aux.alloc() for _ in range(n_rows)]  # rows 0..n_rows-1
        for r in reversed(rows[g : n_rows - g]):  # next alloc: row g first
            self.aux.free(r)
        self.guard_ids = {
            "kv": [0] + list(range(n_pages - g + 1, n_pages + 1)),
            "state": ([0] + list(range(n_slots - g + 1, n_slots + 1)) if n_slots else []),
            "aux": rows[:g] + rows[n_rows - g :],
        }
        self.free_ids = {
            "kv": set(range(1, n_pages - g + 1)),
            "state": set(range(1, n_slots - g + 1)) if n_slots else set(),
            "aux": set(rows[g : n_rows - g]),
        }
        self.last_owner: Dict[str, Dict[int, int]] = {"kv": {}, "state": {}, "aux": {}}
        self.full = self._counts()
        for v in self.views + self.state_views:
            v.fill_(self.sentinel)
        self.aux.data[:] = self.sentinel
        self.lock = threading.Lock()
        self.recs: Dict[int, dict] = {}
        self.events: "queue.SimpleQueue[int]" = queue.SimpleQueue()
        self.tally: collections.Counter = collections.Counter()
        self.late: List[dict] = []  # first few late-write findings
        self.late_by: collections.Counter = collections.Counter()
        self.kind_of: Dict[int, str] = {}  # soak: room -> how the plan aborts it
        self.aborted_in: collections.Counter = collections.Counter()  # soak: state at abort
        self.outcomes: Dict[int, str] = {}
        self._torch = torch
        self.mgr = KVManager(
            m.kv_args,
            role,
            bootstrap_addr=bootstrap if role == "prefill" else None,
            host=self.host,
            error_mode=opts.get("error_mode", "peer"),
            timeouts=Timeouts(**opts.get("timeouts", {})),
            name=f"rel-{role}-{os.getpid()}",
            **secret_kw(),
        ).start_background()
        self.rss0, self.fds0 = rss_mib(), open_fds()

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        self.mgr.close_background()
        if self.bs is not None:
            self.bs.stop_thread()

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "bootstrap": self.bootstrap,
            "address": list(self.mgr.address),
            "free": self.full,
            "page_bytes": sum(int(v.shape[1]) for v in self.views),
        }

    def _counts(self) -> dict:
        return {
            "pages": self.pages.available_pages(),
            "slots": self.slots.available_size() if self.slots is not None else 0,
            "aux": self.aux.available(),
        }

    # ------------------------------------------------------------------ items
    def _item_views(self, group: str):
        return {"kv": self.views, "state": self.state_views}.get(group)

    def _not_sentinel(self, group: str, ids: List[int]) -> List[int]:
        """Ids among ``ids`` whose bytes are not all this side's sentinel."""
        if not ids:
            return []
        torch = self._torch
        if group == "aux":
            rows = self.aux.data[ids]
            return [i for i, bad in zip(ids, (rows != self.sentinel).any(axis=1)) if bad]
        idx = torch.as_tensor(ids, dtype=torch.int64)
        bad = torch.zeros(len(ids), dtype=torch.bool)
        for v in self._item_views(group):
            bad |= (v[idx] != self.sentinel).any(dim=1)
        return [ids[i] for i in bad.nonzero().flatten().tolist()]

    def _late(self, group: str, ids: List[int], when: str) -> None:
        for i in self._not_sentinel(group, ids):
            self.tally[f"late_writes_{group}"] += 1
            last = self.last_owner[group].get(i)
            self.late_by[f"{group} of a room {self.kind_of.get(last, 'not aborted')}"] += 1
            if len(self.late) < 8:
                self.late.append(
                    {
                        "group": group,
                        "item": i,
                        "found": when,
                        "last_room": self.last_owner[group].get(i),
                    }
                )

    def _alloc(self, n: int) -> Optional[dict]:
        """Pages + state slot + aux row (caller holds the lock), checking that each item
        still holds the sentinel it got when it was last freed; None when it does not fit."""
        if self.aux.available() == 0 or self.pages.available_pages() < n:
            return None
        if self.slots is not None and self.slots.available_size() == 0:
            return None
        pages = self.pages.alloc_pages(n)
        if pages is None:
            return None
        slot = self.slots.alloc(1)[0] if self.slots is not None else None
        row = self.aux.alloc()
        rec = {
            "pages": pages,
            "ids": [int(p) for p in pages],
            "slot": slot,
            "row": row,
            "n": n,
            "calls": 0,
            "done": threading.Event(),
            "state": None,
        }
        for group, ids in (
            ("kv", rec["ids"]),
            ("state", [] if slot is None else [slot]),
            ("aux", [row]),
        ):
            self.free_ids[group].difference_update(ids)
            self._late(group, ids, "reuse")
        return rec

    def _release(self, rec: dict) -> None:
        """Sentinel into every item of ``rec``, then back to the allocators (lock held)."""
        idx, room = rec["pages"], rec["room"]
        for v in self.views:
            v[idx] = self.sentinel
        if rec["slot"] is not None:
            for v in self.state_views:
                v[rec["slot"]] = self.sentinel
        self.aux.data[rec["row"]] = self.sentinel
        if rec["n"]:
            self.pages.free_pages(idx)
        if rec["slot"] is not None:
            self.slots.free([rec["slot"]])
        self.aux.free(rec["row"])
        for group, ids in (
            ("kv", rec["ids"]),
            ("state", [] if rec["slot"] is None else [rec["slot"]]),
            ("aux", [rec["row"]]),
        ):
            self.free_ids[group].update(ids)
            for i in ids:
                self.last_owner[group][i] = room

    def _fill(self, rec: dict) -> None:
        room, idx = rec["room"], rec["pages"]
        for e, v in enumerate(self.views):
            if rec["n"]:
                v[idx] = pattern(room, range(rec["n"]), e, v.shape[1])
        if rec["slot"] is not None:
            for e, v in enumerate(self.state_views):
                v[rec["slot"]] = pattern(room, [1000], e, v.shape[1])[0]
        payload = pattern(room, [2000], 0, self.aux.row_bytes - 24)[0].numpy().tobytes()
        self.aux.set_output(rec["row"], first_token(room), payload)

    def _landed(self, rec: dict):
        """(pages whose every descriptor holds the pattern, items that differ in all)."""
        torch = self._torch
        room, n = rec["room"], rec["n"]
        ok = torch.ones(n, dtype=torch.bool)
        for e, v in enumerate(self.views):
            if n:
                ok &= (v[rec["pages"]] == pattern(room, range(n), e, v.shape[1])).all(dim=1)
        bad = n - int(ok.sum())
        if rec["slot"] is not None:
            for e, v in enumerate(self.state_views):
                bad += int(not torch.equal(v[rec["slot"]], pattern(room, [1000], e, v.shape[1])[0]))
        want = pattern(room, [2000], 0, self.aux.row_bytes - 24)[0].numpy().tobytes()
        bad += int(
            self.aux.first_token(rec["row"]) != first_token(room)
            or self.aux.payload(rec["row"], self.aux.row_bytes - 24) != want
        )
        return int(ok.sum()), bad

    def _on_done(self, rec: dict):
        def cb(state, exc) -> None:  # manager loop thread
            with self.lock:
                rec["calls"] += 1
                if rec["calls"] > 1:
                    self.tally["on_done_twice"] += 1
                    return
                rec.update(
                    state=state.name,
                    exc=type(exc).__name__ if exc else None,
                    msg=str(exc)[:300] if exc else "",
                    t_done=time.monotonic(),
                )
                if self.role == "decode":
                    rec["landed"], bad = self._landed(rec)
                    if state.name == "Success":
                        self.tally["rooms_verified"] += 1
                        self.tally["pages_verified"] += rec["n"]
                        if bad:
                            self.tally["corrupt_rooms"] += 1
                            self.tally["corrupt_items"] += bad
                        rec["bad"] = bad
                self._release(rec)
                self.outcomes[rec["room"]] = (
                    state.name if exc is None else f"{state.name}:{type(exc).__name__}"
                )
            rec["done"].set()
            self.events.put(rec["room"])

        return cb

    # ------------------------------------------------------------------ rooms (RPC)
    def open(
        self,
        room: int,
        n: int,
        init: bool = True,
        meta: bool = True,
        bootstrap: Optional[str] = None,
    ) -> None:
        """Allocate and open a room. Prefill: fill the pattern, KVSender, ``init`` declares
        it. Decode: KVReceiver, ``init`` connects, ``meta`` sends the destination."""
        with self.lock:
            rec = self._alloc(n)
            if rec is None:
                raise MemoryError(f"{self.role}: no room for {n} pages")
            rec["room"] = room
            if self.role == "prefill":
                self._fill(rec)
        self._open(rec, bootstrap or self.bootstrap)
        if init:
            self.init(room)
            if meta and self.role == "decode":
                self.meta(room)

    def _open(self, rec: dict, bootstrap: str) -> None:
        from kvxfer.disagg import KVReceiver, KVSender

        cls = KVSender if self.role == "prefill" else KVReceiver
        self.recs[rec["room"]] = rec
        rec["h"] = cls(self.mgr, bootstrap, rec["room"], on_done=self._on_done(rec))

    def init(self, room: int) -> None:
        rec = self.recs[room]
        if self.role == "prefill":
            rec["h"].init(rec["n"], rec["row"])
        else:
            rec["h"].init()

    def meta(self, room: int) -> None:
        rec = self.recs[room]
        rec["h"].send_metadata(
            rec["pages"], rec["row"], None if rec["slot"] is None else [rec["slot"]]
        )

    def send(self, room: int, lo: int, hi: int) -> None:
        rec = self.recs[room]
        last = hi == rec["n"]
        rec["h"].send(
            rec["pages"][lo:hi], [rec["slot"]] if last and rec["slot"] is not None else None
        )

    def abort(self, room: int) -> None:
        self.recs[room]["h"].abort()

    def poll(self, room: int) -> Optional[str]:
        """The room's state, or None when this worker has no such room."""
        rec = self.recs.get(room)
        return None if rec is None else rec["h"].poll().name

    def poll_until(self, room: int, states, timeout: float = 10.0) -> str:
        """What a scheduler does: poll() each iteration until one of ``states`` (or a
        terminal state, or ``timeout``); returns the last state seen."""
        h = self.recs[room]["h"]
        end = time.monotonic() + timeout
        while True:
            s = h.poll().name
            if s in states or s in TERMINAL or time.monotonic() > end:
                return s
            time.sleep(0.0005)

    def wait_landed(self, room: int, timeout: float = 10.0) -> bool:
        """Decode: poll until the first page of ``room`` holds its pattern (its write has
        begun to land); False after ``timeout``."""
        rec = self.recs[room]
        page = rec["pages"][:1]
        want = [pattern(room, [0], e, v.shape[1]) for e, v in enumerate(self.views)]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(bool((v[page] == w).all()) for v, w in zip(self.views, want)):
                return True
            time.sleep(0.0005)
        return False

    def _result(self, rec: dict) -> dict:
        return {
            k: rec.get(k) for k in ("state", "exc", "msg", "t_done", "calls", "landed", "bad", "n")
        }

    def wait(self, room: int, timeout: float) -> dict:
        """Block until the room was released (``on_done`` ran) or ``timeout``; its result
        (``state`` None: not released)."""
        rec = self.recs[room]
        rec["done"].wait(timeout)
        return self._result(rec)

    def results(self, rooms) -> Dict[int, dict]:
        """Results of those of ``rooms`` this worker opened."""
        return {r: self._result(self.recs[r]) for r in rooms if r in self.recs}

    def poke(self, group: str, item: int, value: int = 0x11) -> None:
        """Change one byte of an item behind the transfer layer's back: the self-test that
        shows each check (late write, guard, corruption) does fire."""
        with self.lock:
            if group == "aux":
                self.aux.data[item, 40] = value
            else:
                self._item_views(group)[0][item, 0] = value

    def close_manager(self) -> float:
        """Close the KVManager gracefully (the process and its pools stay, for the checks);
        returns when it finished."""
        self.mgr.close_background()
        return time.monotonic()

    def ids(self, room: int) -> dict:
        rec = self.recs[room]
        return {"kv": rec["ids"], "state": rec["slot"], "aux": rec["row"]}

    # ------------------------------------------------------------------ checks
    def check(self, settle_s: float = 0.0) -> dict:
        """Wait up to ``settle_s`` for every opened room to be released, then scan every
        free and guard item for its sentinel and count what is still held."""
        end = time.monotonic() + settle_s
        for rec in list(self.recs.values()):
            rec["done"].wait(max(0.0, end - time.monotonic()))
        with self.lock:
            for group in ("kv", "state", "aux"):
                self._late(group, sorted(self.free_ids[group]), "check")
                bad = self._not_sentinel(group, self.guard_ids[group])
                self.tally[f"guard_{group}"] += len(bad)
            now = self._counts()
            leaks = {k: self.full[k] - now[k] for k in now}
        leaks["rooms"] = len(self.mgr.rooms)
        unreleased = [r for r, rec in self.recs.items() if rec["calls"] == 0]
        t = self.tally
        return {
            "leaks": leaks,
            "unreleased": len(unreleased),
            "late_writes": {g: t[f"late_writes_{g}"] for g in ("kv", "state", "aux")},
            "late_examples": list(self.late),
            "late_by": dict(self.late_by),
            "guard_hits": {g: t[f"guard_{g}"] for g in ("kv", "state", "aux")},
            "on_done_twice": t["on_done_twice"],
            "corrupt_rooms": t["corrupt_rooms"],
            "corrupt_items": t["corrupt_items"],
            "rooms_verified": t["rooms_verified"],
            "pages_verified": t["pages_verified"],
            "late_calls": {k[10:]: v for k, v in t.items() if k.startswith("late_call_")},
            "rss_mib": [round(self.rss0, 1), round(rss_mib(), 1)],
            "fds": [self.fds0, open_fds()],
            "lanes": sorted(self.mgr.stats["lanes"]),
        }

    # ------------------------------------------------------------------ soak
    def soak(
        self, plan_kw: dict, window: int, deadline_s: float, bootstrap: Optional[str] = None
    ) -> dict:
        """Run every request of ``make_plan(**plan_kw)`` as this side's scheduler: at most
        ``window`` rooms open, pages allocated per request, aborts where the plan says.
        Returns per-room outcomes ("Success" / "Failed:<error type>")."""
        from kvxfer.testing.reliability.plan import make_plan

        plan = make_plan(**plan_kw)
        self.kind_of = {q.room: f"aborted by {q.abort[0]} {q.abort[1]}" for q in plan if q.abort}
        bootstrap = bootstrap or self.bootstrap
        self.outcomes = {}
        self.aborted_in.clear()
        rss0, t0 = rss_mib(), time.monotonic()
        lagged: Dict[int, List[int]] = collections.defaultdict(list)
        open_: Dict[int, dict] = {}
        stuck = None
        try:
            for i, q in enumerate(plan):
                for room in lagged.pop(i, ()):
                    self._abort_if_open(room)
                rec = self._admit(q, open_, window, deadline_s)
                open_[q.room] = rec
                self._open(rec, bootstrap)
                lag = self._drive(rec, q)
                if lag is not None:
                    lagged[i + 1 + lag].append(q.room)
        except Stuck as exc:
            stuck = str(exc)
        for rooms in lagged.values():
            for room in rooms:
                self._abort_if_open(room)
        end = time.monotonic() + deadline_s
        for rec in list(open_.values()):
            rec["done"].wait(max(0.0, end - time.monotonic()))
        hung = [r for r, rec in open_.items() if not rec["done"].is_set()]
        return {
            "outcomes": dict(self.outcomes),
            "stuck": stuck,
            "aborted_in": dict(self.aborted_in),
            "hung": hung[:20],
            "n_hung": len(hung),
            "wall_s": time.monotonic() - t0,
            "rss_mib": [round(rss0, 1), round(rss_mib(), 1)],
        }

    def _admit(self, q, open_: dict, window: int, deadline_s: float) -> dict:
        """Allocate for ``q``, settling released rooms until it fits the window and pools."""
        while True:
            while True:
                try:
                    self._settled(open_, self.events.get_nowait())
                except queue.Empty:
                    break
            if len(open_) < window:
                with self.lock:
                    rec = self._alloc(q.pages)
                    if rec is not None:
                        rec["room"] = q.room
                        if self.role == "prefill":
                            self._fill(rec)
                        return rec
            if not open_:
                raise Stuck(f"{self.role}: {q.pages} pages do not fit an empty pool")
            try:
                self._settled(open_, self.events.get(timeout=deadline_s))
            except queue.Empty:
                raise Stuck(
                    f"{self.role}: no room released within {deadline_s}s ({len(open_)} open)"
                ) from None

    def _settled(self, open_: dict, room: int) -> None:
        """A released room leaves the scheduler (its outcome stays in ``outcomes``)."""
        open_.pop(room, None)
        self.recs.pop(room, None)

    def _drive(self, rec: dict, q) -> Optional[int]:
        """Issue this side's calls for ``q``; returns a lag (requests) for a deferred abort."""
        side, point, arg = q.abort or (None, None, 0)
        mine = side == self.role
        h = rec["h"]
        if mine and point == "before_init":
            self._abort(h)
            return None
        if self.role == "prefill":
            h.init(rec["n"], rec["row"])
            lo = 0
            for c, hi in enumerate(q.cuts):
                last = hi == rec["n"]
                h.send(
                    rec["pages"][lo:hi], [rec["slot"]] if last and rec["slot"] is not None else None
                )
                lo = hi
                if mine and point == "after_chunk" and c == arg:
                    self._abort(h)
                    return None
        else:
            h.init()
            if mine and point in ("before_meta", "meta_after_release"):
                self._abort(h)
                if point == "meta_after_release":
                    self._late_call(rec)
                return None
            h.send_metadata(
                rec["pages"], rec["row"], None if rec["slot"] is None else [rec["slot"]]
            )
        return arg if mine and point == "lag" else None

    def _late_call(self, rec: dict) -> None:
        """``send_metadata()`` on a room whose ``on_done`` already ran (see the plan)."""
        from kvxfer.errors import KvxferError

        ack_s = self.opts.get("timeouts", {}).get("abort_ack_s", 10.0)
        if not rec["done"].wait(ack_s + 5.0):
            self.tally["late_call_unreleased"] += 1
            return
        try:
            rec["h"].send_metadata(
                rec["pages"], rec["row"], None if rec["slot"] is None else [rec["slot"]]
            )
            self.tally["late_call_accepted"] += 1
        except KvxferError:
            self.tally["late_call_rejected"] += 1

    def _abort_if_open(self, room: int) -> None:
        rec = self.recs.get(room)
        if rec is not None and not rec["done"].is_set():
            self._abort(rec["h"])

    def _abort(self, h) -> None:
        """abort(), counting the state the room was in (the soak's coverage of states)."""
        self.aborted_in[h.poll().name] += 1
        h.abort()
