"""Worker-process side of the SGLang integration tests: real SGLang classes on CPU.

Each node is hosted in a spawned :class:`kvxfer.procs.Worker` (built by :func:`node`, called
through a typed proxy of :class:`PrefillNode` / :class:`DecodeNode`), its process set up the
way SGLang sets up a scheduler process: plugins loaded (``load_plugins()`` when kvxfer's
entry point is installed, else the plugin's ``register()`` + SGLang's
``HookRegistry.apply_hooks()``), server args from SGLang's own argument parser,
``publish(..., role="scheduler")``. Then, per scenario, SGLang's real pools
(``MHATokenToKVPool``, or ``HybridLinearKVPool`` over a ``MambaPool``), its
``MetadataBuffers`` and ``KVArgs`` filled like ``PrefillBootstrapQueue._init_kv_manager`` /
``DecodePreallocQueue._init_kv_manager`` do, and the manager/sender/receiver classes taken
from ``get_kv_class(TransferBackend("kvxfer"), ...)``.

Content is deterministic: token ``t`` of room ``R`` in layer-buffer ``e`` holds
``(R*31 + t*7 + e*13 + byte) % 251``; Mamba slot state of room ``R`` uses ``t = 100000``.
"""

from __future__ import annotations

import os
import time

from kvxfer.procs import scoped_env

PAGE = 4
LAYERS = 3
HEADS, DIM = 2, 8
#: MLA latent per token (``kv_lora_rank + qk_rope_head_dim`` elements, bfloat16)
MLA_LORA, MLA_ROPE = 16, 8
POOL_TOKENS = 256
META_ROWS = 16
MAMBA_SLOTS = 8
#: hybrid pools (HybridLinearKVPool over a MambaPool): "mamba" (Mamba2, one conv part),
#: "gdn" (Mamba2 with a conv of three independently split parts), "kimi" (KimiLinear: conv
#: [K-1, channels], the split dim after the outer rows, three parts)
STATE_KINDS = ("mamba", "gdn", "kimi")
#: how this process loaded the plugin: "entry_point" (SGLang's load_plugins) or "register"
PLUGIN_VIA = None


def _setup_process(mode: str, extra_args=(), dp_rank=None, world_rank=0):
    import logging

    logging.basicConfig(level=logging.WARNING)
    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins

    global PLUGIN_VIA
    if any(ep.name == "kvxfer" for ep in entry_points(group="sglang.srt.plugins")):
        load_plugins()
        PLUGIN_VIA = "entry_point"
    else:  # a source checkout that was not pip-installed
        PLUGIN_VIA = "register"
        from sglang.srt.plugins.hook_registry import HookRegistry

        from kvxfer.integrations.sglang import plugin

        plugin.register()
        HookRegistry.apply_hooks()
    return _publish(mode, extra_args, dp_rank, world_rank)


def _publish(mode: str, extra_args=(), dp_rank=None, world_rank=0):
    """Server args from SGLang's parser, published as a scheduler's at ``world_rank`` (SGLang
    allows re-publishing: last publish wins, as when a process rebuilds its engine)."""
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    argv = [
        "--model-path",
        "dummy",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--page-size",
        str(PAGE),
        "--disaggregation-mode",
        mode,
        "--disaggregation-transfer-backend",
        "kvxfer",
        *extra_args,
    ]
    sa = prepare_server_args(argv)
    publish(
        sa,
        role="scheduler",
        ranks=SpawnRanks(world_rank=world_rank, dp_rank=dp_rank, gpu_id=0),
    )
    from sglang.srt.runtime_context import get_parallel

    # a scheduler builds its torch.distributed groups; one rank per role needs none
    get_parallel().override_permanently(pp_group=None)
    return sa


