"""The transport's native receive thread hands what it received to the manager as the loop's
guest (``KVManager.take_natively``, on by default): a Done reaches its room, ``on_done``
included, on that thread with no wake-up of decode's loop. Between two spawned processes
over real UCX loopback.

Forced: decode's loop stops watching its completion queue (``deaf``) while the native take
stays on, and nobody polls: the room still succeeds, on a thread that is neither the loop's
nor the scheduler's. Forced the other way: decode's loop is held busy, so the native thread
cannot take the loop's gate; the Done waits in the queue (polls cannot take it either) and
the loop handles it once released. Hammered: hundreds of rooms in bursts with the native
take on, every byte verified, nothing leaked; and the take switched off and on meanwhile.
Every test runs twice: with the own worker's thread lingering after activity (the default)
and without (``KVXFER_SPIN_LINGER_US=0``).

The native thread takes only while the loop waits for events (else the loop does, woken by
the queue's eventfd, which a deaf loop ignores): the first test makes sure decode's loop is
idle before the Done can arrive (``quiet``: its earlier sends completed) and that no timer
wakes it meanwhile (heartbeats every 30 s here, not FAST's 0.2 s)."""

import itertools

import pytest
from pd_harness import FAST, Node, Worker
from testenv import DEVICE

pytestmark = pytest.mark.timeout(120)

CLEAN = {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}


class Pair:
    """A prefill and a decode node (kind mha) in error mode "none": the transports on
    kvxfer's own worker, whose thread receives the Done (in mode "peer" on host memory,
    UCXX's worker receives it and the loop takes it, as before)."""

    def __init__(self, env=None) -> None:
        from kvxfer.disagg import BootstrapServer

        self.no_linger = bool(env and env.get("KVXFER_SPIN_LINGER_US") == "0")
        self.bs = BootstrapServer(port=0).start_in_thread()
        # (no heartbeat during a test: a loop woken by it could not be the native thread's)
        t = dict(FAST, heartbeat_interval_s=30.0, heartbeat_timeout_s=60.0)
        node = dict(kind="mha", timeouts=t, bootstrap=self.bs.address, error_mode="none")
        self.pw = Worker({"n": dict(node, role="prefill", device=DEVICE)}, env=env)
        self.dw = Worker({"n": dict(node, role="decode", device=DEVICE)}, env=env)
        for w in (self.pw, self.dw):
            w.ready()
        self.p, self.d = self.pw["n"], self.dw["n"]

    def close(self) -> None:
        for w in (self.pw, self.dw):
            w.request_exit()
        for w in (self.pw, self.dw):
            w.close()
        self.bs.stop_thread()


@pytest.fixture(scope="module", params=[None, "0"], ids=["default", "no-linger"])
def pair(request):
    c = Pair(None if request.param is None else {"KVXFER_SPIN_LINGER_US": request.param})
    try:
        yield c
    finally:
        c.close()


_ids = itertools.count(7_000_000, 7)


def _opened(p, d, pages: int) -> int:
    """A fresh room opened on both sides, prefill at WaitingForInput."""
    a = next(_ids)
    d.d_open(a, pages)
    p.p_open(a, pages)
    assert p.poll_until(a, ["WaitingForInput"]) == "WaitingForInput"
    return a


def _clean(p, d) -> None:
    assert d.loop_errors() == [] and p.loop_errors() == []
    for n in (p, d):
        assert n.leaks() == CLEAN


def test_the_native_thread_completes_the_room_without_the_loop(pair):
    p, d = pair.p, pair.d
    a = _opened(p, d, 3)
    takes0 = d.stats()["native_takes"]
    d.deaf(True, keep_native=True)
    try:
        d.quiet()  # idle when the Done arrives: only the native thread can take it
        p.p_send(a, 0, 3)
        res = d.wait(a)  # no poll: only on_done, which the native thread runs
        assert res is not None and res["state"] == "Success", res
        assert res["thread"] not in (d.loop_thread_name(), "MainThread"), res
        assert d.stats()["native_takes"] >= takes0 + 1
        assert d.wait_queued(0, within=0) == 0
    finally:
        d.deaf(False)
    assert p.wait(a) is not None
    assert d.verify(a) == 0
    _clean(p, d)


def test_a_busy_loop_keeps_what_the_native_thread_could_not_take(pair):
    p, d = pair.p, pair.d
    a = _opened(p, d, 2)
    takes0 = d.stats()["native_takes"]
    d.hold_loop(True)  # the loop runs a callback that waits: its gate is held
    try:
        p.p_send(a, 0, 2)
        assert p.poll_until(a, ["Success"]) == "Success"
        assert d.wait_queued(1) >= 1  # the native thread found the gate held: left queued
        assert d.poll(a) in ("WaitingForInput", "Transferring")  # a poll cannot take it either
        assert d.stats()["native_takes"] == takes0
    finally:
        d.hold_loop(False)
    res = d.wait(a)
    assert res is not None and res["state"] == "Success", res
    assert res["thread"] == d.loop_thread_name(), res  # the loop, woken by the eventfd
    assert d.stats()["native_takes"] == takes0
    assert d.verify(a) == 0
    _clean(p, d)


def test_bursts_with_the_native_take_switched_meanwhile(pair):
    p, d = pair.p, pair.d
    takes0 = d.stats()["native_takes"]
    for k in range(4):
        rooms = [next(_ids) for _ in range(100)]
        d.batch([(Node.d_open, r, 1) for r in rooms], timeout=60)
        p.batch([(Node.p_open, r, 1) for r in rooms], timeout=60)
        if k == 2:
            d.start(Node.poll_all_until_done, rooms)  # a polling scheduler takes too
        else:
            d.start(Node.toggle_native_takes, 20)  # switched off and on while they arrive
        p.batch([(Node.p_send, r, 0, 1) for r in rooms], timeout=60)
        d.join()
        assert d.wait_all(rooms, 30.0, timeout=60) == {"Success": len(rooms)}
        assert p.wait_all(rooms, 30.0, timeout=60) == {"Success": len(rooms)}
        assert sum(d.batch([(Node.verify, r) for r in rooms], timeout=60)) == 0
    print(f"native takes: {d.stats()['native_takes'] - takes0}", end=" ")
    assert d.stats()["native_takes"] > takes0
    _clean(p, d)
    # the setting reached both processes' transports (the default: SPIN_LINGER_US)
    from kvxfer.transport.ucx import SPIN_LINGER_US

    for n in (p, d):
        linger = n.spin_linger_us()
        assert linger == (0.0 if pair.no_linger else SPIN_LINGER_US), linger
