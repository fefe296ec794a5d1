"""Races of the prefill/decode protocol (issue 12, defects 1-4), each interleaving forced with
the manager's test hook (see pd_harness ``hook_on``), then hammered with random timing.

Every test ends with both sides released (no page, slot, aux row or room left) and no byte of
a freed item or guard item changed (``fence_check``): a write that lands after its room's
``on_done`` fails the test even when both sides report a clean outcome."""

import random
import time

import pytest
from pd_harness import FAST, Node

pytestmark = pytest.mark.timeout(120)
K = "hybrid_per_layer"  # pages + a state slot + an aux row per room
NO_LEAKS = {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}


def clean(*pairs):
    for w, n in pairs:
        assert w[n].leaks() == NO_LEAKS, n
        f = w[n].fence_check()
        assert not (f["pages"] or f["slots"] or f["rows"] or f["guards"]), (n, f)


def held_pending(c, r, node=K):
    """Decode's metadata for ``r`` reached prefill before any KVSender: a pending record.
    Bounded at 30 s: at load ~20 a fresh decode worker's lookup, connect and hello can
    take over 10 s (it returns as soon as the record is there)."""
    got = c.p[node].record(r, 30.0)
    assert got == "pending", (r, got)


# ------------------------------------------------------------------ defect 1
# The scheduler creates the KVSender while decode's metadata waits in a 'pending' record that
# is failing. Hook points: "room_failed" (the failure began: the log record, before the record
# is retired), "pending_retired" (just after), "abort_received" (before prefill looks the room
# up). Whichever wins, the KVSender never writes into a destination decode released.
def _race(c, node, point, r, n):
    c.p[node].hook_on(point, r, "call", Node.p_open, r, n)
    return lambda: c.p[node].wait_fired(point, r) == [(point, r), ("done", r)]


@pytest.mark.parametrize("point", ["room_failed", "pending_retired", "abort_received"])
def test_decode_abort_races_sender_creation(cluster, room, point):
    """Decode aborts while prefill holds its metadata and the KVSender is created inside the
    window: the sender fails with TransferAborted whichever wins, and never writes."""
    c, r = cluster, room()
    c.d[K].d_open(r, 3)
    held_pending(c, r)
    fired = _race(c, K, point, r, 3)
    c.d[K].abort(r)
    assert fired()
    c.p[K].p_send(r, 0, 3)  # the scheduler goes on: nothing may be written
    for w in (c.d, c.p):
        res = w[K].wait(r)
        assert res["state"] == "Failed" and res["exc"] == "TransferAborted", res
    clean((c.p, K), (c.d, K))


@pytest.mark.parametrize("point", ["room_failed", "pending_retired"])
def test_pending_expiry_races_sender_creation(cluster, room, point):
    """The pending record's deadline (bootstrap_s) passes as the KVSender is created. Claimed
    first: the sender adopts it (decode was never told) and the room succeeds. Retired first:
    decode was told, so the sender fails at once with TransferTimeout and writes nothing."""
    c, r = cluster, room()
    c.d["tiny"].d_open(r, 2)
    held_pending(c, r, "tiny")
    fired = _race(c, "tiny", point, r, 2)
    assert fired()
    c.p["tiny"].p_send(r, 0, 2)
    d, p = c.d["tiny"].wait(r), c.p["tiny"].wait(r)
    if point == "room_failed":
        assert d["state"] == p["state"] == "Success", (d, p)
        assert c.d["tiny"].verify(r) == 0
    else:
        assert d["state"] == p["state"] == "Failed", (d, p)
        assert d["exc"] == p["exc"] == "TransferTimeout", (d, p)
    clean((c.p, "tiny"), (c.d, "tiny"))


