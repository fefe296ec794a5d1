"""The versioned opening of a UCX channel: the hello frame's bytes and the compatibility check
(pure: no UCX, no torch; :class:`kvxfer.transport.ucx_channel.UcxChannel` sends and reads the
frames).

A hello's payload (after the frame's 8-byte connection epoch) is ``HELLO_MAGIC`` (2 bytes),
the sender's protocol version (u32 LE), its channel wait mode (1 byte: 0 native, 1 yield) and
its native frame token (u64 LE; 0 in yield mode): :data:`HELLO_BYTES` bytes. The magic and the
version come first and keep their place in every future version, so a peer of any version can
name the version it met; the rest is read only when the versions agree.

Invariants
- :func:`parse_hello` never raises for a hello of another version: the accepting side answers
  with its own hello before it checks (:func:`check_opening`), so both ends learn both sides'
  versions and modes and fail with the same error. It raises :class:`ProtocolError` for a
  malformed hello of our version only.
- Version first, then mode: a version mismatch is :class:`VersionMismatch` (naming both
  numbers and both modes), a mode mismatch of one version :class:`IncompatiblePeer`.
- What a hello reveals to an unauthenticated party: the protocol version, the channel wait
  mode and a random per-channel frame token (docs/SECURITY.md). No secret-derived byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import msgpack

from kvxfer.errors import IncompatiblePeer, ProtocolError, VersionMismatch
from kvxfer.wire import PROTOCOL_VERSION

#: first bytes of a hello payload (0xc1 is never a msgpack message; 0xc1 0xc2 was the
#: unversioned hello of protocol 1, :data:`LEGACY_HELLO_MAGIC`)
HELLO_MAGIC = b"\xc1\xc4"
#: protocol 1's hello: this + an 8-byte frame token, native frames only (no version, no mode)
LEGACY_HELLO_MAGIC = b"\xc1\xc2"
LEGACY_HELLO_BYTES = 10
#: the protocol whose builds sent :data:`LEGACY_HELLO_MAGIC` hellos (or none, in yield mode)
LEGACY_VERSION = 1
HELLO_BYTES = 2 + 4 + 1 + 8
#: largest opening frame :func:`peek_version` looks into (an engine Hello is ~200 bytes)
PEEK_BYTES = 4096
MODES = ("native", "yield")
COMPAT_DOC = "docs/engine.md, Compatibility"


@dataclass(frozen=True)
class Hello:
    epoch: int
    version: int
    #: "native" / "yield"; None when unknown (a hello of another version)
    mode: Optional[str]
    token: int


def encode_hello(version: int, mode: str, token: int) -> bytes:
    """The payload of our hello (without the epoch)."""
    if mode not in MODES:
        raise ValueError(f"channel wait mode {mode!r}")
    if (mode == "native") != bool(token):
        raise ValueError("a native channel's hello carries its frame token, a yield one none")
    return (
        HELLO_MAGIC
        + version.to_bytes(4, "little")
        + bytes([MODES.index(mode)])
        + token.to_bytes(8, "little")
    )


def parse_hello(epoch: int, body: bytes, ours: int = PROTOCOL_VERSION) -> Hello:
    """A hello payload (``body`` starts with :data:`HELLO_MAGIC`) -> :class:`Hello`. A hello
    of another version than ``ours`` is returned as far as it can be read (mode None unless it has our
    layout); a malformed hello of our version raises :class:`ProtocolError`."""
    if len(body) < 6 or body[:2] != HELLO_MAGIC:
        raise ProtocolError(f"hello of {len(body)} bytes has no version")
    version = int.from_bytes(body[2:6], "little")
    layout_ok = len(body) == HELLO_BYTES and body[6] < len(MODES)
    if version != ours:
        return Hello(epoch, version, MODES[body[6]] if layout_ok else None, 0)
    if not layout_ok:
        raise ProtocolError(f"protocol {version} hello of {len(body)} bytes is malformed")
    mode = MODES[body[6]]
    token = int.from_bytes(body[7:15], "little")
    if (mode == "native") != bool(token):
        raise ProtocolError(
            "native hello without a frame token" if mode == "native" else "yield hello with one"
        )
    return Hello(epoch, version, mode, token)


def describe(version: Optional[int], mode: Optional[str]) -> str:
    v = "?" if version is None else str(version)
    return f"protocol {v}, channel mode {mode or '?'}"


def mismatch_text(our_version: int, our_mode: str, their_version, their_mode) -> str:
    """The message of a version mismatch: both sides and what to do."""
    return (
        f"kvxfer protocol version mismatch: the peer speaks {describe(their_version, their_mode)}"
        f", this end {describe(our_version, our_mode)}. Every process of a deployment (prefill, "
        "decode, bootstrap) must run a kvxfer of one protocol version: finish the upgrade (or "
        f"roll it back) so both ends match ({COMPAT_DOC})"
    )


def mode_text(our_version: int, our_mode: str, their_mode: str) -> str:
    return (
        f"kvxfer channel mode mismatch: the peer runs KVXFER_CHANNEL_WAIT={their_mode}, this end "
        f"{our_mode} (both protocol {our_version}). Both ends of a connection must use the same "
        f"mode: set KVXFER_CHANNEL_WAIT to one value on every process ({COMPAT_DOC})"
    )


def check_opening(our_version: int, our_mode: str, peer: Hello) -> None:
    """Raise unless the peer's hello is compatible with ours (version first, then mode)."""
    if peer.version != our_version:
        raise VersionMismatch(
            mismatch_text(our_version, our_mode, peer.version, peer.mode),
            ours=our_version,
            theirs=peer.version,
        )
    if peer.mode != our_mode:
        raise IncompatiblePeer(mode_text(our_version, our_mode, peer.mode or "?"))


def legacy_mismatch(our_version: int, our_mode: str) -> VersionMismatch:
    """The error for a protocol-1 hello (unversioned, native frames)."""
    return VersionMismatch(
        mismatch_text(our_version, our_mode, LEGACY_VERSION, "native"),
        ours=our_version,
        theirs=LEGACY_VERSION,
    )


def peek_version(body: bytes) -> Optional[int]:
    """The protocol version of a :mod:`kvxfer.wire` message (its ``"v"``), or None when
    ``body`` is not one (or over :data:`PEEK_BYTES`: not looked into). Nothing else of it
    is read or trusted; used on frames that arrive where a hello belongs."""
    if len(body) > PEEK_BYTES or not body or body[0] == 0xC1:
        return None
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several unrelated types
        return None
    if not isinstance(msg, dict):
        return None
    v = msg.get("v")
    return v if isinstance(v, int) and not isinstance(v, bool) else None
