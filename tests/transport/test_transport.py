"""The UCX transport and the native _rma extension, in a spawned child over loopback."""
import pytest

from kvxfer.testing import Child, transport_node

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def node():
    child = Child(transport_node, name="transport")
    child.start()
    yield child
    child.stop()


@pytest.mark.parametrize("mode,lane", [("peer", "tcp"), ("none", "cma")])
def test_put_flush_bounds(node, mode, lane):
    out = node.call("run", "put_and_bounds", mode)
    assert out["mem_types"] == ["host", "host"]
    assert any(x.startswith(lane) for x in out["lanes"]), out["lanes"]
    assert "outside region" in out["bounds"], out
    assert out["untouched_after_reject"]
    assert "remote region 1 of 1" in out["bad_region"]
    assert out["float"] == "TypeError" and out["length"] == "ValueError"
    assert out["posted"] == 2 and out["exact"]
    assert out["after_close"] == "Closed"


def test_peer_close_is_reported(node):
    out = node.call("run", "peer_close_seen")
    assert out["kind"] == "PeerClosed"
    assert out["send_after"] in ("PeerClosed", "Closed")


def test_completion_queue(node):
    out = node.call("run", "completion_queue")
    assert out["status"] == 0 or out["drained"] == [(7, 0)], out
    assert out["pending"] == 0
    assert out["closed"] == "ValueError"
