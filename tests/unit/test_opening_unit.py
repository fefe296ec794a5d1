"""The channel opening's hello bytes and compatibility check (kvxfer.transport.opening): pure,
every mode x version x malformation."""

import itertools

import msgpack
import pytest

from kvxfer.errors import IncompatiblePeer, ProtocolError, VersionMismatch
from kvxfer.transport import opening as op
from kvxfer.wire import PROTOCOL_VERSION as V

pytestmark = pytest.mark.timeout(10)

TOKEN = 0x1122334455667788


def _hello(mode, version=V):
    return op.encode_hello(version, mode, TOKEN if mode == "native" else 0)


@pytest.mark.parametrize("mode", op.MODES)
def test_round_trip(mode):
    body = _hello(mode)
    assert len(body) == op.HELLO_BYTES and body[:2] == op.HELLO_MAGIC
    h = op.parse_hello(7, body)
    assert h == op.Hello(7, V, mode, TOKEN if mode == "native" else 0)
    op.check_opening(V, mode, h)  # same version and mode: no error


def test_magic_is_not_msgpack_nor_the_legacy_hello():
    assert op.HELLO_MAGIC != op.LEGACY_HELLO_MAGIC
    with pytest.raises(msgpack.exceptions.FormatError):
        msgpack.unpackb(_hello("native"))


@pytest.mark.parametrize("ours,theirs", list(itertools.permutations(op.MODES, 2)))
def test_mode_mismatch_is_incompatible_naming_both(ours, theirs):
    with pytest.raises(IncompatiblePeer) as ei:
        op.check_opening(V, ours, op.parse_hello(1, _hello(theirs)))
    assert not isinstance(ei.value, VersionMismatch)
    assert f"KVXFER_CHANNEL_WAIT={theirs}, this end {ours}" in str(ei.value)
    assert op.COMPAT_DOC in str(ei.value)


@pytest.mark.parametrize("theirs", [0, 1, V + 1, 99, (1 << 32) - 1])
@pytest.mark.parametrize("ours_mode,their_mode", list(itertools.product(op.MODES, op.MODES)))
def test_version_mismatch_names_both_and_comes_before_mode(theirs, ours_mode, their_mode):
    h = op.parse_hello(1, _hello(their_mode, theirs))
    assert h.version == theirs and h.mode == their_mode and h.token == 0  # nothing trusted
    with pytest.raises(VersionMismatch) as ei:
        op.check_opening(V, ours_mode, h)
    e = ei.value
    assert (e.ours, e.theirs) == (V, theirs)
    assert isinstance(e, IncompatiblePeer) and isinstance(e, ProtocolError)
    text = str(e)
    assert f"peer speaks protocol {theirs}, channel mode {their_mode}" in text
    assert f"this end protocol {V}, channel mode {ours_mode}" in text
    assert op.COMPAT_DOC in text


@pytest.mark.parametrize("tail", [b"", b"\x00", b"\x00" * 20])
def test_other_version_of_another_layout_is_still_named(tail):
    body = op.HELLO_MAGIC + (V + 5).to_bytes(4, "little") + tail
    h = op.parse_hello(3, body)
    assert (h.version, h.mode) == (V + 5, None)
    with pytest.raises(VersionMismatch, match=r"protocol \d+, channel mode \?"):
        op.check_opening(V, "native", h)


@pytest.mark.parametrize(
    "body,what",
    [
        (op.HELLO_MAGIC, "no version"),
        (op.HELLO_MAGIC + b"\x02\x00", "no version"),
        (op.HELLO_MAGIC + V.to_bytes(4, "little"), "malformed"),
        (_hello("native") + b"\x00", "malformed"),
        (_hello("native")[:-1], "malformed"),
        (op.HELLO_MAGIC + V.to_bytes(4, "little") + b"\x02" + bytes(8), "malformed"),
        (op.HELLO_MAGIC + V.to_bytes(4, "little") + b"\x00" + bytes(8), "without a frame token"),
        (op.HELLO_MAGIC + V.to_bytes(4, "little") + b"\x01" + b"\x01" * 8, "yield hello with"),
        (b"\xc1\xc2" + bytes(13), "no version"),
    ],
)
def test_malformed_hello_of_our_version(body, what):
    with pytest.raises(ProtocolError, match=what):
        op.parse_hello(1, body)


def test_encode_refuses_inconsistent_input():
    with pytest.raises(ValueError):
        op.encode_hello(V, "spin", 1)
    with pytest.raises(ValueError):
        op.encode_hello(V, "native", 0)
    with pytest.raises(ValueError):
        op.encode_hello(V, "yield", 5)


def test_legacy_mismatch():
    e = op.legacy_mismatch(V, "yield")
    assert (e.ours, e.theirs) == (V, op.LEGACY_VERSION)
    assert "peer speaks protocol 1, channel mode native" in str(e)


@pytest.mark.parametrize(
    "body,version",
    [
        (msgpack.packb({"t": "kx.hello", "v": 1, "name": "x"}), 1),
        (msgpack.packb({"t": "kx.reject", "v": 7}), 7),
        (msgpack.packb({"t": "kx.hello", "v": True}), None),
        (msgpack.packb({"t": "kx.hello", "v": 1.0}), None),
        (msgpack.packb({"t": "kx.hello"}), None),
        (msgpack.packb([1, 2]), None),
        (msgpack.packb({"t": "x", "v": 1, "pad": b"\x00" * op.PEEK_BYTES}), None),
        (b"\xc1\xc2" + bytes(8), None),
        (b"", None),
        (b"\x92\x01", None),  # truncated
    ],
)
def test_peek_version(body, version):
    assert op.peek_version(body) == version
