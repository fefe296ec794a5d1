"""UCX memory registrations (:class:`UcxRegion`) and the RMA endpoint (:class:`UcxRma`:
remote keys, batched PUTs, flush, lanes) of the UCX transport. An endpoint's flushes and
bulk-endpoint close go through the transport's completion queue; what it uses of the
transport is :class:`RmaService` (:class:`kvxfer.transport.ucx.UcxTransport` provides it).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Dict, List, Optional, Protocol, Tuple

import numpy as np

from kvxfer.errors import Closed, IndexOutOfRange, PeerClosed, TransferTimeout, TransportError
from kvxfer.transport.base import Region, RmaEndpoint
from kvxfer.transport.ucx_lib import status_error

log = logging.getLogger(__name__)

_U64 = np.uint64
#: a PUT batch to an endpoint of kvxfer's own worker keeps the GIL (``put_batch``'s
#: ``keep_gil``) when it has at most this many ops and bytes: posting a short batch takes
#: microseconds, while a release hands the GIL to any thread busy in the interpreter until
#: its switch interval (bench/results/native-gil.md); a long batch (a cma PUT copies its
#: bytes in the call) still releases it
KEEP_GIL_MAX_OPS = 64
KEEP_GIL_MAX_BYTES = 1 << 20


class RmaService(Protocol):
    """What a :class:`UcxRma` uses of its transport: the native module and the completion
    queue's flush / close requests (their results arrive on the asyncio loop thread)."""

    rma: Any  # the native kvxfer.transport._rma module

    def flush_future(self, ep_handle: int, spin: bool = False) -> "asyncio.Future[float]": ...

    def chain_future(
        self, ep_handle: int, spin: bool, ctx: int, note_token: int, payload: bytes
    ) -> "asyncio.Future[float]": ...

    async def flush_ep(self, ep_handle: int, timeout: float, spin: bool = False) -> float: ...

    async def close_bulk(self, ep: int, ctx: int, err_token: int, timeout: float) -> bool: ...


# ------------------------------------------------------------------ regions


class UcxRegion(Region):
    def __init__(self, rma, ctx_handle: int, addr: int, length: int):
        self._rma, self._ctx = rma, ctx_handle
        self.addr, self.length = addr, length
        try:
            self.handle, self.mem_type = rma.mem_map(ctx_handle, addr, length)
        except rma.UcxError as exc:
            raise TransportError(f"registering [{addr:#x}, +{length}): {exc.args[1]}") from None

    def packed_key(self) -> bytes:
        if not self.handle:
            raise Closed("region released")
        return self._rma.rkey_pack(self._ctx, self.handle)

    def release(self) -> None:
        if self.handle:
            h, self.handle = self.handle, 0
            self._rma.mem_unmap(self._ctx, h)

    def __repr__(self):
        return (
            f"UcxRegion({self.addr:#x}, {self.length}, {self.mem_type}, "
            f"{'live' if self.handle else 'released'})"
        )


# ------------------------------------------------------------- rma endpoint


