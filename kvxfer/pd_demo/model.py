"""The demo's synthetic model: its pools, allocators and deterministic content.

One :class:`DemoModel` per worker process (prefill or decode), built from the same
:class:`ModelSpec` on both sides so the layout fingerprints agree:

* full-attention layers (even model layer ids when Mamba layers exist) in a page-major pool
  (``kv_layout="page_major"``, one descriptor), a per-layer MHA pool (``"per_layer"``, 2·L
  descriptors) or an MLA latent pool (``"mla"``, L descriptors);
* Mamba layers (odd ids) in a :class:`~kvxfer.pools.mamba.MambaPool` with the ``envelope`` layout
  (one descriptor, one op per request) or ``per_layer`` (one descriptor per state tensor and
  layer), wrapped with the KV pool in a :class:`~kvxfer.pools.hybrid.HybridLinearKVPool`; or none;
* the real allocators (:class:`PagedTokenToKVPoolAllocator`, :class:`MambaSlotAllocator`)
  and a :class:`~kvxfer.disagg.aux.MetadataBuffer` of aux rows.

Content is a pure function of ``(room, token position, layer)`` (plus head / element index),
small integers in ``[-125, 125]`` so every dtype holds them exactly; tokens past the request's
length in its last page are zero. Prefill writes it with the pools' kernel-backed stores
(``set_kv_buffer`` / ``set_mla_kv_buffer``) chunk by chunk; decode recomputes it and compares
every token row of every page, every state tensor of the slot and the first token, byte for
byte. Everything is vectorised per layer (no Python loop per token).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from kvxfer.pd_demo.spec import ModelSpec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _values(seed: torch.Tensor, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``seed [N]`` (int64) -> ``[N, *shape]`` small integers in [-125, 125] as ``dtype``."""
    n_el = 1
    for s in shape:
        n_el *= s
    inner = torch.arange(n_el, dtype=torch.int64, device=seed.device).view(1, *shape)
    val = (seed.view(-1, *([1] * len(shape))) + 3 * inner) % 251 - 125
    return val.to(dtype)


def _room_term(room: int, salt: int) -> int:
    return (room * 131 + salt * 17) % 251


