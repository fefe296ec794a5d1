"""The per-peer handshake (see :mod:`kvxfer.engine.messages` for the message order).

Guarantees
- The whole exchange runs under one deadline (``TransferTimeout`` when it passes).
- Protocol version first (the channel's opening has checked it already, see
  :mod:`kvxfer.transport.opening`; this covers any other channel): a peer speaking another
  version fails with ``VersionMismatch`` (an ``IncompatiblePeer``) naming both versions, on
  both ends (the Reject says ``version``).
- Mutual authentication by HMAC-SHA256 challenge-response over fresh nonces; neither side
  sends its region table (addresses, remote keys) before the other proved the secret.
- Each proof covers the whole opening exchange (both Hellos: ids, names, hosts, nonces,
  stage flags), the role, and the connection it runs on (:meth:`Channel.binding`: the
  client's and the server's socket address, which both ends observe identically). A party
  without the secret that relays between two connections (decode -> it -> prefill) gets
  proofs bound to the other connection; the side it talks to rejects them, so no region
  table, remote key or landing grant ever reaches it.
- Before the peer proved the secret, a message larger than ``MAX_PREAUTH_BYTES`` is dropped
  unread (no decode; the UCX channel holds at most ``MAX_EARLY_BYTES`` of such frames) and
  ends the handshake.
- Every group present on both sides must agree on descriptor count and item sizes,
  otherwise ``IncompatiblePeer`` naming the group and the field; the side that notices
  tells the other with a Reject so both fail the same way.
- Everything received is validated (:func:`kvxfer.wire.decode`, :func:`groups.parse_remote`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

import msgpack

from kvxfer import plan, wire
from kvxfer.engine import hostcopy, ipc
from kvxfer.engine import messages as m
from kvxfer.engine.groups import LocalGroups, RemoteGroups, parse_remote
from kvxfer.errors import (
    AuthenticationFailed,
    IncompatiblePeer,
    KvxferError,
    PeerClosed,
    ProtocolError,
    TransferTimeout,
    VersionMismatch,
)
from kvxfer.transport.base import Channel

NONCE_BYTES = 32
#: largest message accepted from a peer that has not proved the secret yet (Hello, HelloAck
#: and Proof are a few hundred bytes)
MAX_PREAUTH_BYTES = 64 << 10

log = logging.getLogger(__name__)


@dataclass
class HandshakeResult:
    engine_id: str
    name: str
    hostname: str
    remote: RemoteGroups
    #: landing slots we granted the peer (Layout.landing form); the caller owns them now
    granted: dict = field(default_factory=dict)
    #: the peer checked for a host lane (kvxfer.engine.hostcopy.verify; the caller owns its
    #: pidfd now), or None and why not
    host: Optional[hostcopy.Verified] = None
    host_why: str = ""


def _proof(secret: bytes, role: bytes, binding: bytes, hello: m.Hello, ack: m.HelloAck) -> bytes:
    """HMAC-SHA256 of the transcript: role (b"S" / b"C"), the connection's binding and every
    field of both Hellos except the proofs, msgpack-encoded (unambiguous field boundaries)."""
    transcript = msgpack.packb(
        [
            b"kvxfer-handshake",
            wire.PROTOCOL_VERSION,
            role,
            binding,
            hello.engine_id,
            hello.name,
            hello.nonce,
            hello.hostname,
            hello.stage,
            ack.engine_id,
            ack.name,
            ack.nonce,
            ack.hostname,
            ack.stage,
        ],
        use_bin_type=True,
    )
    return hmac.new(secret, transcript, hashlib.sha256).digest()


class _Deadline:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"handshake not finished within {self.seconds:.3g} s")
        return left


def _decode(raw: bytes) -> wire.Message:
    """Decode; a foreign protocol version raises ``VersionMismatch`` (an IncompatiblePeer)."""
    return wire.decode(raw)


async def _recv(ch: Channel, dl: _Deadline, expected, max_bytes: int = MAX_PREAUTH_BYTES):
    return _expect(_decode(await ch.recv(dl.left(), max_bytes)), expected)


def _expect(msg, expected):
    if isinstance(msg, m.Reject):
        cls = {
            "auth": AuthenticationFailed,
            "incompatible": IncompatiblePeer,
            "version": VersionMismatch,
        }.get(msg.kind, ProtocolError)
        raise cls(f"peer rejected the handshake: {msg.reason}")
    return wire.expect(msg, expected)


async def _recv_hello(ch: Channel, dl: _Deadline) -> m.Hello:
    """Accepting side's first message. A connecting side always opens with Hello, so a
    well-formed engine message of another kind before it belongs to an earlier connection
    (see :meth:`Channel.adopt_epoch`): it is dropped and logged. The first other frame
    fixes the connection's epoch and goes through the normal checks."""
    while True:
        raw = await ch.recv(dl.left(), MAX_PREAUTH_BYTES)
        try:
            msg = wire.decode(raw)
        except ProtocolError:
            msg = None
        if (
            msg is not None
            and not isinstance(msg, (m.Hello, m.Reject))
            and msg.TAG.startswith("kx.")
        ):
            log.warning("handshake: dropped a stale %s message of an earlier connection", msg.TAG)
            continue
        ch.adopt_epoch()
        return _expect(_decode(raw), m.Hello)


