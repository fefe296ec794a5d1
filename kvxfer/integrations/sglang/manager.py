"""KvxferKVManager: SGLang's ``CommonKVManager`` with kvxfer's engine as the data path.

What SGLang's base class keeps doing: the HTTP bootstrap registration and ``/route`` rank
mapping, the ZMQ control socket (``rank_port``), per-room status table, failure records,
abort notifications and drained-abort acks (deferred decode KV release), heartbeats.

What this class adds: one :class:`~kvxfer.integrations.sglang.loop.EngineLoop` per rank with
three kinds of groups registered - ``kv`` (SGLang's ``kv_data_ptrs``, item = one page of
one layer's K or V), ``aux`` (the ``MetadataBuffers``, item = one row of each buffer) and
``state<i>`` per state type - and the role's path (:mod:`.prefill_path` /
:mod:`.decode_path`). kvxfer writes no byte of its own into any SGLang buffer: the room is
checked by SGLang's own ``bootstrap_room`` metadata buffer.

Supported: any attention TP sizes that divide one another, SGLang's rank mapping (MHA
pages: each decode rank receives its KV heads from the prefill rank(s) holding them,
:mod:`.tp_pairs`; MLA: whole pages from one prefill rank; Mamba state: each tensor's
TP slices, as SGLang's ``MambaPool`` metadata describes them),
PP/CP/DCP of 1, state type ``mamba``, any decode/prefill DP mapping SGLang resolves, decode
prefix (radix) lengths. Everything else is refused here, before anything starts, with the
reason (see docs/integrations.md).
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Optional

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, StateType
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_disagg, get_parallel
from sglang.srt.server_args import ServerArgs

from kvxfer import config
from kvxfer.config import EngineConfig
from kvxfer.errors import UnsupportedOperation
from kvxfer.integrations.sglang.loop import EngineLoop
from kvxfer.integrations.sglang.messages import STATUS_TAG
from kvxfer.integrations.sglang.regions import check_regions
from kvxfer.integrations.sglang.settings import (
    TP_STAGE_ENGINE,
    host_copy,
    release_risk,
    resolve_secret,
    tp_stage_min_ops,
)
from kvxfer.metrics import TransferMetrics

log = logging.getLogger(__name__)

SUPPORTED_STATE_TYPES = frozenset({StateType.MAMBA})


class RoomStats:
    """Bytes and timing of one room's writes (prefill), filled on the engine loop."""

    __slots__ = ("bytes", "ops", "writes", "t_first", "t_last")

    def __init__(self) -> None:
        self.bytes = self.ops = self.writes = 0
        self.t_first: Optional[float] = None
        self.t_last: Optional[float] = None

    @property
    def latency_s(self) -> Optional[float]:
        if self.t_first is None or self.t_last is None:
            return None
        return self.t_last - self.t_first


def check_supported(args: KVArgs) -> None:
    """Raise UnsupportedOperation for what this backend does not do (before anything starts)."""
    par, disagg = get_parallel(), get_disagg()
    limits = (
        ("pipeline parallelism", par.pp_size),
        ("attention context parallelism", par.attn_cp_size),
        ("decode context parallelism", par.attn_dcp_size),
    )
    for what, size in limits:
        if size != 1:
            raise UnsupportedOperation(
                f"kvxfer transfer backend: {what} of size {size} is not supported (only 1)"
            )
    if par.enable_kv_cache_sharding:
        raise UnsupportedOperation(
            "kvxfer transfer backend: --enable-kv-cache-sharding is not supported"
        )
    if disagg.disaggregation_decode_allocation_policy != "early":
        raise UnsupportedOperation(
            "kvxfer transfer backend: only the 'early' decode allocation policy is supported"
        )
    if envs.SGLANG_DISAGG_STAGING_BUFFER.get():
        raise UnsupportedOperation(
            "kvxfer transfer backend: SGLANG_DISAGG_STAGING_BUFFER "
            "(heterogeneous-TP staging) is not supported"
        )
    for st in getattr(args, "state_types", None) or []:
        if StateType(st) not in SUPPORTED_STATE_TYPES:
            raise UnsupportedOperation(
                f"kvxfer transfer backend: state type {StateType(st).value!r} is not "
                f"supported (supported: {sorted(s.value for s in SUPPORTED_STATE_TYPES)})"
            )
    if getattr(args, "host_kv_data_ptrs", None):
        raise UnsupportedOperation(
            "kvxfer transfer backend: decode host KV destinations are not supported"
        )
    check_regions(groups_of(args))  # e.g. the envelope Mamba layout: refused by name


def groups_of(args: KVArgs) -> Dict[str, tuple]:
    """The engine groups of SGLang's KVArgs: name -> (ptrs, lens, item_lens)."""
    groups = {
        "kv": (args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens),
        "aux": (args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens),
    }
    for i, _ in enumerate(getattr(args, "state_types", None) or []):
        groups[f"state{i}"] = (
            args.state_data_ptrs[i],
            args.state_data_lens[i],
            args.state_item_lens[i],
        )
    return groups


