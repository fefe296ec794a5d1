"""Layer-wise streaming: a chunk's pages move layer by layer while later layers compute.

Prefill declares a chunk's pages with ``KVSender.begin_chunk(kv_indices, state_indices)``
and then each layer of it with ``KVSender.layer_ready(i, event=None)`` as the forward pass
finishes that layer; kvxfer writes the bytes of that layer (of every page of the chunk) at
once, so the transfer hides behind the remaining layers' compute. The write that covers the
chunk's last outstanding layers is the chunk's ordinary write (:meth:`PrefillSide._issue`):
it carries ``Chunk`` / ``Done``, and on the request's last chunk also the state slots (Mamba:
final only after the last token, so it goes with the last layer that completes) and the aux
row. Decode's Success therefore still means every byte is visible.

Units. A *layer* is the kv pool's layer index ``[0, num_layers)`` (``layer_id -
start_layer``; a hybrid pool counts its full-attention layers only, ``pool.layer_index``).
:class:`LayerMap` says which bytes of each registered kv descriptor belong to each layer:
per-layer pools (MHA K then V buffers, MLA, HND) own whole descriptors (descriptor ``d`` is
layer ``d % num_layers``); a page-major pool's single descriptor holds every layer in each
page, so a layer is a byte sub-range of each page (its K and V segments) — one run per page
and layer instead of one per page run. ``layers_per_write`` (``begin_chunk``) groups that
many ready layers per write. Which wins for which sizes: bench/results/layerwise-cpu.md.

Invariants (those of whole-chunk sends, kept): a room's writes form one chain — a layer
write is posted at once, in the loop callback that found it ready (:mod:`kvxfer.eager`: no
task hop; several may be on the wire), but completes only after the previous write of the
chain did, and the chunk's completing write posts only after that — so the completing
write's notify is issued after every earlier layer write of the room is flushed;
``after_fail`` waits for the chain, so aborts, deadlines and the fenced release hold
exactly as before; a layer write that times out fences the link. Layers are
declared in any order, each once per chunk; a chunk begins only after every layer of the
previous one was declared. Before decode's metadata arrives nothing can be planned: a chunk
whose layers are all declared by then is queued whole (as ``send()`` would).

CUDA: ``layer_ready(i, event=ev)`` with an event recorded after the layer's kernels; the
layer is posted once the event completed: :mod:`kvxfer.disagg.event_wait` wakes the loop
then (bounded by ``transfer_s``: a room whose event never completes fails with
TransferTimeout).

Writes in flight: at most ``MAX_INFLIGHT_WRITES`` layer writes of a room are on the wire;
layers that become ready meanwhile go together in the next write (their runs merge where
they are adjacent: a page-major page holds consecutive layers side by side). So a write's
fixed cost (ops posted one by one on the loop, a flush, a notification) is paid once per
batch of ready layers, not per layer, and the loop is never queued up behind posts.

Decode: prefill sends ``LayerDone`` (the layers of the request's last chunk just made
visible) to a decode that advertised ``layer_notify``; :class:`LayerReadiness` (one per
``KVReceiver``: ``layers_ready()``, ``wait_layer(i)``) and :class:`LayerCounter` (SGLang's
``pool.register_layer_transfer_counter``) expose it. State slots and the aux row are visible
only at Success.

Runs on: :class:`LayerStream` and :func:`on_layer_done` on the manager's loop thread; the
``KVSender`` / ``KVReceiver`` methods on the scheduler's thread (or the loop's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence

import numpy as np

from kvxfer import eager
from kvxfer.disagg import event_wait
from kvxfer.disagg import messages as m
from kvxfer.disagg.kv_args import KVArgs
from kvxfer.disagg.page_map import TokenGeometry, plan_runs
from kvxfer.disagg.poll import KVPoll, is_terminal
from kvxfer.disagg.runs import Runs
from kvxfer.errors import (
    InvalidArgument,
    KvxferError,
    PeerClosed,
    TransferAborted,
    TransferTimeout,
    UnsupportedOperation,
)

#: layer writes of one room on the wire at once (the chunk's completing write not counted;
#: ``kvxfer bench layerwise --max-inflight N`` compares values)
MAX_INFLIGHT_WRITES = 1


@dataclass(frozen=True)
class LayerMap:
    """Which bytes of each kv descriptor belong to which layer (see the module docstring).

    ``desc_layer[d]``: the layer owning all of descriptor ``d``, or -1 when it holds several
    (page-major). ``seg_layer``: the layer of every token segment (``kv_segments`` flattened
    descriptor-major), None when the pool states no token geometry (then every descriptor
    must belong to one layer)."""

    num_layers: int
    desc_layer: np.ndarray
    seg_layer: Optional[np.ndarray]

    @classmethod
    def of(cls, args: KVArgs) -> "LayerMap":
        """The map of ``args``: the layer count from the kv pool's ``describe()``
        (``layout["kv"]["layer_num"]``), the ownership from the descriptor count.
        Raises UnsupportedOperation for a layout it cannot split by layer."""
        kv = args.layout.get("kv") if isinstance(args.layout, dict) else None
        num = kv.get("layer_num") if isinstance(kv, dict) else None
        if not isinstance(num, int) or isinstance(num, bool) or num < 1:
            raise UnsupportedOperation(
                "layer-wise streaming needs the kv pool's layer count "
                f"(KVArgs.layout['kv']['layer_num']), got {num!r}"
            )
        n_desc, segs = len(args.kv_data_ptrs), args.kv_segments
        if n_desc % num == 0:
            desc_layer = np.arange(n_desc, dtype=np.int64) % num
            seg_layer = (
                np.concatenate([np.full(len(s), desc_layer[d]) for d, s in enumerate(segs)])
                if segs
                else None
            )
            return cls(num, desc_layer, seg_layer)
        if n_desc == 1 and segs and len(segs[0]) % num == 0:
            per = len(segs[0]) // num
            return cls(
                num, np.full(1, -1, dtype=np.int64), np.arange(len(segs[0]), dtype=np.int64) // per
            )
        raise UnsupportedOperation(
            f"layer-wise streaming: cannot split {n_desc} kv descriptors "
            f"({'with' if segs else 'without'} token geometry) into {num} layers"
        )

    def runs(
        self,
        args: KVArgs,
        geometry: Optional[TokenGeometry],
        r: Any,
        src: np.ndarray,
        first: int,
        layers: Sequence[int],
    ) -> Runs:
        """Byte runs of ``layers`` for a chunk of source pages ``src`` starting at source page
        ``first`` of room ``r`` (its ``pages_map`` and decode's pages ``r.dst_kv``).
        ``geometry``: the manager's ``kv_geometry`` (used where the page map has none:
        heterogeneous TP)."""
        pm = r.pages_map
        want = np.asarray(sorted(layers), dtype=np.int64)
        if self.seg_layer is not None:
            geom = pm.geom or geometry
            assert geom is not None  # seg_layer is set only with kv_segments
            lo, hi = pm.chunk_tokens(first, len(src))
            return plan_runs(
                geom,
                src,
                pm.src_page_size,
                r.dst_kv,
                pm.dst_page_size,
                lo,
                hi,
                src_first_page=first,
                keep=np.isin(self.seg_layer, want),
            )
        s, d = pm.whole_pages(src, first, r.dst_kv)  # no geometry: equal page sizes
        descs = np.flatnonzero(np.isin(self.desc_layer, want))
        if not len(s) or not len(descs):
            return Runs.empty()
        item = np.asarray(args.kv_item_lens, dtype=np.int64)[descs][:, None]
        shape = (len(descs), len(s))
        return Runs.merged(
            np.broadcast_to(descs[:, None], shape).ravel(),
            (s[None, :] * item).ravel(),
            (d[None, :] * item).ravel(),
            np.broadcast_to(item, shape).ravel(),
        )


def pack_mask(layers: Iterable[int], num_layers: int) -> bytes:
    bits = np.zeros(num_layers, dtype=np.uint8)
    bits[np.asarray(list(layers), dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def unpack_mask(mask: bytes, num_layers: int) -> int:
    """The layers of ``mask`` (< ``num_layers``) as a Python int bit set."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:num_layers]
    return sum(1 << int(i) for i in np.flatnonzero(bits))


