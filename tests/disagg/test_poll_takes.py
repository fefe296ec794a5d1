"""``poll()`` takes what already arrived (``KVManager.take_arrived``): a scheduler polling a
room sees its Done handled on its own thread, as the loop's guest, without waiting for the
loop thread to wake. Between two spawned processes over real UCX loopback.

Forced: decode's loop stops watching its completion queue (``deaf``), so the Done waits
there; a poll with the take off sees nothing, the first poll with it on sees Success.
Hammered: a scheduler polling hundreds of rooms back to back while the loop handles the same
queue; every byte verified, nothing leaked. And polls racing the manager's close."""

import pytest
from pd_harness import Node

pytestmark = pytest.mark.timeout(120)

KIND = "mha"


def test_poll_takes_the_done_the_loop_did_not_handle(cluster, room):
    c = cluster
    p, d = c.p[KIND], c.d[KIND]
    a = room()
    d.d_open(a, 3)
    p.p_open(a, 3)
    assert p.poll_until(a, ["WaitingForInput"]) == "WaitingForInput"
    takes0 = d.stats()["poll_takes"]
    d.set_poll_takes(False)
    d.deaf(True)
    try:
        p.p_send(a, 0, 3)
        assert p.poll_until(a, ["Success"]) == "Success"
        assert d.wait_queued(1) >= 1  # the Done reached decode's queue; nobody handled it
        before = d.poll(a)
        assert before in ("WaitingForInput", "Transferring"), before
        assert d.stats()["poll_takes"] == takes0
        d.set_poll_takes(True)
        assert d.poll(a) == "Success"  # this very poll handled it
        assert d.stats()["poll_takes"] == takes0 + 1
        assert d.wait_queued(0, within=0) == 0
    finally:
        d.deaf(False)
        d.set_poll_takes(True)
    assert d.wait(a) is not None and p.wait(a) is not None
    assert d.verify(a) == 0
    assert d.loop_errors() == [] and p.loop_errors() == []
    for n in (p, d):
        assert n.leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}


def test_a_polling_scheduler_and_the_loop_share_the_queue(cluster, room):
    c = cluster
    p, d = c.p["many"], c.d["many"]
    takes0 = d.stats()["poll_takes"]
    for _ in range(3):
        rooms = [room() for _ in range(300)]
        d.batch([(Node.d_open, r, 1) for r in rooms], timeout=60)
        p.batch([(Node.p_open, r, 1) for r in rooms], timeout=60)
        d.start(Node.poll_all_until_done, rooms)  # polls on decode's own thread meanwhile
        p.batch([(Node.p_send, r, 0, 1) for r in rooms], timeout=60)
        states = d.join()
        assert set(states.values()) == {"Success"}, states
        assert d.wait_all(rooms, 30.0, timeout=60) == {"Success": len(rooms)}
        assert p.wait_all(rooms, 30.0, timeout=60) == {"Success": len(rooms)}
        assert sum(d.batch([(Node.verify, r) for r in rooms], timeout=60)) == 0
    print(f"polls that took: {d.stats()['poll_takes'] - takes0}", end=" ")
    assert d.loop_errors() == [] and p.loop_errors() == []
    for n in (p, d):
        assert n.leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}


def test_polls_while_the_manager_closes(cluster, room):
    """A scheduler polling back to back (taking arrivals) while its manager closes: every
    poll returns, no exception reaches the polling thread, every room ends terminal on both
    sides and prefill keeps nothing."""
    c = cluster
    v = c.victim("decode", c.bs["mha"].address)
    p = c.p["mha"]
    rooms = [room() for _ in range(20)]
    for r in rooms:
        v["mha"].d_open(r, 2)
        p.p_open(r, 2)
    for r in rooms:
        assert p.poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    v["mha"].start(Node.poll_all_until_done, rooms)
    for r in rooms[:10]:
        p.p_send(r, 0, 2)
    v["mha"].close()
    states = v["mha"].join()
    assert set(states.values()) <= {"Success", "Failed"}, states
    assert all(states[r] == "Failed" for r in rooms[10:]), states  # never sent: Closed
    for r in rooms:
        assert p.wait(r) is not None, r
    assert p.loop_errors() == []
    assert p.leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}
