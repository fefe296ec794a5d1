"""``BackedBuffers``: the object a pool uses for post-capture backing.

Given the pool's :class:`~kvxfer.pools.layout.KvBufferDesc` list, it reserves address space for every
buffer's full (reserved) size, builds one tensor per descriptor over the reservation without
copying, and backs physical memory in two steps:

1. at construction, page 0 of every buffer (``prefix_span_bytes(page_size)``) -- enough for the
   dummy writes of CUDA-graph capture, which all land on the padding page;
2. :meth:`BackedBuffers.finalize` ``(n)`` once the engine knows its token budget: exactly
   ``final_span_bytes(n)`` of every buffer (rounded out to the allocation granularity).

Wiring it into a pool is::

    owner = BackedBuffers(descs, store_dtype=..., device=..., page_size=..., reserved_num_tokens=size)
    tensors = owner.tensors          # one per descriptor, full reserved shape, stable addresses
    ...
    owner.finalize(n)                # after capture; tensors keep their addresses
    owner.span_bytes                 # what registration may advertise (the backed span)

Invariants:

- ``tensors[i]`` has ``descs[i]``'s full shape and a fixed ``data_ptr()`` from construction to
  :meth:`close` (captured graphs bake these addresses in);
- bytes ``[0, span_bytes[i])`` of buffer ``i`` are always backed; ``span_bytes[i]`` is exactly
  ``final_span_bytes(num_tokens)`` after :meth:`finalize` / :meth:`release_beyond`, and
  ``prefix_span_bytes(page_size)`` before;
- token ids ``[0, usable_tokens)`` are backed in every buffer; :meth:`check_token_ids`,
  :meth:`backed_views`, :meth:`byte_views` and :meth:`item_views` never reach beyond that.
  Indexing ``tensors`` directly past ``usable_tokens`` is the caller's responsibility -- on the
  host it faults (SIGSEGV), on a GPU it is an illegal address -- so pools must bound-check token
  ids against :attr:`usable_tokens` (their ``size + page_size`` after finalize);
- bytes that become usable read as zeros (as in a ``torch.zeros`` pool);
- a spans change is checked in full before anything is committed; a failed commit rolls back
  what it had committed and leaves the owner as it was.

Not thread-safe. After :meth:`close` the tensors must not be used (the owner drops its own
references; the pool must drop its views first).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

import torch

from kvxfer.kernels.errors import BackingError, IndexOutOfRange, InvalidArgument, ShapeMismatch
from kvxfer.pools.layout import KvBufferDesc

from .base import Backing, BackingProvider, round_up, subtract_ranges
from .memory import cuda_index, make_provider, tensor_over

logger = logging.getLogger(__name__)

__all__ = ["BackedBuffers"]

#: every buffer base is aligned to at least this many bytes (vector loads, TMA, UCX)
MIN_ALIGNMENT = 256


def _int_arg(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class BackedBuffers:
    """Reserved-now, backed-later buffers for one pool (see the module docstring).

    Args:
        descs: one descriptor per buffer, in the pool's registration order.
        store_dtype: element dtype of the tensors (one for all, or one per descriptor).
        device: "cpu" (host mmap backing) or a CUDA device (VMM backing).
        page_size: tokens per page; page 0 is backed at construction.
        reserved_num_tokens: the upper bound ``n`` that :meth:`finalize` may ask for; every
            descriptor must hold ``final_span_bytes(reserved_num_tokens)``.
        one_range: one address range for all buffers (each at a granularity-aligned offset)
            instead of one range per buffer.
        handle_types: CUDA only: allocation handle types to try, in order.
        max_extent_bytes: cap on one physical allocation (the unit memory is given back in).
        provider: a shared :class:`BackingProvider` to use (not closed by :meth:`close`).
    """

    def __init__(
        self,
        descs: Sequence[KvBufferDesc],
        *,
        store_dtype: Union[torch.dtype, Sequence[torch.dtype]],
        device: Union[str, torch.device] = "cpu",
        page_size: int,
        reserved_num_tokens: int,
        one_range: bool = False,
        handle_types: Optional[Sequence[str]] = None,
        max_extent_bytes: Optional[int] = None,
        provider: Optional[BackingProvider] = None,
    ) -> None:
        self.descs = list(descs)
        if not self.descs:
            raise InvalidArgument("BackedBuffers needs at least one buffer descriptor")
        for d in self.descs:
            if not isinstance(d, KvBufferDesc):
                raise InvalidArgument(f"expected KvBufferDesc, got {type(d).__name__}: {d!r}")
        dtypes = (
            [store_dtype] * len(self.descs)
            if isinstance(store_dtype, torch.dtype)
            else list(store_dtype)
        )
        if len(dtypes) != len(self.descs) or not all(isinstance(t, torch.dtype) for t in dtypes):
            raise InvalidArgument(
                f"store_dtype must be a torch.dtype or one per descriptor "
                f"({len(self.descs)}), got {store_dtype!r}"
            )
        self.store_dtypes = dtypes
        self.page_size = _int_arg("page_size", page_size, 1)
        self.reserved_num_tokens = _int_arg("reserved_num_tokens", reserved_num_tokens, 0)
        self.device = torch.device(device)
        self.reserved_spans = self._check_descs()
        if self.device.type == "cuda":
            self.device = torch.device("cuda", cuda_index(self.device))

        self._own_provider = provider is None
        self.provider = (
            provider
            if provider is not None
            else make_provider(self.device, handle_types=handle_types)
        )
        if (
            self.provider.device_type != self.device.type
            or getattr(self.provider, "device_index", self.device.index) != self.device.index
        ):
            raise InvalidArgument(f"provider {self.provider.info()} does not serve {self.device}")
        self.tensors: list[torch.Tensor] = []
        self._bytes: list[torch.Tensor] = []
        self._backings: list[Backing] = []
        self._slots: list[tuple[Backing, int]] = []  # (backing, offset of buffer i in it)
        self.span_bytes: list[int] = [0] * len(self.descs)
        self.num_tokens: Optional[int] = None
        self._closed = False
        try:
            self._reserve(one_range, max_extent_bytes)
            prefix = [d.prefix_span_bytes(self.page_size, self.page_size) for d in self.descs]
            self._resize(prefix)
        except BaseException:
            self.close()
            raise
        logger.debug(
            "reserved %d bytes over %d buffers on %s; page 0 backed (%d bytes)",
            self.reserved_bytes,
            len(self.descs),
            self.device,
            self.backed_bytes,
        )

    # -- construction ---------------------------------------------------------------------
    def _check_descs(self) -> list[int]:
        spans = []
        for d, dt in zip(self.descs, self.store_dtypes):
            span = d.reserved_span_bytes(dt.itemsize)
            if span <= 0 or not d.shape:
                raise InvalidArgument(f"{d.name}: empty buffer (shape {d.shape})")
            if span % d.row_bytes:
                raise ShapeMismatch(
                    f"{d.name}: {span} reserved bytes are not whole rows of {d.row_bytes} bytes"
                )
            lead = span // d.shape[0]  # bytes per index of dim 0
            if d.row_bytes % lead:
                raise ShapeMismatch(
                    f"{d.name}: a row ({d.row_bytes} bytes) is not a whole number "
                    f"of dim-0 slices ({lead} bytes) of shape {d.shape}"
                )
            need = d.final_span_bytes(self.reserved_num_tokens, self.page_size)
            if need > span:
                raise ShapeMismatch(
                    f"{d.name}: reserved_num_tokens={self.reserved_num_tokens} needs {need} bytes "
                    f"but the buffer (shape {d.shape}, {dt}) holds {span}"
                )
            spans.append(span)
        return spans

    def _reserve(self, one_range: bool, max_extent_bytes: Optional[int]) -> None:
        g = self.provider.granularity
        slot_sizes = [round_up(s, g) for s in self.reserved_spans]
        if one_range:
            b = self.provider.reserve(sum(slot_sizes), max_extent_bytes=max_extent_bytes)
            self._backings.append(b)
            off = 0
            for size in slot_sizes:
                self._slots.append((b, off))
                off += size
        else:
            for size in slot_sizes:
                b = self.provider.reserve(size, max_extent_bytes=max_extent_bytes)
                self._backings.append(b)
                self._slots.append((b, 0))
        align = max(MIN_ALIGNMENT, *(t.itemsize for t in self.store_dtypes))
        for i, (b, off) in enumerate(self._slots):
            addr = b.address + off
            if addr % align:
                raise BackingError(
                    f"{self.descs[i].name}: base {addr:#x} is not {align}-byte aligned"
                )

    def _make_tensors(self) -> None:
        """Built once page 0 is backed (the CUDA array interface queries the base pointer)."""
        for i, ((b, off), d, dt) in enumerate(zip(self._slots, self.descs, self.store_dtypes)):
            addr, n = b.address + off, self.reserved_spans[i]
            raw = tensor_over(self.device, addr, n, b)
            if raw.data_ptr() != addr or raw.numel() != n:
                raise BackingError(
                    f"{d.name}: tensor over {addr:#x} came back at "
                    f"{raw.data_ptr():#x} ({raw.numel()} bytes): not a view"
                )
            self._bytes.append(raw)
            self.tensors.append(raw.view(dt).view(d.shape))

    # -- queries --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def finalized(self) -> bool:
        return self.num_tokens is not None

    @property
    def reserved_bytes(self) -> int:
        return sum(b.reserved_bytes for b in self._backings)

    @property
    def backed_bytes(self) -> int:
        """Physically backed bytes (granularity-rounded), all buffers together."""
        return sum(b.backed_bytes for b in self._backings)

    @property
    def requested_bytes(self) -> int:
        """Sum of the usable spans (what was asked for, before rounding)."""
        return sum(self.span_bytes)

    @property
    def usable_tokens(self) -> int:
        """Token ids ``[0, usable_tokens)`` are backed in every buffer."""
        return min(s // d.row_bytes * d.tokens_per_row for s, d in zip(self.span_bytes, self.descs))

    def info(self) -> dict[str, Any]:
        return {
            **self.provider.info(),
            "buffers": len(self.descs),
            "reserved_bytes": self.reserved_bytes,
            "backed_bytes": self.backed_bytes,
            "requested_bytes": self.requested_bytes,
            "num_tokens": self.num_tokens,
            "usable_tokens": self.usable_tokens if not self._closed else 0,
        }

    def _check_open(self) -> None:
        if self._closed:
            raise BackingError("BackedBuffers is closed")

    def check_token_ids(self, ids) -> None:
        """Raise IndexOutOfRange unless every id (int, sequence or tensor) is backed.

        A CUDA tensor is reduced on the device and read back once (one sync)."""
        self._check_open()
        if isinstance(ids, torch.Tensor):
            if ids.numel() == 0:
                return
            lo, hi = (int(x) for x in torch.stack(torch.aminmax(ids.reshape(-1))).tolist())
        elif isinstance(ids, int) and not isinstance(ids, bool):
            lo = hi = ids
        else:
            vals = [int(x) for x in ids]
            if not vals:
                return
            lo, hi = min(vals), max(vals)
        cap = self.usable_tokens
        if lo < 0:
            raise IndexOutOfRange(f"token id {lo} is negative")
        if hi >= cap:
            raise IndexOutOfRange(
                f"token id {hi} is beyond the backed capacity: ids must be "
                f"< {cap} (num_tokens={self.num_tokens})"
            )

    def backed_views(self) -> list[torch.Tensor]:
        """``tensors`` narrowed along dim 0 to their backed span (safe to index anywhere)."""
        self._check_open()
        out = []
        for t, s, d, dt in zip(self.tensors, self.span_bytes, self.descs, self.store_dtypes):
            lead = d.reserved_span_bytes(dt.itemsize) // d.shape[0]
            out.append(t.narrow(0, 0, s // lead))
        return out

    def byte_views(self) -> list[torch.Tensor]:
        """uint8 1-D views aliasing exactly the usable span of every buffer."""
        self._check_open()
        return [raw[:s] for raw, s in zip(self._bytes, self.span_bytes)]

    def item_views(self) -> list[torch.Tensor]:
        """uint8 2-D ``[span // item_len, item_len]`` views (item row p = page p)."""
        out = []
        for raw, d in zip(self.byte_views(), self.descs):
            item = d.item_len_bytes(self.page_size)
            out.append(raw[: raw.numel() // item * item].view(-1, item))
        return out

    def buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """``(ptrs, lens, item_lens)``: lens are the usable (backed) spans, never the reserved."""
        self._check_open()
        return (
            [t.data_ptr() for t in self._bytes],
            list(self.span_bytes),
            [d.item_len_bytes(self.page_size) for d in self.descs],
        )

    # -- finalize / release ---------------------------------------------------------------
    def _check_n(self, n, upper: int, what: str) -> int:
        if isinstance(n, bool) or not isinstance(n, int):
            raise InvalidArgument(f"{what}: token count must be an int, got {n!r}")
        if n < 0 or n > upper:
            raise InvalidArgument(f"{what}: token count {n} is outside [0, {upper}]")
        return n

    def _targets(self, n: int) -> list[int]:
        targets = [d.final_span_bytes(n, self.page_size) for d in self.descs]
        for d, t, r in zip(self.descs, targets, self.reserved_spans):
            if t > r:  # ruled out by _check_descs; kept as the check-before-commit guard
                raise BackingError(f"{d.name}: span {t} exceeds the reservation {r}")
        return targets

    def finalize(self, num_tokens: int) -> None:
        """Back exactly ``final_span_bytes(num_tokens)`` of every buffer (growing or
        shrinking); afterwards ``usable_tokens`` covers ``num_tokens`` plus the padding page.

        Raises InvalidArgument for a count outside ``[0, reserved_num_tokens]`` and
        BackingError when backing fails -- in both cases nothing changed."""
        self._check_open()
        n = self._check_n(num_tokens, self.reserved_num_tokens, "finalize")
        self._resize(self._targets(n))
        self.num_tokens = n
        logger.info(
            "backing finalized: %d tokens, requested %d bytes, backed %d bytes (reserved %d) on %s",
            n,
            self.requested_bytes,
            self.backed_bytes,
            self.reserved_bytes,
            self.device,
        )

    def release_beyond(self, num_tokens: int) -> int:
        """Shrink to ``num_tokens`` (<= the finalized count) and give back every extent
        wholly beyond the new spans. Waits for queued device work first. Returns the bytes
        given back."""
        self._check_open()
        if self.num_tokens is None:
            raise BackingError("release_beyond before finalize: nothing beyond page 0 is backed")
        n = self._check_n(num_tokens, self.num_tokens, "release_beyond")
        before = self.backed_bytes
        self._resize(self._targets(n))
        self.num_tokens = n
        return before - self.backed_bytes

    def _resize(self, targets: list[int]) -> None:
        g = self.provider.granularity
        grown: list[tuple[Backing, list]] = []
        try:
            for i, (b, off) in enumerate(self._slots):
                old, new = self.span_bytes[i], targets[i]
                if new > old:
                    grown.append((b, b.commit(off + old, new - old)))
        except BaseException:
            for b, extents in reversed(grown):
                b.release_extents(extents)
            raise
        if not self.tensors:
            self._make_tensors()
        for i, (b, off) in enumerate(self._slots):
            old, new = self.span_bytes[i], targets[i]
            if new > old:
                # fresh host pages read as zeros; everything else is zeroed here
                holes = (
                    [ext for bb, exts in grown if bb is b for ext in exts]
                    if b.fresh_memory_is_zero
                    else []
                )
                for lo, hi in subtract_ranges(off + old, off + new, holes):
                    self._bytes[i][lo - off : hi - off].zero_()
        shrink = [i for i in range(len(targets)) if targets[i] < self.span_bytes[i]]
        if shrink:
            for b in {id(b): b for b, _ in (self._slots[i] for i in shrink)}.values():
                b.sync()
            for i in shrink:
                b, off = self._slots[i]
                lo = off + round_up(targets[i], g)
                hi = off + round_up(self.reserved_spans[i], g)
                if hi > lo:
                    b.decommit(lo, hi - lo)
        self.span_bytes = list(targets)

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the tensors, then tear down: sync, each range newest buffer first (extents
        newest first inside), then the provider if this owner made it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.tensors = []
        self._bytes = []
        errors = []
        for b in reversed(self._backings):
            try:
                b.close()
            except Exception as exc:  # noqa: BLE001 - keep tearing down
                errors.append(exc)
        self._backings = []
        self._slots = []
        if self._own_provider:
            try:
                self.provider.close()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise BackingError(f"teardown failed: {errors[0]}") from errors[0]

    def __enter__(self) -> "BackedBuffers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return "<BackedBuffers closed>"
        return (
            f"<BackedBuffers {len(self.descs)} buffers on {self.device} "
            f"num_tokens={self.num_tokens} backed={self.backed_bytes} "
            f"reserved={self.reserved_bytes}>"
        )
