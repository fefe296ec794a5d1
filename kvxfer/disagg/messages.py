"""Wire messages of the prefill/decode protocol and of the bootstrap service.

All are :mod:`kvxfer.wire` messages (msgpack, tagged, versioned, type-checked on decode).
Index lists travel as little-endian int64 byte strings (cheap to pack, vectorised to check);
:func:`ids_from_bytes` validates their length before anything uses them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

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
ENTRY_FIELDS = {"name": str, "host": str, "port": int, "tp_rank": int, "tp_size": int,
                "dp_rank": int, "pp_rank": int, "fingerprint": dict}


def entry_of(msg: BsRegister) -> Dict[str, Any]:
    return {k: getattr(msg, k) for k in ENTRY_FIELDS}


def check_entry(e: Any) -> Dict[str, Any]:
    if not isinstance(e, dict):
        raise ProtocolError(f"bootstrap entry is a {type(e).__name__}, not a map")
    for k, tp in ENTRY_FIELDS.items():
        v = e.get(k)
        if not isinstance(v, tp) or (tp is int and isinstance(v, bool)):
            raise ProtocolError(f"bootstrap entry field {k!r}={v!r} is not a {tp.__name__}")
    if not 0 < e["port"] < 65536:
        raise ProtocolError(f"bootstrap entry port {e['port']}")
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
    """Decode -> prefill: where a room's bytes go (dst page ids, state slot ids, aux row)."""
    TAG = "pd.info"
    room: int
    dst_kv: bytes
    dst_state: bytes
    dst_aux: int


@wire.register
@dataclass
class Chunk(wire.Message):
    """Prefill -> decode (write notify): a non-final chunk's bytes are visible."""
    TAG = "pd.chunk"
    room: int
    pages_done: int


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
