"""The four classes SGLang's ``get_kv_class`` hands out for ``--disaggregation-transfer-backend
kvxfer``: manager (:mod:`.manager`), sender, receiver, bootstrap server.

Sender and receiver are SGLang's common ones plus what the kvxfer data path needs: the
sender's ``get_transfer_metric`` reports the bytes and time of its room's kvxfer writes; its
``abort`` also tells decode (once no write of the room is in flight - SGLang's common sender
tells nobody); the receiver tracks which prefill ranks may complete its room.
"""

from __future__ import annotations

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferMetric
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVReceiver,
    CommonKVSender,
)

from kvxfer.integrations.sglang.manager import KvxferKVManager, RoomStats


class KvxferKVSender(CommonKVSender):
    def __init__(
        self,
        mgr: KvxferKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.stats = RoomStats()
        with mgr.room_lock:
            mgr.room_stats[int(bootstrap_room)] = self.stats
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)

    def poll(self) -> KVPoll:
        """SGLang's poll, after what arrived for the room's rank was handled
        (``KvxferKVManager.take_arrived``). Runs on: the scheduler thread."""
        if self.conclude_state is None:
            self.kv_mgr.take_arrived()
        return super().poll()

    def get_transfer_metric(self) -> KVTransferMetric:
        """Bytes the room's kvxfer writes moved, and the time from the first write's start
        to the last one's completion (None before any write)."""
        return KVTransferMetric(
            transfer_latency_s=self.stats.latency_s, transfer_total_bytes=self.stats.bytes
        )

    def abort(self) -> None:
        """Runs on: the scheduler thread."""
        mgr = self.kv_mgr
        failed = KVPoll.Failed in (mgr.request_status.get(self.bootstrap_room), self.conclude_state)
        targets = mgr.path.targets(self.bootstrap_room)
        super().abort()
        if not failed:
            mgr.path.report_abort(self.bootstrap_room, targets)

    def clear(self) -> None:
        super().clear()
        with self.kv_mgr.room_lock:
            if self.kv_mgr.room_stats.get(self.bootstrap_room) is self.stats:
                del self.kv_mgr.room_stats[self.bootstrap_room]


class KvxferKVReceiver(CommonKVReceiver):
    def poll(self) -> KVPoll:
        """SGLang's poll, after what arrived for the room's rank was handled
        (``KvxferKVManager.take_arrived``). Runs on: the scheduler thread."""
        if self.conclude_state is None:
            self.kv_mgr.take_arrived()
        return super().poll()

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        infos = getattr(self, "bootstrap_infos", None)
        if infos:
            prefill = getattr(self, "prefill_info", None)
            self.kv_mgr.path.track(
                self.bootstrap_room,
                infos,
                getattr(self, "target_tp_ranks", None),
                getattr(prefill, "attn_tp_size", None),
            )

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, *args, **kwargs):
        """Before the metadata leaves: accept the staged head slices of the room's pages
        from the prefill ranks that may send them (heterogeneous TP; the metadata then
        names those ranks). Runs on: the scheduler thread."""
        if getattr(self, "bootstrap_infos", None) and kv_indices is not None:
            self.kv_mgr.path.expect_slices(self.bootstrap_room, kv_indices)
        return super().send_metadata(kv_indices, aux_index, state_indices, *args, **kwargs)

    def _clear(self) -> None:
        super()._clear()
        self.kv_mgr.path.untrack(self.bootstrap_room)


class KvxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap server (``/route``, ``/health``, DP-rank registry) as is: its
    decode scheduler queries it directly. It carries ZMQ endpoints only; no key material."""


__all__ = ["KvxferKVBootstrapServer", "KvxferKVManager", "KvxferKVReceiver", "KvxferKVSender"]
