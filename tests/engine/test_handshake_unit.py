"""Handshake and layout validation pieces that need no UCX (pure functions)."""

import asyncio

import msgpack
import numpy as np
import pytest

from kvxfer import wire
from kvxfer.engine import handshake
from kvxfer.engine import messages as m
from kvxfer.engine.groups import LocalGroups, parse_remote
from kvxfer.errors import IncompatiblePeer, ProtocolError, VersionMismatch
from kvxfer.transport.base import Channel

pytestmark = pytest.mark.timeout(30)


def layout(**over):
    body = dict(
        groups={
            "kv": {
                "ptrs": [0x1000, 0x2000],
                "lens": [256, 256],
                "item_lens": [32, 32],
                "regions": [0, 0],
            }
        },
        region_bases=[0x1000],
        region_lens=[0x1100],
        region_keys=[b"k"],
        region_types=["host"],
        address=None,
    )
    body.update(over)
    return m.Layout(**body)


def test_parse_remote_ok():
    r = parse_remote(wire.decode(layout().encode()))
    assert r.groups["kv"].num_items == 8 and r.desc_region["kv"].tolist() == [0, 0]


@pytest.mark.parametrize(
    "over,msg",
    [
        ({"region_lens": [0x100]}, "outside region"),
        ({"region_keys": [b""]}, "no key"),
        ({"region_types": []}, "differ in length"),
        ({"groups": {"kv": {"ptrs": [1]}}}, "malformed"),
        (
            {
                "groups": {
                    "kv": {"ptrs": [0x1000], "lens": [250], "item_lens": [32], "regions": [0]}
                }
            },
            "multiple",
        ),
        (
            {
                "groups": {
                    "kv": {"ptrs": [0x1000], "lens": [256], "item_lens": [32], "regions": [3]}
                }
            },
            "region 3",
        ),
        (
            {"groups": {"kv": {"ptrs": [-5], "lens": [256], "item_lens": [32], "regions": [0]}}},
            "unsigned",
        ),
    ],
)
def test_parse_remote_rejects(over, msg):
    with pytest.raises(ProtocolError, match=msg):
        parse_remote(layout(**over))


def test_foreign_protocol_version_is_incompatible():
    raw = msgpack.packb({"t": "kx.hello", "v": wire.PROTOCOL_VERSION + 1}, use_bin_type=True)
    with pytest.raises(VersionMismatch, match="protocol version") as ei:
        handshake._decode(raw)
    assert isinstance(ei.value, IncompatiblePeer)  # what the handshake always raised for it
    assert (ei.value.ours, ei.value.theirs) == (wire.PROTOCOL_VERSION, wire.PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolError):
        handshake._decode(b"\xc1garbage")


class _Pipe(Channel):
    """One end of an in-memory channel pair (the handshake's message order only; the UCX
    channel's own checks are tested in tests/transport). ``version``: what this end's
    messages claim (a peer of another protocol version)."""

    def __init__(self, inbox, outbox, version=wire.PROTOCOL_VERSION):
        self.inbox, self.outbox, self.version = inbox, outbox, version

    async def send(self, payload, timeout):
        body = msgpack.unpackb(payload, raw=False)
        body["v"] = self.version
        await self.outbox.put(msgpack.packb(body, use_bin_type=True))

    async def recv(self, timeout, max_bytes=None):
        return await asyncio.wait_for(self.inbox.get(), timeout)

    def binding(self):
        return b"127.0.0.1:1>127.0.0.1:2"

    def on_closed(self, callback):
        pass

    def closed(self):
        return False

    async def close(self, timeout):
        pass

    def add_remote_regions(self, *a):
        raise NotImplementedError

    def put(self, *a):
        raise NotImplementedError


