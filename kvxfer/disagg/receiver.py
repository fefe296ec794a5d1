"""KVReceiver: the decode end of one room.

Usage (scheduler): ``r = KVReceiver(mgr, prefill_bootstrap_addr, room, on_done=release)``;
``r.init()`` (lookup + connect, shared per prefill rank); allocate pages, state slot and an
aux row; ``r.send_metadata(page_ids, aux_row, state_slots)``; poll until ``Success`` (bytes
visible and the aux row's room stamp checked) or ``Failed``. ``on_done`` runs once the
room's pages are safe to release (on failure) or hand to the scheduler (on success).
"""

from __future__ import annotations

from typing import Optional

from kvxfer.argcheck import as_int
from kvxfer.disagg.bootstrap import parse_addr
from kvxfer.disagg.handle import OnDone, RoomHandle, as_ids
from kvxfer.disagg.layerwise import LayerReadiness
from kvxfer.disagg.page_map import check_span
from kvxfer.disagg.roles import DisaggMode
from kvxfer.errors import InvalidArgument


class KVReceiver(RoomHandle):
    _mode = DisaggMode.DECODE

    def __init__(
        self, mgr, bootstrap_addr: str, room: int, *, on_done: Optional[OnDone] = None
    ) -> None:
        if mgr.mode is not DisaggMode.DECODE:
            raise InvalidArgument(
                f"KVReceiver needs a decode manager, {mgr.name} is {mgr.mode.value}"
            )
        host, port = parse_addr(bootstrap_addr)
        self.bootstrap_addr = f"{host}:{port}"
        self._inited = False
        self._meta = False
        super().__init__(mgr, room, on_done)
        self._r.bootstrap_addr = self.bootstrap_addr  # read on the loop only after init/abort
        #: per-layer readiness (layer-wise streaming, kvxfer.disagg.layerwise)
        self.layers = LayerReadiness(self)

    def init(self) -> None:
        """Start looking up and connecting to the prefill rank (non-blocking).

        Runs on: the scheduler's thread (the lookup and connect run on the loop)."""
        if self._inited:
            return
        self._inited = True
        self.mgr.call(self.mgr.side.init, self._r, self.bootstrap_addr)

    def send_metadata(
        self,
        kv_indices,
        aux_index: int,
        state_indices=None,
        *,
        prefix_len: int = 0,
        num_tokens: Optional[int] = None,
    ) -> None:
        """Tell prefill where this room's bytes go. Validated here (ids in range of our
        registered buffers, no duplicates); a bad call raises and sends nothing.

        ``kv_indices`` cover the request from token 0 (page ``i`` holds tokens
        ``[i*page_size, +page_size)``), the pages of a reused prefix included.
        ``prefix_len``: we already hold tokens ``[0, prefix_len)`` (our prefix cache; need
        not be page-aligned): prefill writes no byte of them, only tokens
        ``[prefix_len, num_tokens)``. ``num_tokens``: the request's token count, when a last
        partial page must not be written past it (with a page size other than prefill's it
        also says where the request ends; by default, the slots both sides' pages hold).
        Raises ShapeMismatch (``num_tokens`` needs another page count) or InvalidArgument
        (``prefix_len`` past the tokens). Shapes supported: docs/shapes.md.

        Runs on: the scheduler's thread (validated there; sent from the loop)."""
        if not self._inited:
            raise InvalidArgument(f"room {self.room}: send_metadata() before init()")
        if self._meta:
            raise InvalidArgument(f"room {self.room}: send_metadata() called twice")
        items = self.mgr.items
        kv = as_ids(kv_indices, f"room {self.room}: kv_indices", items["kv"])
        aux = int(as_ids([aux_index], f"room {self.room}: aux_index", items["aux"])[0])
        st = as_ids(
            [] if state_indices is None else state_indices,
            f"room {self.room}: state_indices",
            items["state"],
        )
        prefix = as_int(prefix_len, f"room {self.room}: prefix_len", 0)
        tokens = (
            None if num_tokens is None else as_int(num_tokens, f"room {self.room}: num_tokens", 0)
        )
        check_span(len(kv), self.mgr.args.page_size, prefix, tokens, f"room {self.room}")
        self._meta = True
        self.mgr.call(self.mgr.side.send_metadata, self._r, kv, st, aux, (prefix, tokens))

    def layers_ready(self) -> int:
        """How many leading kv layers are visible: layers ``[0, n)`` (all at Success).
        Earlier than Success only when prefill streams layer-wise. Runs on: any thread."""
        return self.layers.count()

    def wait_layer(self, layer: int, timeout: float = 60.0) -> None:
        """Block until every byte of kv layer ``layer`` of this request is visible (state
        slots and the aux row: only at Success). Raises the room's failure, or
        TransferTimeout. Runs on: any thread but the manager's loop."""
        self.layers.wait(layer, timeout)
