"""The UCX transport and the native _rma extension, in a spawned child over loopback."""

import pytest

from kvxfer.procs import Worker
from kvxfer.testing.transport_checks import TransportNode

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def node():
    w = Worker(TransportNode, name="transport").start()
    yield w.proxy(TransportNode)
    w.close()


@pytest.mark.parametrize("spin", [False, True], ids=["event", "spin"])
@pytest.mark.parametrize("mode,lane", [("peer", "tcp"), ("none", "cma")])
def test_put_flush_bounds(node, mode, lane, spin):
    out = node.put_and_bounds(mode, spin)
    assert out["mem_types"] == ["host", "host"]
    assert any(x.startswith(lane) for x in out["lanes"]), out["lanes"]
    assert "outside region" in out["bounds"], out
    assert out["untouched_after_reject"]
    assert "remote region 1 of 1" in out["bad_region"]
    assert out["float"] == "TypeError" and out["length"] == "ValueError"
    assert out["posted"] == 2 and out["exact"] and out["t_done_ok"]
    assert out["spinning_after"] == 0
    assert out["after_close"] == "Closed"


@pytest.mark.parametrize("mode", ["peer", "none"])
def test_rma_close_quiesces(node, mode):
    # close() used to destroy the keys at once and "close" a bulk endpoint with a forced
    # close UCX refuses for error mode NONE: the endpoint stayed open with PUTs in flight
    # and a freed error-handler context (SIGSEGV when it later failed)
    out = node.close_quiesces(mode)
    assert out == {"landed": True, "pending": 0}, out


def test_peer_close_is_reported(node):
    out = node.peer_close_seen()
    assert out["kind"] == "PeerClosed" and out["recv"] == "PeerClosed", out
    assert out["send_after"] in ("PeerClosed", "Closed")
    # orderly close: each side took the other's close frame (no receive left posted in
    # UCXX), well within the bound (the client waited for the server to close)
    assert out["client_saw_close"] and out["server_saw_close"], out
    assert out["handshake_s"] < 2.5, out


def test_completion_queue(node):
    out = node.completion_queue()
    assert out["spin_without_worker"] == "ValueError"
    for kind in ("event", "spin"):
        r = out[kind]
        assert r["status"] == 0 or r["drained"] == [(7, 0)], out
        assert r["pending"] == 0 and r["spinning"] == 0, out
        assert r["closed"] == "ValueError" and r["poller_after_close"] is False, out
    # the first spin flush started the poller thread; close() joined it
    assert out["spin"]["poller"] is True and out["event"]["poller"] is False, out


@pytest.mark.timeout(120)
def test_accept_while_the_poller_spins(node):
    # the poller used to progress UCXX's worker itself; a connection request it picked up
    # ran UCXX's listener callback on the poller thread, whose endpoint creation then
    # waited 3 x 3 s for UCXX's progress thread, blocked on the worker lock the poller held
    # ("Bootstrapping for more than 10s" in CI). Now only UCXX's thread progresses it.
    out = node.accept_while_spinning(8)
    assert not out["errors"] and len(out["took"]) == 8, out
    assert max(out["took"]) < 2.5, out
    assert out["spinning"] == 1, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["peer", "none"])
def test_accept_during_spin_flushes(node, mode):
    # the same with real PUT + spin-flush rounds back to back on a connected pair: on UCXX's
    # worker (peer) and on kvxfer's own worker (none)
    out = node.accept_while_spinning(8, hammer=True, mode=mode)
    assert not out["errors"] and len(out["took"]) == 8, out
    assert max(out["took"]) < 2.5, out
    assert out["flush_rounds"] > 8 and out["exact"], out


def test_channel_native_frames(node):
    out = node.channel_frames()
    assert out["native"], out  # the hello exchange gave each end the other's frame token
    assert out["big_to_server"] and out["big_to_client"] and out["order"], out
    assert out["limit"] == "ProtocolError", out
    # orderly close over native frames; nothing of the connection stays registered/posted
    assert out["saw_close"] and out["tokens_left"] == [] and out["rx_left"] == [False, False]
    assert out["close_s"] < 2.5 and out["readers"] == ["PeerClosed", "PeerClosed"], out
    assert out["ucxx_drained"] == 3, out  # UCXX's queue for the endpoint emptied at close