# ====================================================================== prefill
class _Chunk:
    """One declared chunk (loop side): its pages, the layers declared ready (with their
    CUDA events), the layers whose write was issued."""

    __slots__ = ("src", "state", "last", "group", "ready", "sent", "watched")

    def __init__(self, src: np.ndarray, state: Optional[np.ndarray], last: bool, group: int):
        self.src, self.state, self.last, self.group = src, state, last, group
        self.ready: Dict[int, Any] = {}  # layer -> CUDA event or None
        self.sent: set = set()
        self.watched: set = set()  # layers whose event was handed to event_wait


class LayerStream:
    """The loop side of one KVSender's layer-wise chunks. Runs on: the loop thread."""

    def __init__(self, mgr: Any, r: Any, lmap: LayerMap) -> None:
        self.mgr, self.r, self.lmap = mgr, r, lmap
        self.chunks: Deque[_Chunk] = deque()
        self._bound: Optional[asyncio.TimerHandle] = None  # a layer's event: transfer_s
        self.inflight = 0  # layer writes of this room not yet complete

    def begin(self, src: np.ndarray, state: Optional[np.ndarray], last: bool, group: int) -> None:
        if is_terminal(self.r.state):  # the room ended: its scheduler's later chunks are moot
            return
        self.chunks.append(_Chunk(src, state, last, group))

    def ready(self, layer: int, event: Any) -> None:
        """A layer of the last begun chunk is declared. Ignored once the room ended: the
        pump dropped its chunks then (the scheduler may keep declaring layers)."""
        if is_terminal(self.r.state):
            self.chunks.clear()
            return
        self.chunks[-1].ready[layer] = event
        self.pump()

    # ------------------------------------------------------------------ the pump
    def pump(self, _: Any = None) -> None:
        """Issue every write that may go now (see the module docstring)."""
        r, side = self.r, self.mgr.side
        L = self.lmap.num_layers
        while self.chunks:
            c = self.chunks[0]
            if is_terminal(r.state):
                self.chunks.clear()
                return
            done = self._events_done(c)
            if done is None:
                return  # the room failed
            hetero = r.legs is not None or (r.link is not None and r.link.tp is not None)
            if hetero:  # hetero TP (head slices, several peers): whole-chunk sends
                if len(done) < L:
                    return
                self.chunks.popleft()
                side.send(r, c.src, c.state, c.last)
                continue
            if r.dst_kv is None or r.pages_map is None:
                if r.dst_kv is None and len(done) == L:  # decode not here yet: queue it whole
                    self.chunks.popleft()
                    side.send(r, c.src, c.state, c.last)
                    continue
                return
            todo = sorted(set(done) - c.sent)
            complete = len(c.sent) + len(todo) == L
            if not todo:
                return
            if not complete and (len(todo) < c.group or self.inflight >= MAX_INFLIGHT_WRITES):
                return
            self._issue(c, todo, complete)
            if not complete:
                return
            self.chunks.popleft()

    def _events_done(self, c: _Chunk) -> Optional[List[int]]:
        """Declared layers whose CUDA event (if any) completed; schedules a re-poll for the
        others. None when the room was failed here (a query raised, or its bound passed)."""
        out, waiting = [], False
        for layer, ev in c.ready.items():
            if ev is None or layer in c.sent:
                out.append(layer)
                continue
            try:
                ok = bool(ev.query())
            except Exception as exc:  # a CUDA error surfaced by the query
                self.mgr.fail(
                    self.r,
                    TransferAborted(f"room {self.r.room}: layer {layer}'s CUDA event: {exc}"),
                )
                return None
            if ok:
                c.ready[layer] = None
                out.append(layer)
                if self.r.trace is not None:  # when the loop saw the layer's event done
                    self.r.trace.setdefault("layer_seen", {})[layer] = time.monotonic_ns()
            else:
                waiting = True
                if layer not in c.watched:
                    c.watched.add(layer)
                    event_wait.watch(ev, asyncio.get_running_loop(), self.pump)
        if not waiting:
            if self._bound is not None:
                self._bound.cancel()
                self._bound = None
        elif self._bound is None:
            self._bound = asyncio.get_running_loop().call_later(
                self.mgr.t.transfer_s, self._expired
            )
        return out

    def _expired(self) -> None:
        """A layer's event was still pending ``transfer_s`` after the wait began."""
        self._bound = None
        if self.chunks and not is_terminal(self.r.state):
            self.mgr.fail(
                self.r,
                TransferTimeout(
                    f"room {self.r.room}: a layer's CUDA event did not complete within "
                    f"{self.mgr.t.transfer_s:g}s"
                ),
            )

    def _issue(self, c: _Chunk, layers: List[int], complete: bool) -> None:
        mgr, r = self.mgr, self.r
        first = r.pages_queued  # advanced by the chunk's completing write only
        c.sent.update(layers)
        if complete:

            def kv_part(_r: Any, src: np.ndarray, start: int) -> Any:
                runs = self.lmap.runs(mgr.args, mgr.kv_geometry, _r, src, start, layers)
                return runs.raw_write("kv") if len(runs) else None

            mgr.side._issue(r, c.src, c.state, c.last, kv_part=kv_part)
            return
        try:
            runs = self.lmap.runs(mgr.args, mgr.kv_geometry, r, c.src, first, layers)
        except KvxferError as exc:
            mgr.fail(r, exc)
            return
        if not len(runs):
            return  # e.g. decode holds these pages' tokens already
        link = r.link
        notify = None
        if c.last and link is not None and link.layer_notify:
            notify = m.LayerDone(room=r.room, mask=pack_mask(layers, self.lmap.num_layers))
        if r.state != KVPoll.Transferring:
            mgr.advance(r, KVPoll.Transferring)
        prev = r.chain
        self.inflight += 1
        # started on this stack (kvxfer.eager, as the chunk writes of PrefillSide._issue):
        # planned and posted before this returns; the flush and the wait for the previous
        # write of the chain continue in an owned task. A failure before the first
        # suspension (a dead link, a planning or posting error) fails the room here, while
        # r.chain is still ``prev``: after_fail waits for ``prev`` — as it did through the
        # task, whose only wait after such a failure is ``prev``. The done callback runs
        # from the loop (call_soon, even when already done): it never re-enters this pump.
        r.chain = eager.start(
            mgr.spawn, _write_part(mgr, r, prev, runs.raw_write("kv"), notify, layers)
        )
        r.chain.add_done_callback(self._write_done)

    def _write_done(self, _: Any) -> None:
        """A layer write completed (or failed): layers that became ready meanwhile may go.
        Runs on: the loop thread."""
        self.inflight -= 1
        self.pump()


