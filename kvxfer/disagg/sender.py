"""KVSender: the prefill end of one room.

Usage (scheduler): ``s = KVSender(mgr, addr, room, on_done=release)``; poll until
``WaitingForInput`` (decode's metadata arrived; sending earlier is allowed and queued);
``s.init(num_pages, aux_index)``; ``s.send(page_ids)`` per chunk — the chunk that completes
``num_pages`` is the last one and also carries ``state_indices`` and the aux row.

Layer-wise (:mod:`kvxfer.disagg.layerwise`): ``s.begin_chunk(page_ids, state_indices)`` per
chunk instead of ``send``, then ``s.layer_ready(i)`` (or ``s.layer_ready(i, event=ev)``)
for every kv layer ``i`` of it as the forward pass finishes it.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from kvxfer.argcheck import as_int
from kvxfer.config import direct_limit
from kvxfer.disagg.handle import OnDone, RoomHandle, as_ids
from kvxfer.disagg.roles import DisaggMode
from kvxfer.disagg.trace import mark
from kvxfer.errors import IndexOutOfRange, InvalidArgument


class KVSender(RoomHandle):
    _mode = DisaggMode.PREFILL

    def __init__(
        self, mgr, bootstrap_addr: Optional[str], room: int, *, on_done: Optional[OnDone] = None
    ) -> None:
        if mgr.mode is not DisaggMode.PREFILL:
            raise InvalidArgument(
                f"KVSender needs a prefill manager, {mgr.name} is {mgr.mode.value}"
            )
        self.bootstrap_addr = bootstrap_addr
        self._num: Optional[int] = None
        self._sent = 0
        self._done_sending = False
        self._layers: Any = None  # kvxfer.disagg.layerwise.SenderLayers, on first begin_chunk
        #: its loop side (kvxfer.disagg.layerwise.LayerStream), pumped when decode attaches
        self.layer_stream: Any = None
        super().__init__(mgr, room, on_done)

    def init(self, num_kv_indices: int, aux_index: int) -> None:
        """Declare the request's page count and the prefill aux row holding its first token.

        Runs on: the scheduler's thread (validated there; the rest is handed to the loop)."""
        if self._num is not None:
            raise InvalidArgument(f"room {self.room}: init() called twice")
        num_kv_indices = as_int(num_kv_indices, f"room {self.room}: num_kv_indices", 0)
        aux_index = int(as_ids([aux_index], "aux_index", self.mgr.items["aux"])[0])
        self._num = num_kv_indices
        mgr = self.mgr
        mgr.call(mgr.side.init, self._r, num_kv_indices, aux_index, direct=mgr.direct_pages > 0)

    def _chunk(
        self, kv_indices, state_indices
    ) -> Tuple[np.ndarray, Optional[np.ndarray], bool, int]:
        """Validate one chunk (nothing is recorded): ``(src, state, last, pages so far)``."""
        if self._num is None:
            raise InvalidArgument(f"room {self.room}: send() before init()")
        if self._done_sending:
            raise InvalidArgument(f"room {self.room}: the last chunk was already sent")
        if self._layers is not None and self._layers.open:
            raise InvalidArgument(
                f"room {self.room}: the layer-wise chunk still has undeclared layers"
            )
        src = as_ids(kv_indices, f"room {self.room}: kv_indices", self.mgr.items["kv"])
        total = self._sent + len(src)
        if total > self._num:
            raise IndexOutOfRange(
                f"room {self.room}: chunk ends at page {total} > num_kv_indices {self._num}"
            )
        last = total == self._num
        if not last and len(src) == 0:
            raise InvalidArgument(f"room {self.room}: empty non-final chunk")
        st = None
        if state_indices is not None:
            if not last:
                raise InvalidArgument(
                    f"room {self.room}: state_indices belong to the last chunk "
                    f"(this one ends at page {total} of {self._num})"
                )
            st = as_ids(state_indices, f"room {self.room}: state_indices", self.mgr.items["state"])
        return src, st, last, total

    def send(self, kv_indices, state_indices=None) -> None:
        """Send one chunk of source pages (in request order). Validated here: ids in range,
        no duplicates, total <= num_kv_indices, state only with the last chunk — a bad call
        raises and sends nothing. Ids are best host arrays (numpy, lists): a CUDA tensor
        works but costs a synchronising device-to-host copy on this thread first (on the
        H200 it was most of a 1-page request's host time, bench/results/direct-cpu.md).

        Runs on: the scheduler's thread (validated there; the writes run on the loop — or,
        a chunk of at most ``KVManager.direct_pages`` pages while the loop is idle, planned
        and posted right here: ``KVManager.call``'s ``direct``; a room with several decode
        peers the same unless ``$KVXFER_LEG_DIRECT_PAGES`` sets a lower bound). ``self._r.legs`` is read
        here before the loop may set it: a send racing the adoption picks either path, and
        both are correct."""
        src, st, last, total = self._chunk(kv_indices, state_indices)
        self._sent = total
        self._done_sending = last
        if last and self._r.trace is not None:
            mark(self._r.trace, "send")
        mgr, legs = self.mgr, self._r.legs
        limit = direct_limit(mgr.direct_pages, 1 if legs is None else legs.expect)
        mgr.call(mgr.side.send, self._r, src, st, last, direct=0 < limit and len(src) <= limit)

    def begin_chunk(self, kv_indices, state_indices=None, *, layers_per_write: int = 1) -> None:
        """Declare a chunk for layer-wise streaming (validated as :meth:`send`); nothing
        moves until its layers are declared with :meth:`layer_ready`. The previous chunk's
        layers must all be declared. ``layers_per_write``: wait for that many ready layers
        per write (the chunk's last write takes what is left). Raises UnsupportedOperation
        when the kv pool's layout cannot be split by layer.

        Runs on: the scheduler's thread (or the loop's: an asyncio scheduler)."""
        group = as_int(layers_per_write, f"room {self.room}: layers_per_write", 1)
        src, st, last, total = self._chunk(kv_indices, state_indices)
        if self._layers is None:
            from kvxfer.disagg.layerwise import SenderLayers

            self._layers = SenderLayers(self.mgr, self._r)
            self.layer_stream = self._layers.stream
        self._sent = total
        self._done_sending = last
        if last and self._r.trace is not None:
            mark(self._r.trace, "send")
        self._layers.begin(src, st, last, group)

    def layer_ready(self, layer: int, event: Any = None) -> None:
        """Layer ``layer`` (the kv pool's layer index, ``[0, num_layers)``) of the open chunk
        is computed: its bytes start moving. ``event``: a CUDA event recorded after the
        layer's kernels; the loop waits (polls, bounded) until it completes before posting.
        Each layer once per chunk, in any order.

        Runs on: the scheduler's thread (or the loop's)."""
        if self._layers is None:
            raise InvalidArgument(f"room {self.room}: layer_ready() before begin_chunk()")
        self._layers.ready(layer, event)

    @property
    def num_layers(self) -> int:
        """Layers per chunk for :meth:`layer_ready` (from the kv pool's layout)."""
        from kvxfer.disagg.layerwise import LayerMap

        return LayerMap.of(self.mgr.args).num_layers
