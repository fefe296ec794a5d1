"""Named descriptor groups and their UCX registrations (local side), and the validated
remote view of a peer's groups.

Local invariants
- Groups are added before the engine starts, then frozen; every descriptor lies in exactly
  one registration (a merged span), and ``desc_region[g][d]`` is its index.
- Overlapping descriptors always share a registration. Descriptors that merely touch share
  one for host memory; for device memory a registration may not span two allocations
  (CUDA IPC exports one allocation), so a merged span of device memory joined by adjacency
  is kept only when the CUDA driver confirms one allocation holds it; otherwise it is
  registered again piece by piece (overlaps only).
- Release unmaps every registration once; after it the registry is empty.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from kvxfer import plan
from kvxfer.engine.hostcopy import parse_offer
from kvxfer.engine.staging import GroupStage
from kvxfer.errors import Closed, InvalidArgument, ProtocolError
from kvxfer.transport.base import Region, Transport

log = logging.getLogger(__name__)
_U64 = np.uint64


def _one_allocation(span: plan.Span, groups) -> bool:
    """True when the CUDA driver says the whole span lies in one device allocation."""
    from kvxfer.kernels.cuda_driver import alloc_range

    rng = alloc_range(span.start)
    return rng is not None and rng[0] <= span.start and span.end <= rng[0] + rng[1]


class LocalGroups:
    def __init__(self) -> None:
        self.groups: Dict[str, plan.GroupLayout] = {}
        #: groups whose peer may have other item sizes (only RawWrite pairs them then)
        self.loose: Set[str] = set()
        self.regions: List[Region] = []
        self.desc_region: Dict[str, np.ndarray] = {}
        self.desc_memh: Dict[str, np.ndarray] = {}
        self.stages: Dict[str, GroupStage] = {}  # staged path (kvxfer.engine.staging)
        self.peer_slots = 0
        self.group_regions = 0  # registrations of the groups (the regions before the landings)
        #: {group: legacy-IPC capable?} for CUDA groups (None: host memory / unknown); see
        #: kvxfer.engine.ipc. Filled by freeze().
        self.ipc: Dict[str, Optional[bool]] = {}
        #: offer peers the device lane (export IPC blobs of CUDA regions); set by the engine
        self.export_ipc = False
        self._blobs: Optional[List[bytes]] = None
        #: groups in CUDA VMM memory that same-host peers' device lanes map (vmm_share)
        self.vmm_groups: Set[str] = set()
        self._vmm: Optional[Any] = None  # the VmmExporter, when some region is offered
        self.frozen = False

    def add(self, name, ptrs, lens, item_lens, *, item_lens_may_differ=False) -> plan.GroupLayout:
        if self.frozen:
            raise Closed("groups are registered before start(); the engine already started")
        if name in self.groups:
            raise InvalidArgument(f"group {name!r} is already registered")
        g = plan.make_group(name, ptrs, lens, item_lens)
        self.groups[name] = g
        if item_lens_may_differ:
            self.loose.add(name)
        return g

    def all_device_memory(self) -> bool:
        """Whether there are groups and every descriptor starts in CUDA device memory (the
        driver knows its allocation); False without a CUDA driver. Asked before
        registration (config.own_worker)."""
        from kvxfer.kernels.cuda_driver import alloc_range

        ptrs = [int(p) for g in self.groups.values() for p in g.ptrs]
        return bool(ptrs) and all(alloc_range(p) is not None for p in ptrs)

    def freeze(
        self, transport: Transport, merge_adjacent: bool = True, stage=None, ipc_query=None
    ) -> None:
        """Register every span with the transport (once). ``stage``: ``(slot_bytes,
        landing_slots, peer_slots, stage_host_memory, groups or None)`` to allocate and
        register the staged path's rings for every group (of ``groups``, when given) on a
        supported device (their landing regions join the region table).
        ``ipc_query(addr) -> Optional[bool]``: the legacy-IPC capability query used for
        CUDA groups (default: the CUDA driver, loaded only when a CUDA group exists)."""
        assert not self.frozen
        self.frozen = True
        member_region: Dict[Tuple[str, int], int] = {}
        try:
            for span in plan.merge_spans(list(self.groups.values()), merge_adjacent):
                region = transport.register(span.start, span.length)
                if (
                    span.adjacent_only
                    and region.mem_type != "host"
                    and not _one_allocation(span, self.groups)
                ):
                    region.release()
                    ranges = [
                        (
                            self.groups[g].ptrs[i],
                            self.groups[g].ptrs[i] + self.groups[g].lens[i],
                            (g, i),
                        )
                        for g, i in span.members
                    ]
                    pieces = plan.merge_ranges(ranges, merge_adjacent=False)
                    log.debug(
                        "%s span [%#x, +%d) split into %d registrations",
                        region.mem_type,
                        span.start,
                        span.length,
                        len(pieces),
                    )
                else:
                    self.regions.append(region)
                    for mem in span.members:
                        member_region[mem] = len(self.regions) - 1
                    continue
                for piece in pieces:
                    self.regions.append(transport.register(piece.start, piece.length))
                    for m in piece.members:
                        member_region[m] = len(self.regions) - 1
        except BaseException:
            self.release()
            raise
        for name, g in self.groups.items():
            idx = np.array([member_region[(name, i)] for i in range(g.count)], dtype=_U64)
            self.desc_region[name] = idx
            self.desc_memh[name] = np.array([self.regions[int(r)].handle for r in idx], _U64)
        self.group_regions = len(self.regions)
        self.ipc = self._ipc_report(ipc_query)
        if stage is not None:
            from kvxfer.engine.staging import build_stages

            slot_bytes, landing_slots, self.peer_slots, host, only = stage
            kinds = {n: self.desc_mem_types(n) for n in self.groups}
            staged = {n: g for n, g in self.groups.items() if only is None or n in only}
            try:
                self.stages = build_stages(
                    transport, staged, kinds, slot_bytes, landing_slots, self.peer_slots, host
                )
            except BaseException:
                self.release()
                raise
            for st in self.stages.values():
                assert st.landing_region is not None  # registered by GroupStage()
                st.region_index = len(self.regions)
                self.regions.append(st.landing_region)
        log.info(
            "registered %d group(s), %d descriptor(s) in %d registration(s) (%s)",
            len(self.groups),
            sum(g.count for g in self.groups.values()),
            len(self.regions),
            ",".join(sorted({r.mem_type for r in self.regions})),
        )

    def desc_mem_types(self, name: str) -> List[str]:
        """Memory type of each descriptor's registration in group ``name``."""
        return [self.regions[int(r)].mem_type for r in self.desc_region[name]]

    def _ipc_report(self, query) -> Dict[str, Optional[bool]]:
        from kvxfer.engine import ipc

        kinds = {n: self.desc_mem_types(n) for n in self.groups}
        if query is None:
            if not any("cuda" in k for k in kinds.values()):
                return {n: None for n in self.groups}
            from kvxfer.kernels.cuda_driver import ipc_capable

            query = ipc_capable
        report = ipc.ipc_report(self.groups, kinds, query)
        if self.export_ipc and any(ok is False for ok in report.values()):
            self._offer_vmm(report, kinds, query)
        ipc.warn_non_ipc({n: ok for n, ok in report.items() if n not in self.vmm_groups})
        return report

    def _offer_vmm(self, report, kinds, query) -> None:
        """Offer same-host peers' device lanes the registrations in CUDA VMM memory
        (:mod:`kvxfer.engine.vmm_share`); ``vmm_groups``: the groups not legacy-IPC capable
        whose every CUDA registration a peer can map that way."""
        from kvxfer.engine.vmm_share import VmmExporter
        from kvxfer.kernels.cuda_driver import vmm_extents

        offered = {
            i
            for i, r in enumerate(self.regions)
            if r.mem_type == "cuda" and vmm_extents(r.addr, r.length) is not None
        }
        if not offered:
            return
        try:
            self._vmm = VmmExporter([(r.addr, r.length) for r in self.regions], sorted(offered))
        except OSError as exc:
            log.warning("CUDA VMM registrations not offered to same-host peers: %s", exc)
            return
        for name, ok in report.items():
            g = self.groups[name]
            if ok is False and all(
                int(r) in offered or query(p) is True
                for r, p, k in zip(self.desc_region[name], g.ptrs, kinds[name])
                if k == "cuda"
            ):
                self.vmm_groups.add(name)
            if ok is False:
                log.info(
                    "group %r: CUDA VMM memory, %s same-host peers' device lanes",
                    name,
                    "mapped by" if name in self.vmm_groups else "partly not offered to",
                )

    @property
    def mem_types(self) -> set:
        return {r.mem_type for r in self.regions}

    def wire_groups(self) -> dict:
        return {
            name: {
                "ptrs": list(g.ptrs),
                "lens": list(g.lens),
                "item_lens": list(g.item_lens),
                "regions": [int(r) for r in self.desc_region[name]],
            }
            for name, g in self.groups.items()
        }

    def region_table(self):
        return (
            [r.addr for r in self.regions],
            [r.length for r in self.regions],
            [r.packed_key() for r in self.regions],
            [r.mem_type for r in self.regions],
        )

    def ipc_blobs(self) -> Optional[List[bytes]]:
        """Per region its CUDA IPC blob or b"" (computed once); None when not offered or
        no region has one."""
        if not self.export_ipc:
            return None
        if self._blobs is None:
            from kvxfer.kernels.cuda_driver import ipc_export

            self._blobs = [
                (ipc_export(r.addr) or b"") if r.mem_type == "cuda" else b"" for r in self.regions
            ]
            vmm = self._vmm
            if vmm is not None:  # VMM memory: the exporter's entry instead (vmm_share)
                self._blobs = [
                    b or (vmm.blob(i) if vmm.offers(i) else b"") for i, b in enumerate(self._blobs)
                ]
        return self._blobs if any(self._blobs) else None

    def cuda_regions(self, device: int) -> List[Region]:
        """Registrations in CUDA memory of ``device``."""
        from kvxfer.kernels.cuda_driver import device_ordinal

        return [
            r for r in self.regions if r.mem_type == "cuda" and device_ordinal(r.addr) == device
        ]

    def grant_landing(self) -> Dict[str, dict]:
        """Landing slots for one new peer, per staged group, in Layout.landing form."""
        out = {}
        for name, st in self.stages.items():
            slots = st.grant(self.peer_slots)
            if slots:
                out[name] = {
                    "region": st.region_index,
                    "base": st.landing_base,
                    "slot_bytes": st.slot_bytes,
                    "slots": slots,
                }
            else:
                log.info(
                    "group %r: landing ring exhausted (%d slots); this peer writes unstaged",
                    name,
                    st.landing_slots,
                )
        return out

    def release_landing(self, grant: Dict[str, dict]) -> None:
        for name, body in (grant or {}).items():
            st = self.stages.get(name)
            if st is not None:
                st.give_back(body["slots"])

    def release(self) -> None:
        vmm, self._vmm = self._vmm, None
        if vmm is not None:
            vmm.close()
        stages, self.stages = self.stages, {}
        for st in stages.values():  # landing regions are also in self.regions: unmap once
            if st.landing_region is not None and st.landing_region in self.regions:
                st.landing_region = None
            st.release()
        regions, self.regions = self.regions, []
        for r in regions:
            try:
                r.release()
            except Exception as exc:  # keep releasing the rest
                log.warning("releasing %r: %s", r, exc)
        self.desc_region.clear()
        self.desc_memh.clear()


