"""Coalesced last chunks (kvxfer.disagg.coalesce, issue 15): rooms that finish while their
decode peer's link is busy go as one write with one DoneMany.

Each interleaving is forced: prefill's loop is held at room A's ``before_write`` hook (the
"gate") while the scheduler sends the other rooms — their sends queue behind it on the loop,
so once the gate opens A's write is in flight when each of them is issued (the prefill node
coalesces from one write in flight: ``coalesce_after=1``). Then the same with random timing
from several scheduler threads, with and without decode aborting rooms meanwhile. Every test
ends with both sides released and no byte of a freed item or guard changed."""

import pytest
from pd_harness import FAST, Node, Worker
from testenv import DEVICE

pytestmark = pytest.mark.timeout(120)
K = "hybrid_per_layer"  # pages + a state slot + an aux row per room
NO_LEAKS = {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}


class Pair:
    """A prefill and a decode worker of their own (the stats below count from zero)."""

    def __init__(self):
        from kvxfer.disagg import BootstrapServer

        self.bs = BootstrapServer(port=0).start_in_thread()
        node = dict(kind=K, timeouts=FAST, bootstrap=self.bs.address, device=DEVICE)
        # every write returns through prefill's loop: sends queued there meanwhile find it
        # in flight (waited for inline, a write could be over before they run)
        self.p = Worker({K: dict(node, role="prefill", coalesce_after=1, inline_wait_us=0)})
        self.d = Worker({K: dict(node, role="decode")})
        self.victims = []
        for w in (self.p, self.d):
            w.ready()
        self.rooms = iter(range(7_000_000, 8_000_000, 11))
        self.room(1)  # connect once, so that the tests below start on a live link

    def room(self, n: int, decode=None) -> int:
        """A room of ``n`` pages opened on both sides and sent once it succeeded."""
        r = next(self.rooms)
        (decode or self.d)[K].d_open(r, n)
        self.p[K].p_open(r, n)
        self.p[K].p_send(r, 0, n)
        assert self.p[K].wait(r)["state"] == "Success"
        d = (decode or self.d)[K]
        assert d.wait(r)["state"] == "Success" and d.verify(r) == 0
        return r

    def victim(self) -> Worker:
        w = Worker(
            {
                K: dict(
                    kind=K, role="decode", timeouts=FAST, bootstrap=self.bs.address, device=DEVICE
                )
            }
        )
        self.victims.append(w)
        return w.ready()

    def close(self):
        workers = [self.p, self.d] + self.victims
        for w in workers:
            w.request_exit()
        for w in workers:
            w.close()
        self.bs.stop_thread()


@pytest.fixture(scope="module")
def pair():
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def clean(*nodes):
    for n in nodes:
        assert n.leaks() == NO_LEAKS
        f = n.fence_check()
        assert not (f["pages"] or f["slots"] or f["rows"] or f["guards"]), f


def delta(before: dict, after: dict) -> dict:
    keys = ("coalesced_writes", "coalesced_rooms", "coalesce_refused")
    return {k: after[k] - before[k] for k in keys}


def open_rooms(c: Pair, sizes, decode=None):
    ids = [next(c.rooms) for _ in sizes]
    for r, n in zip(ids, sizes):
        (decode or c.d)[K].d_open(r, n)
        c.p[K].p_open(r, n)
    for r in ids:
        assert c.p[K].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    return ids


def hold_first(c: Pair, a: int, n: int) -> None:
    """Send room ``a`` and hold prefill's loop at its ``before_write`` (gate)."""
    c.p[K].hook_on("before_write", a, "gate")
    c.p[K].p_send(a, 0, n)
    assert c.p[K].wait_fired("before_write", a, entered=True) == [("before_write", a)]


