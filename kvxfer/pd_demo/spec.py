"""Geometry of the demo's synthetic model: plain values, no torch (the parent process of the
demo never imports torch; the workers build pools from it in :mod:`kvxfer.pd_demo.model`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Tuple

from kvxfer.errors import InvalidArgument

KV_LAYOUTS = ("page_major", "per_layer", "hnd", "mla")
MAMBA_LAYOUTS = ("envelope", "per_layer", "none")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class ModelSpec:
    """Geometry of the synthetic model (plain values: it travels to the worker processes)."""

    kv_layout: str = "page_major"
    mamba_layout: str = "envelope"
    attn_layers: int = 4
    mamba_layers: int = 4
    heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    pool_tokens: int = 16384
    mamba_slots: int = 128
    aux_rows: int = 256
    conv_dim: int = 64
    conv_width: int = 4
    ssm_heads: int = 2
    ssm_head_dim: int = 16
    ssm_state: int = 16
    dtype: str = "bfloat16"
    device: str = "cpu"
    #: this worker's TP rank and size: ``heads`` (KV heads), ``conv_dim`` and ``ssm_heads``
    #: are the model's, split over the ranks (docs/shapes.md); MLA latents are replicated
    tp_rank: int = 0
    tp_size: int = 1
    #: the kv pool reserved at construction and backed by ``finalize_backing`` afterwards
    #: (:mod:`kvxfer.pools.post_capture`; on CUDA: VMM memory with POSIX-FD handles, which
    #: a same-host peer's device lane maps: :mod:`kvxfer.engine.vmm_share`)
    post_capture: bool = False

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise InvalidArgument(f"kv_layout {self.kv_layout!r} not in {KV_LAYOUTS}")
        if self.mamba_layout not in MAMBA_LAYOUTS:
            raise InvalidArgument(f"mamba_layout {self.mamba_layout!r} not in {MAMBA_LAYOUTS}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        for name in (
            "attn_layers",
            "heads",
            "head_dim",
            "page_size",
            "pool_tokens",
            "mamba_slots",
            "aux_rows",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mamba_layout != "none" and self.mamba_layers < 1:
            raise InvalidArgument(f"mamba_layout {self.mamba_layout!r} needs mamba_layers >= 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"tp_rank {self.tp_rank} not in [0, tp_size {self.tp_size})")
        if self.tp_size > 1:
            if self.kv_layout != "mla" and max(self.heads, self.tp_size) % min(
                self.heads, self.tp_size
            ):
                raise InvalidArgument(
                    f"{self.heads} KV heads cannot be split or replicated over tp {self.tp_size}"
                )
            if self.has_mamba and (self.conv_dim % self.tp_size or self.ssm_heads % self.tp_size):
                raise InvalidArgument(
                    f"conv_dim {self.conv_dim} and ssm_heads {self.ssm_heads} must split over "
                    f"tp {self.tp_size}"
                )
        if self.pool_tokens % self.page_size:
            raise InvalidArgument(
                f"pool_tokens {self.pool_tokens} is not a multiple of page_size {self.page_size}"
            )

    @property
    def has_mamba(self) -> bool:
        return self.mamba_layout != "none"

    def layer_ids(self) -> Tuple[List[int], List[int]]:
        """(full-attention ids, mamba ids): interleaved attention / mamba, extras at the end."""
        if not self.has_mamba:
            return list(range(self.attn_layers)), []
        attn, mamba, lid = [], [], 0
        while len(attn) < self.attn_layers or len(mamba) < self.mamba_layers:
            if len(attn) < self.attn_layers:
                attn.append(lid)
                lid += 1
            if len(mamba) < self.mamba_layers:
                mamba.append(lid)
                lid += 1
        return attn, mamba

    def as_dict(self) -> dict:
        return asdict(self)
