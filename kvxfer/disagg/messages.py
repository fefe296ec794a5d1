"""Wire messages of the prefill/decode protocol and of the bootstrap service.

All are :mod:`kvxfer.wire` messages (msgpack, tagged, versioned, type-checked on decode).
Index lists travel as little-endian int64 byte strings (cheap to pack, vectorised to check);
:func:`ids_from_bytes` validates their length before anything uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from kvxfer import wire
from kvxfer.errors import ProtocolError


def ids_to_bytes(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def ids_from_bytes(data: bytes, what: str) -> np.ndarray:
    if len(data) % 8:
        raise ProtocolError(f"{what}: {len(data)} bytes is not a whole number of int64")
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


# ---------------------------------------------------------------- bootstrap service
# One request per TCP connection, authenticated both ways (see kvxfer.disagg.bootstrap):
#   server -> client  BsChallenge(nonce_s)
#   client -> server  BsSealed(nonce_c, body=<BsRegister | BsUnregister | BsLookup>, mac)
#   server -> client  BsSealed(nonce_c, body=<BsReply>, mac)   or, unauthenticated, a BsReply
#                     that only says why the request was refused
@wire.register
@dataclass
class BsChallenge(wire.Message):
    """Server -> client on connect: the nonce this connection's request must be bound to."""

    TAG = "bs.challenge"
    nonce: bytes


@wire.register
@dataclass
class BsSealed(wire.Message):
    """An encoded request or reply (``body``) with its HMAC over both nonces and the
    direction (:func:`kvxfer.disagg.bootstrap.seal`); ``nonce`` is the client's."""

    TAG = "bs.sealed"
    nonce: bytes
    body: bytes
    mac: bytes


@wire.register
@dataclass
class BsRegister(wire.Message):
    """A prefill rank announces where its engine listens and what it holds."""

    TAG = "bs.register"
    name: str
    host: str
    port: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    pp_rank: int
    fingerprint: Dict[str, Any]


@wire.register
@dataclass
class BsUnregister(wire.Message):
    TAG = "bs.unregister"
    name: str
    dp_rank: int
    tp_rank: int
    pp_rank: int


@wire.register
@dataclass
class BsLookup(wire.Message):
    """Decode asks for every prefill rank of one DP group."""

    TAG = "bs.lookup"
    dp_rank: int


@wire.register
@dataclass
class BsReply(wire.Message):
    TAG = "bs.reply"
    ok: bool
    error: str = ""
    entries: list = field(default_factory=list)


#: the fields every entry of a BsReply must carry, with their types
ENTRY_FIELDS = {
    "name": str,
    "host": str,
    "port": int,
    "tp_rank": int,
    "tp_size": int,
    "dp_rank": int,
    "pp_rank": int,
    "fingerprint": dict,
}
#: bounds of an entry's fields (ranks are non-negative and below these)
MAX_NAME_CHARS = 256
MAX_HOST_CHARS = 255
MAX_TP_SIZE = 1 << 16
MAX_RANK = 1 << 20


def entry_of(msg: BsRegister) -> Dict[str, Any]:
    return {k: getattr(msg, k) for k in ENTRY_FIELDS}


def check_entry(e: Any) -> Dict[str, Any]:
    if not isinstance(e, dict):
        raise ProtocolError(f"bootstrap entry is a {type(e).__name__}, not a map")
    for k, tp in ENTRY_FIELDS.items():
        v = e.get(k)
        if not (wire.is_int(v) if tp is int else isinstance(v, tp)):
            raise ProtocolError(
                f"bootstrap entry field {k!r} is not a {tp.__name__} ({type(v).__name__})"
            )
    if not 0 < e["port"] < 65536:
        raise ProtocolError(f"bootstrap entry port {e['port']}")
    if len(e["name"]) > MAX_NAME_CHARS or not 0 < len(e["host"]) <= MAX_HOST_CHARS:
        raise ProtocolError("bootstrap entry: name or host too long (or host empty)")
    if not 0 < e["tp_size"] <= MAX_TP_SIZE or not 0 <= e["tp_rank"] < e["tp_size"]:
        raise ProtocolError(
            f"bootstrap entry: tp_rank {e['tp_rank']} not in "
            f"[0, tp_size={e['tp_size']}) or tp_size out of range"
        )
    for k in ("dp_rank", "pp_rank"):
        if not 0 <= e[k] < MAX_RANK:
            raise ProtocolError(f"bootstrap entry: {k} {e[k]} not in [0, {MAX_RANK})")
    return e