def _pools(kind: str, heads: int = HEADS, tp: int = 1):
    import torch
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool

    bf = torch.bfloat16
    if kind == "mha":
        return MHATokenToKVPool(
            size=POOL_TOKENS,
            page_size=PAGE,
            dtype=bf,
            head_num=heads,
            head_dim=DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
    if kind == "mla":
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        return MLATokenToKVPool(
            size=POOL_TOKENS,
            page_size=PAGE,
            dtype=bf,
            kv_lora_rank=MLA_LORA,
            qk_rope_head_dim=MLA_ROPE,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
    if kind in STATE_KINDS or kind == "envelope":
        from sglang.srt.configs.mamba_utils import (
            KimiLinearCacheParams,
            KimiLinearStateShape,
            Mamba2CacheParams,
            Mamba2StateShape,
        )
        from sglang.srt.mem_cache.memory_pool import MambaPool

        if kind == "kimi":  # conv [K-1, q|k|v channels]: the split dim after 3 outer rows
            shape = KimiLinearStateShape.create(
                tp_world_size=tp, num_heads=4, head_dim=4, num_k_heads=4, head_k_dim=2
            )
            params = KimiLinearCacheParams(shape=shape, layers=[1, 3])
        else:  # "gdn": conv x|B|C of 32|16|16 channels, each split by TP on its own
            shape = Mamba2StateShape.create(
                tp_world_size=tp,
                intermediate_size=32,
                n_groups=1 if kind == "mamba" else 4,
                num_heads=4,
                head_dim=8,
                state_size=4,
                conv_kernel=4,
                conv_shard_groups=[32, 16, 16] if kind == "gdn" else None,
            )
            params = Mamba2CacheParams(shape=shape, layers=[1, 3])
        mamba = MambaPool(
            size=MAMBA_SLOTS,
            spec_state_size=0,
            device="cpu",
            cache_params=params,
            mamba_layer_ids=[1, 3],
            # "envelope": SGLang's page-major state layout (every layer's state of a slot
            # in one entry; conv / temporal are strided views of it)
            envelope_layout=kind == "envelope",
        )
        return HybridLinearKVPool(
            size=POOL_TOKENS,
            dtype=bf,
            page_size=PAGE,
            head_num=heads,
            head_dim=DIM,
            full_attention_layer_ids=[0, 2],
            device="cpu",
            mamba_pool=mamba,
        )
    raise ValueError(kind)


def pattern(room: int, tokens, e: int, nbytes: int, base: int = 0):
    """Content of ``nbytes`` of each token row from byte ``base`` of the model's row (a
    rank holding KV heads ``[a, b)`` holds bytes from ``a * head bytes``: every rank's
    content is a slice of one global pattern, whatever its TP)."""
    import numpy as np

    t = np.asarray(tokens, dtype=np.int64)[:, None]
    b = base + np.arange(nbytes, dtype=np.int64)[None, :]
    return ((room * 31 + t * 7 + e * 13 + b) % 251).astype(np.uint8)


def _state_meta(pool):
    mamba = getattr(pool, "mamba_pool", None)
    if mamba is None:
        return []
    return [
        [int(n), int(d), int(o), None if g is None else [int(x) for x in g]]
        for n, d, o, g in zip(
            mamba.get_contiguous_buf_infos()[2],
            mamba.get_state_dim_per_tensor(),
            mamba.get_state_slice_outer_counts(),
            mamba.get_state_conv_shard_groups(),
        )
    ]


def state_share(room, e, nbytes, dim, outer, groups, rank, tp):
    """Bytes of TP rank ``rank`` of ``tp`` of state tensor ``e``'s slot (``nbytes``, as
    SGLang's ``MambaPool`` holds it: ``outer`` rows, each of ``dim`` local rows of the split
    dim; ``dim`` 0: replicated) for room ``room``: a gather of one global slot of ``outer``
    rows of ``dim * tp`` rows (the global content :func:`pattern` of tensor ``e``). The
    global rows of the rank, from SGLang's sharding (``MambaPool`` /
    ``compute_mamba_state_slice_blocks``): each of the parts ``groups`` (full sizes, e.g.
    conv ``q | k | v``; None or not summing to the dim: one part) split on its own, the rank
    holding rows ``[rank * g/tp, (rank+1) * g/tp)`` of every part ``g``, parts back to
    back."""
    import numpy as np

    if dim == 0:
        return pattern(room, [100000], e, nbytes)[0]
    full = dim * tp
    row = nbytes // (outer * dim)
    parts = list(groups) if groups and sum(groups) == full else [full]
    rows, base = [], 0
    for g in parts:
        n = g // tp
        rows += range(base + rank * n, base + (rank + 1) * n)
        base += g
    rows = np.asarray(rows, dtype=np.int64)
    o = np.arange(outer, dtype=np.int64)[:, None, None]
    idx = (o * full + rows[None, :, None]) * row + np.arange(row)[None, None, :]
    return pattern(room, [100000], e, outer * full * row)[0][idx.ravel()]


class Node:
    """One scheduler-like process: managers by scenario name, handles by room."""

    def __init__(self, mode: str, server_args, extra_args=(), dp_rank=None) -> None:
        self.mode = mode
        self.server_args = server_args
        self.extra_args, self.dp_rank = tuple(extra_args), dp_rank
        self.scen = {}
        self.handles = {}

    # ------------------------------------------------------------------ setup
    def add(
        self, name: str, kind: str, bootstrap_port: int, secret=None, tp=None, heads=None, env=None
    ):
        """Build scenario ``name``'s pool, metadata buffers and manager. ``tp=(size, rank)``:
        as attention-TP rank ``rank`` of ``size`` (the process re-publishes its config as
        that scheduler's first; ``--tp-size``) holding its share of ``heads`` KV heads over
        all ranks (SGLang's split: ``heads/size`` each, or one replicated head). ``kind``
        ``"mla"``: an ``MLATokenToKVPool`` (every rank holds the whole latent) and a manager
        built as an MLA backend's. ``env``: variables set for this manager's construction
        only (e.g. ``KVXFER_SGL_TP_STAGE_MIN_OPS``), as ``secret`` (``KVXFER_SECRET``)."""
        import torch
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            TransferBackend,
            get_kv_class,
            setup_state_kv_args,
        )
        from sglang.srt.runtime_context import get_context, get_parallel

        from kvxfer.disagg.tp_plan import owned

        server_args = self.server_args
        size, rank = tp if tp is not None else (1, 0)
        mla = kind == "mla"
        total = 1 if mla else heads if heads is not None else HEADS * size
        h0, h1 = (0, 1) if mla else owned(rank, size, total)
        if tp is not None:
            extra = list(self.extra_args) + ["--tp-size", str(size)]
            server_args = _publish(self.mode, extra, self.dp_rank, rank)
        get_context().override("test", disaggregation_bootstrap_port=int(bootstrap_port))
        backend = TransferBackend("kvxfer")
        pool = _pools(kind, h1 - h0, size)
        meta = MetadataBuffers(
            META_ROWS, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
        )
        kv_args = get_kv_class(backend, KVClassType.KVARGS)()
        kv_args.engine_rank = rank
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = get_parallel().dp_rank
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "bfloat16"
        kv_args.kv_layout = None
        kv_args.prefill_start_layer = 0
        kv_args.prefill_end_layer = None
        ptrs, lens, items = pool.get_contiguous_buf_infos()
        kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, items
        kv_args.num_draft_entries = 0
        kv_args.kv_layer_ids = []
        kv_args.kv_head_num, kv_args.total_kv_head_num = h1 - h0, total
        kv_args.page_size = PAGE
        (kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens) = meta.get_buf_infos()
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        setup_state_kv_args(kv_args, pool, None, LAYERS)
        mode = DisaggregationMode(self.mode)
        scoped = dict(env or {})
        if secret is not None:
            scoped["KVXFER_SECRET"] = secret
        with scoped_env(scoped):  # this manager only (read at construction)
            mgr = get_kv_class(backend, KVClassType.MANAGER)(kv_args, mode, server_args, mla)
        head_bytes = DIM * 2  # bfloat16
        self.scen[name] = dict(
            kind=kind,
            pool=pool,
            meta=meta,
            mgr=mgr,
            backend=backend,
            base=h0 * head_bytes,
            tp=(size, rank),
        )
        return {
            "cls": type(mgr).__name__,
            "rank_port": mgr.rank_port,
            "engine": list(mgr.engine.address),
            "system_dp_rank": mgr.system_dp_rank,
            "release_risk": getattr(mgr, "release_risk", None),
            "item_lens": [
                list(kv_args.kv_item_lens),
                list(kv_args.aux_item_lens),
                [list(x) for x in kv_args.state_item_lens],
            ],
            # per Mamba state tensor: [slot bytes, split rows, outer rows, parts]
            "state_meta": _state_meta(pool),
        }

    def try_add(self, name, kind, bootstrap_port, **kw):
        """:meth:`add`, returning ``[error type, message]`` where it raised (else None)."""
        try:
            self.add(name, kind, bootstrap_port, **kw)
        except Exception as exc:  # noqa: BLE001 - the point is what it raises
            return [type(exc).__name__, str(exc)]
        return None

    def state_regions(self, kind):
        """SGLang's state descriptors of a ``kind`` pool, as KVArgs carries them:
        ``[(offset from the first, len, item_len)]``, and each state view's slot stride
        in bytes."""
        pool = _pools(kind)
        ptrs, lens, items = pool.mamba_pool.get_contiguous_buf_infos()
        base = min(ptrs)
        strides = [
            t.stride(0) * t.element_size()
            for _, t, _, _ in pool.mamba_pool._iter_transfer_state_entries()
        ]
        return [[p - base, n, i] for p, n, i in zip(ptrs, lens, items)], strides

    def _bufs(self, name):
        """The KV layer buffers as uint8 ``[tokens, bytes]`` views, then the Mamba state
        tensors per layer as uint8 ``[slots, bytes]`` views."""
        import torch

        pool = self.scen[name]["pool"]
        kvp = getattr(pool, "full_kv_pool", pool)
        layers = (
            list(kvp.kv_buffer)
            if hasattr(kvp, "kv_buffer")
            else list(kvp.k_buffer) + list(kvp.v_buffer)
        )
        kv = [b.view(b.shape[0], -1).view(torch.uint8) for b in layers]
        states = []
        mamba = getattr(pool, "mamba_pool", None)
        if mamba is not None:
            for t in list(mamba.mamba_cache.conv) + [mamba.mamba_cache.temporal]:
                states += [
                    t[layer].view(t.shape[1], -1).view(torch.uint8) for layer in range(t.shape[0])
                ]
        return kv, states

    # ------------------------------------------------------------------ content
    def fill(self, name, room, pages, mamba_slot=None):
        """Write room ``room``'s pattern into ``pages`` (request order) and ``mamba_slot``."""
        import torch

        kv, states = self._bufs(name)
        base = self.scen[name]["base"]
        tokens = [p * PAGE + i for p in pages for i in range(PAGE)]
        pos = list(range(len(tokens)))
        for e, b in enumerate(kv):
            b[tokens] = torch.from_numpy(pattern(room, pos, e, b.shape[1], base))
        if mamba_slot is not None:
            for e, b in enumerate(states):
                b[mamba_slot] = torch.from_numpy(self._state_content(name, room, e, b.shape[1]))
        return True

    def read(self, name, pages, mamba_slot=None):
        kv, states = self._bufs(name)
        tokens = [p * PAGE + i for p in pages for i in range(PAGE)]
        out = [b[tokens].numpy().tobytes() for b in kv]
        if mamba_slot is not None:
            out += [b[mamba_slot].numpy().tobytes() for b in states]
        return out

    def expected(self, name, room, n_pages, prefix_pages=0, mamba=False):
        kv, states = self._bufs(name)
        base = self.scen[name]["base"]
        pos = list(range(prefix_pages * PAGE, (prefix_pages + n_pages) * PAGE))
        out = [pattern(room, pos, e, b.shape[1], base).tobytes() for e, b in enumerate(kv)]
        if mamba:
            out += [
                self._state_content(name, room, e, b.shape[1]).tobytes()
                for e, b in enumerate(states)
            ]
        return out

    def _state_content(self, name, room, e, nbytes):
        """This rank's bytes of state tensor ``e`` (one slot) of room ``room``: its share of
        one global slot (:func:`state_share`), whatever its TP."""
        pool = self.scen[name]["pool"].mamba_pool
        size, rank = self.scen[name]["tp"]
        return state_share(
            room,
            e,
            nbytes,
            pool.get_state_dim_per_tensor()[e],
            pool.get_state_slice_outer_counts()[e],
            pool.get_state_conv_shard_groups()[e],
            rank,
            size,
        )

    # ------------------------------------------------------------------ handles
    def handle(self, room):
        return self.handles[room]

    def poll(self, room) -> int:
        return int(self.handles[room].poll())

    def wait(self, room, states, timeout=30.0, interval=0.002) -> int:
        """Poll like a scheduler loop until the state is one of ``states`` (bounded)."""
        return self.wait_t(room, states, timeout, interval)[0]

    def wait_t(self, room, states, timeout=30.0, interval=0.002):
        """:meth:`wait`, also returning ``time.monotonic()`` when the state was seen."""
        h = self.handles[room]
        deadline = time.monotonic() + timeout
        while True:
            st = int(h.poll())
            if st in states or time.monotonic() > deadline:
                return [st, time.monotonic()]
            time.sleep(interval)

    def failure(self, room):
        try:
            self.handles[room].failure_exception()
        except Exception as exc:  # noqa: BLE001 - the point is what it raises
            return [type(exc).__name__, str(exc)]
        return None

    def abort(self, room):
        self.handles[room].abort()
        return True

    def clear(self, room):
        self.handles.pop(room).clear()
        return True

    def deaf(self, name, on):
        """Test hook: scenario ``name``'s engine loop stops (``on``) or resumes watching its
        transport's completion queue, so that meanwhile only a ``poll()``'s take
        (``KvxferKVManager.take_arrived``) handles what arrives there (prefill's SglDone)."""
        el = self.scen[name]["mgr"].engine
        tr = el.engine.transport
        fd = tr._cq.fileno()

        async def switch():
            if on:
                el.loop.remove_reader(fd)
            else:
                el.loop.add_reader(fd, tr._on_completions)

        el.run(switch(), 10.0)
        return True

    def queued(self, name, n, within=10.0):
        """Wait (bounded) until ``n`` completions wait in scenario ``name``'s transport queue;
        returns how many do."""
        cq = self.scen[name]["mgr"].engine.engine.transport._cq
        deadline = time.monotonic() + within
        while cq.queued < n and time.monotonic() < deadline:
            time.sleep(0.001)
        return cq.queued

    def set_poll_takes(self, name, on):
        self.scen[name]["mgr"].poll_takes = bool(on)
        return True

    def peers(self, name, n=1, timeout=30.0):
        """Wait (bounded) until this scenario's engine has ``n`` connected peers."""
        eng = self.scen[name]["mgr"].engine.engine
        deadline = time.monotonic() + timeout
        while len(eng.peers) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(eng.peers)

    def refused(self, name, state_type):
        """Construct this scenario's manager class with ``state_type`` added: the error."""
        import copy

        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.utils import DisaggregationMode

        mgr = self.scen[name]["mgr"]
        args = copy.copy(mgr.kv_args)
        args.state_types = [StateType(state_type)]
        try:
            type(mgr)(args, DisaggregationMode(self.mode), self.server_args, False)
        except Exception as exc:  # noqa: BLE001 - the point is what it raises
            return [type(exc).__name__, str(exc)]
        return None

    def metrics(self, name):
        return self.scen[name]["mgr"].metrics.snapshot()

    def room_entries(self, name, room):
        """Tables of this scenario's manager that still hold ``room`` (after ``clear``: none)."""
        mgr = self.scen[name]["mgr"]
        path = mgr.path
        tables = {
            "request_status": mgr.request_status,
            "failure_records": getattr(mgr, "failure_records", {}),
            "transfer_infos": getattr(mgr, "transfer_infos", {}),
            "staging_outstanding": getattr(mgr, "_staging_outstanding", {}),
            "room_stats": mgr.room_stats,
            "chains": getattr(path, "chains", {}),
            "decode_rooms": getattr(path, "_rooms", {}),
            "response_tracker": getattr(mgr, "prefill_response_tracker", {}),
            "required_responses": getattr(mgr, "required_prefill_response_num_table", {}),
            "decode_tp": getattr(path, "_tp", {}),
            "decode_slices": getattr(path, "_slices", {}),
        }
        out = sorted(k for k, t in tables.items() if room in t)
        # staged slices still expected under the room's key by any engine peer (forgotten on
        # the engine loop right after clear: read there, after it)
        keys = mgr.engine.run(_slice_keys(mgr.engine.engine), 10.0)
        return out + (["slice_keys"] if room in keys else [])

    def write_ops(self, room):
        """Ops (PUTs or device-lane runs) and writes the room's kvxfer writes took (prefill)."""
        st = self.handles[room].stats
        return [st.ops, st.writes]

    def close(self) -> None:
        """At the worker's exit: close the managers (bounded)."""
        for s in self.scen.values():
            s["mgr"].close()


async def _slice_keys(engine):
    """Keys of the staged slices this engine's peers still expect (on its loop)."""
    return {k for p in engine.peers.values() for k in p._staged.expected}


class PrefillNode(Node):
    def __init__(self, server_args, extra_args=(), dp_rank=None):
        super().__init__("prefill", server_args, extra_args, dp_rank)

    def sender(self, name, room, bootstrap_host="127.0.0.1", bootstrap_port=0):
        from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

        s = self.scen[name]
        cls = get_kv_class(s["backend"], KVClassType.SENDER)
        self.handles[room] = cls(
            mgr=s["mgr"],
            bootstrap_addr=f"{bootstrap_host}:{bootstrap_port}",
            bootstrap_room=room,
            req_has_disagg_prefill_dp_rank=False,
        )
        return type(self.handles[room]).__name__

    def start(self, name, room, n_tokens, aux_row, first_token):
        """What ``finalize_bootstrap`` does: pop decode's prefix, ``init(pages, aux)``; and
        what ``set_buf`` does for the metadata row."""
        import numpy as np

        s, h = self.scen[name], self.handles[room]
        prefix = h.pop_decode_prefix_len()
        n_pages = -(-(n_tokens - prefix) // PAGE)
        h.init(np.int64(n_pages), np.int64(aux_row))
        meta = s["meta"]
        meta.output_ids[aux_row][0] = first_token
        meta.bootstrap_room[aux_row][0] = room
        return {"prefix": prefix, "pages": n_pages}

    def send(self, room, pages, last, mamba_slot=None, num_kv_tokens=None):
        import numpy as np

        h = self.handles[room]
        state = None
        if last and mamba_slot is not None:
            state = [[np.array(mamba_slot)]]  # SGLang's _mamba_payload shape
        if not h.should_send_kv_chunk(len(pages), last):
            return False
        t = time.monotonic()
        h.send(
            np.asarray(pages, dtype=np.int32),
            state,
            num_kv_tokens=num_kv_tokens if num_kv_tokens is not None else len(pages) * PAGE,
        )
        self.t_send = t
        return True

    def last_send_time(self):
        return self.t_send

    def send_then_abort(self, room, pages):
        """The last chunk's ``send`` and, right behind it on the same (scheduler) thread,
        ``abort`` - no command round trip between them."""
        self.send(room, pages, True)
        self.abort(room)
        return True

    def direct_calls(self, name):
        """How many scheduler calls of scenario ``name`` ran as the engine loop's guest."""
        return self.scen[name]["mgr"].engine.direct_calls

    def notes_sent(self, name):
        """Native notifications the scenario's engine sent (chained or ``Peer.notify``)."""
        eng = self.scen[name]["mgr"].engine.engine
        return sum(p._notes_sent for p in eng.peers.values())

    def incompatible(self, name, changes=None):
        """Prefill's verdict on a decode registration like its own but with ``changes``."""
        from kvxfer.integrations.sglang.messages import SglRegister
        from kvxfer.integrations.sglang.tp_pairs import state_tp_fields

        mgr = self.scen[name]["mgr"]
        a = mgr.kv_args
        reg = dict(
            endpoint="127.0.0.1",
            port=1,
            engine_host="127.0.0.1",
            engine_port=2,
            name="x",
            tp_size=1,
            tp_rank=0,
            page_size=a.page_size,
            dtype=a.kv_cache_dtype_str,
            kv_item_lens=list(a.kv_item_lens),
            aux_item_lens=list(a.aux_item_lens),
            state_types=[s.value for s in a.state_types],
            state_item_lens=[list(x) for x in a.state_item_lens],
            **state_tp_fields(a),
        )
        reg.update(changes or {})
        return mgr.path._incompatible(SglRegister(**reg))[0]

    def metric(self, room):
        m = self.handles[room].get_transfer_metric()
        return [m.transfer_total_bytes, m.transfer_latency_s]

    def hold_writes(self, name):
        """Test hook: park every write of this scenario until :meth:`release_writes`.
        Returns once the hook is in place on the engine's loop: a send issued after this
        call sees it (and so does not take the direct path, which runs no test hooks)."""
        import asyncio
        import threading

        mgr = self.scen[name]["mgr"]
        gate = {}
        installed = threading.Event()

        def install():
            gate["ev"] = asyncio.Event()
            gate["n"] = 0

            async def before(room):
                gate["n"] += 1
                await gate["ev"].wait()

            mgr.path.before_write = before
            installed.set()

        mgr.engine.loop.call_soon_threadsafe(install)
        if not installed.wait(30.0):
            raise RuntimeError("the write hook was not installed within 30 s")
        self._gate = gate
        return True

    def parked(self):
        return self._gate.get("n", 0)

    def release_writes(self, name):
        mgr = self.scen[name]["mgr"]

        def go():
            mgr.path.before_write = None
            self._gate["ev"].set()

        mgr.engine.loop.call_soon_threadsafe(go)
        return True


class DecodeNode(Node):
    def __init__(self, server_args, extra_args=(), dp_rank=None):
        super().__init__("decode", server_args, extra_args, dp_rank)

    def receiver(self, name, room, bootstrap_addr, timeout=30.0):
        """``_create_receiver_and_enqueue`` + ``_ensure_prefill_info`` + ``_init_receiver``."""
        from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

        s = self.scen[name]
        mgr = s["mgr"]
        cls = get_kv_class(s["backend"], KVClassType.RECEIVER)
        r = cls(mgr=mgr, bootstrap_addr=bootstrap_addr, bootstrap_room=room)
        self.handles[room] = r
        deadline = time.monotonic() + timeout
        while not mgr.try_ensure_parallel_info(bootstrap_addr):
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill at {bootstrap_addr} never became ready")
            time.sleep(0.05)
        info = mgr.prefill_info_table[bootstrap_addr]
        if info.dp_size == 1:
            dp = 0
        elif info.follow_bootstrap_room:
            dp = room % info.dp_size
        else:
            dp = int(type(r).query_prefill_dp_ranks(bootstrap_addr, [room])[str(room)])
        r.init(dp)
        return {"prefill_dp_rank": dp, "dp_size": info.dp_size}

    def metadata(self, name, room, pages, aux_row, mamba_slot=None, prefix_tokens=0):
        import numpy as np

        s = self.scen[name]
        s["meta"].clear_slot(aux_row)
        s["meta"].output_ids[aux_row][0] = -1
        state = [[np.array(mamba_slot)]] if mamba_slot is not None else None
        if s["mgr"].kv_args.state_types and state is None:
            state = [None]
        self.handles[room].send_metadata(
            np.asarray(pages, dtype=np.int32), aux_row, state, decode_prefix_len=prefix_tokens
        )
        return True

    def first_token(self, name, aux_row):
        """What ``DecodeTransferQueue`` reads after Success: (output_ids[0], bootstrap_room)."""
        out = self.scen[name]["meta"].get_buf(aux_row)
        return [int(out[0][0]), int(out[-1][0])]

    def parse(self, argv):
        """SGLang's own server-argument parser (``prepare_server_args``) on ``argv``."""
        from sglang.srt.server_args import prepare_server_args

        try:
            sa = prepare_server_args(list(argv))
        except SystemExit as exc:
            return ["exit", exc.code]
        return [
            "ok",
            sa.disaggregation_transfer_backend,
            PLUGIN_VIA,
            os.environ.get("KVXFER_SECRET_FILE"),
        ]

    def claim_version(self, name, version):
        """Test hook: this scenario's control messages (registration, room metadata) claim
        kvxfer protocol version ``version`` (None: the real one) - a decode rank of another
        kvxfer, as prefill sees it."""
        self.scen[name]["mgr"].path.claim_version = version
        return True

    def release_safe(self, name, room, acks=1):
        return bool(self.scen[name]["mgr"].is_abort_release_safe(room, acks))


def node(role: str, extra_args=(), dp_rank=None) -> Node:
    """What a node's worker hosts: a :class:`PrefillNode` or :class:`DecodeNode` in a process
    set up as a scheduler's (the worker's ``env`` is in place before anything is imported)."""
    sa = _setup_process(role, extra_args, dp_rank)
    cls = PrefillNode if role == "prefill" else DecodeNode
    return cls(sa, extra_args, dp_rank)


class BootstrapServers:
    """``n_servers`` SGLang bootstrap servers (the kvxfer backend's class) on free ports."""

    def __init__(self, n_servers: int) -> None:
        _setup_process("prefill")
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

        cls = get_kv_class(TransferBackend("kvxfer"), KVClassType.BOOTSTRAP_SERVER)
        self.servers: list = []
        self._ports: list = []
        for _ in range(n_servers):
            srv = cls(host="127.0.0.1", port=0)
            deadline = time.monotonic() + 30
            while getattr(srv, "_runner", None) is None or not srv._runner.addresses:
                if time.monotonic() > deadline:
                    raise TimeoutError("bootstrap server did not start")
                time.sleep(0.01)
            self.servers.append(srv)
            self._ports.append(int(srv._runner.addresses[0][1]))

    def ports(self) -> list:
        return list(self._ports)

    def close(self) -> None:
        for srv in self.servers:
            srv.close()
