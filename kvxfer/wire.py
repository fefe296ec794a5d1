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
from typing import Any, Callable, ClassVar, Dict, Type, TypeVar

import msgpack

from kvxfer.errors import ProtocolError, VersionMismatch

#: The one protocol version of kvxfer: every wire message carries it, the UCX channel's
#: opening hello announces it (:mod:`kvxfer.transport.opening`), the handshake's proofs and
#: the bootstrap's seals cover it. Bump it with any change an older build cannot take (a
#: message field added or retyped, a frame changed): peers of two versions then fail at once
#: with :class:`VersionMismatch` naming both. 1: up to the unversioned channel opening;
#: 2: versioned opening (version and channel wait mode), SglRoom.slices; 3: Layout.host_lane
#: (kvxfer.engine.hostcopy); 4: heterogeneous TP's replicated whole pages written by every
#: replica a block each (who writes which page, and the integrity check's pair sums:
#: kvxfer.disagg.tp_rooms.TpPair.replica_blocks).
PROTOCOL_VERSION = 4

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
        body: Dict[str, Any] = {"t": self.TAG, "v": PROTOCOL_VERSION}
        cls = type(self)
        encoding = cls.__dict__.get("_encoding")  # resolved by register()
        if encoding is None:  # a class that was not registered (it encodes all the same)
            encoding = _encoding(cls)
        for name, optional in encoding:
            value = getattr(self, name)
            if value is None and optional:
                continue  # an optional field left unset is absent on the wire
            body[name] = value
        return _pack(body)


def register(cls: Type[Message]) -> Type[Message]:
    """Class decorator adding a message type to the decoder's registry. A field type the
    wire cannot check raises TypeError here (nothing is registered)."""
    if not cls.TAG:
        raise TypeError(f"{cls.__name__} has no TAG")
    if cls.TAG in _REGISTRY and _REGISTRY[cls.TAG] is not cls:
        raise TypeError(f"duplicate wire tag {cls.TAG!r}")
    fields = dataclasses.fields(cls)
    types = _resolve_fields(cls)
    # resolved once per class (a message is encoded and decoded on every request's path):
    # (name, left out while None) in declaration order, a checker per field, the fields that
    # take None, the required ones
    checkers = {name: _checker(tp, f"{cls.TAG}.{name}") for name, tp in types.items()}
    cls._field_types = types  # type: ignore[attr-defined]
    cls._encoding = _encoding(cls)  # type: ignore[attr-defined]
    cls._checkers = checkers  # type: ignore[attr-defined]
    cls._nullable = frozenset(  # type: ignore[attr-defined]
        name
        for name, tp in types.items()
        if typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)
    )
    cls._required = frozenset(  # type: ignore[attr-defined]
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    )
    _REGISTRY[cls.TAG] = cls
    return cls


def _encoding(cls: type) -> tuple:
    """``(name, left out while None)`` of each field of ``cls``, in declaration order."""
    return tuple((f.name, f.default is None) for f in dataclasses.fields(cls))


def _pack(body: Dict[str, Any]) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _resolve_fields(cls):
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _checker(tp: Any, where: str) -> Callable[[Any], None]:
    """``value -> None`` raising ProtocolError exactly as :func:`_check_type` does for
    ``tp`` (tests/unit/test_wire_unit.py): ``int``, ``str``, ``bytes`` and ``bool`` fields get
    a direct test, the rest defer to :func:`_check_type`. TypeError for a type the wire does
    not support."""
    _check_type_supported(tp, where)
    if tp is int:

        def check_int(value: Any) -> None:
            if not is_int(value):
                raise ProtocolError(f"{where}: expected int, got {type(value).__name__}")

        return check_int
    if tp in (str, bytes, bool):
        kinds = (bytes, bytearray) if tp is bytes else tp
        label = tp.__name__

        def check_simple(value: Any) -> None:
            if not isinstance(value, kinds):
                raise ProtocolError(f"{where}: expected {label}, got {type(value).__name__}")

        return check_simple
    args = typing.get_args(tp) if typing.get_origin(tp) in (list, typing.List) else ()
    item = args[0] if args else None
    if item in _EXACT:  # a list of ints (DoneMany's rooms): one C-level pass when all is well
        exact = _EXACT[item]

        def check_list(value: Any) -> None:
            if type(value) is not list or not exact.issuperset(map(type, value)):
                _check_type(value, tp, where)  # the element that fails, named as ever

        return check_list
    return lambda value: _check_type(value, tp, where)


#: list element types whose elements of exactly these types pass (anything else is left to
#: :func:`_check_type`, which accepts a subclass where the generic test does)
_EXACT: Dict[Any, frozenset] = {
    int: frozenset((int,)),
    str: frozenset((str,)),
    bytes: frozenset((bytes, bytearray)),
    bool: frozenset((bool,)),
}


def _check_type_supported(tp: Any, where: str) -> None:
    """Raise TypeError (at registration) for a field type :func:`_check_type` cannot check."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union type for {where}")
        return _check_type_supported(inner[0], where)
    if origin in (list, typing.List):
        return _check_type_supported(args[0], where) if args else None
    if origin in (dict, typing.Dict) or tp in (dict, list, bool, int, float, str, bytes):
        return None
    raise TypeError(f"unsupported wire field type {tp!r} for {where}")


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
    checkers = cls._checkers  # type: ignore[attr-defined]
    if not checkers.keys() >= body.keys():
        unknown = set(body) - set(checkers)
        raise ProtocolError(f"{tag}: unknown field(s) {_short(sorted(unknown, key=str))}")
    if not cls._required <= body.keys():  # type: ignore[attr-defined]
        missing = [n for n in checkers if n in cls._required and n not in body]  # type: ignore[attr-defined]
        raise ProtocolError(f"{tag}: missing field(s) {missing}")
    nullable = cls._nullable  # type: ignore[attr-defined]
    for name, value in body.items():
        if value is not None or name not in nullable:
            checkers[name](value)
    return cls(**body)


_M = TypeVar("_M", bound=Message)


def expect(msg: Message, cls: Type[_M]) -> _M:
    """Return ``msg`` if it is a ``cls``; otherwise raise :class:`ProtocolError`."""
    if not isinstance(msg, cls):
        raise ProtocolError(f"expected {cls.TAG}, got {msg.TAG}")
    return msg
