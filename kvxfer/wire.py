"""Wire messages: small dataclasses encoded with msgpack, tagged and versioned.

Every message on the wire is a msgpack map ``{"t": TAG, "v": PROTOCOL_VERSION, ...fields}``.
Decoding validates before anything acts on the data: the tag must be registered, the
version must be the int ``PROTOCOL_VERSION`` (``True`` and ``1.0`` compare equal to 1 in
Python and are refused), every declared field must be present with the declared type, and no
unknown field is accepted. Nothing is ever pickled.

Define a message by subclassing :class:`Message` with a unique ``TAG`` and annotating its
fields with one of the supported types (``int``, ``str``, ``bytes``, ``bool``, ``float``,
``list[int]``, ``list[bytes]``, ``list[str]``, ``dict``, ``list``, or ``Optional[...]`` of
those), and decorating it with :func:`register`. An ``Optional`` field whose default is
``None`` is left out of the encoding while it is ``None``. A field typed ``int`` takes Python
ints only: ``bool`` and ``float`` values are refused.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, Dict, Type, TypeVar

import msgpack

from kvxfer.errors import ProtocolError, VersionMismatch

#: The one protocol version of kvxfer: every wire message carries it, the UCX channel's
#: opening hello announces it (:mod:`kvxfer.transport.opening`), the handshake's proofs and
#: the bootstrap's seals cover it. Bump it with any change an older build cannot take (a
#: message field added or retyped, a frame changed): peers of two versions then fail at once
#: with :class:`VersionMismatch` naming both. 1: up to the unversioned channel opening;
#: 2: versioned opening (version and channel wait mode), SglRoom.slices.
PROTOCOL_VERSION = 2

#: Upper bound of one encoded message; larger input is rejected before unpacking.
MAX_MESSAGE_BYTES = 64 << 20

_REGISTRY: Dict[str, Type["Message"]] = {}


def is_int(value: Any) -> bool:
    """A wire int: a Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass
class Message:
    """Base of every wire message. Subclasses set ``TAG`` and declare fields."""

    TAG: ClassVar[str] = ""

    def encode(self) -> bytes:
        body = {"t": self.TAG, "v": PROTOCOL_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue  # an optional field left unset is absent on the wire
            body[f.name] = value
        return msgpack.packb(body, use_bin_type=True)


def register(cls: Type[Message]) -> Type[Message]:
    """Class decorator adding a message type to the decoder's registry."""
    if not cls.TAG:
        raise TypeError(f"{cls.__name__} has no TAG")
    if cls.TAG in _REGISTRY and _REGISTRY[cls.TAG] is not cls:
        raise TypeError(f"duplicate wire tag {cls.TAG!r}")
    _REGISTRY[cls.TAG] = cls
    cls._field_types = _resolve_fields(cls)  # type: ignore[attr-defined]
    return cls


def _resolve_fields(cls):
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check_type(value: Any, tp: Any, where: str) -> None:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _check_type(value, inner[0], where)
        raise TypeError(f"unsupported union type for {where}")
    if origin in (list, typing.List):
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected list, got {type(value).__name__}")
        if args:
            for i, v in enumerate(value):
                _check_type(v, args[0], f"{where}[{i}]")
        return
    if origin in (dict, typing.Dict) or tp is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected map, got {type(value).__name__}")
        return
    if tp is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected list, got {type(value).__name__}")
        return
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected bool, got {type(value).__name__}")
        return
    if tp is int:
        if not is_int(value):
            raise ProtocolError(f"{where}: expected int, got {type(value).__name__}")
        return
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected float, got {type(value).__name__}")
        return
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected str, got {type(value).__name__}")
        return
    if tp is bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise ProtocolError(f"{where}: expected bytes, got {type(value).__name__}")
        return
    raise TypeError(f"unsupported wire field type {tp!r} for {where}")


def _short(value: Any) -> str:
    """``repr`` of a received value for an error message, cut short (it may be huge)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decode and validate one message; raises :class:`ProtocolError` on anything off
    (:class:`VersionMismatch` for a well-formed message of another protocol version)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"message is a {type(body).__name__}, not a map")
    tag = body.pop("t", None)
    version = body.pop("v", None)
    if not is_int(version):  # the version decides how to read the rest: checked first
        raise ProtocolError(f"{_short(tag)}: protocol version {_short(version)} is not an int")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"{_short(tag)}: the peer speaks kvxfer protocol version {_short(version)}, this "
            f"side {PROTOCOL_VERSION}: every process of a deployment must run a kvxfer of one "
            "protocol version (docs/engine.md, Compatibility)",
            ours=PROTOCOL_VERSION,
            theirs=version,
        )
    cls = _REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_short(tag)}")
    fields = cls._field_types  # type: ignore[attr-defined]
    unknown = set(body) - set(fields)
    if unknown:
        raise ProtocolError(f"{tag}: unknown field(s) {_short(sorted(unknown, key=str))}")
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in body
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    if missing:
        raise ProtocolError(f"{tag}: missing field(s) {missing}")
    for name, value in body.items():
        _check_type(value, fields[name], f"{tag}.{name}")
    return cls(**body)


_M = TypeVar("_M", bound=Message)


def expect(msg: Message, cls: Type[_M]) -> _M:
    """Return ``msg`` if it is a ``cls``; otherwise raise :class:`ProtocolError`."""
    if not isinstance(msg, cls):
        raise ProtocolError(f"expected {cls.TAG}, got {msg.TAG}")
    return msg