async def _write_part(
    mgr: Any,
    r: Any,
    prev: Optional[asyncio.Future],
    kv: Any,
    notify: Optional[m.LayerDone],
    layers: Sequence[int],
) -> None:
    """One layer write of a room's chain (no state, no aux, no chunk accounting): posts
    ``kv`` at once — started by :func:`kvxfer.eager.start`, so on the stack of the call that
    issued it (``MAX_INFLIGHT_WRITES`` layer writes of a room on the wire) — then awaits the
    previous write of the chain before it completes: the chain's last future is done only
    once every earlier write is, which is what the completing write and ``after_fail`` wait
    for. Failures as in ``PrefillSide._write``."""
    try:
        await _post_part(mgr, r, kv, notify, layers)
    finally:
        if prev is not None and not prev.done():
            await asyncio.wait([prev])


async def _post_part(
    mgr: Any, r: Any, kv: Any, notify: Optional[m.LayerDone], layers: Sequence[int]
) -> None:
    if is_terminal(r.state):
        return
    link = r.link
    if link is None or link.dead:
        mgr.fail(r, PeerClosed(f"room {r.room}: decode is gone"), notify=False, peer_gone=True)
        return
    mgr.hook("before_layer_write", r.room)
    t_call = time.monotonic_ns()
    try:
        stats = await link.peer.write(
            [kv], notify=None if notify is None else notify.encode(), timeout=mgr.t.transfer_s
        )
    except TransferTimeout as exc:
        mgr.link_failed(link, exc, fence=True)  # it may still be in flight
        mgr.fail(r, exc, notify=False, peer_gone=True)
        return
    except KvxferError as exc:
        mgr.fail(r, exc)
        return
    if r.trace is not None:
        r.trace.setdefault("layer_writes", []).append(layer_write_record(t_call, stats, layers))
    mgr.count_write(stats)
    if not is_terminal(r.state):
        mgr.arm(r)  # lease renewed by progress