def test_rooms_behind_a_busy_link_go_as_one_write(pair):
    """Four rooms sent while A's write is about to be posted: one coalesced write carries
    them all, every room succeeds on both sides and every byte is where it belongs."""
    c = pair
    before = c.p[K].stats()
    sizes = [2, 1, 3, 2, 1]
    ids = open_rooms(c, sizes)
    hold_first(c, ids[0], sizes[0])
    for r, n in zip(ids[1:], sizes[1:]):
        c.p[K].p_send(r, 0, n)  # queued behind the gate on prefill's loop
    c.p[K].open_gate()
    for r in ids:
        assert c.p[K].wait(r)["state"] == "Success"
        assert c.d[K].wait(r)["state"] == "Success", r
        assert c.d[K].verify(r) == 0, r
    assert delta(before, c.p[K].stats()) == {
        "coalesced_writes": 1,
        "coalesced_rooms": 4,
        "coalesce_refused": 0,
    }
    clean(c.p[K], c.d[K])
    c.room(2)  # the link still works


def test_a_write_that_returned_is_not_counted_in_flight(pair):
    """The next request a scheduler sends as soon as the last one is done finds nothing in
    flight: B's send reaches prefill's loop while A's write has returned but A's room is not
    yet reported done (a hook at ``written`` hands it over there; it runs before A's write's
    future completes). B is written on its own — it used to wait, coalesced, until that
    future's done callback, as if A's write were still in flight."""
    c = pair
    before = c.p[K].stats()
    a, b = open_rooms(c, [1, 1])
    c.p[K].hook_on("written", a, "call", Node.p_send, b, 0, 1)
    c.p[K].p_send(a, 0, 1)
    assert c.p[K].wait_fired("written", a)[-1] == ("done", a)
    for r in (a, b):
        assert c.p[K].wait(r)["state"] == "Success"
        assert c.d[K].wait(r)["state"] == "Success" and c.d[K].verify(r) == 0
    assert delta(before, c.p[K].stats())["coalesced_writes"] == 0
    clean(c.p[K], c.d[K])


def test_room_aborted_while_waiting_is_never_written(pair):
    """Prefill's scheduler aborts C while C's last chunk waits for the coalesced write: C
    leaves the outbox unwritten and fails on both sides; decode's pages of C never change
    (fence_check: freed pages keep their sentinel); B and D still go as one write."""
    c = pair
    before = c.p[K].stats()
    sizes = [1, 2, 2, 2]
    a, b, cc, d = ids = open_rooms(c, sizes)
    hold_first(c, a, 1)
    for r in (b, cc, d):
        c.p[K].p_send(r, 0, 2)
    c.p[K].abort(cc)  # handed to the loop after the three sends
    c.p[K].open_gate()
    res = c.p[K].wait(cc)
    assert res["state"] == "Failed" and res["exc"] == "TransferAborted", res
    res = c.d[K].wait(cc)
    assert res["state"] == "Failed" and res["exc"] == "TransferAborted", res
    for r in (a, b, d):
        assert c.p[K].wait(r)["state"] == "Success"
        assert c.d[K].wait(r)["state"] == "Success" and c.d[K].verify(r) == 0, r
    assert delta(before, c.p[K].stats()) == {
        "coalesced_writes": 1,
        "coalesced_rooms": 2,
        "coalesce_refused": 0,
    }
    assert len(ids) == 4
    clean(c.p[K], c.d[K])


def test_refused_coalesced_write_is_split_per_room(pair):
    """Decode names the same destination pages for B and C (a buggy scheduler): each room
    alone is a valid write, the two together are refused (duplicate destinations) before a
    byte moves — so each room goes on its own and both succeed, as they would have without
    coalescing."""
    c = pair
    before = c.p[K].stats()
    a, b, cc = next(c.rooms), next(c.rooms), next(c.rooms)
    for r in (a, b):
        c.d[K].d_open(r, 2)
    c.d[K].d_open(cc, 2, meta=False)
    c.d[K].d_meta_as(cc, b)  # C's metadata names B's pages
    for r in (a, b, cc):
        c.p[K].p_open(r, 2)
        assert c.p[K].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    hold_first(c, a, 2)
    c.p[K].p_send(b, 0, 2)
    c.p[K].p_send(cc, 0, 2)
    c.p[K].open_gate()
    for r in (a, b, cc):
        assert c.p[K].wait(r)["state"] == "Success", r
        assert c.d[K].wait(r)["state"] == "Success", r
    assert c.d[K].verify(a) == 0
    for r in (b, cc):  # B's pages hold one of the two rooms' bytes: freed unchecked
        c.d[K].verify(r)
    assert delta(before, c.p[K].stats()) == {
        "coalesced_writes": 0,
        "coalesced_rooms": 0,
        "coalesce_refused": 1,
    }
    clean(c.p[K], c.d[K])