def test_channel_flood_drops_the_connection(node):
    out = node.channel_flood(16)
    assert "flooded" in out["why"] and out["recv"] == "PeerClosed", out
    assert out["queued"] == 0, out


def test_channel_oversize_before_trust_drops_the_connection(node):
    out = node.channel_oversize()
    assert "size limit" in out["why"] and out["queued"] == 0, out


_LEFT_NOTHING = {"tokens_left": [], "inbox_left": 0, "pending": 0}


def _left_nothing(out):
    assert out["channels"] == 2, out
    assert {k: out[k] for k in _LEFT_NOTHING} == _LEFT_NOTHING, out
    assert out["rx_left"] == [False, False] and out["eps_left"] == [False, False], out


@pytest.mark.parametrize(
    "connect,accept",
    [("native", "yield"), ("yield", "native")],
    ids=["native-yield", "yield-native"],
)
def test_opening_mode_mismatch_fails_both_ends_fast(node, connect, accept):
    out = node.opening_mismatch({"mode": connect}, {"mode": accept})
    for side, mine, theirs in (("client", connect, accept), ("server", accept, connect)):
        assert out[side] == "IncompatiblePeer", out
        msg = out[f"{side}_msg"]
        assert f"KVXFER_CHANNEL_WAIT={theirs}, this end {mine}" in msg, out
        assert "docs/engine.md" in msg, out
    # at once: well inside the opening's timeouts (HELLO_TIMEOUT_S 5 s, OPEN_TIMEOUT_S 10 s)
    assert out["client_s"] < 2.5 and out["server_s"] < 2.5, out
    assert out["accepted"] == 0, out
    _left_nothing(out)


@pytest.mark.parametrize("side", ["connect", "accept"])
def test_opening_version_mismatch_names_both(node, side):
    from kvxfer.wire import PROTOCOL_VERSION as V

    out = node.opening_mismatch(
        {"version": 99} if side == "connect" else {}, {"version": 99} if side == "accept" else {}
    )
    for end, role in (("client", "connect"), ("server", "accept")):
        ours, theirs = (99, V) if role == side else (V, 99)
        assert out[end] == "VersionMismatch", out
        assert out[f"{end}_versions"] == [ours, theirs], out
        assert (
            f"the peer speaks protocol {theirs}, channel mode native, this end protocol {ours}"
            in out[f"{end}_msg"]
        ), out
    assert out["client_s"] < 2.5 and out["server_s"] < 2.5, out
    assert out["accepted"] == 0, out
    _left_nothing(out)


@pytest.mark.parametrize("mode", ["native", "yield"])
def test_opening_same_version_and_mode_pairs(node, mode):
    out = node.opening_same(mode)
    assert out["ok"] and out["modes"] == [mode, mode] and out["dropped"] == 0, out
    assert out["native"] == [mode == "native"] * 2, out
    assert out["saw_close"], out
    _left_nothing(out)


@pytest.mark.parametrize("value", ["keep", "release"])
@pytest.mark.parametrize("mode", ["peer", "none"])
def test_native_calls_keep_the_gil_on_the_own_worker_only(node, mode, value):
    # error_mode "none" (kvxfer's own worker): chains and short PUT batches keep the GIL
    # unless KVXFER_NATIVE_GIL=release; never on UCXX's worker ("peer"); bytes land and the
    # chained notification arrives either way, for a short batch and a long one
    out = node.native_gil(mode, value)
    kept = mode == "none" and value == "keep"
    assert out["transport"] is kept and out["endpoint"] is kept, out
    assert out["payload"] == b"done" and out["landed"], out