class UcxRma(RmaEndpoint):
    """PUTs over a UCP endpoint: either the channel's UCXX endpoint, borrowed
    (``error_mode="peer"``), or an owned bulk endpoint ``raw=(ep, ctx)`` made by
    ``CompletionQueue.ep_create`` (``error_mode="none"``: shared-memory lanes, failures
    reported through ``err_token`` instead of aborting the process)."""

    def __init__(
        self,
        transport: RmaService,
        ep=None,
        raw: Optional[Tuple[int, int]] = None,
        err_token: int = 0,
        keep_gil: bool = False,
    ):
        """``keep_gil``: ``raw`` is an endpoint of kvxfer's own worker, whose short PUT
        batches are posted without releasing the GIL (``UcxTransport.keep_gil``)."""
        self._t, self._ep, self._raw, self._err_token = transport, ep, raw, err_token
        self._keep_gil = keep_gil
        self._rkeys: List[int] = []
        self._rbase = np.zeros(0, _U64)
        self._rlen = np.zeros(0, _U64)
        self._rkey_arr = np.zeros(0, _U64)
        self._closed = False
        self._failed: Optional[Exception] = None
        self._fail_cbs: list = []
        self._lanes: Optional[List[str]] = None

    def _handle(self) -> int:
        if self._closed:
            raise Closed("RMA endpoint closed")
        if self._failed is not None:
            raise PeerClosed(str(self._failed))
        if self._raw is not None:
            return self._raw[0]
        h = self._ep.ucp_endpoint if self._ep is not None else 0
        if not h:
            raise PeerClosed("UCX endpoint is gone (peer died or disconnected)")
        return h

    def on_failed(self, callback) -> None:
        """``callback(exc)`` once when the (owned) endpoint reports a failure.
        Runs on: the asyncio loop thread (see :meth:`_on_error`)."""
        self._fail_cbs.append(callback)

    def _on_error(self, status: int) -> None:
        """The owned endpoint failed. Runs on: the asyncio loop thread
        (``UcxTransport._on_completions``; the native error handler queued the status on
        UCXX's progress thread or the own worker's thread)."""
        if self._failed is not None:
            return
        self._failed = status_error(self._t.rma, status, "bulk endpoint failed")
        if not isinstance(self._failed, PeerClosed):
            self._failed = PeerClosed(str(self._failed))
        for cb in self._fail_cbs:
            try:
                cb(self._failed)
            except Exception:
                log.exception("RMA failure callback failed")

    def add_remote_regions(self, bases, lengths, keys):
        rma = self._t.rma
        h = self._handle()
        for key in keys:
            try:
                self._rkeys.append(rma.rkey_unpack(h, key))
            except rma.UcxError as exc:
                raise TransportError(f"unpacking a remote key: {exc.args[1]}") from None
        self._rbase = np.concatenate([self._rbase, np.asarray(bases, _U64)])
        self._rlen = np.concatenate([self._rlen, np.asarray(lengths, _U64)])
        self._rkey_arr = np.asarray(self._rkeys, dtype=_U64)

    def put(self, laddr, raddr, nbytes, lmemh, ridx) -> int:
        rma = self._t.rma
        keep = (
            self._keep_gil
            and len(laddr) <= KEEP_GIL_MAX_OPS
            and int(np.asarray(nbytes).sum()) <= KEEP_GIL_MAX_BYTES
        )
        try:
            return rma.put_batch(
                self._handle(),
                laddr,
                raddr,
                nbytes,
                lmemh,
                ridx,
                self._rbase,
                self._rlen,
                self._rkey_arr,
                keep,
                self._raw[1] if self._raw is not None else 0,
            )
        except IndexError as exc:
            raise IndexOutOfRange(f"native bounds check: {exc}") from None
        except rma.UcxError as exc:
            status, text, posted = exc.args
            err = status_error(rma, status, text)
            err.posted = posted
            raise err from None

    async def flush(self, timeout: float, spin: bool = False) -> float:
        """Flush the endpoint. An owned endpoint flushes through its chain (note token 0),
        which also fails when a PUT on it failed before (``_rma`` put_cb): some transports'
        flushes complete after a failed PUT (cma, to a dead peer)."""
        if self._raw is not None:
            try:
                return await asyncio.wait_for(self.flush_future(spin), timeout)
            except asyncio.TimeoutError:
                raise TransferTimeout(f"ucp_ep_flush not complete after {timeout:.3g} s") from None
        return await self._t.flush_ep(self._handle(), timeout, spin)

    def flush_future(self, spin: bool = False):
        """A chain without a notification (note token 0): the same flush, with the
        chain's bounded inline progress (see UcxTransport.chain_future)."""
        ctx = self._raw[1] if self._raw is not None else 0
        return self._t.chain_future(self._handle(), spin, ctx, 0, b"")

    def flush_notify_future(
        self, note_token: int, payload: bytes, spin: bool = False, inline: bool = True
    ):
        """The native chain flush -> notify (see base.RmaEndpoint). On an owned endpoint the
        chain holds its error-handler context, and a close started before the flush
        completed cancels the notification (UCX forbids posting on a closing endpoint)."""
        ctx = self._raw[1] if self._raw is not None else 0
        return self._t.chain_future(self._handle(), spin, ctx, note_token, payload, inline)

    def note_future(self, note_token: int, payload: bytes):
        """One native active message to ``note_token``, no flush, no inline wait (see
        base.RmaEndpoint); like a chain, an owned endpoint's closing cancels it."""
        ctx = self._raw[1] if self._raw is not None else 0
        return self._t.note_future(self._handle(), ctx, note_token, payload)

    def info(self) -> str:
        return self._t.rma.ep_info(self._handle())

    def lanes(self) -> List[str]:
        """Transports of the RMA bandwidth lanes (``ucp_ep_print_info``), cached."""
        if self._lanes is None:
            try:
                self._lanes = parse_rma_lanes(self.info())
            except (PeerClosed, Closed):
                return []
        return list(self._lanes)

    async def close(self, timeout: float) -> None:
        """Quiesce, then destroy the remote keys (UCX forbids destroying a key under a PUT
        still in flight): an owned endpoint is closed (flush mode), a live borrowed one
        flushed. Afterwards no PUT of ours is in flight to the peer. Quiescing not
        confirmed in time: the keys are leaked (logged) rather than destroyed."""
        if self._closed:
            return
        raw, ucx_ep = self._raw, self._ep
        self._closed, self._raw, self._ep = True, None, None
        rkeys, self._rkeys = self._rkeys, []
        self._rkey_arr = np.zeros(0, _U64)
        if raw is not None:
            quiet = await self._t.close_bulk(*raw, self._err_token, timeout)
        elif rkeys and self._failed is None and ucx_ep is not None and not ucx_ep.closed:
            try:
                await self._t.flush_ep(ucx_ep.ucp_endpoint, timeout)
                quiet = True
            except TransferTimeout:
                quiet = False
            except (PeerClosed, TransportError, Closed):
                quiet = True  # failed: UCX dropped its requests (or the transport is gone)
        else:  # failed or closed: UCX dropped its requests
            quiet = True
        if not quiet:
            log.warning(
                "RMA endpoint not quiesced in %.3g s: %d remote keys leaked", timeout, len(rkeys)
            )
            return
        for rk in rkeys:
            self._t.rma.rkey_destroy(rk)


def parse_rma_lanes(info: str) -> List[str]:
    """``transport/device`` names of the lanes ``ucp_ep_print_info`` marks ``rma_bw``
    (falling back to ``rma`` lanes)."""
    found: Dict[str, List[str]] = {"rma_bw": [], "rma": []}
    for line in info.splitlines():
        if "lane[" not in line:
            continue
        m = re.search(r"\b([A-Za-z0-9_]+/[A-Za-z0-9_.:\-]+)", line)
        if not m:
            continue
        for kind in ("rma_bw", "rma"):
            if re.search(rf"\b{kind}#?\d*\b", line) and m.group(1) not in found[kind]:
                found[kind].append(m.group(1))
    return found["rma_bw"] or found["rma"]
