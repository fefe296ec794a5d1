"""Token and page allocators for the KV pools (and a re-export of ``ReqToTokenPool``).

Geometry: a pool of ``size`` tokens with ``page_size`` tokens per page has
``num_pages = size // page_size`` usable pages with ids ``1..num_pages``; page ``p`` covers
token ids ``[p * page_size, (p + 1) * page_size)``. Page 0 (tokens ``0..page_size-1``) is the
padding page and is never handed out, matching KV pools of ``size + page_size`` rows.

Invariants (checked by the fuzz tests):

* A page is in exactly one of: free (``_free`` or a release batch), allocated, or
  pending in an open free group. ``available_size()`` counts free pages only.
* Page 0 and ids ``> num_pages`` are never handed out and cannot be freed.
* Out of memory: ``alloc*`` return ``None`` and change nothing.
* Bad frees (page 0 / out of range → :class:`IndexOutOfRange`, a page that is not
  allocated, or the same page twice in one ``free_pages`` call → :class:`DoubleFree`) raise
  before anything changes.

Bookkeeping lives on the host (numpy): the free list, the release batches and the
allocated bitmap, so validating a free never touches the device — no device sync and a few
microseconds for a request's pages given as a list, numpy array or CPU tensor (ids given as a
device tensor are copied to the host once, which waits for that tensor). The free list has a
device copy that allocations slice without a copy; token-id arithmetic for the caller
(``alloc``, ``alloc_extend``, ``alloc_decode``) is vectorised torch on the allocator's device,
and the only host reads there are the ``*_cpu`` lengths the caller already holds. Freed pages
are collected in release batches and merged (sorted) into the free list lazily when an
allocation needs them — the one time the free list is copied to the device — so consecutive
allocations tend to be contiguous, which the transfer layer turns into fewer RMA operations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from kvxfer.kernels.ids import sorted_unique
from kvxfer.pools.errors import DoubleFree, IndexOutOfRange, InvalidArgument
from kvxfer.pools.req_to_token import ReqToTokenPool  # noqa: F401  (part of this module's API)

logger = logging.getLogger(__name__)

__all__ = [
    "ReqToTokenPool",
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "AllocatorState",
]

Ids = Union[torch.Tensor, Sequence[int]]


@dataclass
class AllocatorState:
    """Opaque snapshot for :meth:`PagedTokenToKVPoolAllocator.restore_state`."""

    free: np.ndarray
    release: List[np.ndarray]
    allocated: np.ndarray


class PagedTokenToKVPoolAllocator:
    """Page-granular token allocator (see module docstring for geometry and invariants)."""

    def __init__(self, size: int, page_size: int, device: Union[str, torch.device] = "cpu"):
        size, page_size = int(size), int(page_size)
        if page_size < 1:
            raise InvalidArgument(f"page_size must be >= 1, got {page_size}")
        if size < page_size:
            raise InvalidArgument(f"size {size} holds no full page of {page_size} tokens")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self._slot_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        """Every page free again; any open free group is dropped."""
        self._set_free(np.arange(1, self.num_pages + 1, dtype=np.int64))
        self._release: List[np.ndarray] = []
        self._n_release = 0
        self._allocated = np.zeros(self.num_pages + 1, dtype=bool)
        self._group: Optional[List[np.ndarray]] = None

    def _set_free(self, free: np.ndarray) -> None:
        """The free list (ascending after a merge) and its device copy, sliced in step."""
        self._free = free
        dev = torch.from_numpy(free)
        # pageable source: the driver stages it before the call returns, so the host array may
        # change afterwards
        self._free_dev = (
            dev if self.device.type == "cpu" else dev.to(self.device, non_blocking=True)
        )

    def available_size(self) -> int:
        """Free tokens (whole free pages × page_size); pages pending in a free group excluded."""
        return (int(self._free.size) + self._n_release) * self.page_size

    def available_pages(self) -> int:
        return int(self._free.size) + self._n_release

    def backup_state(self) -> AllocatorState:
        if self._group is not None:
            raise InvalidArgument("cannot back up allocator state inside an open free group")
        return AllocatorState(self._free.copy(), list(self._release), self._allocated.copy())

    def restore_state(self, state: AllocatorState) -> None:
        if self._group is not None:
            raise InvalidArgument("cannot restore allocator state inside an open free group")
        self._set_free(state.free.copy())
        self._release = list(state.release)
        self._n_release = sum(int(r.size) for r in self._release)
        self._allocated = state.allocated.copy()

    # ------------------------------------------------------------------ pages
    def _merge_release(self) -> None:
        if self._release:
            self._set_free(np.sort(np.concatenate([self._free, *self._release])))
            self._release = []
            self._n_release = 0

    def _take_pages(self, n: int) -> Optional[torch.Tensor]:
        if n < 0:
            raise InvalidArgument(f"cannot allocate a negative number of pages ({n})")
        if n > self._free.size:
            self._merge_release()
            if n > self._free.size:
                return None
        out = self._free_dev[:n]
        self._allocated[self._free[:n]] = True
        self._free, self._free_dev = self._free[n:], self._free_dev[n:]
        return out

    def alloc_pages(self, n: int) -> Optional[torch.Tensor]:
        """``n`` whole pages (int64 page ids, never 0), or ``None`` if fewer are free."""
        return self._take_pages(int(n))

    def pages_to_tokens(self, pages: torch.Tensor) -> torch.Tensor:
        """Token ids of whole pages, page by page (int64)."""
        pages = pages.to(device=self.device, dtype=torch.int64)
        return (pages[:, None] * self.page_size + self._slot_offsets).reshape(-1)

    # ------------------------------------------------------------------ alloc
    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` token ids (int64, whole pages: ``need_size % page_size == 0``)."""
        need_size = int(need_size)
        if need_size < 0 or need_size % self.page_size:
            raise InvalidArgument(
                f"alloc({need_size}) needs a non-negative multiple of page_size {self.page_size}"
            )
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self.pages_to_tokens(pages)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: Optional[torch.Tensor],
        seq_lens: torch.Tensor,
        seq_lens_cpu: Optional[torch.Tensor],
        last_loc: torch.Tensor,
        extend_num_tokens: Optional[int] = None,
    ) -> Optional[torch.Tensor]:
        """Token ids for extending request ``b`` from ``prefix_lens[b]`` to ``seq_lens[b]``.

        The partially filled last page of each prefix is filled first (tokens
        ``last_loc[b] + 1, ...``, where ``last_loc[b]`` is the id of the prefix's last token),
        then fresh pages are taken. The result is request-major, ``sum(seq - prefix)`` long.
        Returns ``None`` (nothing changed) when too few pages are free.
        """
        p_cpu = _cpu_lens(prefix_lens, prefix_lens_cpu)
        s_cpu = _cpu_lens(seq_lens, seq_lens_cpu)
        if p_cpu.shape != s_cpu.shape or last_loc.numel() != p_cpu.numel():
            raise InvalidArgument(
                f"prefix_lens {tuple(p_cpu.shape)}, seq_lens {tuple(s_cpu.shape)} and "
                f"last_loc {tuple(last_loc.shape)} must have one entry per request"
            )
        if bool((s_cpu < p_cpu).any()) or bool((p_cpu < 0).any()):
            raise InvalidArgument("seq_lens must be >= prefix_lens >= 0 for every request")
        total = int((s_cpu - p_cpu).sum())
        if extend_num_tokens is not None and int(extend_num_tokens) != total:
            raise InvalidArgument(
                f"extend_num_tokens={extend_num_tokens} but sum(seq_lens - prefix_lens)={total}"
            )
        ps = self.page_size
        n_new_cpu = _ceil_div(s_cpu, ps) - _ceil_div(p_cpu, ps)
        pages = self._take_pages(int(n_new_cpu.sum()))
        if pages is None:
            return None

        dev = self.device
        prefix = prefix_lens.to(device=dev, dtype=torch.int64).reshape(-1)
        seq = seq_lens.to(device=dev, dtype=torch.int64).reshape(-1)
        last = last_loc.to(device=dev, dtype=torch.int64).reshape(-1)
        ext = seq - prefix
        b = torch.arange(prefix.numel(), device=dev)
        req = torch.repeat_interleave(b, ext, output_size=total)
        start = torch.cumsum(ext, 0) - ext
        local = torch.arange(total, device=dev) - start[req]
        pos = prefix[req] + local
        prefix_ceil_pages = _ceil_div(prefix, ps)
        in_partial = pos < prefix_ceil_pages[req] * ps
        partial_tok = last[req] + 1 + local
        if pages.numel() == 0:
            return partial_tok
        n_new = _ceil_div(seq, ps) - prefix_ceil_pages
        page_base = torch.cumsum(n_new, 0) - n_new
        page_idx = (
            page_base[req] + torch.div(pos, ps, rounding_mode="floor") - prefix_ceil_pages[req]
        )
        page_idx = torch.where(in_partial, torch.zeros_like(page_idx), page_idx)
        new_tok = pages[page_idx] * ps + pos % ps
        return torch.where(in_partial, partial_tok, new_tok)

    def alloc_decode(
        self,
        seq_lens: torch.Tensor,
        seq_lens_cpu: Optional[torch.Tensor],
        last_loc: torch.Tensor,
    ) -> Optional[torch.Tensor]:
        """One token per request at position ``seq_lens[b] - 1`` (``seq_lens`` include it).

        A request whose new token starts a page gets a fresh page; the others get
        ``last_loc[b] + 1``. Returns ``None`` (nothing changed) when too few pages are free.
        """
        s_cpu = _cpu_lens(seq_lens, seq_lens_cpu)
        if last_loc.numel() != s_cpu.numel():
            raise InvalidArgument(
                f"seq_lens {tuple(s_cpu.shape)} and last_loc {tuple(last_loc.shape)} differ"
            )
        if bool((s_cpu < 1).any()):
            raise InvalidArgument("alloc_decode needs seq_lens >= 1 (they include the new token)")
        ps = self.page_size
        pages = self._take_pages(int(((s_cpu - 1) % ps == 0).sum()))
        if pages is None:
            return None
        dev = self.device
        seq = seq_lens.to(device=dev, dtype=torch.int64).reshape(-1)
        nxt = last_loc.to(device=dev, dtype=torch.int64).reshape(-1) + 1
        if pages.numel() == 0:
            return nxt
        need = (seq - 1) % ps == 0
        idx = (torch.cumsum(need.to(torch.int64), 0) - 1).clamp_(min=0)
        return torch.where(need, pages[idx] * ps, nxt)

    # ------------------------------------------------------------------ free
    def free(self, token_ids: Ids) -> None:
        """Free the pages holding ``token_ids`` (several tokens of one page free it once)."""
        tok = _host_ids(token_ids)
        if tok.size == 0:
            return
        pages = tok // self.page_size
        if pages.size > 1:  # a request's tokens come page by page: one per run, then sort
            run = np.empty(pages.size, dtype=bool)
            run[0] = True
            np.not_equal(pages[1:], pages[:-1], out=run[1:])
            pages = pages[run]
        pages = sorted_unique(pages)
        self._release_pages(pages, what="token", raw=tok)

    def free_pages(self, page_ids: Ids) -> None:
        """Free whole pages by id (the disaggregation path)."""
        pages = _host_ids(page_ids)
        if pages.size == 0:
            return
        srt = np.sort(pages)  # a new array: never the caller's memory
        same = srt[1:] == srt[:-1]
        if same.any():
            dup = int(srt[1:][same][0])
            raise DoubleFree(f"page {dup} appears more than once in one free_pages call")
        self._release_pages(srt, what="page", raw=pages)

    def _release_pages(self, pages: np.ndarray, *, what: str, raw: np.ndarray) -> None:
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi > self.num_pages:
            bad_page = lo if lo < 1 else hi
            if what == "token":
                bad = raw[raw // self.page_size == bad_page][0]
                raise IndexOutOfRange(
                    f"token id {int(bad)} lies in page {bad_page}, outside the allocatable "
                    f"pages [1, {self.num_pages}] (page 0 is the padding page)"
                )
            raise IndexOutOfRange(
                f"page id {bad_page} outside the allocatable pages [1, {self.num_pages}] "
                "(page 0 is the padding page)"
            )
        held = self._allocated[pages]
        if not held.all():
            raise DoubleFree(f"page {int(pages[~held][0])} is not allocated (double free?)")
        self._allocated[pages] = False
        if self._group is not None:
            self._group.append(pages)
        else:
            self._release.append(pages)
            self._n_release += int(pages.size)

    def free_group_begin(self) -> None:
        """Collect subsequent frees; they become available at :meth:`free_group_end`."""
        if self._group is not None:
            raise InvalidArgument("free_group_begin called while a free group is open")
        self._group = []

    def free_group_end(self) -> None:
        if self._group is None:
            raise InvalidArgument("free_group_end called without free_group_begin")
        group, self._group = self._group, None
        if group:
            pages = np.concatenate(group)
            self._release.append(pages)
            self._n_release += int(pages.size)

    def is_allocated(self, page_ids: Ids) -> torch.Tensor:
        """Bool per page id (ids must be in ``[0, num_pages]``), on the allocator's device."""
        ids = _host_ids(page_ids)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > self.num_pages):
            raise IndexOutOfRange(f"page ids must lie in [0, {self.num_pages}]")
        return torch.from_numpy(self._allocated[ids]).to(self.device)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()}, device={self.device})"
        )


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Token-granular allocator: the paged allocator with ``page_size == 1``.

    Token ids ``1..size`` are allocatable; token 0 is the padding slot.
    """

    def __init__(self, size: int, device: Union[str, torch.device] = "cpu"):
        super().__init__(size, 1, device)


def _ceil_div(x: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(x + (d - 1), d, rounding_mode="floor")


def _cpu_lens(dev_lens: torch.Tensor, cpu_lens: Optional[torch.Tensor]) -> torch.Tensor:
    src = cpu_lens if cpu_lens is not None else dev_lens
    if not isinstance(src, torch.Tensor):
        src = torch.as_tensor(src)
    return src.detach().to("cpu", torch.int64).reshape(-1)


def _host_ids(ids: Ids) -> np.ndarray:
    """``ids`` as a 1-D int64 numpy array (a device tensor is copied to the host once);
    InvalidArgument for floating-point or bool ids."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InvalidArgument(f"ids must be an integer tensor, got {ids.dtype}")
        return ids.detach().to("cpu", torch.int64).reshape(-1).numpy()
    arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"ids must be integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)
