"""Block-FP4 KV pools: ``MHATokenToKVPoolFP4`` and ``MLATokenToKVPoolFP4``.

Both keep, per layer, a **packed** buffer (two e2m1 values per byte) and a **scale** buffer (one
UE8M0 byte per 16 elements); the format and its error bound are in :mod:`kvxfer.kernels.fp4`::

    |read(write(x)) - x| <= max(s / 4, |x| / 4)  with  amax / 6 <= s < amax / 3

per element, ``amax`` being the largest magnitude of the element's 16-element block (blocks
run along the head dim and never span two heads). ``dtype`` is the *logical* dtype
(bf16 / fp16 / fp32): writes accept it, reads dequantize to it. ``store_dtype`` is uint8.

Writes quantize and scatter in one kernel launch per buffer pair (packed + scale); reads
(:meth:`get_key_buffer` etc.) return freshly dequantized tensors -- writing into them does not
change the cache. Use the ``*_rows`` / ``get_mla_kv_buffer`` readers for a subset of tokens and
:meth:`get_fp4_buffers` for the raw bytes.

Token rows (packed and scale alike) are indexed by token id, so moves (one launch for every
buffer), host copies and registration work exactly as for the unquantized pools.

Registration (MHA): ``4 * layer_num`` entries ``k0.., v0.., k_scale0.., v_scale0..``;
(MLA): ``2 * layer_num`` entries ``kv0.., kv_scale0..``; item = one page of that buffer.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from kvxfer.kernels.copy import KvCopyTable
from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch, UnsupportedOperation
from kvxfer.kernels.fp4 import BLOCK_ELEMS, FLOAT_DTYPES, dequantize_fp4, store_fp4
from kvxfer.pools.base import _int_arg
from kvxfer.pools.cpu_copy import TokenBuffer
from kvxfer.pools.layout import KvBufferDesc, per_layer_descs
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.mla import MLATokenToKVPool
from kvxfer.pools.write_loc import unwrap_write_loc

logger = logging.getLogger(__name__)

__all__ = ["MHATokenToKVPoolFP4", "MLATokenToKVPoolFP4", "KV_QUANT"]

#: value of ``describe()["kv_quant"]``: element format / block size / scale format.
KV_QUANT = "fp4_e2m1/16/ue8m0"


def _check_fp4_dims(dtype: torch.dtype, **dims: int) -> None:
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgument(f"FP4 pools dequantize to one of {FLOAT_DTYPES}; got dtype {dtype}")
    for name, d in dims.items():
        if d % BLOCK_ELEMS:
            raise InvalidArgument(f"{name}={d} must be a multiple of {BLOCK_ELEMS} (FP4 block)")


def _quant_descs(prefixes: list[str], shapes: list[tuple], layer_num: int) -> list[KvBufferDesc]:
    out: list[KvBufferDesc] = []
    for prefix, shape in zip(prefixes, shapes):
        out += per_layer_descs(prefix, layer_num, shape, 1, 1)
    return out


class MHATokenToKVPoolFP4(MHATokenToKVPool):
    """Per-layer MHA pool storing block-FP4 K/V (see module docstring). Constructor as
    :class:`MHATokenToKVPool`; ``layout`` must be ``"nhd"``; ``head_dim`` and ``v_head_dim``
    must be multiples of 16; ``post_capture_active=True`` raises :class:`UnsupportedOperation`."""

    kind = "mha_fp4"

    # -- construction hooks ------------------------------------------------------------------
    def _set_layout(self, layout: str) -> None:
        if layout != "nhd":
            raise InvalidArgument(f"MHATokenToKVPoolFP4 supports layout 'nhd' only, got {layout!r}")
        _check_fp4_dims(self.dtype, head_dim=self.head_dim, v_head_dim=self.v_head_dim)
        self.layout = "nhd"
        self.store_dtype = torch.uint8

    def _shapes(self) -> list[tuple]:
        S, H, D, Dv = self.num_slots, self.head_num, self.head_dim, self.v_head_dim
        return [
            (S, H, D // 2),
            (S, H, Dv // 2),
            (S, H, D // BLOCK_ELEMS),
            (S, H, Dv // BLOCK_ELEMS),
        ]

    def _create_buffers(self) -> None:
        kw = dict(dtype=torch.uint8, device=self.device)
        k, v, ks, vs = self._shapes()
        self.k_buffer = [torch.zeros(k, **kw) for _ in range(self.layer_num)]
        self.v_buffer = [torch.zeros(v, **kw) for _ in range(self.layer_num)]
        self.k_scale_buffer = [torch.zeros(ks, **kw) for _ in range(self.layer_num)]
        self.v_scale_buffer = [torch.zeros(vs, **kw) for _ in range(self.layer_num)]

    def _all_buffers(self) -> list[torch.Tensor]:
        return self.k_buffer + self.v_buffer + self.k_scale_buffer + self.v_scale_buffer

    def _copy_buffers(self) -> list[torch.Tensor]:
        return self._all_buffers()

    def _registered(self) -> list[tuple[torch.Tensor, KvBufferDesc]]:
        descs = _quant_descs(["k", "v", "k_scale", "v_scale"], self._shapes(), self.layer_num)
        return list(zip(self._all_buffers(), descs))

    def _token_buffers(self) -> list[TokenBuffer]:
        return [TokenBuffer(b, "rows") for b in self._all_buffers()]

    # -- reads ---------------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Every slot's K, dequantized: a new ``[num_slots, H, D]`` tensor of ``dtype``."""
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        return dequantize_fp4(
            self.k_buffer[idx],
            self.k_scale_buffer[idx],
            dtype=self.dtype,
            backend=self.kernel_backend,
        )

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """Every slot's V, dequantized: a new ``[num_slots, H, Dv]`` tensor of ``dtype``."""
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        return dequantize_fp4(
            self.v_buffer[idx],
            self.v_scale_buffer[idx],
            dtype=self.dtype,
            backend=self.kernel_backend,
        )

    def get_kv_rows(self, layer, loc) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k [N, H, D], v [N, H, Dv])`` of the tokens ``loc``, dequantized."""
        idx = self.layer_index(layer)
        self._wait_layer(idx)
        loc = self._as_loc(unwrap_write_loc(loc)[0])
        kw = dict(loc=loc, dtype=self.dtype, backend=self.kernel_backend)
        return (
            dequantize_fp4(self.k_buffer[idx], self.k_scale_buffer[idx], **kw),
            dequantize_fp4(self.v_buffer[idx], self.v_scale_buffer[idx], **kw),
        )

    def get_fp4_buffers(
        self, layer
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw ``(k_packed, k_scale, v_packed, v_scale)`` uint8 buffers of ``layer``."""
        idx = self.layer_index(layer)
        self._wait_layer(idx)
        return (
            self.k_buffer[idx],
            self.k_scale_buffer[idx],
            self.v_buffer[idx],
            self.v_scale_buffer[idx],
        )

    # -- writes --------------------------------------------------------------------------------
    def _source(self, name: str, x, n: int, dim: int, scale: Optional[float]) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise InvalidArgument(f"{name} must be a tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(
                f"{name} must be one of {FLOAT_DTYPES} to quantize, got {x.dtype}"
            )
        self._check_rows(name, x, n, (self.head_num, dim))
        if scale is not None:
            x = x / scale
        return x.to(self.device)

    def set_kv_buffer(
        self,
        layer,
        loc,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Optional[torch.Tensor] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
    ) -> None:
        """Quantize ``k [N, H, D]`` / ``v [N, H, Dv]`` (after ``/ k_scale`` / ``/ v_scale``) and
        write them at ``loc`` (tensor or :class:`KVWriteLoc`); ``mask`` as in the MHA pool."""
        idx = self.layer_index(layer)
        loc = self._as_loc(unwrap_write_loc(loc)[0])
        n = loc.shape[0]
        k = self._source("k", k, n, self.head_dim, k_scale)
        v = self._source("v", v, n, self.v_head_dim, v_scale)
        if mask is not None:
            mask = self._as_mask(mask, n)
        # both writes share loc and row count: once K's checks pass, V's cannot fail
        store_fp4(
            self.k_buffer[idx],
            self.k_scale_buffer[idx],
            loc,
            k,
            mask=mask,
            backend=self.kernel_backend,
        )
        store_fp4(
            self.v_buffer[idx],
            self.v_scale_buffer[idx],
            loc,
            v,
            mask=mask,
            backend=self.kernel_backend,
        )

    def set_kv_buffer_prefix_valid(
        self,
        layer,
        loc_2d,
        commit_lens,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
    ) -> None:
        """Write row ``(b, t)`` only when ``t < commit_lens[b]`` (see the MHA pool)."""
        if not isinstance(loc_2d, torch.Tensor) or loc_2d.dim() != 2:
            raise ShapeMismatch(
                f"loc_2d must be a 2-D tensor, got {getattr(loc_2d, 'shape', loc_2d)}"
            )
        if not isinstance(commit_lens, torch.Tensor) or tuple(commit_lens.shape) != (
            loc_2d.shape[0],
        ):
            raise ShapeMismatch(
                f"commit_lens must have shape {(loc_2d.shape[0],)}, got "
                f"{tuple(getattr(commit_lens, 'shape', ()))}"
            )
        T = loc_2d.shape[1]
        lens = commit_lens.to(self.device, torch.int64)
        keep = (torch.arange(T, device=self.device)[None, :] < lens[:, None]).reshape(-1)
        self.set_kv_buffer(
            layer, loc_2d.reshape(-1), k, v, mask=keep, k_scale=k_scale, v_scale=v_scale
        )

    def kv_token_segments(self) -> None:
        """None: FP4: values and their scale buffers pair by token with different granularities; transfers need equal page sizes (not modelled as token geometry)."""
        return None

    def describe(self) -> dict:
        d = super().describe()
        d["kv_quant"] = KV_QUANT
        return d