class KvxferKVManager(CommonKVManager):
    kv_status_msg_tag = STATUS_TAG
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True
    # the prefill side acks a decode's abort only once no write of the room is in flight
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: Optional[bool] = False,
    ) -> None:
        secret = resolve_secret()  # no secret: nothing starts
        #: a hetero-TP chunk write of more PUTs than this goes staged where the peer has no
        #: device lane (0: never); both sides need it > 0 (it gives the kv group rings)
        self.tp_stage_min_ops = tp_stage_min_ops()
        #: poll() of a sender / receiver first takes what arrived (config.poll_takes:
        #: KVXFER_POLL_TAKES, default on; docs/engine.md "Polls that take what arrived")
        self.poll_takes = config.poll_takes()
        check_supported(args)
        self._closed = False
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        self.role = role
        #: decode: what SGLang's release of a failed room's pages risks (settings.release_risk;
        #: logged once here), else None
        self.release_risk: Optional[str] = None
        if role == "decode":
            risk = release_risk(
                self.enable_deferred_decode_kv_release,
                envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get(),
            )
            if risk is not None:
                log.log(risk[0], "kvxfer transfer backend: %s", risk[1])
                self.release_risk = risk[1]
        self.metrics = TransferMetrics(role)
        self.room_lock = threading.Lock()  # _staging_outstanding, transfer_infos, stats
        self.room_stats: Dict[int, RoomStats] = {}
        stage = (
            dict(TP_STAGE_ENGINE, stage_slice_min_ops=self.tp_stage_min_ops)
            if self.tp_stage_min_ops
            else {}
        )
        self.engine = EngineLoop(
            EngineConfig(
                secret=secret,
                host=self.local_ip,
                port=0,
                name=f"sglang-{role}@{self.local_ip}:{self.rank_port}",
                host_copy=host_copy(),
                **stage,
            )
        )
        try:
            # kv pages and state slots differ in size between TP sizes (heads / state rows
            # per rank): checked per pair by the prefill path (tp_pairs) at registration,
            # not by the engine's handshake
            groups = self._groups()
            self.engine.start(groups, loose=[g for g in groups if g != "aux"])
            if role == "prefill":
                from kvxfer.integrations.sglang.prefill_path import PrefillPath

                self.path = PrefillPath(self)
            else:
                from kvxfer.integrations.sglang.decode_path import DecodePath

                self.path = DecodePath(self)
            self.path.start()
        except BaseException:
            self.close()
            raise
        log.info("%s: kvxfer engine on %s", self.engine.config.name, self.engine.address)

    def __repr__(self) -> str:
        return f"KvxferKVManager({self.role}, {self.local_ip}:{self.rank_port})"

    def take_arrived(self) -> bool:
        """With :attr:`poll_takes`: handle the completions and notifications that reached
        this rank's engine, now, as its loop's guest (:meth:`EngineLoop.take_arrived`), so
        that the poll that called it sees their result. Runs on: the scheduler thread."""
        return self.poll_takes and not self._closed and self.engine.take_arrived()

    def _groups(self):
        return groups_of(self.kv_args)

    # ------------------------------------------------------------------ base-class hooks
    def check_status(self, bootstrap_room: int) -> KVPoll:
        """Runs on: the scheduler thread (a dict read)."""
        return self.request_status.get(bootstrap_room, KVPoll.WaitingForInput)

    def add_transfer_request(
        self,
        bootstrap_room,
        kv_indices,
        index_slice,
        is_last_chunk,
        aux_index=None,
        state_indices=None,
        num_kv_tokens=None,
        **_,
    ):
        """Runs on: the scheduler thread (handed to the engine's loop)."""
        self.path.add_transfer_request(
            bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index, state_indices
        )

    def build_receiver_registration_message(self):
        return self.path.registration_message()

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room,
        required_dst_info_num,
        kv_indices,
        aux_index,
        state_indices,
        decode_prefix_len,
        is_dummy,
        device_kv_indices=None,
    ):
        return self.path.metadata_message(
            bootstrap_room,
            required_dst_info_num,
            kv_indices,
            aux_index,
            state_indices,
            decode_prefix_len,
            is_dummy,
        )

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float = 10.0) -> None:
        """Stop the control thread, close the engine and the ZMQ socket; idempotent.
        (SGLang never closes a manager - its process exits - but tests and embedders do.)"""
        if self._closed:
            return
        self._closed = True
        path = getattr(self, "path", None)
        if path is not None:
            path.stop(timeout)
        hb = getattr(self, "_heartbeat_shutdown", None)
        if hb is not None:
            hb.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(timeout)
        sock = getattr(self, "server_socket", None)
        if sock is not None:
            sock.close(linger=0)
        with getattr(self, "_socket_lock", threading.Lock()):
            for s in list(getattr(self, "_socket_cache", {}).values()):
                s.close(linger=0)
            for s in list(getattr(self, "_monitor_cache", {}).values()):
                s.close(linger=0)
