"""The ``KVCache`` contract every KV pool honours.

Token ids and pages
    A pool of ``size`` tokens has ``size + page_size`` token slots: ids ``[0, size + page_size)``.
    Page ``p`` covers token ids ``[p * page_size, (p + 1) * page_size)``; page 0 (which holds the
    padding slot 0) is the padding page, written by padded/dummy tokens and never handed out.
    Any id outside ``[0, size + page_size)`` raises :class:`IndexOutOfRange` (on the CPU/torch
    kernel path, before anything is written; on GPU such rows are never written).

Layers
    Layer ids run ``[start_layer, start_layer + layer_num)``; methods take the global id (or any
    object with ``.layer_id``) and index their buffers with ``layer_id - start_layer``; other ids
    raise :class:`IndexOutOfRange`. ``end_layer`` is informational (the last layer id, inclusive;
    default ``start_layer + layer_num - 1``).

Dtypes
    ``dtype`` is the logical element type; ``store_dtype`` is what the buffers hold (``uint8``
    for the fp8 types, whose bytes are copied verbatim). Getters return views as ``dtype``.

Registration
    ``get_contiguous_buf_infos()`` -> ``(ptrs, lens, item_lens)`` with one entry per registered
    buffer (see each pool for the order); ``lens[i] = desc.final_span_bytes(size, page_size)``,
    ``item_lens[i]`` = one page of that buffer. ``get_item_views()`` gives the same bytes as
    ``uint8 [lens[i] // item_lens[i], item_lens[i]]`` tensors: row ``p`` is page ``p``.
    ``describe()`` is the plain-dict layout fingerprint two peers compare.

Post-capture backing
    Pools built with ``post_capture_active=True`` reserve their buffers and back them later
    (:mod:`kvxfer.pools.post_capture`): valid ids are then ``[0, token_limit)`` and ``lens[i]`` is the
    *backed* span of buffer ``i``. For an ordinary pool ``token_limit == num_slots``.
"""

from __future__ import annotations

import abc
import logging
from typing import Any, Optional

import torch

from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch
from kvxfer.pools.cpu_copy import KvCpuCopy, TokenBuffer, copy_to_host, load_from_host
from kvxfer.pools.layout import KvBufferDesc
from kvxfer.pools.post_capture import PostCaptureMixin
from kvxfer.pools.write_loc import KVWriteLoc

logger = logging.getLogger(__name__)

__all__ = ["KVCache", "FP8_DTYPES", "store_dtype_for"]

FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