class MLATokenToKVPoolFP4(MLATokenToKVPool):
    """MLA latent pool storing block-FP4 rows (see module docstring). Constructor as
    :class:`MLATokenToKVPool`; ``kv_lora_rank`` and ``qk_rope_head_dim`` must be multiples of
    16 so that the latent and rope parts never share a block."""

    kind = "mla_fp4"

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device="cpu",
        *,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        kernel_backend: str = "auto",
        cpu_copy_chunk_tokens: int = 8192,
        post_capture_active: bool = False,
    ):
        if post_capture_active:
            raise UnsupportedOperation(
                f"{type(self).__name__} does not support post_capture_active=True"
            )
        layers = _int_arg("layer_num", layer_num, 0)
        start = 0 if start_layer is None else start_layer
        if end_layer is None and layers and isinstance(start, int):
            end_layer = start + layers - 1
        # The parent allocates full-precision rows per layer; build it with no layers and
        # create the FP4 buffers here instead (no transient full-size allocation).
        super().__init__(
            size,
            page_size,
            dtype,
            kv_lora_rank,
            qk_rope_head_dim,
            0,
            device,
            start_layer=start_layer,
            end_layer=end_layer,
            kernel_backend=kernel_backend,
            cpu_copy_chunk_tokens=cpu_copy_chunk_tokens,
        )
        _check_fp4_dims(dtype, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
        self.layer_num = layers
        self.store_dtype = torch.uint8
        kw = dict(dtype=torch.uint8, device=self.device)
        packed, scale = self._shapes()
        self.kv_buffer = [torch.zeros(packed, **kw) for _ in range(layers)]
        self.kv_scale_buffer = [torch.zeros(scale, **kw) for _ in range(layers)]
        self._copy_table = KvCopyTable(self.kv_buffer + self.kv_scale_buffer) if layers else None
        self._copy_table_full = self._copy_table

    def _shapes(self) -> list[tuple]:
        S, D = self.num_slots, self.kv_cache_dim
        return [(S, 1, D // 2), (S, 1, D // BLOCK_ELEMS)]

    def _registered(self) -> list[tuple[torch.Tensor, KvBufferDesc]]:
        descs = _quant_descs(["kv", "kv_scale"], self._shapes(), self.layer_num)
        return list(zip(self.kv_buffer + self.kv_scale_buffer, descs))

    def _token_buffers(self) -> list[TokenBuffer]:
        return [TokenBuffer(b, "rows") for b in self.kv_buffer + self.kv_scale_buffer]

    # -- reads ---------------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Every slot's row (latent + rope), dequantized: ``[num_slots, 1, R + Dr]``."""
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        return dequantize_fp4(
            self.kv_buffer[idx],
            self.kv_scale_buffer[idx],
            dtype=self.dtype,
            backend=self.kernel_backend,
        )

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The latent part of :meth:`get_key_buffer`: ``[num_slots, 1, R]``."""
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def get_fp4_buffers(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw ``(packed, scale)`` uint8 buffers of ``layer``."""
        idx = self.layer_index(layer)
        self._wait_layer(idx)
        return self.kv_buffer[idx], self.kv_scale_buffer[idx]

    def get_mla_kv_buffer(
        self, layer, loc, dst_dtype: Optional[torch.dtype] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_nope [N, 1, R], k_rope [N, 1, Dr])`` of tokens ``loc``, dequantized to
        ``dst_dtype`` (default ``dtype``)."""
        idx = self.layer_index(layer)
        self._wait_layer(idx)
        loc = self._as_loc(unwrap_write_loc(loc)[0])
        out_dtype = dst_dtype if dst_dtype in FLOAT_DTYPES else self.dtype
        rows = dequantize_fp4(
            self.kv_buffer[idx],
            self.kv_scale_buffer[idx],
            loc=loc,
            dtype=out_dtype,
            backend=self.kernel_backend,
        )
        nope, rope = rows[..., : self.kv_lora_rank], rows[..., self.kv_lora_rank :]
        if dst_dtype is not None and dst_dtype != out_dtype:
            nope, rope = nope.to(dst_dtype), rope.to(dst_dtype)
        return nope, rope

    # -- writes --------------------------------------------------------------------------------
    def _store(self, idx: int, loc, row: torch.Tensor, mask=None) -> None:
        if row.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(
                f"rows must be one of {FLOAT_DTYPES} to quantize, got {row.dtype}"
            )
        store_fp4(
            self.kv_buffer[idx],
            self.kv_scale_buffer[idx],
            loc,
            row.to(self.device),
            mask=mask,
            backend=self.kernel_backend,
        )

    def set_kv_buffer(
        self,
        layer,
        loc,
        k: torch.Tensor,
        v: Optional[torch.Tensor] = None,
        *,
        mask: Optional[torch.Tensor] = None,
    ) -> None:
        """Quantize whole rows ``k [N, 1, R + Dr]`` and write them at ``loc`` (tensor or
        :class:`KVWriteLoc`); ``v`` is ignored (it is part of ``k``)."""
        idx = self.layer_index(layer)
        loc = self._as_loc(unwrap_write_loc(loc)[0])
        if not isinstance(k, torch.Tensor):
            raise InvalidArgument(f"k must be a tensor, got {type(k).__name__}")
        self._check_rows("k", k, loc.shape[0], (1, self.kv_cache_dim))
        if mask is not None:
            mask = mask.to(self.device)
        self._store(idx, loc, k, mask)

    def set_mla_kv_buffer(self, layer, loc, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Quantize ``k_nope [N, 1, R]`` and ``k_rope [N, 1, Dr]`` into one row per token."""
        idx = self.layer_index(layer)
        loc = self._as_loc(unwrap_write_loc(loc)[0])
        n = loc.shape[0]
        for name, x in (("k_nope", k_nope), ("k_rope", k_rope)):
            if not isinstance(x, torch.Tensor):
                raise InvalidArgument(f"{name} must be a tensor, got {type(x).__name__}")
        self._check_rows("k_nope", k_nope, n, (1, self.kv_lora_rank))
        self._check_rows("k_rope", k_rope, n, (1, self.qk_rope_head_dim))
        if k_nope.dtype != k_rope.dtype:
            raise ShapeMismatch(f"k_nope is {k_nope.dtype} but k_rope is {k_rope.dtype}")
        # blocks never straddle the latent/rope boundary (both dims are multiples of 16), so
        # quantizing the concatenated row equals quantizing the parts separately
        self._store(idx, loc, torch.cat((k_nope, k_rope), dim=-1))

    def kv_token_segments(self) -> None:
        """None: FP4: values and their scale buffers pair by token with different granularities; transfers need equal page sizes (not modelled as token geometry)."""
        return None

    def describe(self) -> dict:
        d = super().describe()
        d["kv_quant"] = KV_QUANT
        return d