async def _reject(ch: Channel, dl: _Deadline, exc: KvxferError) -> None:
    kind = (
        "auth"
        if isinstance(exc, AuthenticationFailed)
        else "version"
        if isinstance(exc, VersionMismatch)
        else "incompatible"
        if isinstance(exc, IncompatiblePeer)
        else "protocol"
    )
    try:
        await ch.send(m.Reject(kind=kind, reason=str(exc)[:500]).encode(), min(dl.left(), 1.0))
    except KvxferError:
        pass  # the peer may already be gone; our own error is what matters


def check_groups(local: LocalGroups, remote: RemoteGroups) -> None:
    for name in sorted(set(local.groups) & set(remote.groups)):
        lg, rg = local.groups[name], remote.groups[name]
        if name in local.loose and lg.count == rg.count:
            continue  # item sizes may differ: byte-addressed (RawWrite) only
        try:
            plan.check_compatible(lg, rg)
        except plan.IncompatibleLayout as exc:
            raise IncompatiblePeer(str(exc)) from None


def _layout(
    local: LocalGroups,
    address: bytes,
    grant: dict,
    note_token: int = 0,
    bulk_only: bool = False,
    peer_errors: bool = False,
    host_lane: Optional[dict] = None,
) -> bytes:
    bases, lens, keys, types = local.region_table()
    return m.Layout(
        groups=local.wire_groups(),
        region_bases=bases,
        region_lens=lens,
        region_keys=keys,
        region_types=types,
        address=address,
        landing=grant or None,
        non_ipc=ipc.non_ipc(local.ipc) or None,
        region_ipc=local.ipc_blobs(),
        note_token=note_token,
        bulk_only=bulk_only,
        peer_errors=peer_errors,
        host_lane=host_lane,
    ).encode()


def _check_ipc(
    local: LocalGroups, layout: m.Layout, remote: RemoteGroups, hostname: str, refuse: bool
) -> None:
    # groups in CUDA VMM memory that a same-host device lane maps (kvxfer.engine.vmm_share)
    # are not emulated: ours when we offer them, the peer's when we map them
    ours = [g for g in ipc.non_ipc(local.ipc) if g not in local.vmm_groups]
    theirs = ipc.parse_non_ipc(layout.non_ipc)
    if local.export_ipc:
        theirs = [g for g in theirs if not remote.vmm_covers(g)]
    ipc.check_destinations(
        local.groups, remote.groups, ours, theirs, hostname == socket.gethostname(), refuse
    )


async def _guarded(ch: Channel, dl: _Deadline, coro):
    """Run one step; a locally detected auth/compat/protocol failure is sent to the peer."""
    try:
        return await coro
    except (AuthenticationFailed, IncompatiblePeer, ProtocolError) as exc:
        if "peer rejected" not in str(exc):
            await _reject(ch, dl, exc)
        raise


