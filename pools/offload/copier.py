"""The copies of one direction (device -> host or host -> device) for the offload manager.

Two ways to move the rows ``dev_ids[i] <-> host_ids[i]`` of every buffer, both issued on the
caller's current stream and never synchronising the device:

* **direct**: the pairing is split into runs contiguous on both sides; every run is ONE
  ``copy_`` per buffer. Best when runs are long (a request whose pages are contiguous costs
  one copy per buffer whatever its size).
* **staged** (only with a staging buffer): for requests broken into many short runs, the
  pages are gathered (``index_select``) into a fixed device staging buffer, batch by batch,
  and each batch crosses the bus as one copy per buffer and host run (restore: the reverse,
  then ``index_copy_``). This replaces ``runs x buffers`` small copies by
  ``batches x buffers`` large ones; the staging buffer is allocated once, at construction,
  so it never grows under memory pressure. Batches reuse the buffer in stream order.

``Copier.copy`` picks staged when the direct copies would average fewer than
``min_chunk_bytes`` bytes and the request has more than one run.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .runs import contiguous_runs

logger = logging.getLogger(__name__)

__all__ = ["Copier"]


class Copier:
    """Copies between device item views and host item views, in one direction."""

    def __init__(
        self,
        device: torch.device,
        to_host: bool,
        *,
        staging_bytes: int = 0,
        min_chunk_bytes: int = 2 << 20,
    ) -> None:
        self.device = device
        self.to_host = to_host
        self.non_blocking = device.type == "cuda"
        self.min_chunk_bytes = int(min_chunk_bytes)
        self._foreach = True
        self.staging = (
            torch.empty(int(staging_bytes), dtype=torch.uint8, device=device)
            if staging_bytes > 0
            else None
        )

    def copy(
        self, dev_views, host_views, dev_ids: np.ndarray, host_ids: np.ndarray
    ) -> tuple[int, bool]:
        """Issue the copies; returns (number of bus copies, whether staging was used)."""
        if dev_ids.size == 0 or not dev_views:
            return 0, False
        runs = contiguous_runs(dev_ids, host_ids)
        row_bytes = sum(int(v.shape[1]) for v in dev_views)
        direct_chunks = runs.shape[0] * len(dev_views)
        if (
            self.staging is not None
            and runs.shape[0] > 1
            and self.staging.numel() >= row_bytes
            and dev_ids.size * row_bytes < self.min_chunk_bytes * direct_chunks
        ):
            return self._staged(dev_views, host_views, dev_ids, host_ids, row_bytes), True
        return self._direct(dev_views, host_views, runs), False

    def _direct(self, dev_views, host_views, runs: np.ndarray) -> int:
        nb = self.non_blocking
        dev, host = [], []
        for d0, h0, n in runs.tolist():
            dev += [dv[d0 : d0 + n] for dv in dev_views]
            host += [hv[h0 : h0 + n] for hv in host_views]
        dst, src = (host, dev) if self.to_host else (dev, host)
        if self._foreach:
            try:  # one dispatch for every chunk (each still its own copy)
                torch._foreach_copy_(dst, src, non_blocking=nb)
                return len(dst)
            except (RuntimeError, AttributeError, TypeError) as exc:  # older torch
                logger.debug("_foreach_copy_ unusable (%s); copying chunk by chunk", exc)
                self._foreach = False
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=nb)
        return len(dst)

    def _staged(self, dev_views, host_views, dev_ids, host_ids, row_bytes: int) -> int:
        nb = self.non_blocking
        idx = torch.from_numpy(dev_ids)
        if nb:  # pinned, so the index upload is a true async copy on this stream
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        batch = self.staging.numel() // row_bytes
        copies = 0
        for b0 in range(0, dev_ids.size, batch):
            m = min(batch, dev_ids.size - b0)
            bidx = idx[b0 : b0 + m]
            segs, off = [], 0
            for dv in dev_views:
                length = int(dv.shape[1])
                segs.append(self.staging[off : off + m * length].view(m, length))
                off += m * length
            # host side of this batch: runs of consecutive host ids (positions 0..m-1)
            hruns = contiguous_runs(np.arange(m, dtype=np.int64), host_ids[b0 : b0 + m]).tolist()
            if self.to_host:
                for dv, seg in zip(dev_views, segs):
                    torch.index_select(dv, 0, bidx, out=seg)
                for p0, h0, n in hruns:
                    for seg, hv in zip(segs, host_views):
                        hv[h0 : h0 + n].copy_(seg[p0 : p0 + n], non_blocking=nb)
            else:
                for p0, h0, n in hruns:
                    for seg, hv in zip(segs, host_views):
                        seg[p0 : p0 + n].copy_(hv[h0 : h0 + n], non_blocking=nb)
                for dv, seg in zip(dev_views, segs):
                    dv.index_copy_(0, bidx, seg)
            copies += len(hruns) * len(dev_views)
        return copies
