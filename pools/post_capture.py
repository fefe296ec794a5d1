"""Post-capture backing for KV pools: reserve address space now, back it physically later.

Mixed into :class:`kvxfer.pools.base.KVCache`. A pool built with ``post_capture_active=True`` (per-layer
MHA in either layout, page-major MHA, MLA; :class:`kvxfer.pools.hybrid.HybridLinearKVPool` delegates to
its inner pool):

1. rounds ``size`` UP to a whole number of pages, reserves every buffer's full size through
   :class:`kvxfer.pools.backing.BackedBuffers` and backs page 0 only (the padding page, which takes
   every dummy write of CUDA-graph capture). The buffers have their full reserved shapes and
   fixed ``data_ptr()`` s from construction to :meth:`close`, so captured graphs stay valid;
2. :meth:`finalize_backing` ``(n)`` backs exactly ``final_span_bytes(n)`` of every buffer
   (every span is checked before anything is committed; a bad ``n`` raises, nothing is
   clamped) and sets ``size = n``; :meth:`release_beyond` ``(m)`` shrinks to ``m <= n`` and
   gives memory back; :meth:`close` tears everything down (idempotent).

Invariants (for a post-capture pool):

- valid token ids are ``[0, token_limit)`` with ``token_limit = min(num_slots,
  usable_tokens)``: page 0 before finalize, ``size + page_size`` after. Every pool API taking
  ids rejects others with :class:`IndexOutOfRange` on the host-checked paths (CPU, torch
  backend) -- touching an unbacked byte would fault (SIGSEGV) on the host;
- the kernels get the buffers narrowed to the backed span, so their own row limit is the
  backed row count: on CUDA an id beyond it is never written (the kernels mask it off, no
  host sync), never an illegal address. Exception: while a CUDA graph is being *captured* the
  kernels get the full buffers (the row limit is baked into the graph, and a page-0 limit
  would silently drop every write replayed after finalize); the engine guarantees replayed
  ids are backed (its allocator is sized from ``finalize_backing``);
- registration (``get_contiguous_buf_infos``, ``get_item_views``, ``get_kv_size_bytes``)
  reports the backed spans ``owner.span_bytes``, never the reservation;
- after :meth:`close` every pool API raises :class:`BackingError`.

Getters (``get_key_buffer`` ...) return the full reserved-shape tensors: indexing them past
``token_limit`` is the caller's responsibility, as for any raw tensor.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

import torch

from kvxfer.kernels.errors import BackingError, InvalidArgument, UnsupportedOperation
from kvxfer.pools.layout import KvBufferDesc, ceil_div

logger = logging.getLogger(__name__)

__all__ = ["PostCaptureMixin", "page_align_up"]

#: BackedBuffers keyword arguments a pool may pass through ``backing_options``
_BACKING_OPTIONS = ("one_range", "handle_types", "max_extent_bytes", "provider")


def page_align_up(size, page_size):
    """``size`` rounded up to a multiple of ``page_size`` (non-ints pass through for the
    constructor's own validation to reject)."""
    if (
        isinstance(size, int)
        and not isinstance(size, bool)
        and size >= 0
        and isinstance(page_size, int)
        and not isinstance(page_size, bool)
        and page_size > 0
    ):
        return ceil_div(size, page_size) * page_size
    return size


def _token_count(value, what: str) -> int:
    """An int token count, or the ``max_total_num_tokens`` of a config object."""
    n = getattr(value, "max_total_num_tokens", value)
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgument(
            f"{what}: token count must be an int (or an object with an int "
            f".max_total_num_tokens), got {value!r}"
        )
    return n


class PostCaptureMixin:
    """Post-capture lifecycle shared by the KV pools (see the module docstring).

    A pool opts in by calling :meth:`_init_post_capture` before creating its buffers, creating
    them with :meth:`_reserve_backing` when :attr:`post_capture_active`, and implementing
    :meth:`_refresh_kernel_views` (narrowed views for the kernels) and :meth:`_drop_buffers`.
    """

    post_capture_active: bool = False
    _backing = None  # BackedBuffers when post-capture is active
    _backing_options: Mapping[str, Any] = {}
    _closed: bool = False

    # -- construction -----------------------------------------------------------------------
    def _init_post_capture(self, active, backing_options: Optional[Mapping[str, Any]]) -> None:
        if not isinstance(active, bool):
            raise InvalidArgument(f"post_capture_active must be a bool, got {active!r}")
        opts = dict(backing_options or {})
        unknown = sorted(set(opts) - set(_BACKING_OPTIONS))
        if unknown:
            raise InvalidArgument(f"unknown backing_options {unknown}; allowed: {_BACKING_OPTIONS}")
        if opts and not active:
            raise InvalidArgument("backing_options needs post_capture_active=True")
        self.post_capture_active = active
        self._backing_options = opts

    def _reserve_backing(
        self, descs: Sequence[KvBufferDesc], store_dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """Reserve ``descs`` for ``self.size`` tokens, back page 0; the full-shape tensors."""
        # imported here: keeps the backing layer off plain pools' import
        from kvxfer.pools.backing import BackedBuffers

        if not descs:
            raise InvalidArgument(
                f"{type(self).__name__}: post_capture_active needs at least "
                f"one buffer (layer_num={getattr(self, 'layer_num', 0)})"
            )
        self._backing = BackedBuffers(
            descs,
            store_dtype=store_dtype,
            device=self.device,
            page_size=self.page_size,
            reserved_num_tokens=self.size,
            **self._backing_options,
        )
        if self._backing.device != self.device:  # "cuda" resolved to "cuda:i"
            self.device = self._backing.device
        return list(self._backing.tensors)

    def _check_post_capture_built(self) -> None:
        """After construction: a subclass that creates its own buffers has not reserved."""
        if self.post_capture_active and self._backing is None:
            raise UnsupportedOperation(
                f"{type(self).__name__} does not support post_capture_active=True"
            )

    # -- queries ----------------------------------------------------------------------------
    @property
    def backing(self):
        """The :class:`~kvxfer.pools.backing.BackedBuffers` owner, or None for an ordinary pool."""
        return self._backing

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def token_limit(self) -> int:
        """Valid token ids are ``[0, token_limit)`` (``num_slots`` for an ordinary pool)."""
        if self._backing is None:
            return self.num_slots
        if self._closed:
            return 0
        return min(self.num_slots, self._backing.usable_tokens)

    @property
    def post_capture_backed_bytes(self) -> int:
        """Physically backed bytes (granularity-rounded); 0 for an ordinary or closed pool."""
        if self._backing is None or self._closed:
            return 0
        return self._backing.backed_bytes

    def _check_open(self) -> None:
        if self._closed:
            raise BackingError(f"{type(self).__name__} is closed")

    def _capturing(self) -> bool:
        """True while a CUDA graph is being captured on the current stream (post-capture
        pools on CUDA only)."""
        return (
            self._backing is not None
            and self.device.type == "cuda"
            and torch.cuda.is_current_stream_capturing()
        )

    def _span_lens(self, regs) -> list[int]:
        """Advertised byte span of each registered buffer (``regs`` from ``_registered``)."""
        if self._backing is None:
            return [d.final_span_bytes(self.size, self.page_size) for _, d in regs]
        self._check_open()
        spans = list(self._backing.span_bytes)
        assert len(spans) == len(regs), "registered buffers differ from the backed ones"
        return spans

    def _narrow(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` narrowed along dim 0 to the valid ids: 3-D buffers are token rows
        ``[rows, ...]``, 4-D ones pages ``[pages, ...]`` (HND, page-major, paged views)."""
        limit = self.token_limit
        n0 = limit if buf.dim() == 3 else ceil_div(limit, self.page_size)
        return buf.narrow(0, 0, min(n0, buf.shape[0]))

    # -- lifecycle ----------------------------------------------------------------------------
    def _require_backing(self, what: str):
        if self._backing is None:
            raise UnsupportedOperation(
                f"{what}: {type(self).__name__} was not built with post_capture_active=True"
            )
        self._check_open()
        return self._backing

    def finalize_backing(self, max_total_num_tokens) -> None:
        """Back exactly ``final_span_bytes(n)`` of every buffer and set ``size = n``.

        ``max_total_num_tokens`` is an int or an object with ``.max_total_num_tokens`` (an
        engine's memory-pool config). ``n`` may grow or shrink a previous finalize, up to the
        reserved size. Raises InvalidArgument for a bad ``n`` and BackingError when backing
        fails (e.g. device OOM); either way nothing changed. Buffer addresses never change.
        """
        owner = self._require_backing("finalize_backing")
        n = _token_count(max_total_num_tokens, "finalize_backing")
        owner.finalize(n)
        self.size = n
        self._refresh_kernel_views()
        logger.info(
            "%s finalized: %d tokens, %d bytes backed", type(self).__name__, n, owner.backed_bytes
        )

    def release_beyond(self, num_tokens) -> int:
        """Shrink to ``num_tokens`` (<= the finalized size), give back every extent wholly
        beyond the new spans and return the bytes given back. Waits for queued device work
        first. The caller's allocator must no longer hand out ids ``>= num_tokens +
        page_size``."""
        owner = self._require_backing("release_beyond")
        n = _token_count(num_tokens, "release_beyond")
        freed = owner.release_beyond(n)
        self.size = n
        self._refresh_kernel_views()
        return freed

    def close(self) -> None:
        """Release the backing (drop every view first, then the ordered teardown). Idempotent.
        An ordinary pool holds no backing: this is a no-op for it."""
        if self._backing is None or self._closed:
            return
        self._closed = True
        self._drop_buffers()
        self._backing.close()

    # -- hooks --------------------------------------------------------------------------------
    def _refresh_kernel_views(self) -> None:
        """Rebuild the views/tables the kernels use after the backed span changed."""

    def _drop_buffers(self) -> None:
        """Forget every tensor over the backing (before it is torn down)."""
