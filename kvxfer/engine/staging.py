"""Staged transfers: local staging ring, landing ring, gather and scatter (one group each).

A scattered page set costs one PUT per run per descriptor (each with a fixed CPU cost over
cuda_ipc, a syscall each over cma). The staged path replaces them by: gather the source
items into a registered *staging slot* (one ``index_select`` per descriptor), one PUT of the
packed bytes into a *landing slot* of the peer, then the peer scatters them into its items
(one ``index_copy_`` per descriptor) before its message handlers see the notification.
Whether that pays off is measured, not assumed (staged against direct:
bench/results/transfer-cpu.md; on CUDA, ``kvxfer bench transfer --paths direct,staged``).

Packing (both sides agree, nothing else is on the wire): ``n`` items of a group with
descriptors ``d = 0..D-1`` lie descriptor-major, ``[d0: n x item_lens[0]][d1: ...]...``, so
``nbytes = n x item_bytes``.

Invariants
- Both rings live on the group's device (host memory, or the CUDA device of its first
  descriptor), are allocated and registered at ``start()``, and are released with the
  group registrations. The landing ring is in the region table advertised to peers; the
  staging ring is not.
- Landing slots are granted to peers in disjoint sets (``grant`` / ``release``); a slot is
  owned by at most one peer at a time.
- Host groups use numpy (``take`` / fancy-index assignment: no torch import), CUDA groups
  torch (``index_select`` / ``index_copy_`` on the current stream of that device).
- ``gather`` / ``scatter`` return only when the bytes are in place (CUDA: the current
  stream is synchronised), so a PUT never reads a half-written staging slot and a handler
  never sees half-scattered items.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from typing import Dict, List, Optional

import numpy as np

from kvxfer import plan
from kvxfer.engine import slices
from kvxfer.errors import Closed, ProtocolError
from kvxfer.transport.base import Region

log = logging.getLogger(__name__)

SUPPORTED_MEM_TYPES = ("host", "cuda")


def _cuda_ordinal(addr: int) -> Optional[int]:
    """CUDA device ordinal of a device pointer (driver query; None when unknown)."""
    from kvxfer.kernels.cuda_driver import device_ordinal

    return device_ordinal(addr)


class _CudaBytes:
    """Minimal ``__cuda_array_interface__`` over raw device bytes (for torch.as_tensor)."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def byte_view(ptr: int, nbytes: int, device: str):
    """Bytes ``[ptr, ptr+nbytes)`` without a copy: a numpy uint8 array for ``"cpu"`` (host
    memory needs no torch import), a torch uint8 tensor for a CUDA device."""
    if device == "cpu":
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    import torch

    return torch.as_tensor(_CudaBytes(ptr, nbytes), device=device)


def group_device(group: plan.GroupLayout, mem_types: List[str]) -> Optional[str]:
    """``"cpu"`` or ``"cuda:N"`` holding every descriptor of ``group``, or None
    (mixed or unsupported memory types: the group always moves unstaged)."""
    kinds = set(mem_types)
    if len(kinds) != 1 or next(iter(kinds)) not in SUPPORTED_MEM_TYPES:
        return None
    if kinds == {"host"}:
        return "cpu"
    ords = {_cuda_ordinal(p) for p in group.ptrs}
    if len(ords) != 1 or None in ords:
        return None
    return f"cuda:{ords.pop()}"