@dataclass
class RemoteGroups:
    """A peer's groups and region table, validated (see :func:`parse_remote`)."""

    groups: Dict[str, plan.GroupLayout]
    desc_region: Dict[str, np.ndarray]
    bases: List[int]
    lens: List[int]
    keys: List[bytes]
    types: List[str]
    address: Optional[bytes]
    #: landing slots the peer granted us: {group: (region index, base, slot_bytes, [slots])}
    landing: Dict[str, tuple] = field(default_factory=dict)
    #: per region the peer's CUDA IPC blob or b"" (empty list: none offered)
    ipc: List[bytes] = field(default_factory=list)
    #: the peer's token for chained notifications (0: the peer takes AppMessages only)
    note_token: int = 0
    #: the peer's keys need a bulk endpoint to ``address`` (messages.Layout.bulk_only)
    bulk_only: bool = False
    #: the peer's error_mode is "peer" (messages.Layout.peer_errors)
    peer_errors: bool = False
    #: the peer's host-lane offer (messages.Layout.host_lane, validated), None: none
    host_lane: Optional[dict] = None

    def vmm_covers(self, group: str) -> bool:
        """Whether a same-host device lane can map every CUDA region of ``group``, one of
        them at least through a VMM blob (:mod:`kvxfer.engine.vmm_share`): each comes with
        a legacy IPC handle or a VMM blob."""
        from kvxfer.engine.vmm_share import is_blob

        if not self.ipc or group not in self.desc_region:
            return False
        cuda = [r for r in {int(r) for r in self.desc_region[group]} if self.types[r] == "cuda"]
        return all(self.ipc[r] for r in cuda) and any(is_blob(self.ipc[r]) for r in cuda)


