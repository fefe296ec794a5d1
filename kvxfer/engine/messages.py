"""Engine wire messages (msgpack via :mod:`kvxfer.wire`; tagged, versioned, validated).

Handshake, in order (C = connecting side, S = listening side)::

    C -> S  Hello(engine_id, nonce_c, ...)
    S -> C  HelloAck(engine_id, nonce_s, ..., proof_s)  proof_s = HMAC(secret, "S", transcript)
    C -> S  Proof(proof_c)        (or Reject)           proof_c = HMAC(secret, "C", transcript)
    S -> C  Layout                (or Reject)           only after proof_c verified
    C -> S  Layout                (or Reject)           only after proof_s verified
    S -> C  Ready                 (or Reject)

transcript = the connection's binding (client and server socket address) and every field of
Hello and HelloAck but the proof (:func:`kvxfer.engine.handshake._proof`).

After it, both directions carry :class:`AppMessage` (application payloads, including the
completion ``notify`` of a write) and finally :class:`Bye`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from kvxfer import wire


@wire.register
@dataclass
class Hello(wire.Message):
    TAG = "kx.hello"
    engine_id: str
    name: str
    nonce: bytes
    hostname: str
    #: the sender uses the staged path (wants landing slots granted)
    stage: bool = False


@wire.register
@dataclass
class HelloAck(wire.Message):
    TAG = "kx.hello_ack"
    engine_id: str
    name: str
    nonce: bytes
    proof: bytes
    hostname: str
    stage: bool = False


@wire.register
@dataclass
class Proof(wire.Message):
    TAG = "kx.proof"
    proof: bytes


@wire.register
@dataclass
class Reject(wire.Message):
    """``kind``: "auth" | "incompatible" | "version" | "protocol" (older peers map "version",
    unknown to them, to ProtocolError)."""

    TAG = "kx.reject"
    kind: str
    reason: str


@wire.register
@dataclass
class Layout(wire.Message):
    """Registered groups and the region table they live in.

    ``groups`` maps name -> {"ptrs": [int], "lens": [int], "item_lens": [int],
    "regions": [int]} (region index per descriptor). ``address`` is the worker address for
    a separate bulk endpoint (sent by every side; used by peers in error_mode "none")."""

    TAG = "kx.layout"
    groups: dict
    region_bases: List[int]
    region_lens: List[int]
    region_keys: List[bytes]
    region_types: List[str]
    address: Optional[bytes] = None
    #: landing rings granted to the receiver of this Layout (staged path):
    #: {group: {"region": int, "base": int, "slot_bytes": int, "slots": [int]}}; slot ``s``
    #: is ``[base + s*slot_bytes, +slot_bytes)`` inside region ``region`` of the table
    landing: Optional[dict] = None
    #: the sender's groups in CUDA memory that is not legacy-IPC capable (CUDA VMM): UCX
    #: would emulate PUTs into them (see kvxfer.engine.ipc)
    non_ipc: Optional[List[str]] = None
    #: per region: its legacy CUDA IPC blob (kvxfer.kernels.cuda_driver) or b"" (host
    #: memory, not IPC capable, or the sender does not offer the device lane)
    region_ipc: Optional[List[bytes]] = None
    #: the receiver's token for chained notifications (Peer.write's native flush -> notify;
    #: kvxfer.transport.base.Transport.note_listen); 0: send notifications as AppMessage
    note_token: int = 0
    #: the sender's region keys are valid only on a bulk endpoint to ``address`` (its
    #: registrations live on kvxfer's own UCP context: error_mode "none"): a peer writes to
    #: it over such an endpoint whatever its own error mode
    bulk_only: bool = False
    #: the sender's error_mode is "peer": a bulk endpoint between two such engines uses
    #: peer error handling on both ends (UCX matches the two endpoints of a worker pair, and
    #: ends of different error modes reset each other), otherwise error mode NONE on both
    peer_errors: bool = False
    #: the sender's offer of host lanes into its host memory (kvxfer.engine.hostcopy:
    #: {"pid", "ns", "addr", "cookie"}); None: none offered
    host_lane: Optional[dict] = None


@wire.register
@dataclass
class Ready(wire.Message):
    TAG = "kx.ready"


@wire.register
@dataclass
class AppMessage(wire.Message):
    TAG = "kx.app"
    payload: bytes


@wire.register
@dataclass
class StagedWrite(wire.Message):
    """Scatter plan of one staged chunk, sent after its PUT into landing slot ``slot`` was
    flushed: ``dst`` (little-endian int64 item ids) receive the ``len(dst)`` items packed
    descriptor-major at byte ``offset`` of the slot (``nbytes`` = items x item bytes). The
    target validates it, scatters, then answers :class:`SlotFree`."""

    TAG = "kx.staged"
    group: str
    slot: int
    offset: int
    nbytes: int
    dst: bytes


@wire.register
@dataclass
class SliceChunk(wire.Message):
    """One staged chunk of a SliceWrite, sent after its PUT into landing slot ``slot`` was
    flushed: the slices of items ``dst`` (little-endian int64 ids), packed as
    :mod:`kvxfer.engine.slices` says, ``nbytes`` of them. The target unpacks them with the
    runs it registered under ``key`` (never with offsets from the wire), then answers
    :class:`SlotFree`."""

    TAG = "kx.slice"
    group: str
    slot: int
    key: int
    nbytes: int
    dst: bytes


@wire.register
@dataclass
class SlotFree(wire.Message):
    """Landing slot ``slot`` of ``group`` is drained; the initiator may reuse it."""

    TAG = "kx.slot_free"
    group: str
    slot: int


@wire.register
@dataclass
class SlotAbandon(wire.Message):
    """The initiator gives up the chunk of landing slot ``slot`` of ``group`` (its write was
    cancelled or failed). Sent after the chunk's plan, if that was sent at all (the channel
    is ordered): the target drops a plan of that slot it has not scattered yet, and answers
    :class:`SlotReclaimed` once every message of the slot before it was handled."""

    TAG = "kx.slot_abandon"
    group: str
    slot: int


@wire.register
@dataclass
class SlotReclaimed(wire.Message):
    """Answer to :class:`SlotAbandon`: nothing of the slot's abandoned chunk will be
    scattered, and no SlotFree for it follows; the initiator may reuse the slot."""

    TAG = "kx.slot_reclaimed"
    group: str
    slot: int


@wire.register
@dataclass
class Bye(wire.Message):
    """``notes``: chained notifications the sender completed before this Bye (they travel
    outside the channel); the receiver delivers that many before it acts on the Bye."""

    TAG = "kx.bye"
    reason: str = field(default="")
    notes: int = 0