def test_decode_killed_while_rooms_wait(pair):
    """Decode dies while three rooms wait behind A's write: every room fails on prefill
    (none hangs to its deadline's end, none is left) and prefill keeps working."""
    c = pair
    v = c.victim()
    sizes = [1, 1, 2, 2]
    ids = open_rooms(c, sizes, decode=v)
    hold_first(c, ids[0], 1)
    for r, n in zip(ids[1:], sizes[1:]):
        c.p[K].p_send(r, 0, n)
    v.kill()
    c.p[K].open_gate()
    states = [c.p[K].wait(r, FAST["heartbeat_timeout_s"] + 5)["state"] for r in ids]
    assert states[1:] == ["Failed"] * 3, states  # A's write may have landed before the kill
    clean(c.p[K])
    c.room(1)


def test_a_polling_schedulers_burst_leaves_its_writes_in_flight(pair):
    """Eight rooms sent back to back by a scheduler that polled them before (not between
    these sends): every room but the first either starts its write without the inline
    flush wait, or waits in the outbox for a coalesced write (kvxfer.disagg.bursts). Sent
    one at a time with a poll before each send, none is a burst. Every byte lands either
    way."""
    c = pair

    def counts():
        s = c.p[K].stats()
        return s["burst_writes"], s["coalesced_rooms"]

    b0, c0 = counts()
    ids = open_rooms(c, [1] * 8)  # polled until WaitingForInput
    for r in ids:
        c.p[K].p_send(r, 0, 1)
    for r in ids:
        assert c.p[K].wait(r)["state"] == "Success"
        assert c.d[K].wait(r)["state"] == "Success" and c.d[K].verify(r) == 0, r
    b1, c1 = counts()
    assert (b1 - b0) + (c1 - c0) == len(ids) - 1, (b1 - b0, c1 - c0)
    for _ in range(4):  # one at a time, polled before its send
        (r,) = open_rooms(c, [1])
        c.p[K].p_send(r, 0, 1)
        assert c.p[K].wait(r)["state"] == "Success"
        assert c.d[K].wait(r)["state"] == "Success" and c.d[K].verify(r) == 0, r
    assert counts()[0] == b1
    clean(c.p[K], c.d[K])


@pytest.mark.parametrize("aborts", [False, True], ids=["sends", "sends+aborts"])
def test_hammer_many_senders(pair, aborts):
    """56 rooms (the pool's state slots bound them) sent whole from four scheduler threads at random pacing (decode aborting
    a random third meanwhile with ``aborts``): every room ends on both sides, each success
    is byte-exact on decode, nothing leaks and no freed byte changes; some rooms went
    coalesced (four threads outrun one link's writes)."""
    import random

    c = pair
    c.p[K].widen(None, 0.0)  # no hook armed: scheduler calls may run direct again
    before = c.p[K].stats()
    rng = random.Random(7 + aborts)
    sizes = [rng.randint(1, 3) for _ in range(56)]
    ids = open_rooms(c, sizes)
    victims = rng.sample(ids, 18) if aborts else []
    if victims:
        c.d[K].start(Node.hammer_abort, victims, 3, 0.0005)
    c.p[K].send_from_threads(list(zip(ids, sizes)), 4, 11, 0.0)
    if victims:
        c.d[K].join()
    p_res = c.p[K].wait_all(ids)
    d_res = c.d[K].wait_all(ids)
    assert not any(k.startswith("Timeout") for k in list(p_res) + list(d_res)), (p_res, d_res)
    ok = [r for r in ids if c.d[K].poll(r) == "Success"]
    if not aborts:
        assert len(ok) == len(ids), d_res
    bad = c.d[K].batch([(Node.verify, r) for r in ok])
    assert sum(bad) == 0, dict(zip(ok, bad))
    assert delta(before, c.p[K].stats())["coalesced_rooms"] > 0
    clean(c.p[K], c.d[K])