def _int_list(v, where: str) -> List[int]:
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64 for x in v
    ):
        raise ProtocolError(f"{where}: expected a list of unsigned 64-bit ints")
    return v


def parse_remote(msg) -> RemoteGroups:
    """Validate a received Layout before anything is derived from it: region table
    consistent, every group well formed, every descriptor inside its region."""
    n = len(msg.region_bases)
    if not (len(msg.region_lens) == len(msg.region_keys) == len(msg.region_types) == n):
        raise ProtocolError("layout: region table columns differ in length")
    bases = _int_list(msg.region_bases, "layout.region_bases")
    lens = _int_list(msg.region_lens, "layout.region_lens")
    for i, (b, ln, k) in enumerate(zip(bases, lens, msg.region_keys)):
        if ln == 0 or b + ln > 1 << 64 or not k:
            raise ProtocolError(f"layout: region {i} is empty, overflows or has no key")
    groups, desc_region = {}, {}
    if not all(isinstance(k, str) for k in msg.groups):
        raise ProtocolError("layout: group names must be strings")
    for name, body in msg.groups.items():
        if not isinstance(body, dict) or set(body) != {"ptrs", "lens", "item_lens", "regions"}:
            raise ProtocolError(f"layout: group {name!r} is malformed")
        cols = {k: _int_list(body[k], f"layout.{name}.{k}") for k in body}
        try:
            g = plan.make_group(name, cols["ptrs"], cols["lens"], cols["item_lens"])
        except InvalidArgument as exc:
            raise ProtocolError(f"layout: {exc}") from None
        if len(cols["regions"]) != g.count:
            raise ProtocolError(f"layout: group {name!r} region column length")
        try:
            plan.check_inside(
                g.ptrs, g.lens, bases, lens, cols["regions"], f"layout group {name!r}"
            )
        except InvalidArgument as exc:
            raise ProtocolError(str(exc)) from None
        groups[name] = g
        desc_region[name] = np.asarray(cols["regions"], dtype=_U64)
    landing = parse_landing(msg.landing, groups, bases, lens)
    note = msg.note_token
    if not isinstance(note, int) or isinstance(note, bool) or not 0 <= note < 1 << 64:
        raise ProtocolError("layout: note_token must be an unsigned 64-bit int")
    if not isinstance(msg.bulk_only, bool) or (msg.bulk_only and not msg.address):
        raise ProtocolError("layout: bulk_only must be a bool, and needs an address")
    if not isinstance(msg.peer_errors, bool):
        raise ProtocolError("layout: peer_errors must be a bool")
    return RemoteGroups(
        groups,
        desc_region,
        bases,
        lens,
        list(msg.region_keys),
        list(msg.region_types),
        msg.address,
        landing,
        parse_ipc(msg.region_ipc, n),
        note,
        msg.bulk_only,
        msg.peer_errors,
        parse_offer(msg.host_lane),
    )