# ---------------------------------------------------------------- peer (engine) messages
@wire.register
@dataclass
class Hello(wire.Message):
    """Decode -> prefill once per connection: who I am and what I hold."""

    TAG = "pd.hello"
    name: str
    tp_rank: int
    fingerprint: Dict[str, Any]


@wire.register
@dataclass
class HelloAck(wire.Message):
    TAG = "pd.hello_ack"
    ok: bool
    error: str = ""
    name: str = ""


@wire.register
@dataclass
class TransferInfo(wire.Message):
    """Decode -> prefill: where a room's bytes go (dst page ids, state slot ids, aux row).

    ``dst_kv`` covers the request's tokens from token 0 (prefix pages included). Only when
    decode declares them (absent otherwise, so peers without them still interoperate):
    ``prefix`` — decode already holds tokens ``[0, prefix)``, prefill writes none of their
    bytes; ``tokens`` — the request's token count (else: the slots both sides' pages hold)."""

    TAG = "pd.info"
    room: int
    dst_kv: bytes
    dst_state: bytes
    dst_aux: int
    prefix: Optional[int] = None
    tokens: Optional[int] = None


@wire.register
@dataclass
class Chunk(wire.Message):
    """Prefill -> decode (write notify): a non-final chunk's bytes are visible; ``pages_done``
    counts decode's pages (its page size) written so far, in full or in part."""

    TAG = "pd.chunk"
    room: int
    pages_done: int


@wire.register
@dataclass
class LayerDone(wire.Message):
    """Prefill -> decode (write notify), layer-wise streaming of a room's last chunk only
    (:mod:`kvxfer.disagg.layerwise`), and only to a decode whose hello fingerprint says
    ``layer_notify``: every byte of the layers set in ``mask`` (bit ``i`` of byte ``i // 8``)
    is visible for the whole request."""

    TAG = "pd.layer_done"
    room: int
    mask: bytes


@wire.register
@dataclass
class Done(wire.Message):
    """Prefill -> decode (write notify): the last chunk, state and aux row are visible."""

    TAG = "pd.done"
    room: int
    pages: int
    #: integrity mode only (absent otherwise): little-endian uint32 checksums of the source
    #: items as prefill sent them - the room's kv pages in order, its state slots, its aux row
    sums: Optional[bytes] = None


#: rooms one DoneMany may name (a coalesced write carries at most this many)
DONE_MANY_MAX = 1024


@wire.register
@dataclass
class DoneMany(wire.Message):
    """Prefill -> decode (write notify), only to a decode whose hello fingerprint says
    ``done_many``: the :class:`Done` of every room in ``rooms`` (``pages[i]`` is room
    ``rooms[i]``'s page count), whose last chunks, state and aux rows went as one write
    (:mod:`kvxfer.disagg.coalesce`); at most :data:`DONE_MANY_MAX` rooms. Never with
    integrity checksums."""

    TAG = "pd.done_many"
    rooms: List[int]
    pages: List[int]


@wire.register
@dataclass
class Abort(wire.Message):
    """Either direction: the room failed/aborted on the sender of this message.

    From prefill it is sent only once no write for the room is in flight any more, so decode
    may release the room's pages as soon as it arrives. ``kind`` names the error class; from
    decode, ``LayoutMismatch`` is its refusal of a prefill whose layout it cannot take."""

    TAG = "pd.abort"
    room: int
    reason: str
    kind: str = "TransferAborted"


@wire.register
@dataclass
class AbortAck(wire.Message):
    """Prefill -> decode: no write for ``room`` is in flight and none will be issued."""

    TAG = "pd.abort_ack"
    room: int


@wire.register
@dataclass
class Verdict(wire.Message):
    """Decode -> prefill, integrity mode only: decode's outcome for a room whose Done it
    received (``ok`` once every checksum matched; otherwise the error's class name and text).
    Prefill reports the room's Success only after an ok verdict."""

    TAG = "pd.verdict"
    room: int
    ok: bool
    reason: str = ""
    kind: str = ""


@wire.register
@dataclass
class Ping(wire.Message):
    TAG = "pd.ping"
    seq: int
