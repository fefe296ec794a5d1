"""Small value types of the engine API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List


@dataclass(frozen=True)
class ItemWrite:
    """Copy items ``src_items[k]`` of local group ``group`` to items ``dst_items[k]`` of the
    peer's group of the same name. Ids: sequences or 1-D int arrays/CPU tensors, same length."""

    group: str
    src_items: Any
    dst_items: Any


@dataclass(frozen=True)
class RawWrite:
    """Byte ranges: ``[src_off, src_off+nbytes)`` of local descriptor ``desc`` of ``group``
    to ``[dst_off, dst_off+nbytes)`` of the peer's descriptor ``desc``. Scalars or arrays."""

    group: str
    src_off: Any
    dst_off: Any
    nbytes: Any
    desc: Any = 0


@dataclass(frozen=True)
class SliceWrite:
    """Strided slices of items (:mod:`kvxfer.engine.slices`): the runs ``runs[d] = (offs,
    lens)`` (relative to one item of local descriptor ``d``) of every item ``src_items[k]`` of
    local group ``group`` land in item ``dst_items[k]`` of the peer's group of the same name,
    at the runs *the peer* derived itself and registered under ``key``
    (:meth:`~kvxfer.engine.peer.Peer.expect_slices`); nothing but item ids and byte counts
    travels. Always staged: gathered into staging memory, one PUT per landing-slot chunk,
    scattered by the peer before the write's ``notify`` is delivered. Needs landing slots
    from the peer (both engines with ``stage_slice_min_ops > 0``)."""

    group: str
    src_items: Any
    dst_items: Any
    runs: Any
    key: int


@dataclass(frozen=True)
class PatternWrite:
    """The same item-relative runs of every item pair: per descriptor ``d`` of ``group``,
    ``runs[d] = (src offs, dst offs, lens)`` (relative to one item on each side; a validated
    :class:`~kvxfer.engine.slices.PatternRuns` is taken as is) copy from item
    ``src_items[k]`` into the peer's item ``dst_items[k]`` (distinct). To a same-host peer
    with a device lane that covers the group it is ONE copy launch whatever the run count
    (:mod:`kvxfer.kernels.pattern_copy`); otherwise the runs go as PUTs, exactly as the
    RawWrite of the expanded runs would (:meth:`~kvxfer.engine.peer.Peer.can_pattern`)."""

    group: str
    src_items: Any
    dst_items: Any
    runs: Any


@dataclass
class TransferStats:
    """What one ``Peer.write`` did. ``post_s``: time spent posting the native batch;
    ``complete_s``: from the end of posting until the flush completed (bytes visible at the
    target) and the notification was handed to UCX; ``flush_s``: from the end of posting until
    UCX reported the flush complete (a chained notification, kvxfer.engine.notes: until the
    chain ended, its notification included); ``wake_s``: from the end of posting until the
    event loop resumed after that report (the rest of ``complete_s`` is the notification; both
    0 without UCX PUTs). ``lanes``: UCX transports carrying RMA. ``device_bytes`` of ``bytes`` (in
    ``device_ops`` of the ``ops`` runs) went over the same-host device lane (one copy launch
    into the peer's IPC-mapped memory, kvxfer.engine.devcopy) instead of UCX; ``launch_s`` of
    ``post_s`` went to those launches (they come before the UCX posts).
    ``staged``: at least one part went through the staged path (gather → one PUT per
    landing-slot chunk → scatter at the target); ``staged_bytes`` of ``bytes`` did, and
    ``staged_direct_ops`` is how many PUTs those parts would have needed unstaged; ``ops``
    counts the PUTs actually posted. ``posted_ns``: ``time.monotonic_ns()`` at the end of
    posting (0: not measured), the origin of the durations above; ``launched_ns``: at the
    end of the write's lane launches (0: none), ``put_ns``: where its UCX PUTs started being
    posted (after the launches, the lane masks and the notification's turn; 0: not
    measured) — stage stamps (kvxfer.disagg.trace)."""

    bytes: int = 0
    ops: int = 0
    post_s: float = 0.0
    complete_s: float = 0.0
    flush_s: float = 0.0
    wake_s: float = 0.0
    device_bytes: int = 0
    device_ops: int = 0
    launch_s: float = 0.0
    lanes: List[str] = field(default_factory=list)
    staged: bool = False
    staged_bytes: int = 0
    staged_direct_ops: int = 0
    posted_ns: int = 0
    launched_ns: int = 0
    put_ns: int = 0
    #: of ``ops`` / ``bytes``, the runs copied by the same-host host lane
    #: (kvxfer.engine.hostcopy: process_vm_writev) instead of UCX; a copy done inline (up to
    #: 1 MiB) counts in ``post_s`` and ``launch_s``
    host_ops: int = 0
    host_bytes: int = 0

    @property
    def total_s(self) -> float:
        return self.post_s + self.complete_s

    @property
    def gbps(self) -> float:
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0