def store_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Buffers hold fp8 as ``uint8`` (raw bytes); every other dtype as itself."""
    return torch.uint8 if dtype in FP8_DTYPES else dtype


def _int_arg(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")
    return value


def byte_rows_view(t: torch.Tensor, nrows: int, row_bytes: int) -> torch.Tensor:
    """``uint8 [nrows, row_bytes]`` view of the bytes starting at ``t.data_ptr()``."""
    offset = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()
    assert offset + nrows * row_bytes <= storage.nbytes(), "item view past the storage end"
    out = torch.empty((0,), dtype=torch.uint8, device=t.device)
    out.set_(storage, offset, (nrows, row_bytes), (row_bytes, 1))
    return out


class KVCache(PostCaptureMixin, abc.ABC):
    """Abstract KV pool. Subclasses set ``kind``/``layout`` and the head geometry attributes
    used by :meth:`describe`, create their buffers, and implement the abstract methods."""

    kind: str = "abstract"
    layout: str = "nhd"
    head_num: int = 0
    head_dim: int = 0
    v_head_dim: int = 0

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device="cpu",
        *,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        kernel_backend: str = "auto",
        cpu_copy_chunk_tokens: int = 8192,
    ):
        self.size = _int_arg("size", size, 0)
        self.page_size = _int_arg("page_size", page_size, 1)
        self.layer_num = _int_arg("layer_num", layer_num, 0)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgument(f"dtype must be a torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.store_dtype = store_dtype_for(dtype)
        self.device = torch.device(device)
        self.start_layer = _int_arg("start_layer", 0 if start_layer is None else start_layer, 0)
        self.end_layer = (
            self.start_layer + max(self.layer_num, 1) - 1
            if end_layer is None
            else _int_arg("end_layer", end_layer, self.start_layer)
        )
        if kernel_backend not in ("auto", "triton", "torch"):
            raise InvalidArgument(
                f"kernel_backend must be auto|triton|torch, got {kernel_backend!r}"
            )
        self.kernel_backend = kernel_backend
        self.cpu_copy_chunk_tokens = _int_arg("cpu_copy_chunk_tokens", cpu_copy_chunk_tokens, 1)
        self.layer_transfer_counter = None

    # -- token slots and layers --------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """Token slots including the padding page: valid ids are ``[0, num_slots)``."""
        return self.size + self.page_size

    def layer_index(self, layer: Any) -> int:
        """Buffer index of ``layer`` (a global layer id or an object with ``.layer_id``)."""
        if self._closed:
            self._check_open()
        layer_id = getattr(layer, "layer_id", layer)
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise InvalidArgument(f"layer must be an int id or have .layer_id, got {layer!r}")
        idx = layer_id - self.start_layer
        if not 0 <= idx < self.layer_num:
            raise IndexOutOfRange(
                f"layer id {layer_id} outside [{self.start_layer}, "
                f"{self.start_layer + self.layer_num})"
            )
        return idx

    def register_layer_transfer_counter(self, counter) -> None:
        """Install a counter whose ``wait_until(layer_idx)`` gates the buffer getters (layer-wise
        loading: a getter for layer ``i`` blocks until layer ``i`` has arrived)."""
        self.layer_transfer_counter = counter

    def _wait_layer(self, idx: int) -> None:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(idx)

    # -- dtype helpers ------------------------------------------------------------------------
    def _to_store(self, x: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
        """``x`` cast to ``dtype`` (after ``x / scale`` when given) and viewed as ``store_dtype``."""
        if not isinstance(x, torch.Tensor):
            raise InvalidArgument(f"expected a tensor, got {type(x).__name__}")
        if x.dtype != self.dtype:
            if x.dtype == self.store_dtype and self.store_dtype != self.dtype:
                return x  # already raw store bytes
            if scale is not None:
                x = x / scale
            x = x.to(self.dtype)
        if self.store_dtype != self.dtype:
            x = x.view(self.store_dtype)
        if x.device != self.device:
            x = x.to(self.device)
        return x

    def _as_logical(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def _as_loc(self, loc, name: str = "loc") -> torch.Tensor:
        """``loc`` as a 1-D int32/int64 tensor on the pool device (no copy when it already is).

        A :class:`~kvxfer.pools.write_loc.KVWriteLoc` contributes its generic ``loc``."""
        if isinstance(loc, KVWriteLoc):
            loc = loc.loc
        if not isinstance(loc, torch.Tensor):
            loc = torch.as_tensor(loc, dtype=torch.int64)
        if loc.dtype not in (torch.int32, torch.int64):
            if loc.dtype.is_floating_point or loc.dtype == torch.bool:
                raise InvalidArgument(f"{name} must be int32/int64, got {loc.dtype}")
            loc = loc.to(torch.int64)
        if loc.dim() != 1:
            loc = loc.reshape(-1)
        if loc.device != self.device:
            loc = loc.to(self.device)
        return loc

    def _move_locs(self, tgt_loc, src_loc) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_open()
        tgt = self._as_loc(tgt_loc, "tgt_loc")
        src = self._as_loc(src_loc, "src_loc")
        if tgt.shape != src.shape:
            raise ShapeMismatch(f"tgt_loc {tuple(tgt.shape)} and src_loc {tuple(src.shape)} differ")
        return tgt, src

    @staticmethod
    def _check_rows(name: str, x: torch.Tensor, n: int, trailing: tuple) -> None:
        if tuple(x.shape) != (n, *trailing):
            raise ShapeMismatch(f"{name} has shape {tuple(x.shape)}, expected {(n, *trailing)}")

    # -- the contract --------------------------------------------------------------------------
    @abc.abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor: ...

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    @abc.abstractmethod
    def set_kv_buffer(self, layer, loc, k: torch.Tensor, v: Optional[torch.Tensor], **kw) -> None:
        """Write token rows ``k``/``v`` of ``layer`` at token ids ``loc``."""

    @abc.abstractmethod
    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """Copy token rows ``src_loc[i] -> tgt_loc[i]`` in every layer and buffer."""

    @abc.abstractmethod
    def _registered(self) -> list[tuple[torch.Tensor, KvBufferDesc]]:
        """(tensor whose ``data_ptr()`` is the base, descriptor), in registration order."""

    @abc.abstractmethod
    def _token_buffers(self) -> list[TokenBuffer]:
        """Every buffer holding token rows, in a fixed order, for host copies."""

    # -- registration ---------------------------------------------------------------------------
    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        regs = self._registered()
        lens = self._span_lens(regs)
        ptrs = [int(t.data_ptr()) for t, _ in regs]
        items = [d.item_len_bytes(self.page_size) for _, d in regs]
        return ptrs, lens, items

    def get_buffer_descs(self) -> list[KvBufferDesc]:
        return [d for _, d in self._registered()]

    def get_item_views(self) -> list[torch.Tensor]:
        """``uint8 [lens[i] // item_lens[i], item_lens[i]]`` views of the registered bytes."""
        regs = self._registered()
        views = []
        for (t, d), span in zip(regs, self._span_lens(regs)):
            item = d.item_len_bytes(self.page_size)
            views.append(byte_rows_view(t, span // item, item))
        return views

    def kv_token_segments(self) -> Optional[list[list[int]]]:
        """Token geometry of the registered descriptors (see :mod:`kvxfer.disagg.page_map`):
        per descriptor, the bytes of one token row in each segment of an item, in item order;
        ``None`` when the pool cannot say (transfers then need equal page sizes). Default: a
        descriptor whose rows are single tokens is one segment of ``row_bytes``."""
        descs = [d for _, d in self._registered()]
        if any(d.tokens_per_row != 1 for d in descs):
            return None
        return [[d.row_bytes] for d in descs]

    def kv_token_heads(self) -> Optional[list[list[tuple[int, int]]]]:
        """Which of this rank's KV heads each token segment holds (what a TP split needs on
        top of :meth:`kv_token_segments`): per descriptor, per segment, ``(first, count)``:
        one token row of the segment is ``count`` equal head rows, heads ``first ..
        first + count - 1`` (NHD ``[(0, H)]``; HND ``[(0, 1), ..., (H - 1, 1)]``). An empty
        list: the descriptor is the same on every TP rank (MLA's latent). ``None``: the pool
        cannot say (no heterogeneous TP). Default: ``None``."""
        return None

    def describe(self) -> dict:
        """Layout fingerprint (msgpack-able) that two peers compare before transferring."""
        return {
            "kind": self.kind,
            "dtype": str(self.dtype).replace("torch.", ""),
            "page_size": self.page_size,
            "layer_num": self.layer_num,
            "head_num": int(self.head_num),
            "head_dim": int(self.head_dim),
            "v_head_dim": int(self.v_head_dim),
            "layout": self.layout,
            "item_lens": self.get_contiguous_buf_infos()[2],
        }

    def get_kv_size_bytes(self) -> int:
        """Bytes held by the registered buffers (the whole allocation; for a post-capture pool
        the backed spans)."""
        return sum(self._span_lens(self._registered()))

    # -- host copies (retract / restore) -------------------------------------------------------
    def get_cpu_copy(
        self, indices, *, chunk_tokens: Optional[int] = None, pin_memory: Optional[bool] = None
    ) -> KvCpuCopy:
        """Copy the token rows at ``indices`` of every layer to host memory."""
        self._check_open()
        return copy_to_host(
            self._token_buffers(),
            indices,
            page_size=self.page_size,
            limit=self.token_limit,
            store_dtype=self.store_dtype,
            chunk_tokens=chunk_tokens or self.cpu_copy_chunk_tokens,
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
        )

    def load_cpu_copy(
        self, copy: KvCpuCopy, indices, *, chunk_tokens: Optional[int] = None
    ) -> None:
        """Write a copy back at ``indices`` (any ids, as many as were copied). Validates the
        copy against this pool first; on any mismatch raises and writes nothing."""
        self._check_open()
        load_from_host(
            copy,
            self._token_buffers(),
            indices,
            page_size=self.page_size,
            limit=self.token_limit,
            store_dtype=self.store_dtype,
            chunk_tokens=chunk_tokens or self.cpu_copy_chunk_tokens,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"dtype={self.dtype}, layers={self.start_layer}+{self.layer_num}, "
            f"layout={self.layout}, device={self.device})"
        )