@pytest.mark.parametrize("mode", ["peer", "none"])
def test_note_spin_keeps_the_thread_progressing(node, mode):
    # KVXFER_NOTE_SPIN=1: the queue's thread progresses from the start (one spinner, no
    # flush behind it); a chained notification is delivered with its native arrival stamp,
    # which is 0 again outside the delivery; closing the transport stops the thread
    out = node.note_spin(mode)
    assert out["spinning"] == 1, out
    assert out["payload"] == b"done" and out["landed"], out
    assert out["arrival_in_order"] and out["arrival_outside"] == 0.0, out
    assert out["poller_after_close"] is False, out


@pytest.mark.parametrize("inline_yield", ["1", "0"], ids=["yield", "pause"])
def test_spin_linger_keeps_the_own_thread_awake_between_requests(node, inline_yield):
    # KVXFER_SPIN_LINGER_US: after a notification the receiver's own thread keeps
    # progressing for the window instead of sleeping on the event fd, so the next one
    # within it wakes no thread (without a linger it sleeps between the two: once here);
    # once traffic stops and a 1 ms window has passed it sleeps again. Between idle
    # progress calls it yields the CPU where inline waits do (KVXFER_INLINE_YIELD)
    out = node.spin_linger(1e7, inline_yield)
    assert out["setting"] == 1e7 and out["yield"] is (inline_yield == "1"), out
    assert out["first"] == b"done" and out["second"] == b"again" and out["landed"], out
    assert out["sleeps_between"] == 0, out
    assert out["slept_after"] is True, out
    off = node.spin_linger(0)
    assert off["setting"] == 0.0 and off["second"] == b"again" and off["landed"], off


def test_spin_linger_default_and_bad_values(monkeypatch):
    import kvxfer.transport.ucx as u
    from kvxfer.errors import InvalidArgument

    monkeypatch.delenv(u.SPIN_LINGER_ENV, raising=False)
    assert u.spin_linger_us() == u.SPIN_LINGER_US > 0  # on by default, every host
    monkeypatch.setenv(u.SPIN_LINGER_ENV, " ")
    assert u.spin_linger_us() == u.SPIN_LINGER_US
    monkeypatch.setenv(u.SPIN_LINGER_ENV, "250")
    assert u.spin_linger_us() == 250.0
    monkeypatch.setenv(u.SPIN_LINGER_ENV, "0")
    assert u.spin_linger_us() == 0.0
    for bad in ("-1", "soon", "nan", "inf"):
        monkeypatch.setenv(u.SPIN_LINGER_ENV, bad)
        with pytest.raises(InvalidArgument, match="KVXFER_SPIN_LINGER_US"):
            u.spin_linger_us()


def test_set_linger_refuses_bad_values():
    from kvxfer.transport.ucx_lib import load_ucx

    q = load_ucx()[1].CompletionQueue()  # no worker: no own thread to linger
    try:
        with pytest.raises(ValueError, match="own worker"):
            q.set_linger(10.0)
    finally:
        q.close()


PRIME_CHECK = """
import sys, threading
import ucxx
import kvxfer.transport.ucx as u

seen = []
orig = ucxx.init


def init(*a, **k):  # what UCXX's progress thread will find when ucxx.init starts it
    seen.append(("cuda.core" in sys.modules, [t.name for t in threading.enumerate()]))
    return orig(*a, **k)


ucxx.init = init
t = u.UcxTransport()
print(seen)
"""


def test_ucxx_progress_thread_start_work_is_done_before_ucxx_starts_it():
    """The imports UCXX's progress thread starts with (cuda.core and what it loads) are done,
    and the helper that did them has ended, before ``ucxx.init`` starts that thread: they no
    longer load libraries while this process creates its UCP context and worker (a start-up
    SIGSEGV seen there). A fresh interpreter: UCX initialises once per process."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("cuda.core") is None:
        pytest.skip("no cuda.core: UCXX's thread imports nothing here")
    out = subprocess.run(
        [sys.executable, "-c", PRIME_CHECK], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    ((loaded, threads),) = eval(out.stdout.strip().splitlines()[-1])
    assert loaded and "kvxfer-ucxx-prime" not in threads, (loaded, threads)
