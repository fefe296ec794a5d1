"""Abort from each side in each state, and the deadlines of each state: the other side
always learns (Failed), and every page, slot, aux row and room is released on both sides."""

import time

import pytest
from pd_harness import TINY, Node

pytestmark = pytest.mark.timeout(120)
K = "page_major"


def no_leaks(*pairs):
    for w, n in pairs:
        assert w[n].leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}, n


def _to_state(c, r, side, state, node=K):
    """Drive room ``r`` until ``side`` is in ``state``; returns nothing."""
    if side == "decode":
        if state == "Bootstrapping":
            c.p[node].p_open(r, 4)
            c.d[node].d_open(r, 4, meta=False, init=False)
            return
        c.p[node].p_open(r, 4)
        c.d[node].d_open(r, 4)
        assert c.d[node].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
        assert c.p[node].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
        if state == "Transferring":
            c.p[node].p_send(r, 0, 2)
            assert c.d[node].poll_until(r, ["Transferring"]) == "Transferring"
    else:
        c.p[node].p_open(r, 4)
        if state == "Bootstrapping":
            return
        c.d[node].d_open(r, 4)
        assert c.p[node].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
        if state == "Transferring":
            c.p[node].p_send(r, 0, 2)
            assert c.p[node].poll_until(r, ["Transferring"]) == "Transferring"


@pytest.mark.parametrize("state", ["Bootstrapping", "WaitingForInput", "Transferring"])
@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_abort_reaches_the_other_side(cluster, room, side, state):
    c = cluster
    r = room()
    _to_state(c, r, side, state)
    me, other = (c.d, c.p) if side == "decode" else (c.p, c.d)
    assert me[K].poll(r) == state
    me[K].abort(r)
    res = me[K].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TransferAborted", res
    if side == "prefill" and state == "Bootstrapping":
        c.d[K].d_open(r, 4)  # decode comes late: told at once
    res = other[K].wait(r)
    assert res["state"] == "Failed", res
    assert res["exc"] in ("TransferAborted", "UnknownRoom"), res
    no_leaks((c.p, K), (c.d, K))


def test_decode_abort_during_bootstrap_lookup(cluster, room):
    """init() ran, the lookup/connection is in progress: prefill still hears of the abort."""
    c = cluster
    r = room()
    c.p[K].p_open(r, 2)
    c.d[K].batch([(Node.d_open, r, 2, True, False), (Node.abort, r)])
    assert c.d[K].wait(r)["state"] == "Failed"
    res = c.p[K].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TransferAborted", res
    no_leaks((c.p, K), (c.d, K))


def _timed_wait(w, node, r):
    t0 = time.monotonic()
    res = w[node].wait(r)
    return res, time.monotonic() - t0


SLACK = 3.0  # loaded 2-core CI machines


def test_deadline_prefill_bootstrapping(cluster, room):
    c, r = cluster, room()
    c.p["tiny"].p_open(r, 1)  # decode never shows up
    res, dt = _timed_wait(c.p, "tiny", r)
    assert res["state"] == "Failed" and res["exc"] == "TransferTimeout", res
    assert "Bootstrapping" in res["msg"] and dt < TINY["bootstrap_s"] + SLACK
    no_leaks((c.p, "tiny"))


def test_deadline_decode_bootstrapping(cluster, room):
    """No prefill ever registers at this bootstrap server."""
    from kvxfer.disagg import BootstrapServer

    c, r = cluster, room()
    empty = BootstrapServer(port=0).start_in_thread()
    try:
        c.d["tiny"].d_open(r, 1, addr=empty.address)
        res, dt = _timed_wait(c.d, "tiny", r)
    finally:
        empty.stop_thread()
    assert res["state"] == "Failed" and res["exc"] == "TransferTimeout", res
    assert dt < TINY["bootstrap_s"] + SLACK
    no_leaks((c.d, "tiny"))


def test_deadline_waiting_for_input(cluster, room):
    """Both sides connected, prefill never computes/sends: both fail, both release."""
    c, r = cluster, room()
    c.p["tiny"].p_open(r, 2)
    c.d["tiny"].d_open(r, 2)
    assert c.p["tiny"].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    res, dt = _timed_wait(c.p, "tiny", r)
    assert res["state"] == "Failed" and res["exc"] == "TransferTimeout", res
    assert "WaitingForInput" in res["msg"] and dt < TINY["waiting_s"] + SLACK
    res = c.d["tiny"].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TransferTimeout", res
    no_leaks((c.p, "tiny"), (c.d, "tiny"))


def test_deadline_transferring(cluster, room):
    """A chunk went out, the rest never comes: the lease runs out on both sides."""
    c, r = cluster, room()
    c.p["tiny"].p_open(r, 2)
    c.d["tiny"].d_open(r, 2)
    c.p["tiny"].p_send(r, 0, 1)
    assert c.d["tiny"].poll_until(r, ["Transferring"]) == "Transferring"
    res, dt = _timed_wait(c.p, "tiny", r)
    assert res["state"] == "Failed" and res["exc"] == "TransferTimeout", res
    assert "Transferring" in res["msg"] and dt < TINY["transfer_s"] + SLACK
    res = c.d["tiny"].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TransferTimeout", res
    no_leaks((c.p, "tiny"), (c.d, "tiny"))


def test_decode_metadata_without_sender_expires(cluster, room):
    """Decode's metadata for a room prefill never creates: held, then refused on deadline."""
    c, r = cluster, room()
    c.d["tiny"].d_open(r, 1)
    res = c.d["tiny"].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TransferTimeout", res
    no_leaks((c.p, "tiny"), (c.d, "tiny"))