def kv_rows(
    room: int,
    layer: int,
    kind: int,
    pos: torch.Tensor,
    length: int,
    shape: Tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows of ``layer`` (``kind`` 0 = K / latent, 1 = V / rope) at token positions ``pos``:
    the pattern where ``pos < length``, zero past the end of the request."""
    seed = (_room_term(room, kind) + 7 * pos + 13 * layer) % 251
    rows = _values(seed, shape, dtype)
    rows[pos >= length] = 0
    return rows


def state_values(
    room: int, tensor: int, shape: Tuple[int, ...], dtype: torch.dtype, num_layers: int, device
) -> torch.Tensor:
    """``[num_layers, *shape]``: state tensor ``tensor`` of every mamba layer of one slot."""
    layers = torch.arange(num_layers, dtype=torch.int64, device=device)
    seed = (_room_term(room, 5 + tensor) + 13 * layers) % 251
    return _values(seed, shape, dtype)


def first_token(room: int) -> int:
    return (room * 2654435761) % 1000003


class DemoModel:
    """Pools + allocators + aux rows of one worker (see module docstring)."""

    def __init__(self, spec: ModelSpec) -> None:
        from kvxfer.disagg import KVArgs, MetadataBuffer
        from kvxfer.disagg.tp_plan import local_units, owned
        from kvxfer.pools import MHATokenToKVPool, MLATokenToKVPool, PageMajorMHATokenToKVPool
        from kvxfer.pools.allocator import PagedTokenToKVPoolAllocator
        from kvxfer.pools.mamba_alloc import MambaSlotAllocator

        self.spec = s = spec
        self.dtype = DTYPES[s.dtype]
        tp, rank = s.tp_size, s.tp_rank
        #: this rank's KV heads [lo, hi) of the model's (MLA: the replicated latent)
        self.heads = (0, s.heads) if tp == 1 else owned(rank, tp, s.heads)
        h = self.heads[1] - self.heads[0]
        #: this rank's rows of each state tensor (conv channels, ssm heads) [lo, hi)
        self.state_rows = [
            (rank * n // tp, (rank + 1) * n // tp) for n in (s.conv_dim, s.ssm_heads)
        ]
        assert h == local_units(s.heads, tp) or s.kv_layout == "mla"
        self.ps = s.page_size
        self.attn_ids, self.mamba_ids = s.layer_ids()
        n_attn = len(self.attn_ids)
        common = (s.pool_tokens, s.page_size, self.dtype)
        backed: dict = {}
        if s.post_capture:  # reserved now, backed below; on CUDA VMM memory with POSIX-FD
            backed["post_capture_active"] = True  # handles (what a same-host lane maps)
            if str(s.device).startswith("cuda"):
                backed["backing_options"] = {"handle_types": ("posix_fd",)}
        if s.kv_layout == "mla":
            self.mla_dims = (s.heads * s.head_dim, max(1, s.head_dim // 2))
            kv = MLATokenToKVPool(*common, *self.mla_dims, n_attn, s.device, **backed)
        elif s.kv_layout == "page_major":
            kv = PageMajorMHATokenToKVPool(*common, h, s.head_dim, n_attn, s.device, **backed)
        else:
            layout = "hnd" if s.kv_layout == "hnd" else "nhd"
            kv = MHATokenToKVPool(*common, h, s.head_dim, n_attn, s.device, layout=layout, **backed)
        if s.post_capture:  # (as an engine does after its CUDA graphs were captured)
            kv.finalize_backing(s.pool_tokens)
        self.kv_pool = kv
        self.mamba = None
        if s.has_mamba:
            from kvxfer.pools.hybrid import HybridLinearKVPool
            from kvxfer.pools.mamba import MambaPool
            from kvxfer.pools.mamba_spec import MambaStateSpec

            mspec = MambaStateSpec(
                conv_shapes=((s.conv_dim // tp, s.conv_width - 1),),
                temporal_shape=(s.ssm_heads // tp, s.ssm_head_dim, s.ssm_state),
                conv_dtype=self.dtype,
                temporal_dtype=torch.float32,
                layer_ids=tuple(self.mamba_ids),
            )
            self.mamba = MambaPool(s.mamba_slots, mspec, s.device, layout=s.mamba_layout)
            self.pool = HybridLinearKVPool(kv, self.mamba, self.attn_ids)
        else:
            self.pool = kv
        self.pages = PagedTokenToKVPoolAllocator(s.pool_tokens, s.page_size, s.device)
        self.slots = MambaSlotAllocator(s.mamba_slots) if s.has_mamba else None
        self.aux = MetadataBuffer(s.aux_rows, 64)
        self.kv_args = KVArgs.from_pools(
            self.pool,
            aux=self.aux,
            state_pool=self.pool if s.has_mamba else None,
            tp_rank=rank,
            tp_size=tp,
            total_kv_heads=s.heads,
        )
        self.full = self.counts()

    # ------------------------------------------------------------------ sizes
    def page_bytes(self) -> int:
        return sum(self.kv_args.kv_item_lens)

    def slot_bytes(self) -> int:
        return sum(self.kv_args.state_item_lens)

    def request_bytes(self, n_pages: int) -> int:
        """Bytes one request moves: its pages, its state slot and its aux row."""
        return (
            n_pages * self.page_bytes()
            + (self.slot_bytes() if self.mamba else 0)
            + self.kv_args.aux_item_lens[0]
        )

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.ps)

    # ------------------------------------------------------------------ allocation
    def counts(self) -> Dict[str, int]:
        return {
            "pages": self.pages.available_pages(),
            "slots": self.slots.available_size() if self.slots is not None else 0,
            "aux": self.aux.available(),
        }

    def leaks(self) -> Dict[str, int]:
        now = self.counts()
        return {k: self.full[k] - now[k] for k in now}

    def alloc(self, n_pages: int) -> Optional[dict]:
        """Pages + (state slot) + aux row for one request, or None (nothing taken)."""
        if self.aux.available() == 0 or self.pages.available_pages() < n_pages:
            return None
        if self.slots is not None and self.slots.available_size() == 0:
            return None
        pages = self.pages.alloc_pages(n_pages)
        if pages is None:
            return None
        slot = self.slots.alloc(1)[0] if self.slots is not None else None
        return {"pages": pages, "slot": slot, "row": self.aux.alloc()}

    def free(self, res: dict) -> None:
        if res["pages"].numel():
            self.pages.free_pages(res["pages"])
        if res["slot"] is not None:
            self.slots.free([res["slot"]])
        self.aux.free(res["row"])

    # ------------------------------------------------------------------ content
    def _locs(self, pages: torch.Tensor, lo_tok: int, hi_tok: int) -> torch.Tensor:
        return self.pages.pages_to_tokens(pages)[lo_tok:hi_tok]

    def write_tokens(
        self,
        room: int,
        pages: torch.Tensor,
        lo_tok: int,
        hi_tok: int,
        length: int,
        layers: Optional[List[int]] = None,
    ) -> None:
        """Prefill 'computes' token positions ``[lo_tok, hi_tok)`` of the request (positions
        past ``length`` are written as zeros) through the pools' kernel-backed stores;
        ``layers``: only those kv layers (indices into the full-attention layers)."""
        loc = self._locs(pages, lo_tok, hi_tok)
        pos = torch.arange(lo_tok, hi_tok, device=loc.device)
        s = self.spec
        for i, lid in enumerate(self.attn_ids):
            if layers is not None and i not in layers:
                continue
            if s.kv_layout == "mla":
                r, dr = self.mla_dims
                nope = kv_rows(room, i, 0, pos, length, (1, r), self.dtype)
                rope = kv_rows(room, i, 1, pos, length, (1, dr), self.dtype)
                self.pool.set_mla_kv_buffer(lid, loc, nope, rope)
            else:
                a, b = self.heads  # this rank's heads of the model's rows
                k = kv_rows(room, i, 0, pos, length, (s.heads, s.head_dim), self.dtype)
                v = kv_rows(room, i, 1, pos, length, (s.heads, s.head_dim), self.dtype)
                self.pool.set_kv_buffer(lid, loc, k[:, a:b], v[:, a:b])

    def _state_tensors(self) -> List[torch.Tensor]:
        return [*self.mamba.conv, self.mamba.temporal]

    def _state_want(self, room: int, j: int, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of state tensor ``j`` of the request (every layer)."""
        a, b = self.state_rows[min(j, 1)]  # conv tensors, then the temporal one
        shape = (self.spec.tp_size * (b - a), *t.shape[3:])
        return state_values(room, j, shape, t.dtype, t.shape[0], t.device)[:, a:b]

    def write_state(self, room: int, slot: int) -> None:
        """The request's final Mamba state (every layer, every state tensor) into ``slot``."""
        for j, t in enumerate(self._state_tensors()):
            t[:, slot] = self._state_want(room, j, t)

    def ready(self) -> None:
        """Make the stores visible to the transfer (RMA does not order with CUDA streams):
        what a GPU prefill does, with an event, before handing pages to ``send()``."""
        dev = self.pages.device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def write_aux(self, room: int, row: int) -> None:
        self.aux.set_output(row, first_token(room))

    def _read_rows(self, lid: int, kind: int, loc: torch.Tensor) -> torch.Tensor:
        if self.spec.kv_layout == "mla":
            buf = self.pool.get_key_buffer(lid)
            r = self.mla_dims[0]
            buf = buf[..., :r] if kind == 0 else buf[..., r:]
        else:
            buf = self.pool.get_key_buffer(lid) if kind == 0 else self.pool.get_value_buffer(lid)
        if self.spec.kv_layout == "hnd":  # [pages, H, page_size, D]
            return buf[loc // self.ps, :, loc % self.ps]
        if buf.dim() == 4:  # page-major view [pages, page_size, H, D]
            return buf[loc // self.ps, loc % self.ps]
        return buf[loc]

    def verify(self, room: int, res: dict, length: int) -> List[str]:
        """Problems found in a received request (empty list = byte-exact everywhere)."""
        bad: List[str] = []
        pages = res["pages"]
        n_tok = pages.numel() * self.ps
        loc = self._locs(pages, 0, n_tok)
        pos = torch.arange(n_tok, device=loc.device)
        for i, lid in enumerate(self.attn_ids):
            for kind in (0, 1):
                got = self._read_rows(lid, kind, loc)
                shape = tuple(got.shape[1:])
                if self.spec.kv_layout != "mla":
                    shape = (self.spec.heads, *shape[1:])
                a, b = self.heads if self.spec.kv_layout != "mla" else (0, shape[0])
                want = kv_rows(room, i, kind, pos, length, shape, self.dtype)[:, a:b]
                diff = (
                    got.contiguous().view(torch.uint8).view(n_tok, -1)
                    != want.contiguous().view(torch.uint8).view(n_tok, -1)
                ).any(dim=1)
                if bool(diff.any()):
                    rows = diff.nonzero().flatten()
                    bad.append(
                        f"layer {lid} {'KV'[kind]}: {rows.numel()} token rows differ "
                        f"(first at position {int(rows[0])}, page "
                        f"{int(pages[int(rows[0]) // self.ps])})"
                    )
        if res["slot"] is not None:
            for j, t in enumerate(self._state_tensors()):
                want = self._state_want(room, j, t)
                got = t[:, res["slot"]]
                if not torch.equal(
                    got.contiguous().view(torch.uint8).flatten(),
                    want.contiguous().view(torch.uint8).flatten(),
                ):
                    bad.append(f"state tensor {j} of slot {res['slot']} differs")
        tok = self.aux.first_token(res["row"])
        if tok != first_token(room):
            bad.append(f"first token {tok} != {first_token(room)}")
        return bad
