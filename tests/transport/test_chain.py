"""The native put -> flush -> notify chain (``_rma.CompletionQueue.flush_notify``) and the
notification receiver (``note_listen``), in a spawned child over loopback."""

import pytest

from kvxfer.procs import Worker
from kvxfer.testing.chain_checks import ChainNode

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def node():
    w = Worker(ChainNode, name="chain").start()
    yield w.proxy(ChainNode, timeout=80.0)
    w.close()


@pytest.mark.parametrize("spin", [False, True], ids=["event", "spin"])
@pytest.mark.parametrize("mode", ["peer", "none"])
def test_notify_never_before_bytes(node, mode, spin):
    # 8 MiB per round: the flush takes long enough for an early notification to show
    out = node.ordering(mode, 12, 8, spin)
    assert out["seen"] == [f"round-{i}" for i in range(12)], out
    assert all(out["visible"]), out  # the receiver saw every byte when the notify arrived
    assert out["times_ok"] and out["flushes_left"] == 0, out


@pytest.mark.parametrize(
    "mode,inline_us,yield_idle",
    [
        ("peer", -1.0, False),
        ("none", -1.0, False),
        ("none", 0.0, False),
        ("none", 1.0, False),
        ("none", 50.0, True),
    ],
)
def test_many_concurrent_chains(node, mode, inline_us, yield_idle):
    """Also with the starters' inline wait off or 1 µs: chains ended by the own worker's
    thread, which a starter wakes only after its call (_rma.c cq_req_wake) — none is lost;
    and with an inline wait that yields the CPU when the worker is idle (KVXFER_INLINE_YIELD)."""
    out = node.many(mode, 300, inline_us, yield_idle)
    assert out["errors"] == [] and out["count"] == 300 and out["order_ok"], out
    assert out["bytes_ok"], out
    # every chain released its queue reference, no spin flush left, no future left
    assert out["pending_delta"] == 0 and out["spinning"] == 0 and out["flushes_left"] == 0, out


def test_close_cancels_pending_chain(node):
    out = node.cancelled_by_close(64)
    # the flush was pending when close() marked the endpoint closing: typed failure, and
    # the notification was never sent (only the later chain's arrived)
    assert out["first"] in ("PeerClosed", "completed"), out
    if out["first"] == "PeerClosed":
        assert out["got"] == ["later"], out
    else:  # the flush beat the close: then the notification went out before it
        assert out["got"] == ["never", "later"], out
    assert out["after_close"] == "Closed", out
    assert out["pending"] == 0 and out["pending_after_unlisten"] == 0, out


def test_unknown_token_dropped(node):
    out = node.unknown_token()
    assert out["got"] == ["2:live"] and out["ok"], out


def test_native_deliver_that_raises_leaves_everything_to_the_loop(node):
    """The own worker's thread calls a deliver callable instead of signalling the eventfd
    (``UcxTransport.take_natively``): one that raises is reported (unraisable) and what it
    left is signalled, so the loop still takes every notification, once and in order."""
    out = node.native_deliver("none", 50, "raise")
    assert out["calls"] >= 1 and out["native_thread"], out
    assert out["raised"] and "deliver failed" in out["raised"][0], out
    assert out["errors"] == [] and out["count"] == 50 and out["order_ok"], out
    assert out["notes_on_loop"], out


def test_native_deliver_that_closes_the_queue():
    """A deliver callable that closes the completion queue from the own worker's thread
    (the last reference dropped there): the thread is not joined (it would wait for itself),
    it ends once the call returns, and the process goes on: nothing hangs or aborts (its
    own process: the transport is left without a queue, its worker to the process's end)."""
    w = Worker(ChainNode, name="chain-close").start()
    try:
        node = w.proxy(ChainNode, timeout=60.0)
        out = node.native_deliver("none", 50, "close")
        assert out["calls"] == 1 and out["native_thread"], out
        assert w.alive()
    finally:
        w.close()
