"""This build against a protocol-1 kvxfer (the unversioned opening), played frame by frame on a
raw UCXX endpoint in a spawned child: this end fails fast with a typed error naming both
versions (or, where the old peer sends nothing to tell, after the short hello wait with a
message naming the cause), and the old peer gets our close frame in its epoch, which ends its
opening at once. Its own worker: the raw endpoints stay out of the other transport tests."""

import pytest

from kvxfer.procs import Worker
from kvxfer.testing.transport_checks import TransportNode
from kvxfer.wire import PROTOCOL_VERSION as V

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def node():
    w = Worker(TransportNode, name="legacy").start()
    yield w.proxy(TransportNode)
    w.close()


def _left_nothing(out):
    assert out["channels"] == 1 and out["tokens_left"] == [] and out["pending"] == 0, out
    assert out["rx_left"] == [False] and out["eps_left"] == [False], out


@pytest.mark.parametrize("kind", ["native-connector", "yield-connector", "yield-acceptor"])
def test_old_peer_is_a_version_mismatch(node, kind):
    out = node.opening_legacy(kind)
    assert out["error"] == "VersionMismatch" and out["versions"] == [V, 1], out
    assert "peer speaks protocol 1" in out["msg"] and f"this end protocol {V}" in out["msg"], out
    assert out["s"] < 2.5, out
    # the old peer saw our padding, (accepting: our hello,) then our close frame in its epoch
    assert out["old_saw"][0] == "padding" and out["old_saw"][-1] == "close", out
    _left_nothing(out)


def test_old_native_acceptor_ends_in_the_short_hello_wait(node):
    # protocol 1 with native frames drops our hello and sends nothing but its padding:
    # indistinguishable from a slow peer, so the wait is short and the message names it
    out = node.opening_legacy("native-acceptor")
    assert out["error"] == "TransferTimeout" and "older kvxfer" in out["msg"], out
    assert out["s"] < 2.5, out  # HELLO_TIMEOUT_S patched to 0.5 s here (5 s by default)
    assert out["old_saw"] == ["padding", "hello", "close"], out
    _left_nothing(out)
