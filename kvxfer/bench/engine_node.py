"""Engines in a worker process, for ``kvxfer bench transfer`` and the multi-process tests.

:class:`EngineNode` hosts one or more engines (each a :class:`kvxfer.sync.SyncEngine`) over
numpy host buffers or torch device buffers; the parent hosts it in a
:class:`kvxfer.procs.Worker` and calls its public methods through a typed proxy::

    w = Worker(EngineNode, spec, name="A").start()
    node = w.proxy(EngineNode)
    port = node.ports()["main"]

``spec``: ``{"engines": {key: {"config": {...EngineConfig kwargs},
"groups": {name: {"item_lens": [...], "items": N, "contiguous": bool}}}}}``. With
``contiguous`` the group's descriptors are carved back to back out of one buffer
(exercises registration merging), with ``loose`` peers of other item sizes are accepted
(``item_lens_may_differ``); an engine's optional ``"device"`` ("cpu" default,
or e.g. "cuda") puts its buffers in torch device memory.
"""

from __future__ import annotations

import time
from typing import Any, Dict


def _result(fn, *args):
    """Run ``fn``; a kvxfer error becomes ``{"error": type name, "msg": text}``."""
    from kvxfer.errors import KvxferError

    try:
        return {"ok": fn(*args)}
    except KvxferError as exc:
        return {"error": type(exc).__name__, "msg": str(exc)}


async def _set_device(device):
    import torch

    dev = torch.device(device)
    # set_device needs an explicit index on some torch releases ("cuda" alone is refused).
    torch.cuda.set_device(dev.index if dev.index is not None else 0)
    torch.zeros(1, device=dev)