@pytest.mark.parametrize("point", ["room_failed", "pending_retired"])
def test_decode_death_races_sender_creation(cluster, room, point):
    """Decode dies while prefill holds its metadata (defects 3 and 4): a KVSender created as
    the pending record fails, or after it failed, fails at once with the link's cause
    (PeerClosed; never 'pending-expired'), never adopts the dead link and never waits out a
    deadline."""
    c = cluster
    v = c.victim("decode", c.bs["mha"].address)
    a, b = room(), room()
    v["mha"].d_open(a, 2)
    v["mha"].d_open(b, 2)
    held_pending(c, a, "mha")
    held_pending(c, b, "mha")
    fired = _race(c, "mha", point, a, 2)
    t0 = time.monotonic()
    v.kill()
    assert fired()
    assert c.p["mha"].record(b, 10.0, None) is None  # b's pending record failed
    c.p["mha"].p_open(b, 2)
    for r in (a, b):
        c.p["mha"].p_send(r, 0, 2)
        res = c.p["mha"].wait(r, FAST["waiting_s"])
        assert res is not None and res["state"] == "Failed", res
        assert res["exc"] == "PeerClosed" and "expired" not in res["msg"], res
    assert time.monotonic() - t0 < FAST["heartbeat_timeout_s"]
    clean((c.p, "mha"))


