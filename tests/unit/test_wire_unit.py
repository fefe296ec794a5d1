"""kvxfer.wire: the per-class encoders and checkers resolved at registration accept and
refuse exactly what the generic type check does (every registered message, every field,
a matrix of values), and the decoder's errors name the message and field."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import List, Optional

import msgpack
import pytest

import kvxfer.disagg.messages  # noqa: F401  (registers the protocol's messages)
import kvxfer.engine.messages  # noqa: F401
import kvxfer.integrations.sglang.messages  # noqa: F401
from kvxfer import wire
from kvxfer.errors import ProtocolError, VersionMismatch

pytestmark = pytest.mark.timeout(60)

#: values of every wire type and of none (bool vs int, float vs int, bytearray vs bytes...)
SAMPLES = [
    0,
    -3,
    1 << 62,
    True,
    False,
    1.5,
    "s",
    "",
    b"b",
    bytearray(b"x"),
    None,
    [],
    [1, 2],
    [1, "x"],
    [b"a"],
    ["a", "b"],
    [True],
    [1, True],
    [0, 1.0],
    [b"a", bytearray(b"b")],
    [b"a", "b"],
    [False, True],
    [False, 0],
    list(range(1000)),
    list(range(999)) + [None],
    (1, 2),
    {},
    {"a": 1},
]


def _accepts(tp, value) -> bool:
    try:
        wire._check_type(value, tp, "f")
    except ProtocolError:
        return False
    return True


def _fields():
    for tag, cls in sorted(wire._REGISTRY.items()):
        for name, tp in cls._field_types.items():
            yield tag, cls, name, tp


@pytest.mark.parametrize("tag,cls,name,tp", list(_fields()), ids=lambda v: str(v)[:40])
def test_compiled_checkers_match_the_generic_check(tag, cls, name, tp):
    nullable = name in cls._nullable
    for value in SAMPLES:
        want = _accepts(tp, value)
        try:
            if value is not None or not nullable:
                cls._checkers[name](value)
            got = True
        except ProtocolError as exc:
            got = False
            assert f"{tag}.{name}" in str(exc)
        assert got == want, (tag, name, tp, value)


def test_nullable_are_exactly_the_optional_fields():
    for _tag, cls, name, tp in _fields():
        optional = typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)
        assert (name in cls._nullable) == optional


@wire.register
@dataclass
class _Probe(wire.Message):
    TAG = "test.wire.probe"
    n: int
    ids: List[int]
    blob: bytes
    name: str = "x"
    extra: Optional[int] = None


def _raw(**body) -> bytes:
    return msgpack.packb({"t": _Probe.TAG, "v": wire.PROTOCOL_VERSION, **body}, use_bin_type=True)


def test_round_trip_and_optional_left_out():
    msg = _Probe(n=3, ids=[1, 2], blob=b"\x00")
    data = msg.encode()
    assert "extra" not in msgpack.unpackb(data, raw=False)
    assert wire.decode(data) == msg
    full = _Probe(n=-1, ids=[], blob=b"", name="y", extra=7)
    assert wire.decode(full.encode()) == full
    fields = [f.name for f in dataclasses.fields(_Probe)]
    assert list(msgpack.unpackb(full.encode(), raw=False))[2:] == fields


@pytest.mark.parametrize(
    "body,words",
    [
        (dict(n=1, ids=[], blob=b"", zz=1), "unknown field(s) ['zz']"),
        (dict(ids=[], name="a"), "missing field(s) ['n', 'blob']"),
        (dict(n=True, ids=[], blob=b""), "test.wire.probe.n: expected int, got bool"),
        (dict(n=1.0, ids=[], blob=b""), "test.wire.probe.n: expected int, got float"),
        (dict(n=None, ids=[], blob=b""), "test.wire.probe.n: expected int, got NoneType"),
        (dict(n=1, ids=[1, "a"], blob=b""), "test.wire.probe.ids[1]: expected int"),
        (dict(n=1, ids=[], blob="s"), "test.wire.probe.blob: expected bytes, got str"),
        (dict(n=1, ids=[], blob=b"", name=None), "test.wire.probe.name: expected str"),
        (dict(n=1, ids=[], blob=b"", extra="a"), "test.wire.probe.extra: expected int"),
    ],
)
def test_bad_bodies_are_refused_by_name(body, words):
    with pytest.raises(ProtocolError) as ei:
        wire.decode(_raw(**body))
    assert words in str(ei.value)


def test_explicit_none_of_an_optional_field_decodes():
    assert wire.decode(_raw(n=1, ids=[], blob=b"", extra=None)).extra is None


def test_envelope_errors():
    with pytest.raises(VersionMismatch):
        wire.decode(msgpack.packb({"t": _Probe.TAG, "v": wire.PROTOCOL_VERSION + 1}))
    with pytest.raises(ProtocolError, match="not an int"):
        wire.decode(msgpack.packb({"t": _Probe.TAG, "v": True}))
    with pytest.raises(ProtocolError, match="unknown message type"):
        wire.decode(msgpack.packb({"t": "nope", "v": wire.PROTOCOL_VERSION}))
    with pytest.raises(ProtocolError, match="not a map"):
        wire.decode(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError, match="undecodable"):
        wire.decode(b"\xc1")


def test_unsupported_field_types_are_refused_at_registration():
    with pytest.raises(TypeError, match="unsupported"):

        @wire.register
        @dataclass
        class _Bad(wire.Message):
            TAG = "test.wire.bad"
            x: set

    with pytest.raises(TypeError, match="unsupported union"):

        @wire.register
        @dataclass
        class _Bad2(wire.Message):
            TAG = "test.wire.bad2"
            x: typing.Union[int, str]

    assert "test.wire.bad" not in wire._REGISTRY and "test.wire.bad2" not in wire._REGISTRY


def test_unregistered_messages_still_encode():
    @dataclass
    class _Loose(wire.Message):
        TAG = "test.wire.loose"
        a: int
        b: Optional[int] = None

    assert msgpack.unpackb(_Loose(a=1).encode(), raw=False) == {
        "t": "test.wire.loose",
        "v": wire.PROTOCOL_VERSION,
        "a": 1,
    }
    assert msgpack.unpackb(wire.Message().encode(), raw=False)["t"] == ""