def layer_write_record(t_call: int, stats: Any, layers: Sequence[int]) -> Dict[str, Any]:
    """What a traced room keeps of one layer write (``trace["layer_writes"]``): its layers,
    the ``Peer.write`` call and return (monotonic ns), its ops (device-lane ops among them)
    and the engine's stage durations in µs."""
    return {
        "layers": [int(x) for x in layers],
        "call": t_call,
        "ret": time.monotonic_ns(),
        "ops": int(getattr(stats, "ops", 0)),
        "device_ops": int(getattr(stats, "device_ops", 0)),
        "post_us": float(getattr(stats, "post_s", 0.0)) * 1e6,
        "flush_us": float(getattr(stats, "flush_s", 0.0)) * 1e6,
        "complete_us": float(getattr(stats, "complete_s", 0.0)) * 1e6,
    }


class SenderLayers:
    """The scheduler-side bookkeeping of a KVSender's layer-wise chunks (validation only;
    everything else is handed to the loop's :class:`LayerStream`)."""

    def __init__(self, mgr: Any, r: Any) -> None:
        self.lmap = LayerMap.of(mgr.args)
        self.mgr, self.r = mgr, r
        self.stream = LayerStream(mgr, r, self.lmap)
        self.declared: Optional[set] = None  # layers declared in the open chunk
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        return self.declared is not None

    def begin(self, src: np.ndarray, state: Optional[np.ndarray], last: bool, group: int) -> None:
        with self._lock:
            self.declared = set()
        self.mgr.call(self.stream.begin, src, state, last, group)

    def ready(self, layer: Any, event: Any) -> None:
        room = self.r.room
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise InvalidArgument(f"room {room}: layer must be an int, got {layer!r}")
        layer = int(layer)
        with self._lock:
            if self.declared is None:
                raise InvalidArgument(f"room {room}: layer_ready() without an open begin_chunk()")
            if not 0 <= layer < self.lmap.num_layers:
                raise InvalidArgument(
                    f"room {room}: layer {layer} not in [0, {self.lmap.num_layers})"
                )
            if layer in self.declared:
                raise InvalidArgument(f"room {room}: layer {layer} declared twice in this chunk")
            self.declared.add(layer)
            if len(self.declared) == self.lmap.num_layers:
                self.declared = None
        self.mgr.call(self.stream.ready, layer, event)