class EngineNode:
    """Engines over numpy host buffers, driven through :class:`kvxfer.sync.SyncEngine`."""

    def __init__(self, spec: dict):
        import threading

        import numpy as np

        from kvxfer.config import EngineConfig
        from kvxfer.sync import SyncEngine

        self.np = np
        self.engines: Dict[str, Any] = {}
        self.buffers: Dict[str, Dict[str, list]] = {}
        self._closed: Dict[str, list] = {}
        self.streams: Dict[str, dict] = {}
        self._items: Dict[str, Dict[str, int]] = {}
        self._inbox: Dict[str, list] = {}
        self._threading = threading
        self._ports = {}
        for key, e in spec["engines"].items():
            eng = SyncEngine(EngineConfig(**e["config"]))
            if str(e.get("device", "cpu")).startswith("cuda"):  # make its context current there
                eng._run(_set_device(e["device"]), 30.0)
            self.buffers[key] = {}
            self._items[key] = {g: spec_g["items"] for g, spec_g in e["groups"].items()}
            device = e.get("device", "cpu")
            for gname, g in e["groups"].items():
                bufs = self._alloc(g, device)
                self.buffers[key][gname] = bufs
                eng.register(
                    gname,
                    [self._ptr(b) for b in bufs],
                    [int(b.numel()) if device != "cpu" else b.nbytes for b in bufs],
                    list(g["item_lens"]),
                    item_lens_may_differ=bool(g.get("loose")),
                )
            self._closed[key] = []
            eng.on_peer_closed(
                lambda pid, exc, k=key: self._closed[k].append((pid, type(exc).__name__))
            )
            self._ports[key] = eng.start()[1]
            self.engines[key] = eng

    def _alloc(self, g, device):
        """Zeroed uint8 buffers, one per descriptor: numpy on "cpu", torch elsewhere; with
        ``"vmm": True`` (CUDA) in one CUDA VMM range (the pools' post-capture backing,
        POSIX-FD handles, extents of at most 4 MiB) instead of ``cudaMalloc`` memory."""
        n, ils = g["items"], list(g["item_lens"])
        if g.get("vmm"):
            return self._alloc_vmm(n * sum(ils), ils, n, device)
        if device == "cpu":
            zeros = lambda k: self.np.zeros(k, dtype=self.np.uint8)  # noqa: E731
        else:
            import torch

            zeros = lambda k: torch.zeros(k, dtype=torch.uint8, device=device)  # noqa: E731
        if g.get("contiguous"):
            whole = zeros(n * sum(ils))
            out, off = [], 0
            for il in ils:
                out.append(whole[off : off + n * il])
                off += n * il
            return out
        return [zeros(n * il) for il in ils]

    def _alloc_vmm(self, total: int, ils, n: int, device):
        import torch

        from kvxfer.pools.backing.cuda import CudaVmmProvider
        from kvxfer.pools.backing.memory import tensor_over

        dev = torch.device(device)
        provider = CudaVmmProvider(dev.index or 0, handle_types=("posix_fd",))
        g = provider.granularity
        backing = provider.reserve(-(-total // g) * g, max_extent_bytes=max(g, 4 << 20))
        backing.commit(0, total)
        self._keep = getattr(self, "_keep", []) + [provider, backing]
        whole = tensor_over(dev, backing.address, total, backing)
        whole.zero_()
        out, off = [], 0
        for il in ils:
            out.append(whole[off : off + n * il])
            off += n * il
        return out

    @staticmethod
    def _ptr(b) -> int:
        return b.ctypes.data if hasattr(b, "ctypes") else b.data_ptr()

    def _host(self, b):
        return b if hasattr(b, "ctypes") else b.cpu().numpy()

    def ports(self) -> Dict[str, int]:
        """``{engine key: listening port}`` (each engine bound port 0)."""
        return dict(self._ports)

    def engine_id(self, key) -> str:
        """Engine ``key``'s id (what its peers know it by)."""
        return self.engines[key].engine.id

    def _peer(self, key, peer_id):
        return self.engines[key].peers()[peer_id]

    # -- commands
    def connect(self, key, host, port, timeout=None):
        return _result(lambda: self.engines[key].connect(host, port, timeout).id)

    def fill(self, key, group, seed):
        rng = self.np.random.default_rng(seed)
        for i, b in enumerate(self.buffers[key][group]):
            if hasattr(b, "ctypes"):
                b[:] = rng.integers(0, 256, len(b), dtype=self.np.uint8)
            else:  # device memory: generate there (fast for GiB pools)
                import torch

                gen = torch.Generator(device=b.device).manual_seed(seed * 1000 + i)
                b.copy_(
                    torch.randint(
                        0, 256, b.shape, dtype=torch.uint8, device=b.device, generator=gen
                    )
                )

    def zero(self, key, group):
        for b in self.buffers[key][group]:
            b[:] = 0

    def items(self, key, group, ids):
        """Bytes of the given items across every descriptor (descriptor-major)."""
        n = self._items[key][group]
        idx = self.np.asarray(ids, dtype=self.np.int64)
        return b"".join(
            self._host(b).reshape(n, -1)[idx].tobytes() for b in self.buffers[key][group]
        )

    def bytes(self, key, group, desc, off, n):
        return self._host(self.buffers[key][group][desc])[off : off + n].tobytes()

    def checksum(self, key, group):
        return [int(self._host(b).sum(dtype=self.np.uint64)) for b in self.buffers[key][group]]

    def _writes(self, parts):
        """``(group, src_ids, dst_ids)`` → ItemWrite; ``(group, src_ids, dst_ids, runs)`` →
        PatternWrite; ``(group, src_off, dst_off, nbytes, desc)`` → RawWrite;
        ``("slice", group, src_ids, dst_ids, sides, key)`` → SliceWrite."""
        from kvxfer.engine import ItemWrite, PatternWrite, RawWrite, SliceWrite

        kinds = {3: ItemWrite, 4: PatternWrite}
        return [
            SliceWrite(*p[1:]) if p[0] == "slice" else kinds.get(len(p), RawWrite)(*p)
            for p in parts
        ]

    def peer_names(self, key):
        """``{peer id: the peer engine's name}``."""
        return {pid: p._peer.name for pid, p in self.engines[key].peers().items()}

    def expect_slices(self, key, peer_id, slice_key, group, items, sides):
        """``Peer.expect_slices`` on the engine's loop (the target of a SliceWrite)."""
        peer = self._peer(key, peer_id)._peer

        async def go():
            peer.expect_slices(slice_key, group, items, sides)

        return _result(lambda: self.engines[key]._run(go(), 30.0))

    def write(self, key, peer_id, parts, notify=None, timeout=None):
        def go():
            p = self._peer(key, peer_id)
            st = p.write(self._writes(parts), notify, timeout)
            lane = getattr(getattr(p, "_peer", p), "_hostl", None)
            return {
                "host_patterns": 0 if lane is None else lane.patterns,
                "device_lane": getattr(p, "_peer", p).device_lane,
                "host_lane": getattr(p, "_peer", p).host_lane,
                "bytes": st.bytes,
                "ops": st.ops,
                "lanes": st.lanes,
                "post_s": st.post_s,
                "complete_s": st.complete_s,
                "flush_s": st.flush_s,
                "device_bytes": st.device_bytes,
                "device_ops": st.device_ops,
                "host_bytes": st.host_bytes,
                "host_ops": st.host_ops,
            }

        return _result(go)

    def write_peer_dies_mid_copy(self, key, peer_id, parts, timeout=10.0):
        """Test hook: a write whose host-lane copy runs on the lane's threads, held at its
        start (a barrier in ``hostcopy._Job.run``) while the peer is marked dead (as UCX's
        error handler does) and the loop runs on; then released. Returns ``{"error": type
        name of what the write raised, "done_while_held": whether the write had already
        ended while its copy was held, "jobs_at_raise": the lane's copies still running
        when it raised}``. The peer is gone afterwards. Runs the write on the engine's loop."""
        import asyncio
        import threading

        from kvxfer.engine import hostcopy
        from kvxfer.errors import PeerClosed

        peer = self._peer(key, peer_id)._peer
        held, release = threading.Event(), threading.Event()
        real = hostcopy._Job.run

        def run(job):  # on a host-lane thread
            held.set()
            release.wait(30)
            real(job)

        async def go():
            lane = peer._hostl
            t = asyncio.ensure_future(peer.write(self._writes(parts), b"n", timeout))
            # (the copy on a lane thread, at the barrier; a thread waits for it, not the loop)
            if not await asyncio.get_running_loop().run_in_executor(None, held.wait, 20):
                return {"error": f"the write's copy never started ({t})"}
            peer._mark_dead(PeerClosed("engine_node: peer marked dead mid-copy"))
            for _ in range(50):  # the write's failure path runs meanwhile
                await asyncio.sleep(0)
            done_while_held = t.done()
            release.set()
            try:
                await t
            except Exception as exc:  # noqa: BLE001 - reported
                return {
                    "error": type(exc).__name__,
                    "done_while_held": done_while_held,
                    "jobs_at_raise": len(lane._jobs),
                }
            return {"error": None, "done_while_held": done_while_held}

        hostcopy._Job.run = run  # type: ignore[method-assign]
        try:
            return self.engines[key]._run(go(), 60.0)
        finally:
            hostcopy._Job.run = real  # type: ignore[method-assign]
            release.set()

    def write_many(self, key, peer_id, batches, timeout=None):
        """Submit every batch before waiting for any: ``batches`` = [(parts, notify)]."""
        peer = self._peer(key, peer_id)
        pend = [peer.write_async(self._writes(parts), notify, timeout) for parts, notify in batches]
        return [_result(lambda p=p: p.result().bytes) for p in pend]

    def send(self, key, peer_id, payload):
        return _result(lambda: self._peer(key, peer_id).send(payload))

    def messages(self, key, n, timeout):
        """Wait (bounded) for ``n`` messages; returns [(peer_id, payload)] received so far."""
        got = self._inbox.setdefault(key, [])
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            got.extend(self.engines[key].poll_messages())
            time.sleep(0.005)
        got.extend(self.engines[key].poll_messages())
        out = list(got)
        got.clear()
        return out

    def peers(self, key):
        return sorted(self.engines[key].peers())

    def closed(self, key):
        return list(self._closed[key])

    def chain_state(self, key, peer_id=None):
        """Chained notifications: how many the peer's writes sent, and what the engine's
        transport still holds (flush/chain futures, completion-queue references)."""
        eng = self.engines[key].engine
        t = eng._transport
        out = {"flushes": len(t._flushes), "waiters": len(t._waiters), "notes": len(t._notes)}
        if peer_id is not None and peer_id in eng._peers:
            out["sent"] = eng._peers[peer_id]._notes_sent
        return out

    def registrations(self, key):
        return self.engines[key].engine.registrations

    def stream_start(self, key, peer_id, group, n_items, timeout, hold_after=0, notify=None):
        """Write items 0..n-1 to the same ids on the peer, over and over, in a thread, until
        a write fails. ``hold_after=k``: after the k-th successful write the thread waits
        for ``stream_release`` before it writes again (the parent then knows exactly which
        writes completed before what it does meanwhile). ``notify``: every write's
        notification (chained where the peer takes it)."""
        st = self.streams[key] = {
            "count": 0,
            "error": None,
            "t_end": None,
            "held": self._threading.Event(),
            "release": self._threading.Event(),
        }
        ids = list(range(n_items))

        peer = self._peer(key, peer_id)  # once: a dead peer leaves the engine's table

        def loop():
            try:
                while True:
                    peer.write(self._writes([(group, ids, ids)]), notify, timeout)
                    st["count"] += 1
                    if st["count"] == hold_after:
                        st["held"].set()
                        if not st["release"].wait(60.0):
                            raise TimeoutError("stream not released within 60 s")
            except Exception as exc:  # reported to the parent
                st["error"] = (type(exc).__name__, str(exc))
            st["t_end"] = time.monotonic()

        st["thread"] = self._threading.Thread(target=loop, daemon=True)
        st["thread"].start()

    def stream_status(self, key):
        st = self.streams[key]
        return {
            "count": st["count"],
            "error": st["error"],
            "t_end": st["t_end"],
            "held": st["held"].is_set(),
        }

    def stream_held(self, key, timeout):
        """Wait (bounded) until the stream holds after its ``hold_after``-th write."""
        return self.streams[key]["held"].wait(timeout)

    def stream_release(self, key):
        self.streams[key]["release"].set()

    def stream_join(self, key, timeout):
        """Wait (bounded) for the stream to end by itself, i.e. for a write to fail."""
        st = self.streams[key]
        st["thread"].join(timeout)
        return {
            "count": st["count"],
            "error": st["error"],
            "alive": st["thread"].is_alive(),
            "t_end": st["t_end"],
        }

    def close(self):
        for eng in self.engines.values():
            eng.close()


#: the 1:1, 2:1 and 1:2 topology of the heterogeneous-TP benches: engine key -> worker
TP_TOPOLOGY = {"decode": ("d1", "d2_0", "d2_1"), "p0": ("p1", "p2_0"), "p1": ("p2_1",)}
#: its connections (prefill engine, decode engine)
TP_LINKS = (("p1", "d1"), ("p1", "d2_0"), ("p1", "d2_1"), ("p2_0", "d1"), ("p2_1", "d1"))


def start_tp_topology(eng, start_timeout: float = 120.0):
    """Start :data:`TP_TOPOLOGY` (``eng(key)``: an engine spec for ``key``; "d1"/"p1" are the
    TP-1 ranks, "d2_r"/"p2_r" rank r of TP 2) in three worker processes and make
    :data:`TP_LINKS`. Returns ``(workers, proxies, conn)``: the workers to close (prefill
    first), ``{"decode" | "p0" | "p1": EngineNode proxy}``, ``{(prefill key, decode key):
    peer id}``. The workers are closed if a start or a connection fails."""
    from kvxfer.procs import Worker

    workers: Dict[str, Any] = {}
    try:
        for name, keys in TP_TOPOLOGY.items():
            spec = {"engines": {k: eng(k) for k in keys}}
            workers[name] = Worker(EngineNode, spec, name=name).start(start_timeout)
        proxies = {name: w.proxy(EngineNode) for name, w in workers.items()}
        ports = proxies["decode"].ports()
        where = {k: name for name, keys in TP_TOPOLOGY.items() for k in keys}
        conn = {}
        for key, dst in TP_LINKS:
            r = proxies[where[key]].connect(key, "127.0.0.1", ports[dst])
            if "ok" not in r:
                raise RuntimeError(f"connecting {key} -> {dst}: {r}")
            conn[(key, dst)] = r["ok"]
    except BaseException:
        for w in reversed(list(workers.values())):
            w.close()
        raise
    return [workers[n] for n in ("p1", "p0", "decode")], proxies, conn


def write_concurrently(conn, parts, timeout: float = 300.0) -> list:
    """``parts``: ``[(EngineNode proxy, prefill key, decode key, write parts)]`` posted at
    once over :func:`start_tp_topology`'s ``conn``; each write's stats, in order (a failed
    write raises AssertionError with its error)."""
    from kvxfer.procs import post

    pend = [post(node.write, key, conn[(key, de)], w) for node, key, de, w in parts]
    res = [p.result(timeout) for p in pend]
    for r in res:
        assert "ok" in r, r
    return [r["ok"] for r in res]