def parse_ipc(raw, n: int) -> List[bytes]:
    """Validate Layout.region_ipc: None, or one bytes entry per region, each empty, one
    legacy IPC blob or one VMM blob naming its own region (:mod:`kvxfer.engine.vmm_share`)."""
    from kvxfer.engine import vmm_share
    from kvxfer.kernels.cuda_driver import IPC_BLOB_BYTES

    if raw is None:
        return []
    if (
        not isinstance(raw, list)
        or len(raw) != n
        or not all(
            isinstance(b, (bytes, bytearray))
            and (len(b) in (0, IPC_BLOB_BYTES) or vmm_share.is_blob(b))
            for b in raw
        )
    ):
        raise ProtocolError(
            f"layout: region_ipc must be {n} entries of 0 or {IPC_BLOB_BYTES} bytes, or VMM blobs"
        )
    blobs = [bytes(b) for b in raw]
    vmm_share.offers(blobs)  # every VMM blob well formed (ProtocolError)
    return blobs


def parse_landing(raw, groups, bases, lens) -> Dict[str, tuple]:
    """Validate granted landing slots: known group, region in the table, every slot inside
    it, slots unique, a slot holds at least one item."""
    out: Dict[str, tuple] = {}
    if raw is None:
        return out
    for name, body in raw.items():
        if name not in groups:
            raise ProtocolError(f"layout: landing for unknown group {name!r}")
        if not isinstance(body, dict) or set(body) != {"region", "base", "slot_bytes", "slots"}:
            raise ProtocolError(f"layout: landing of group {name!r} is malformed")
        region, base, slot_bytes = (
            _int_list([body[k]], f"layout.landing.{name}.{k}")[0]
            for k in ("region", "base", "slot_bytes")
        )
        slots = _int_list(body["slots"], f"layout.landing.{name}.slots")
        item = groups[name].item_bytes
        if not 0 <= region < len(bases):
            raise ProtocolError(f"layout: landing of {name!r}: region {region} of {len(bases)}")
        if slot_bytes < item or slot_bytes % item or not slots or len(set(slots)) != len(slots):
            raise ProtocolError(
                f"layout: landing of {name!r}: slot_bytes {slot_bytes} / slots "
                f"{slots} invalid for {item}-byte items"
            )
        if (
            base < bases[region]
            or base + (max(slots) + 1) * slot_bytes > bases[region] + lens[region]
        ):
            raise ProtocolError(f"layout: landing slots of {name!r} outside region {region}")
        out[name] = (region, base, slot_bytes, list(slots))
    return out
