"""Which registered groups UCX can reach only by emulation (CUDA memory that is not
legacy-IPC capable), and what the engine does about it. No torch, no UCX, no driver
import here: the driver query is passed in (:func:`kvxfer.kernels.cuda_driver.ipc_capable`
in the engine, a plain function in tests).

A PUT *into* CUDA VMM memory (``cuMemCreate``, also torch's expandable segments) is
silently emulated by UCX, orders of magnitude below cuda_ipc, because the driver reports it
not legacy-IPC capable; as a PUT source it is fine. The remedy for pools is the POSIX-FD
share path of ``pools/backing/share.py`` (the peer maps the pool's physical memory and
copies with the copy engines; bench/results/backing-h200.md).

Invariants
- :func:`ipc_report` queries only descriptors of groups whose registrations are CUDA
  memory; host groups (and CPU-only machines) never touch the driver.
- A group is ``False`` when any CUDA descriptor is reported not IPC capable, ``True`` when
  every one is reported capable, ``None`` when it holds no CUDA memory or the driver
  could not answer for some descriptor (never a guess).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence

from kvxfer.errors import IncompatiblePeer

log = logging.getLogger(__name__)

#: where the fast alternative for VMM-backed pools lives
SHARE_PATH_HINT = "pools/backing/share.py"

IpcQuery = Callable[[int], Optional[bool]]


class Layout(Protocol):
    """What :func:`ipc_report` reads of a group layout (``kvxfer.plan.GroupLayout``)."""

    @property
    def ptrs(self) -> Sequence[int]: ...


def ipc_report(
    groups: Mapping[str, Layout], mem_types: Mapping[str, Sequence[str]], query: IpcQuery
) -> Dict[str, Optional[bool]]:
    """``{group: ipc_capable}``; ``groups`` maps names to layouts with ``ptrs``,
    ``mem_types`` maps names to the memory type of each descriptor's registration."""
    out: Dict[str, Optional[bool]] = {}
    for name, g in groups.items():
        kinds = list(mem_types.get(name, ()))
        cuda = [p for p, k in zip(g.ptrs, kinds) if k == "cuda"]
        if not cuda:
            out[name] = None
            continue
        answers = [query(p) for p in cuda]
        if any(a is False for a in answers):
            out[name] = False
        elif all(a is True for a in answers):
            out[name] = True
        else:
            out[name] = None
    return out


def non_ipc(report: Dict[str, Optional[bool]]) -> List[str]:
    """Groups UCX would have to emulate PUTs into, sorted."""
    return sorted(n for n, ok in report.items() if ok is False)


def warn_non_ipc(report: Dict[str, Optional[bool]], who: str = "") -> List[str]:
    """Log one loud warning per group in non-IPC-capable CUDA memory; returns them."""
    bad = non_ipc(report)
    for name in bad:
        log.warning(
            "%sgroup %r is registered in CUDA memory that is NOT legacy-IPC capable (CUDA VMM "
            "/ cuMemCreate, or expandable segments): a peer's UCX PUT into it is silently "
            "emulated (orders of magnitude below cuda_ipc). Back the "
            "pool with the POSIX-FD share path (%s) for same-host transfers, or set "
            "EngineConfig.refuse_emulated_destinations=True to refuse such peers",
            who,
            name,
            SHARE_PATH_HINT,
        )
    return bad


def check_destinations(
    local_groups: Iterable[str],
    remote_groups: Iterable[str],
    local_non_ipc: Sequence[str],
    remote_non_ipc: Sequence[str],
    same_host: bool,
    refuse: bool,
) -> None:
    """Handshake check (``refuse_emulated_destinations``): raise ``IncompatiblePeer``
    naming the group when a same-host peer would PUT into our non-IPC memory, or we into
    its. Groups only one side has are never written, so they do not count."""
    if not refuse or not same_host:
        return
    shared = set(local_groups) & set(remote_groups)
    ours = sorted(shared & set(local_non_ipc))
    theirs = sorted(shared & set(remote_non_ipc))
    if ours:
        raise IncompatiblePeer(
            f"group {ours[0]!r}: this side's memory is not legacy-IPC capable (CUDA VMM); "
            f"the peer's PUTs into it would be emulated by UCX (far below cuda_ipc). Use the POSIX-FD "
            f"share path ({SHARE_PATH_HINT}) or turn off refuse_emulated_destinations"
        )
    if theirs:
        raise IncompatiblePeer(
            f"group {theirs[0]!r}: the peer's memory is not legacy-IPC capable (CUDA VMM); "
            f"PUTs into it would be emulated by UCX (far below cuda_ipc). Use the POSIX-FD share path "
            f"({SHARE_PATH_HINT}) or turn off refuse_emulated_destinations"
        )


def parse_non_ipc(raw) -> List[str]:
    """Validate the ``non_ipc`` field of a received Layout (None or a list of names)."""
    from kvxfer.errors import ProtocolError

    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise ProtocolError("layout: non_ipc must be a list of group names")
    return list(raw)
