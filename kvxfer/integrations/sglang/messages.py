"""Messages of the SGLang backend (msgpack, tagged and versioned through :mod:`kvxfer.wire`).

Over SGLang's ZMQ control sockets (frames ``[FRAME_TAG, payload]``), decode -> prefill:

* :class:`SglRegister` - once per decode rank and prefill rank: where the decode engine
  listens and the layout it registered (checked by prefill before any write);
* :class:`SglRoom` - per request: destination pages, state items per state type, aux row.

Over the kvxfer engine (authenticated), prefill -> decode: :class:`SglDone`, sent only after
every write of the room completed (bytes visible at decode). Decode accepts a room's
success from nowhere else. Validation (:func:`decode_frames`, :meth:`SglRoom.arrays`)
happens before anything acts on a message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import msgpack
import numpy as np

from kvxfer import wire
from kvxfer.errors import ProtocolError

#: first ZMQ frame of our control messages (SGLang's own use other tags: ABORT, ...)
FRAME_TAG = b"KVXFER"
#: tag frame of prefill -> decode status messages over ZMQ (failures only, see DecodePath)
STATUS_TAG = b"KVXFER_STATUS"


def ids_to_bytes(ids) -> bytes:
    return np.ascontiguousarray(np.asarray(ids), dtype="<i8").tobytes()


def ids_from_bytes(data: bytes, what: str) -> np.ndarray:
    if len(data) % 8:
        raise ProtocolError(f"{what}: {len(data)} bytes is not a whole number of int64")
    a = np.frombuffer(data, dtype="<i8").astype(np.int64)
    if a.size and int(a.min()) < 0:
        raise ProtocolError(f"{what}: negative id {int(a.min())}")
    return a


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@wire.register
@dataclass
class SglRegister(wire.Message):
    TAG = "sgl.register"
    endpoint: str  # decode's ZMQ host (its identity, with port)
    port: int  # decode's ZMQ port
    engine_host: str
    engine_port: int
    name: str  # decode engine's name (what prefill's engine sees at handshake)
    tp_size: int
    tp_rank: int
    page_size: int
    dtype: str
    kv_item_lens: List[int]
    aux_item_lens: List[int]
    state_types: List[str]
    state_item_lens: list  # one list[int] per state type
    total_kv_heads: int = 0  # the model's KV heads over all ranks (0: not known here)
    mla: bool = False  # an MLA pool (no heads: the latent is replicated over ranks)
    #: per state type, per descriptor (SGLang's KVArgs): this rank's rows of the TP-split
    #: dim (0: replicated), rows before that dim, full sizes of independently split parts
    #: (None: one part) - what prefill slices state tensors by at another TP size
    state_dims: list = field(default_factory=list)
    state_outer: list = field(default_factory=list)
    state_groups: list = field(default_factory=list)

    def check(self) -> "SglRegister":
        if not 0 < self.port < 65536 or not 0 < self.engine_port < 65536:
            raise ProtocolError(f"register: bad port {self.port} / {self.engine_port}")
        if not 0 <= self.tp_rank < self.tp_size or self.page_size <= 0:
            raise ProtocolError(
                f"register: tp {self.tp_rank}/{self.tp_size}, page_size {self.page_size}"
            )
        if self.total_kv_heads < 0:
            raise ProtocolError(f"register: total_kv_heads {self.total_kv_heads}")
        if len(self.state_item_lens) != len(self.state_types):
            raise ProtocolError("register: state_item_lens and state_types differ in length")
        for lens in self.state_item_lens:
            if not isinstance(lens, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in lens
            ):
                raise ProtocolError("register: state_item_lens must be lists of ints")
        for name in ("state_dims", "state_outer", "state_groups"):
            per_type = getattr(self, name)
            if not isinstance(per_type, list) or len(per_type) > len(self.state_types):
                raise ProtocolError(f"register: {name} must be a list, one per state type")
            for i, xs in enumerate(per_type):
                if not isinstance(xs, list) or (xs and len(xs) != len(self.state_item_lens[i])):
                    raise ProtocolError(f"register: {name}[{i}]: one entry per state tensor")
                for x in xs:
                    if name != "state_groups":
                        ok = _count(x)
                    else:
                        ok = x is None or (isinstance(x, list) and all(_count(v) for v in x))
                    if not ok:
                        raise ProtocolError(f"register: {name}[{i}] holds {x!r}")
        return self


@wire.register
@dataclass
class SglRoom(wire.Message):
    TAG = "sgl.room"
    room: int
    endpoint: str
    port: int
    dst_kv: bytes
    dst_aux: int
    required_dst_info_num: int
    dst_state: list  # per state type: bytes of int64 ids, or None
    decode_prefix_len: int = 0
    is_dummy: bool = False
    #: the prefill endpoints ("ip:port") whose staged head slices of this room decode
    #: accepts (it registered them with their engine peer before this message left)
    slices: List[str] = field(default_factory=list)

    def arrays(self):
        """``(dst_kv, [dst_state or None ...])`` as int64 arrays; ProtocolError if malformed."""
        if (
            self.room < 0
            or self.dst_aux < 0
            or self.required_dst_info_num <= 0
            or self.decode_prefix_len < 0
        ):
            raise ProtocolError(f"room {self.room}: negative id or count")
        states: List[Optional[np.ndarray]] = []
        for i, s in enumerate(self.dst_state):
            if s is None:
                states.append(None)
            elif isinstance(s, (bytes, bytearray)):
                states.append(ids_from_bytes(bytes(s), f"room {self.room}: dst_state[{i}]"))
            else:
                raise ProtocolError(f"room {self.room}: dst_state[{i}] is {type(s).__name__}")
        return ids_from_bytes(self.dst_kv, f"room {self.room}: dst_kv"), states


@wire.register
@dataclass
class SglDone(wire.Message):
    TAG = "sgl.done"
    room: int
    prefill_rank: int


class Sender(NamedTuple):
    """Who sent a control message this side refused (:func:`refused_sender`)."""

    tag: str  # the message type it claims ("" when none)
    endpoint: str  # the decode rank's ZMQ host
    port: int  # its ZMQ port
    room: Optional[int]  # the room it is about (None: a registration, or none given)

    @property
    def key(self) -> str:
        return f"{self.endpoint}:{self.port}"


def refused_sender(frames) -> Optional[Sender]:
    """Best effort: who sent ``[FRAME_TAG, payload]``, a control message that
    :func:`decode_frames` refused (a kvxfer of another protocol version, or malformed), so
    the refusal can be answered instead of leaving the sender to SGLang's timeouts.

    Reads only the fields every protocol version so far put in its control messages (a
    msgpack map: ``endpoint`` str, ``port`` int in 1..65535, ``room`` int >= 0 when present)
    and nothing else; None where they are missing or mistyped. The answer this allows is a
    failure status to that endpoint: what the fields claim is unauthenticated, as SGLang's
    status channel is (it can only fail a room, never complete one)."""
    if len(frames) != 2 or frames[0] != FRAME_TAG or len(frames[1]) > wire.MAX_MESSAGE_BYTES:
        return None
    try:
        body = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types
        return None
    if not isinstance(body, dict):
        return None
    tag, endpoint, port, room = (body.get(k) for k in ("t", "endpoint", "port", "room"))
    if not isinstance(endpoint, str) or not endpoint or len(endpoint) > 255:
        return None
    if not wire.is_int(port) or not 0 < port < 65536:
        return None
    if room is not None and not (wire.is_int(room) and 0 <= room < 1 << 64):
        return None
    return Sender(tag if isinstance(tag, str) else "", endpoint, port, room)


def decode_frames(frames) -> wire.Message:
    """``[FRAME_TAG, payload]`` -> a validated message (ProtocolError otherwise)."""
    if len(frames) != 2 or frames[0] != FRAME_TAG:
        raise ProtocolError(f"control message of {len(frames)} frames")
    msg = wire.decode(frames[1])
    if isinstance(msg, SglRegister):
        msg.check()
    return msg