def _hammer(c, rooms, seed, widen):
    """Decode opens every room (prefill holds the metadata); then, at once, prefill's
    scheduler creates senders and sends (random order and pacing, see ``hammer_open``)
    while decode aborts half of the rooms (random order and pacing). ``widen``: prefill's
    loop lingers up to that long in 'room_failed', the window of defect 1."""
    rng = random.Random(seed)
    ids = [r for r, _ in rooms]
    c.d[K].batch([(Node.d_open, r, n) for r, n in rooms], timeout=120)
    for r in ids:
        held_pending(c, r)
    c.p[K].widen("room_failed" if widen else None, widen)
    try:
        c.d[K].start(Node.hammer_abort, rng.sample(ids, len(ids) // 2), seed, 0.002)
        c.p[K].start(Node.hammer_open, rooms, seed, 0.002)
        c.p[K].join(timeout=120)
        c.d[K].join(timeout=120)
        d = c.d[K].wait_all(ids, 60.0, timeout=90)
        p = c.p[K].wait_all(ids, 60.0, timeout=90)
    finally:
        c.p[K].widen(None, 0)
    ok = [r for r in ids if c.d[K].poll(r) == "Success"]
    assert sum(c.d[K].batch([(Node.verify, r) for r in ok], timeout=120)) == 0
    # an abort may cross prefill's completion (prefill: Success, decode: Failed); never the
    # other way round
    assert d.get("Success", 0) == len(ok) <= p.get("Success", 0), (d, p)
    assert set(d) - {"Success", "first_failure"} <= {"Failed: TransferAborted"}, d
    assert set(p) - {"Success", "first_failure"} <= {"Failed: TransferAborted"}, p
    clean((c.p, K), (c.d, K))


def _rounds(c, room, rounds, widen):
    """Rounds of 50 rooms (the hybrid node holds 63 state slots)."""
    for i in range(rounds):
        rooms = [(room(), random.Random(i * 1000 + j).randint(1, 4)) for j in range(50)]
        _hammer(c, rooms, i, widen(i))


def test_hammer_abort_vs_sender_creation(cluster, room):
    """Quick variant: 3 x 50 rooms, prefill's 'room_failed' window widened (20 ms)."""
    _rounds(cluster, room, 3, lambda i: 0.02)


def test_hammer_abort_vs_direct_sends(cluster, room):
    """No window widened: prefill's scheduler creates, inits and sends (1-4 pages) mostly
    direct, as a guest of its idle loop (KVManager.call), while decode's aborts arrive."""
    before = cluster.p[K].stats()["direct_calls"]
    _rounds(cluster, room, 2, lambda i: 0.0)
    assert cluster.p[K].stats()["direct_calls"] > before


def test_hammer_direct_sends_from_several_threads_vs_aborts(cluster, room):
    """Four scheduler threads of one prefill manager send 50 opened rooms at once (their
    direct calls race for the loop's gate, and with the calls handed over when it is busy)
    while decode aborts a quarter of them: every room ends, Success byte-exact, nothing
    leaked. Two rounds, more (up to 6) until some sends ran direct: a loaded box keeps the
    loop busy, and a busy loop hands every send over."""
    c = cluster
    direct = 0
    for i in range(6):
        if i >= 2 and direct:
            break
        rooms = [(room(), random.Random(i * 1000 + j).randint(1, 4)) for j in range(50)]
        ids = [r for r, _ in rooms]
        c.d[K].batch([(Node.d_open, r, n) for r, n in rooms], timeout=120)
        for r in ids:
            held_pending(c, r)
        c.p[K].batch([(Node.p_open, r, n) for r, n in rooms], timeout=120)
        c.d[K].start(Node.hammer_abort, random.Random(i).sample(ids, len(ids) // 4), i, 0.002)
        # paced so that the loop (busy with each write and its completion) is idle at times:
        # a busy loop hands the sends over (at a send every ~0.5 ms none ran direct)
        direct += c.p[K].send_from_threads(rooms, 4, i, 0.01)
        c.d[K].join(timeout=120)
        d = c.d[K].wait_all(ids, 60.0, timeout=90)
        p = c.p[K].wait_all(ids, 60.0, timeout=90)
        ok = [r for r in ids if c.d[K].poll(r) == "Success"]
        assert ok, (d, p)
        assert sum(c.d[K].batch([(Node.verify, r) for r in ok], timeout=120)) == 0
        assert d.get("Success", 0) == len(ok) <= p.get("Success", 0), (d, p)
        assert set(d) - {"Success", "first_failure"} <= {"Failed: TransferAborted"}, d
        assert set(p) - {"Success", "first_failure"} <= {"Failed: TransferAborted"}, p
        clean((c.p, K), (c.d, K))
    assert direct > 0  # some sends raced as guests


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_hammer_abort_vs_sender_creation_long(cluster, room):
    """Long variant (``make test-long``): 100 x 50 rooms, every other round widened."""
    _rounds(cluster, room, 100, lambda i: 0.02 if i % 2 == 0 else 0.0)


# ------------------------------------------------------------------ defects 2, 3 and 4
def test_decode_close_fences_writes_in_flight(cluster, room):
    """Defect 2: decode closes gracefully while prefill still sends. Its loop is held right
    after close() failed the rooms (hook "closing") while prefill writes the last chunk:
    decode must not have released the room's pages before prefill's answer (Done, or the
    ack of decode's abort) — not one byte may change after decode's on_done."""
    c = cluster
    v = c.victim("decode", c.bs["mha"].address)
    r = room()
    v["mha"].d_open(r, 4)
    c.p["mha"].p_open(r, 4)
    c.p["mha"].p_send(r, 0, 1)
    assert v["mha"].poll_until(r, ["Transferring"]) == "Transferring"
    v["mha"].hook_on("closing", -1, "gate")
    v["mha"].start(Node.close)
    assert v["mha"].wait_fired("closing", -1, entered=True) == [("closing", -1)]
    c.p["mha"].p_send(r, 1, 4)
    assert c.p["mha"].wait(r)["state"] in ("Success", "Failed")
    v["mha"].open_gate()
    v["mha"].join()
    assert v["mha"].wait(r)["state"] == "Failed"
    clean((v, "mha"), (c.p, "mha"))


def _settled_after_close(c, v, ids, prefill_res):
    """After decode's close(): every decode room ended (close() releases all it failed);
    a room that succeeded on decode (its Done was handled before close() reached it) also
    succeeded on prefill, is byte-exact, and is the scheduler's to free: ``on_done(Success)``
    hands its pages over rather than releasing them, so verify (which frees them) before
    the leak check. Returns the rooms decode accepted."""
    d = v["mha"].wait_all(ids, 0.0)  # no wait: close() returned only once all were released
    assert not any(k.startswith("Timeout") for k in d), d
    assert set(d) - {"Success", "first_failure"} <= {"Failed: Closed"}, d
    ok = [r for r in ids if v["mha"].poll(r) == "Success"]
    assert len(ok) <= prefill_res.get("Success", 0), (d, prefill_res)
    bad = v["mha"].batch([(Node.verify, r) for r in ok])
    assert sum(bad) == 0, dict(zip(ok, bad))
    return ok


def test_decode_close_while_senders_are_created(cluster, room):
    """Decode closes (gracefully) while prefill creates senders for its rooms and sends:
    every prefill room ends at once (fails, or succeeds where its last write crossed
    decode's abort), none waits out transfer_s holding its pages, and nothing lands in
    decode's pages after their release. A room whose Done decode handled before close()
    reached it succeeded there (under load, some do): its pages are the scheduler's, freed
    by its verify, not by close()."""
    c = cluster
    v = c.victim("decode", c.bs["mha"].address)
    ids = [room() for _ in range(40)]
    v["mha"].batch([(Node.d_open, r, 2) for r in ids])
    for r in ids[:5]:
        held_pending(c, r, "mha")
    c.p["mha"].start(
        Node.batch, [x for r in ids for x in ((Node.p_open, r, 2), (Node.p_send, r, 0, 2))]
    )
    v["mha"].close(timeout=60)
    c.p["mha"].join()
    t0 = time.monotonic()
    res = c.p["mha"].wait_all(ids, FAST["transfer_s"])
    assert time.monotonic() - t0 < FAST["transfer_s"] / 2, res
    assert not any(k.startswith("Timeout") for k in res), res
    assert "Failed: TransferTimeout" not in res, res
    _settled_after_close(c, v, ids, res)
    clean((c.p, "mha"), (v, "mha"))


def test_decode_close_after_a_room_succeeded(cluster, room):
    """The interleaving the test above meets under load, forced: one room's Done reaches
    decode before close() does (it succeeded), the others are mid-flight. close() leaves
    the succeeded room alone (no Abort, its on_done already handed the pages to the
    scheduler), fails the others, and releases them; the succeeded room's pages stay held
    until the scheduler frees them, byte-exact."""
    c = cluster
    v = c.victim("decode", c.bs["mha"].address)
    first, *rest = ids = [room() for _ in range(6)]
    v["mha"].batch([(Node.d_open, r, 2) for r in ids])
    c.p["mha"].batch([(Node.p_open, first, 2), (Node.p_send, first, 0, 2)])
    assert v["mha"].wait(first)["state"] == "Success"
    c.p["mha"].batch([(Node.p_open, r, 2) for r in rest])  # nothing sent: mid-flight
    v["mha"].close(timeout=60)
    assert v["mha"].poll(first) == "Success"  # close() did not touch it
    assert v["mha"].leaks() == {"pages": 2 * 4, "slots": 0, "aux": 1, "rooms": 0}
    res = c.p["mha"].wait_all(ids, FAST["transfer_s"])
    # the others fail on decode's Abort (or its close, if the acks outlasted abort_ack_s)
    assert res.get("Success") == 1, res
    assert set(res) - {"Success", "first_failure"} <= {
        "Failed: TransferAborted",
        "Failed: PeerClosed",
    }, res
    assert _settled_after_close(c, v, ids, res) == [first]
    clean((c.p, "mha"), (v, "mha"))


def test_layout_mismatch_reaches_prefill(cluster, room):
    """Decode's layout differs: decode fails with LayoutMismatch and prefill's room fails with
    LayoutMismatch at once (it used to hold its pages until bootstrap_s)."""
    c = cluster
    r, late = room(), room()
    c.p["mha"].p_open(r, 2)
    t0 = time.monotonic()
    c.d["mismatch"].d_open(r, 2)
    res = c.d["mismatch"].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "LayoutMismatch", res
    assert "page_size" in res["msg"] and "8" in res["msg"] and "4" in res["msg"]
    res = c.p["mha"].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "LayoutMismatch", res
    assert time.monotonic() - t0 < FAST["bootstrap_s"] / 2
    c.d["mismatch"].d_open(late, 2)  # refused before the KVSender exists
    assert c.d["mismatch"].wait(late)["exc"] == "LayoutMismatch"
    c.p["mha"].p_open(late, 2)
    res = c.p["mha"].wait(late)
    assert res["state"] == "Failed" and res["exc"] == "LayoutMismatch", res
    clean((c.d, "mismatch"), (c.p, "mha"))
