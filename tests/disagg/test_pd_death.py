"""A peer process SIGKILLed while rooms sit in each state: the survivor fails every affected
room within its deadline and returns every page, slot, aux row and room; it keeps working."""

import time

import pytest
from pd_harness import FAST, TINY

pytestmark = pytest.mark.timeout(120)
SLACK = 4.0


def no_leaks(w, n):
    assert w[n].leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}, n


def wait_failed(w, node, r, within):
    t0 = time.monotonic()
    res = w[node].wait(r, within + SLACK)
    assert res is not None, f"room {r} not released within {within + SLACK}s"
    assert res["state"] == "Failed", res
    assert time.monotonic() - t0 < within + SLACK
    return res


def test_prefill_killed_in_each_decode_state(cluster, room):
    c = cluster
    addr = c.bs["victim"].address
    v = c.victim("prefill", addr)
    W, T, B = room(), room(), room()
    c.d["mha"].d_open(W, 3, addr=addr)
    v["mha"].p_open(W, 3)
    c.d["mha"].d_open(T, 3, addr=addr)
    v["mha"].p_open(T, 3)
    v["mha"].p_send(T, 0, 1)
    assert c.d["mha"].poll_until(W, ["WaitingForInput"]) == "WaitingForInput"
    assert c.d["mha"].poll_until(T, ["Transferring"]) == "Transferring"
    v.kill()
    c.d["mha"].d_open(B, 3, addr=addr)  # bootstraps towards the dead rank's entry
    for r in (W, T):
        res = wait_failed(c.d, "mha", r, FAST["heartbeat_timeout_s"])
        assert res["exc"] in ("PeerClosed", "TransferTimeout"), res
    wait_failed(c.d, "mha", B, FAST["bootstrap_s"])
    no_leaks(c.d, "mha")
    ok = room()  # the survivor still works
    c.d["mha"].d_open(ok, 2)
    c.p["mha"].p_open(ok, 2)
    c.p["mha"].p_send(ok, 0, 2)
    assert c.d["mha"].wait(ok)["state"] == "Success" and c.d["mha"].verify(ok) == 0
    assert c.p["mha"].wait(ok)["state"] == "Success"


def test_decode_killed_in_each_prefill_state(cluster, room):
    c = cluster
    v = c.victim("decode", c.bs["mha"].address)
    B, W, T = room(), room(), room()
    c.p["mha"].p_open(W, 3)
    v["mha"].d_open(W, 3)
    c.p["mha"].p_open(T, 3)
    v["mha"].d_open(T, 3)
    assert c.p["mha"].poll_until(W, ["WaitingForInput"]) == "WaitingForInput"
    assert c.p["mha"].poll_until(T, ["WaitingForInput"]) == "WaitingForInput"
    c.p["mha"].p_send(T, 0, 1)
    assert v["mha"].poll_until(T, ["Transferring"]) == "Transferring"
    # B last, right before the kill: "tiny" has a 1.5 s Bootstrapping deadline, which the
    # steps above can outlast on a loaded machine
    c.p["tiny"].p_open(B, 3)
    v["mha"].d_open(B, 3, meta=False, addr=c.bs["tiny"].address)  # connected, no metadata
    assert c.p["tiny"].poll(B) == "Bootstrapping"
    assert c.p["mha"].poll(T) == "Transferring"
    v.kill()
    for r in (W, T):
        res = wait_failed(c.p, "mha", r, FAST["heartbeat_timeout_s"])
        assert res["exc"] in ("PeerClosed", "TransferTimeout"), res
    res = wait_failed(c.p, "tiny", B, TINY["bootstrap_s"])
    assert res["exc"] == "TransferTimeout", res
    no_leaks(c.p, "mha")
    no_leaks(c.p, "tiny")
    ok = room()
    c.d["mha"].d_open(ok, 2)
    c.p["mha"].p_open(ok, 2)
    c.p["mha"].p_send(ok, 0, 2)
    assert c.d["mha"].wait(ok)["state"] == "Success" and c.d["mha"].verify(ok) == 0
    assert c.p["mha"].wait(ok)["state"] == "Success"
