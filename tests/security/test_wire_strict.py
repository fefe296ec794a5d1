"""Strict wire types: the protocol version and every field typed ``int`` take Python ints only
(``True == 1`` and ``1.0 == 1`` in Python, so an equality check let them through)."""

import dataclasses
import typing

import msgpack
import pytest

from kvxfer import wire
from kvxfer.disagg import messages as pd  # noqa: F401  (registers the pd./bs. messages)
from kvxfer.engine import handshake
from kvxfer.engine import messages as kx  # noqa: F401  (registers the kx. messages)
from kvxfer.errors import IncompatiblePeer, ProtocolError

pytestmark = pytest.mark.timeout(30)

NOT_INTS = [True, False, 1.0, 2.5, "1", b"\x01", None, [1]]


def _valid(value_of_type):
    """A well-formed body of every registered message type."""
    out = {}
    for tag, cls in sorted(wire._REGISTRY.items()):
        body = {"t": tag, "v": wire.PROTOCOL_VERSION}
        for f in dataclasses.fields(cls):
            body[f.name] = value_of_type(cls._field_types[f.name])
        out[tag] = body
    return out


def _sample(tp):
    if typing.get_origin(tp) is typing.Union:
        return _sample([a for a in typing.get_args(tp) if a is not type(None)][0])
    if typing.get_origin(tp) in (list, typing.List) or tp is list:
        return []
    if typing.get_origin(tp) in (dict, typing.Dict) or tp is dict:
        return {}
    return {int: 1, str: "s", bytes: b"b", bool: False, float: 1.5}[tp]


def _pack(body):
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize("version", [True, 1.0, "1", b"\x01", None, [1]])
def test_version_must_be_the_int(version):
    for body in _valid(_sample).values():
        wire.decode(_pack(body))  # the template itself is fine
        with pytest.raises(ProtocolError, match="version"):
            wire.decode(_pack(dict(body, v=version)))
    hello = _valid(_sample)["kx.hello"]
    with pytest.raises(ProtocolError):
        handshake._decode(_pack(dict(hello, v=version)))


def test_foreign_int_version_is_incompatible_not_malformed():
    hello = _valid(_sample)["kx.hello"]
    with pytest.raises(wire.VersionMismatch):
        wire.decode(_pack(dict(hello, v=wire.PROTOCOL_VERSION + 1)))
    with pytest.raises(IncompatiblePeer):
        handshake._decode(_pack(dict(hello, v=wire.PROTOCOL_VERSION + 1)))
    with pytest.raises(IncompatiblePeer):  # also for a tag this version does not know
        handshake._decode(_pack({"t": "kx.future", "v": wire.PROTOCOL_VERSION + 1}))


def test_every_int_field_refuses_bool_and_float():
    checked = 0
    for tag, body in _valid(_sample).items():
        cls = wire._REGISTRY[tag]
        for name, tp in cls._field_types.items():
            optional = typing.get_origin(tp) is typing.Union
            inner = [a for a in typing.get_args(tp) if a is not type(None)] if optional else [tp]
            bads = [b for b in NOT_INTS if not (optional and b is None)]
            if inner[0] is int:
                for bad in bads:
                    with pytest.raises(ProtocolError, match=name):
                        wire.decode(_pack(dict(body, **{name: bad})))
                checked += 1
            elif typing.get_origin(inner[0]) in (list, typing.List) and typing.get_args(
                inner[0]
            ) == (int,):
                for bad in bads:
                    with pytest.raises(ProtocolError, match=name):
                        wire.decode(_pack(dict(body, **{name: [1, bad]})))
                checked += 1
    assert checked >= 20  # pd.* rooms/ids, bs.* ranks/ports, kx.* slots/offsets, layouts


def test_bootstrap_entries_refuse_bool_and_float_ranks():
    entry = {
        "name": "p",
        "host": "h",
        "port": 80,
        "tp_rank": 0,
        "tp_size": 1,
        "dp_rank": 0,
        "pp_rank": 0,
        "fingerprint": {},
    }
    pd.check_entry(dict(entry))
    for k in ("port", "tp_rank", "tp_size", "dp_rank", "pp_rank"):
        for bad in (True, 1.0):
            with pytest.raises(ProtocolError, match=k):
                pd.check_entry(dict(entry, **{k: bad}))


def test_error_messages_are_bounded():
    huge = "x" * 1_000_000
    with pytest.raises(ProtocolError) as exc:
        wire.decode(_pack({"t": huge, "v": wire.PROTOCOL_VERSION}))
    assert len(str(exc.value)) < 300
    with pytest.raises(ProtocolError) as exc:
        wire.decode(_pack({"t": "kx.bye", "v": huge}))
    assert len(str(exc.value)) < 300
