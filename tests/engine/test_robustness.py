"""Engine robustness over real UCX loopback (two engines in one spawned process): bounded
waits are O(1) each and fail together when the peer dies; abandoned tasks never leave an
unretrieved exception behind."""

import pytest
from robust_nodes import RobustNode

from kvxfer.procs import Worker

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def node():
    w = Worker(RobustNode, name="robust").start()
    yield w.proxy(RobustNode)
    w.close()


def test_many_waits_do_not_pile_on_the_dead_future(node):
    n = 4000
    out = node.many_waits(n)
    # nothing per wait hangs off the peer's shared "dead" future (removal was linear each)
    assert out["dead_callbacks"] <= 2, out
    assert out["completed"] == n, out
    assert out["peer_closed"] == n, out  # every pending wait fails when the peer goes
    assert out["dead_s"] < 5.0, out


@pytest.mark.parametrize("mode", ["timeout", "peer_death"])
def test_abandoned_task_exception_is_retrieved(node, mode):
    out = node.abandoned_task(mode)
    assert (
        out["outcome"] == ("TransferTimeout" if mode == "timeout" else "Closed")
        or out["outcome"] == "PeerClosed"
    ), out
    assert not [r for r in out["reports"] if "never retrieved" in r], out["reports"]


def test_fresh_pairs_reuse_endpoint_handles(node):
    # UCP reuses a closed endpoint's handle and UCXX keys its message queues by it: a
    # receive request left by the old connection swallowed the new one's first message
    out = node.reconnect_rounds(4)
    assert out == {"ok": 4, "errors": []}, out


def test_reconnect_after_protocol_error_sees_no_stale_message(node):
    # A closes on a bad message with the rest of a burst unread; those messages must not
    # surface in the next connection ("expected kx.hello..., got kx.app" before the fix)
    out = node.reconnect_after_protocol_error(3, 40)
    assert out["errors"] == [] and out["reconnected"] == 3, out
    assert out["fresh"] == 3 and out["stale_delivered"] == 0, out