class GroupStage:
    """Staging + landing rings of one local group, and its item views.

    ``slot_bytes`` is a multiple of the group's item bytes (``items_per_slot`` items)."""

    def __init__(
        self,
        transport,
        group: plan.GroupLayout,
        device: str,
        slot_bytes: int,
        landing_slots: int,
        staging_slots: int,
    ):
        self.cuda = device != "cpu"
        if self.cuda:
            import torch

            self._torch = torch
        self.group = group
        self.device = device
        item = group.item_bytes
        cap = max(item, min(slot_bytes, group.num_items * item))
        self.items_per_slot = cap // item
        self.slot_bytes = self.items_per_slot * item
        self.views = [
            byte_view(p, n, device).reshape(n // il, il)
            for p, n, il in zip(group.ptrs, group.lens, group.item_lens)
        ]
        self.landing = self._empty(landing_slots * self.slot_bytes)
        self.staging = self._empty(staging_slots * self.slot_bytes)
        self.landing_region: Optional[Region] = None
        self.staging_region: Optional[Region] = None
        try:
            self.landing_region = transport.register(
                self._ptr(self.landing),
                self.landing.size if not self.cuda else self.landing.numel(),
            )
            self.staging_region = transport.register(
                self._ptr(self.staging),
                self.staging.size if not self.cuda else self.staging.numel(),
            )
        except BaseException:
            self.release()
            raise
        self.landing_slots = landing_slots
        self.region_index = -1  # index of the landing region in the advertised table
        self._grantable = list(range(landing_slots))
        self._staging_free: Optional[asyncio.Queue] = None
        self._staging_count = staging_slots

    def _empty(self, n: int):
        if self.cuda:
            return self._torch.empty(n, dtype=self._torch.uint8, device=self.device)
        return np.empty(n, dtype=np.uint8)

    def _ptr(self, buf) -> int:
        return buf.data_ptr() if self.cuda else buf.ctypes.data

    @property
    def landing_base(self) -> int:
        return self._ptr(self.landing)

    def __repr__(self):
        return (
            f"GroupStage({self.group.name!r}, {self.device}, {self.items_per_slot} items x "
            f"{self.landing_slots} landing / {self._staging_count} staging slots)"
        )

    # ------------------------------------------------------------- landing grants
    def grant(self, n: int) -> List[int]:
        """Up to ``n`` landing slots for one peer (all-or-nothing: [] when fewer are left)."""
        if len(self._grantable) < n:
            return []
        out, self._grantable = self._grantable[:n], self._grantable[n:]
        return out

    def give_back(self, slots) -> None:
        self._grantable.extend(s for s in slots if s not in self._grantable)

    # ------------------------------------------------------------- staging slots
    @property
    def staging_free(self) -> asyncio.Queue:
        if self._staging_free is None:  # created in the engine's loop on first use
            self._staging_free = asyncio.LifoQueue()  # reuse the warm slot first
            for s in range(self._staging_count):
                self._staging_free.put_nowait(s)
        return self._staging_free

    def staging_addr(self, slot: int) -> int:
        return self._ptr(self.staging) + slot * self.slot_bytes

    @property
    def staging_handle(self) -> int:
        """Registration handle of the staging ring (for the PUT batch)."""
        if self.staging_region is None:
            raise Closed(f"staging ring of {self.group.name!r} released")
        return self.staging_region.handle

    # ------------------------------------------------------------- data movement
    def _sync(self) -> None:
        if self.cuda:
            self._torch.cuda.current_stream(self.device).synchronize()

    def _ids(self, ids: np.ndarray):
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        return self._torch.from_numpy(ids).to(self.device) if self.cuda else ids

    def gather(self, src: np.ndarray, slot: int) -> int:
        """Pack items ``src`` (validated ids) into staging slot ``slot``; returns bytes."""
        n = int(src.size)
        assert 0 < n <= self.items_per_slot
        idx = self._ids(src)
        off = slot * self.slot_bytes
        for view, il in zip(self.views, self.group.item_lens):
            out = self.staging[off : off + n * il].reshape(n, il)
            if self.cuda:
                self._torch.index_select(view, 0, idx, out=out)
            else:
                np.take(view, idx, axis=0, out=out, mode="clip")  # ids validated; "raise" buffers
            off += n * il
        self._sync()
        return n * self.group.item_bytes

    def check_plan(self, slot: int, offset: int, nbytes: int, dst_raw: bytes) -> np.ndarray:
        """Validate a scatter plan received from a peer; returns the destination ids.
        Raises ProtocolError naming what is wrong (nothing has been written)."""
        name = self.group.name
        if len(dst_raw) == 0 or len(dst_raw) % 8:
            raise ProtocolError(f"staged {name!r}: dst ids field of {len(dst_raw)} bytes")
        dst = np.frombuffer(dst_raw, dtype="<i8").astype(np.int64)
        n = int(dst.size)
        if nbytes != n * self.group.item_bytes:
            raise ProtocolError(
                f"staged {name!r}: nbytes {nbytes} != {n} items x {self.group.item_bytes}"
            )
        if not 0 <= slot < self.landing_slots:
            raise ProtocolError(f"staged {name!r}: slot {slot} out of range")
        if offset < 0 or offset + nbytes > self.slot_bytes:
            raise ProtocolError(
                f"staged {name!r}: [{offset}, +{nbytes}) outside the "
                f"{self.slot_bytes}-byte landing slot"
            )
        bad = (dst < 0) | (dst >= self.group.num_items)
        if bad.any():
            raise ProtocolError(
                f"staged {name!r}: dst item {int(dst[bad][0])} out of range "
                f"[0, {self.group.num_items})"
            )
        if plan.has_duplicates(dst):
            raise ProtocolError(f"staged {name!r}: duplicate dst items")
        return dst

    def scatter(self, dst: np.ndarray, slot: int, offset: int) -> None:
        """Unpack landing slot ``slot`` (at ``offset``) into items ``dst`` (validated)."""
        n = int(dst.size)
        idx = self._ids(dst)
        off = slot * self.slot_bytes + offset
        for view, il in zip(self.views, self.group.item_lens):
            src = self.landing[off : off + n * il].reshape(n, il)
            if self.cuda:
                view.index_copy_(0, idx, src)
            else:
                view[idx] = src
            off += n * il
        self._sync()

    # ------------------------------------------------------------- strided slices
    def gather_slices(self, items: np.ndarray, runs: slices.SliceRuns, slot: int) -> int:
        """Pack the slices ``runs`` of items ``items`` (validated ids) into staging slot
        ``slot``, descriptor-major (:mod:`kvxfer.engine.slices`); returns bytes packed."""
        off = base = slot * self.slot_bytes
        for d, (view, il) in enumerate(zip(self.views, self.group.item_lens)):
            o, n = runs.offs[d], runs.lens[d]
            if not n.size:
                continue
            k = int(items.size) * int(n.sum())
            assert off + k <= base + self.slot_bytes
            out = self.staging[off : off + k]
            if self.cuda:
                self._slices_cuda(view.reshape(-1), il, items, o, n, out, gather=True)
            else:
                slices.gather_host(view.reshape(-1), il, items, o, n, out)
            off += k
        self._sync()
        return off - base

    def scatter_slices(self, items: np.ndarray, runs: slices.SliceRuns, slot: int) -> None:
        """Unpack landing slot ``slot`` into the slices ``runs`` (this side's own, validated)
        of items ``items`` (validated ids)."""
        off = slot * self.slot_bytes
        for d, (view, il) in enumerate(zip(self.views, self.group.item_lens)):
            o, n = runs.offs[d], runs.lens[d]
            if not n.size:
                continue
            k = int(items.size) * int(n.sum())
            src = self.landing[off : off + k]
            if self.cuda:
                self._slices_cuda(view.reshape(-1), il, items, o, n, src, gather=False)
            else:
                slices.scatter_host(view.reshape(-1), il, items, o, n, src)
            off += k
        self._sync()

    def _slices_cuda(self, flat, il: int, items, o, n, packed, gather: bool) -> None:
        """CUDA gather (``packed`` <- runs) or scatter (runs <- ``packed``) of one
        descriptor: one strided index_select / index_copy_ for regular runs, else a byte
        index (one element per byte moved)."""
        torch = self._torch
        idx = self._ids(items)
        shape = slices.regular(o, n)
        if shape is not None:
            first, step, count, size = shape
            total = (flat.numel() - first - (count - 1) * step - size) // il + 1
            v = flat.as_strided((total, count, size), (il, step, 1), flat.storage_offset() + first)
            rows = packed.view(int(items.size), count, size)
            if gather:
                torch.index_select(v, 0, idx, out=rows)
            else:
                v.index_copy_(0, idx, rows)
            return
        offs, lens = slices.direct_runs(slices.SliceRuns((o,), (n,)), [il], items, 0)
        pos = np.concatenate(([0], np.cumsum(lens)[:-1]))
        byte = np.repeat(offs - pos, lens) + np.arange(int(lens.sum()))
        bidx = torch.from_numpy(byte).to(self.device)
        if gather:
            torch.index_select(flat, 0, bidx, out=packed)
        else:
            flat.index_copy_(0, bidx, packed)

    def release(self) -> None:
        for attr in ("staging_region", "landing_region"):
            r = getattr(self, attr)
            if r is not None:
                setattr(self, attr, None)
                try:
                    r.release()
                except Exception as exc:
                    log.warning("releasing %r: %s", r, exc)


def build_stages(
    transport,
    groups: Dict[str, plan.GroupLayout],
    mem_types: Dict[str, List[str]],
    slot_bytes: int,
    landing_slots: int,
    staging_slots: int,
    host: bool = False,
) -> Dict[str, GroupStage]:
    """A :class:`GroupStage` for every group whose descriptors sit on one supported device
    (host memory only when ``host``; others are skipped: they always move unstaged)."""
    out: Dict[str, GroupStage] = {}
    try:
        for name, g in groups.items():
            dev = group_device(g, mem_types[name])
            if dev == "cpu" and not host:
                dev = None
            if dev is None:
                log.debug("group %r (%s): no staged path", name, sorted(set(mem_types[name])))
                continue
            out[name] = GroupStage(transport, g, dev, slot_bytes, landing_slots, staging_slots)
    except BaseException:
        for st in out.values():
            st.release()
        raise
    return out