async def connect_side(
    ch: Channel,
    local: LocalGroups,
    secret: bytes,
    engine_id: str,
    name: str,
    address: bytes,
    timeout: float,
    refuse_emulated: bool = False,
    note_token: int = 0,
    bulk_only: bool = False,
    peer_errors: bool = False,
    host_lane: bool = False,
) -> HandshakeResult:
    dl = _Deadline(timeout)
    hello = m.Hello(
        engine_id=engine_id,
        name=name,
        nonce=os.urandom(NONCE_BYTES),
        hostname=socket.gethostname(),
        stage=bool(local.stages),
    )
    await ch.send(hello.encode(), dl.left())

    async def steps():
        ack = await _recv(ch, dl, m.HelloAck)
        if len(ack.nonce) != NONCE_BYTES:
            raise ProtocolError("hello_ack: bad nonce length")
        binding = ch.binding()
        if not hmac.compare_digest(_proof(secret, b"S", binding, hello, ack), ack.proof):
            raise AuthenticationFailed(
                f"peer {ack.name or ack.engine_id} failed the challenge (wrong secret, or "
                f"a relay: the proof covers this connection's addresses {binding.decode()})"
            )
        ch.trusted(wire.MAX_MESSAGE_BYTES)
        await ch.send(m.Proof(proof=_proof(secret, b"C", binding, hello, ack)).encode(), dl.left())
        layout = await _recv(ch, dl, m.Layout, wire.MAX_MESSAGE_BYTES)
        remote = parse_remote(layout)
        check_groups(local, remote)
        _check_ipc(local, layout, remote, ack.hostname, refuse_emulated)
        if ack.stage:
            grant.update(local.grant_landing())
        checked.append(hostcopy.verify(remote.host_lane, hello.nonce, ack.hostname, host_lane))
        # the peer reads its nonce back from our offer before it answers Ready: the offer
        # lives in this frame until then
        offer = hostcopy.Offer(ack.nonce) if host_lane else None
        wired = None if offer is None else offer.wire()
        await ch.send(
            _layout(local, address, grant, note_token, bulk_only, peer_errors, wired), dl.left()
        )
        await _recv(ch, dl, m.Ready, wire.MAX_MESSAGE_BYTES)
        del offer
        host, why = checked.pop()
        return HandshakeResult(
            ack.engine_id, ack.name, ack.hostname, remote, dict(grant), host, why
        )

    grant: dict = {}
    checked: list = []  # hostcopy.verify's answer until the result carries it
    try:
        return await _with_timeout(_guarded(ch, dl, steps()), dl)
    except BaseException:
        local.release_landing(grant)
        _close_checked(checked)
        raise


async def accept_side(
    ch: Channel,
    local: LocalGroups,
    secret: bytes,
    engine_id: str,
    name: str,
    address: bytes,
    timeout: float,
    refuse_emulated: bool = False,
    note_token: int = 0,
    bulk_only: bool = False,
    peer_errors: bool = False,
    host_lane: bool = False,
) -> HandshakeResult:
    dl = _Deadline(timeout)

    async def steps():
        hello = await _recv_hello(ch, dl)
        if len(hello.nonce) != NONCE_BYTES:
            raise ProtocolError("hello: bad nonce length")
        binding = ch.binding()
        ack = m.HelloAck(
            engine_id=engine_id,
            name=name,
            nonce=os.urandom(NONCE_BYTES),
            hostname=socket.gethostname(),
            stage=bool(local.stages),
            proof=b"",
        )
        ack.proof = _proof(secret, b"S", binding, hello, ack)
        await ch.send(ack.encode(), dl.left())
        proof = await _recv(ch, dl, m.Proof)
        if not hmac.compare_digest(_proof(secret, b"C", binding, hello, ack), proof.proof):
            raise AuthenticationFailed(
                f"peer {hello.name or hello.engine_id} failed the challenge (wrong secret, "
                f"or a relay: the proof covers this connection's addresses "
                f"{binding.decode()})"
            )
        ch.trusted(wire.MAX_MESSAGE_BYTES)
        if hello.stage:
            grant.update(local.grant_landing())
        # the peer reads its nonce back from our offer before it sends its Layout: the
        # offer lives in this frame until then
        offer = hostcopy.Offer(hello.nonce) if host_lane else None
        wired = None if offer is None else offer.wire()
        await ch.send(
            _layout(local, address, grant, note_token, bulk_only, peer_errors, wired), dl.left()
        )
        layout = await _recv(ch, dl, m.Layout, wire.MAX_MESSAGE_BYTES)
        del offer
        remote = parse_remote(layout)
        check_groups(local, remote)
        _check_ipc(local, layout, remote, hello.hostname, refuse_emulated)
        checked.append(hostcopy.verify(remote.host_lane, ack.nonce, hello.hostname, host_lane))
        await ch.send(m.Ready().encode(), dl.left())
        host, why = checked.pop()
        return HandshakeResult(
            hello.engine_id, hello.name, hello.hostname, remote, dict(grant), host, why
        )

    grant: dict = {}
    checked: list = []  # hostcopy.verify's answer until the result carries it
    try:
        return await _with_timeout(_guarded(ch, dl, steps()), dl)
    except BaseException:
        local.release_landing(grant)
        _close_checked(checked)
        raise


def _close_checked(checked: list) -> None:
    """Close the pidfd of a host-lane check whose handshake did not finish."""
    for host, _ in checked:
        if host is not None:
            host.close()


async def _with_timeout(coro, dl: _Deadline):
    try:
        return await asyncio.wait_for(coro, dl.seconds)
    except asyncio.TimeoutError:
        raise TransferTimeout(f"handshake not finished within {dl.seconds:.3g} s") from None
    except PeerClosed as exc:
        raise PeerClosed(f"peer went away during the handshake: {exc}") from None