# ====================================================================== decode
def on_layer_done(mgr: Any, r: Any, msg: m.LayerDone) -> None:
    """Decode got LayerDone: record the layers, renew the room's lease. Runs on: the loop."""
    if is_terminal(r.state):
        return
    ready = getattr(r.handle, "layers", None)
    if isinstance(ready, LayerReadiness):
        ready.add(msg.mask)
    if r.state == KVPoll.Transferring:
        mgr.arm(r)
    else:
        mgr.advance(r, KVPoll.Transferring)


class LayerReadiness:
    """Per-layer readiness of one KVReceiver's request: layer ``i`` is ready once every byte
    of it (all pages of the request) is visible — from prefill's LayerDone, or at Success.
    Thread-safe; the waits run on any thread but the manager's loop."""

    def __init__(self, handle: Any) -> None:
        self._h = handle
        self._cv = threading.Condition()
        self._bits = 0
        self._num: Optional[int] = None
        self._watching = False

    @property
    def num_layers(self) -> int:
        if self._num is None:
            self._num = LayerMap.of(self._h.mgr.args).num_layers
        return self._num

    def add(self, mask: bytes) -> None:
        """Runs on: the loop thread."""
        bits = unpack_mask(mask, self.num_layers)
        with self._cv:
            self._bits |= bits
            self._cv.notify_all()

    def _wake(self, _: Any = None) -> None:
        with self._cv:
            self._cv.notify_all()

    def is_ready(self, layer: int) -> bool:
        return self._h._r.state == KVPoll.Success or bool(self._bits >> int(layer) & 1)

    def count(self) -> int:
        """Leading layers ready: layers ``[0, count)``."""
        if self._h._r.state == KVPoll.Success:
            return self.num_layers
        n = 0
        while self._bits >> n & 1:
            n += 1
        return n

    def wait(self, layer: int, timeout: float) -> None:
        """Block until ``layer`` is ready. Raises the room's failure (Failed), or
        TransferTimeout after ``timeout`` seconds."""
        h = self._h
        if h.mgr.in_loop():
            raise InvalidArgument("wait_layer() on the manager's own loop would deadlock")
        if not 0 <= int(layer) < self.num_layers:
            raise InvalidArgument(f"layer {layer} not in [0, {self.num_layers})")
        if not self._watching and not is_terminal(h._r.state):  # woken on terminal too
            self._watching = True
            cf: concurrent.futures.Future = concurrent.futures.Future()
            cf.add_done_callback(self._wake)
            h.mgr.call(h._add_waiter, cf)
        end = time.monotonic() + timeout
        with self._cv:
            while not self.is_ready(layer):
                if h._r.state == KVPoll.Failed:
                    raise h._r.exc
                left = end - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(
                        f"room {h.room}: layer {layer} not visible after {timeout:g}s"
                    )
                self._cv.wait(left)


class LayerCounter:
    """What ``pool.register_layer_transfer_counter`` takes: ``wait_until(i)`` blocks until
    layer ``i`` is ready for every receiver of a batch (bounded by ``timeout`` each)."""

    def __init__(self, receivers: Iterable[Any], timeout: float = 60.0) -> None:
        self.receivers = list(receivers)
        self.timeout = float(timeout)

    def wait_until(self, layer: int) -> None:
        for h in self.receivers:
            h.wait_layer(layer, self.timeout)


__all__ = [
    "LayerCounter",
    "LayerMap",
    "LayerReadiness",
    "LayerStream",
    "SenderLayers",
    "on_layer_done",
    "pack_mask",
    "unpack_mask",
]