@pytest.mark.parametrize("foreign", ["connect", "accept"])
def test_handshake_version_mismatch_fails_both_ends_naming_both(foreign):
    V, other = wire.PROTOCOL_VERSION, wire.PROTOCOL_VERSION + 7

    async def run():
        a, b = asyncio.Queue(), asyncio.Queue()
        c = _Pipe(a, b, other if foreign == "connect" else V)
        s = _Pipe(b, a, other if foreign == "accept" else V)
        args = (LocalGroups(), b"secret", "id", "n", b"addr", 5.0)
        return await asyncio.gather(
            handshake.connect_side(c, *args),
            handshake.accept_side(s, *args),
            return_exceptions=True,
        )

    for exc in asyncio.run(run()):
        assert isinstance(exc, VersionMismatch), exc
        assert f"protocol version {other}, this side {V}" in str(exc), exc


def _hello(**over):
    return m.Hello(
        **dict(dict(engine_id="a", name="A", nonce=b"1" * 32, hostname="h", stage=False), **over)
    )


def _ack(**over):
    return m.HelloAck(
        **dict(
            dict(engine_id="b", name="B", nonce=b"2" * 32, hostname="h", stage=False, proof=b""),
            **over,
        )
    )


def test_proofs_bind_role_transcript_and_connection():
    bind = b"127.0.0.1:5000>127.0.0.1:6000"
    p = handshake._proof(b"s", b"C", bind, _hello(), _ack())
    assert p == handshake._proof(b"s", b"C", bind, _hello(), _ack(proof=b"x"))  # proof: out
    changed = [
        handshake._proof(b"t", b"C", bind, _hello(), _ack()),
        handshake._proof(b"s", b"S", bind, _hello(), _ack()),
        # the same ids and nonces seen on another connection (a relay's other leg)
        handshake._proof(b"s", b"C", b"127.0.0.1:5001>127.0.0.1:6000", _hello(), _ack()),
        handshake._proof(b"s", b"C", bind, _hello(engine_id="b"), _ack(engine_id="a")),
        handshake._proof(b"s", b"C", bind, _hello(nonce=b"2" * 32), _ack(nonce=b"1" * 32)),
        handshake._proof(b"s", b"C", bind, _hello(stage=True), _ack()),
        handshake._proof(b"s", b"C", bind, _hello(), _ack(hostname="other")),
        # field boundaries are unambiguous (the old "|"-joined text was not)
        handshake._proof(b"s", b"C", bind, _hello(engine_id="a|b"), _ack(engine_id="")),
    ]
    assert p not in changed and len(set(changed)) == len(changed)


def test_check_groups_names_group_and_field():
    local = LocalGroups()
    local.add("kv", [0x1000, 0x2000], [256, 256], [32, 32])
    local.add("state", [0x9000], [64], [8])
    remote = parse_remote(
        layout(
            groups={
                "kv": {
                    "ptrs": [0x1000, 0x2000],
                    "lens": [512, 512],
                    "item_lens": [64, 64],
                    "regions": [0, 0],
                }
            },
            region_lens=[0x1200],
        )
    )
    with pytest.raises(IncompatiblePeer, match=r"'kv'.*item_lens"):
        handshake.check_groups(local, remote)
    ok = parse_remote(layout())  # same item sizes, other item count, no "state": fine
    handshake.check_groups(local, ok)
    assert np.array_equal(ok.desc_region["kv"], [0, 0])


def test_check_groups_item_lens_may_differ():
    """A group registered with item_lens_may_differ pairs a peer of other item sizes (only
    the descriptor count must match); the others stay strict."""
    remote = parse_remote(
        layout(
            groups={
                "kv": {
                    "ptrs": [0x1000, 0x2000],
                    "lens": [512, 512],
                    "item_lens": [128, 128],
                    "regions": [0, 0],
                }
            },
            region_lens=[0x1200],
        )
    )
    local = LocalGroups()
    local.add("kv", [0x1000, 0x2000], [256, 256], [32, 32], item_lens_may_differ=True)
    handshake.check_groups(local, remote)
    three = LocalGroups()
    three.add("kv", [0x1000, 0x2000, 0x3000], [256] * 3, [32] * 3, item_lens_may_differ=True)
    with pytest.raises(IncompatiblePeer, match=r"'kv'.*count"):
        handshake.check_groups(three, remote)
