"""The PD protocol end to end between two spawned processes over real UCX loopback, for every
pool kind: chunked and unchunked transfers, op counts, concurrency, validation, duplicates,
layout mismatch, room-id mismatch and unknown rooms. Every test ends with no leaked page,
state slot, aux row or room on either side."""

import random
import time

import pytest
from pd_harness import KINDS, Node

from kvxfer.errors import RemoteError

pytestmark = pytest.mark.timeout(120)


def no_leaks(c, *nodes):
    for w, n in nodes:
        assert w[n].leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}, (w, n)


def runs(src, dst):
    """Runs contiguous on both sides (what the engine merges into one op per descriptor)."""
    return sum(
        1 for i in range(len(src)) if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1
    )


def expected_ops(c, node, rooms):
    """``rooms``: {room: chunk bounds}; runs never cross a chunk (one write per chunk)."""
    g = c.p[node].geometry()
    ops = 0
    for room, bounds in rooms.items():
        s, d = c.p[node].ids(room)["pages"], c.d[node].ids(room)["pages"]
        for lo, hi in zip(bounds, bounds[1:]):
            ops += runs(s[lo:hi], d[lo:hi]) * g["kv_entries"]
        ops += g["state_entries"] + 1  # state slot + aux row
    return ops


@pytest.mark.parametrize("kind", KINDS)
def test_full_flow(cluster, room, kind):
    c = cluster
    a, b = room(), room()
    ops0 = c.p[kind].stats()["ops"]
    direct0 = c.p[kind].stats()["direct_calls"]
    # room a: decode first (prefill holds its metadata until the KVSender exists), 3 chunks
    c.d[kind].d_open(a, 7)
    c.p[kind].p_open(a, 7)
    assert c.p[kind].poll_until(a, ["WaitingForInput"]) == "WaitingForInput"
    c.p[kind].p_send(a, 0, 2)
    assert c.d[kind].poll_until(a, ["Transferring"]) == "Transferring"
    c.p[kind].p_send(a, 2, 5)
    c.p[kind].p_send(a, 5, 7)
    # room b: prefill first and sends before decode exists (chunks queue), one chunk
    c.p[kind].p_open(b, 3)
    c.p[kind].p_send(b, 0, 3)
    assert c.p[kind].poll(b) == "Bootstrapping"
    c.d[kind].d_open(b, 3)
    for r in (a, b):
        assert c.d[kind].wait(r)["state"] == "Success"
        assert c.p[kind].wait(r)["state"] == "Success"
        assert c.d[kind].verify(r) == 0
    assert c.p[kind].stats()["ops"] - ops0 == expected_ops(c, kind, {a: [0, 2, 5, 7], b: [0, 3]})
    # the scheduler's small steps (8 here: two adoptions and inits, four sends) run direct
    # while prefill's loop is idle; a step that finds it busy is handed over (so: not all)
    assert c.p[kind].stats()["direct_calls"] > direct0
    no_leaks(c, (c.p, kind), (c.d, kind))


def test_page_major_moves_one_op_per_run(cluster, room):
    """Same request shape: page-major issues 1 op per run, per-layer 2*L (=4) per run."""
    c = cluster
    per_run = {}
    for kind in ("mha", "page_major"):
        r = room()
        ops0 = c.p[kind].stats()["ops"]
        c.d[kind].d_open(r, 8)
        c.p[kind].p_open(r, 8)
        c.p[kind].p_send(r, 0, 8)
        assert c.d[kind].wait(r)["state"] == "Success" and c.d[kind].verify(r) == 0
        assert c.p[kind].wait(r)["state"] == "Success"
        n_runs = runs(c.p[kind].ids(r)["pages"], c.d[kind].ids(r)["pages"])
        per_run[kind] = (c.p[kind].stats()["ops"] - ops0 - 1) / n_runs
    assert per_run == {"mha": 4, "page_major": 1}


@pytest.mark.parametrize("kind", ["hybrid_envelope", "mla"])
def test_concurrent_rooms_random_chunks(cluster, room, kind):
    c = cluster
    rng = random.Random(7)
    rooms = [(room(), rng.randint(1, 9)) for _ in range(40)]
    c.d[kind].batch([(Node.d_open, r, n) for r, n in rooms[::2]])
    calls = []
    for r, n in rooms:
        calls.append((Node.p_open, r, n))
        cuts = (
            sorted(set(rng.sample(range(1, n), k=min(n - 1, rng.randint(0, 3))))) if n > 1 else []
        )
        bounds = [0] + cuts + [n]
        calls += [(Node.p_send, r, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    c.p[kind].batch(calls)
    c.d[kind].batch([(Node.d_open, r, n) for r, n in rooms[1::2]])
    ids = [r for r, _ in rooms]
    assert c.d[kind].wait_all(ids) == {"Success": len(ids)}
    assert c.p[kind].wait_all(ids) == {"Success": len(ids)}
    assert sum(c.d[kind].batch([(Node.verify, r) for r in ids])) == 0
    no_leaks(c, (c.p, kind), (c.d, kind))


def test_thousands_of_rooms_in_flight(cluster, room):
    c = cluster
    ids = [room() for _ in range(1000)]
    t0 = time.perf_counter()
    c.d["many"].batch([(Node.d_open, r, 1) for r in ids], timeout=120)
    t1 = time.perf_counter()
    c.p["many"].batch([(Node.p_open, r, 1) for r in ids], timeout=120)
    t2 = time.perf_counter()
    c.p["many"].batch([(Node.p_send, r, 0, 1) for r in ids], timeout=120)
    t3 = time.perf_counter()
    print(
        f"{len(ids)} rooms: d_open {t1 - t0:.2f}s p_open {t2 - t1:.2f}s p_send {t3 - t2:.2f}s",
        end=" ",
    )
    assert c.d["many"].wait_all(ids, 90.0, timeout=120) == {"Success": len(ids)}
    assert c.p["many"].wait_all(ids, 90.0, timeout=120) == {"Success": len(ids)}
    print(f"all done {time.perf_counter() - t3:.2f}s after the last send")
    assert sum(c.d["many"].batch([(Node.verify, r) for r in ids], timeout=120)) == 0
    no_leaks(c, (c.p, "many"), (c.d, "many"))


def test_room_id_mismatch_is_detected(cluster, room):
    """Prefill stamps another room's id into the aux row: decode must fail, not accept."""
    c, kind = cluster, "page_major"
    r, other = room(), room()
    c.d[kind].d_open(r, 2)
    c.p[kind].p_open(r, 2)
    c.p[kind].p_send(r, 0, 2, stamp_room=other)
    res = c.d[kind].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "RoomMismatch", res
    assert f"room {other}" in res["msg"]
    assert c.p[kind].wait(r)["state"] == "Success"
    no_leaks(c, (c.p, kind), (c.d, kind))


def test_bad_indices_rejected_nothing_sent(cluster, room):
    c, kind = cluster, "hybrid_per_layer"
    r = room()
    c.d[kind].d_open(r, 2, meta=False)
    ids = c.d[kind].ids(r)
    bad_cases = [
        (([ids["pages"][0], 10**6], ids["row"], [ids["slot"]]), "IndexOutOfRange", "1000000"),
        (([ids["pages"][0], -3], ids["row"], [ids["slot"]]), "IndexOutOfRange", "-3"),
        (
            (ids["pages"] + ids["pages"][:1], ids["row"], [ids["slot"]]),
            "InvalidArgument",
            f"id {ids['pages'][0]} appears more than once",
        ),
        ((ids["pages"], 99999, [ids["slot"]]), "IndexOutOfRange", "99999"),
        ((ids["pages"], ids["row"], [4242]), "IndexOutOfRange", "4242"),
        (([0.5, 1.5], ids["row"], None), "InvalidArgument", "integers"),
    ]
    for args, kind_, text in bad_cases:
        with pytest.raises(RemoteError) as ei:
            c.d[kind].d_meta_raw(r, *args)
        assert ei.value.kind == kind_ and text in ei.value.msg, ei.value
    assert c.d[kind].poll(r) in ("Bootstrapping", "WaitingForInput")
    c.p[kind].p_open(r, 2)
    p_ids = c.p[kind].ids(r)
    for args, kind_, text in [
        (([p_ids["pages"][0], 77777],), "IndexOutOfRange", "77777"),
        ((p_ids["pages"] + [0],), "IndexOutOfRange", "chunk ends at page 3"),
        ((p_ids["pages"][:1], [p_ids["slot"]]), "InvalidArgument", "last chunk"),
        ((p_ids["pages"], [5555]), "IndexOutOfRange", "5555"),
    ]:
        with pytest.raises(RemoteError) as ei:
            c.p[kind].p_send_raw(r, *args)
        assert ei.value.kind == kind_ and text in ei.value.msg, ei.value
    c.d[kind].d_meta(r)  # the good calls still work
    c.p[kind].p_send(r, 0, 2)
    assert c.d[kind].wait(r)["state"] == "Success" and c.d[kind].verify(r) == 0
    assert c.p[kind].wait(r)["state"] == "Success"
    no_leaks(c, (c.p, kind), (c.d, kind))


def test_duplicate_rooms(cluster, room):
    c, kind = cluster, "mha"
    r = room()
    c.d[kind].d_open(r, 1)
    c.p[kind].p_open(r, 1)
    for w in (c.p, c.d):
        with pytest.raises(RemoteError) as ei:
            w[kind].new_handle(r)
        assert ei.value.kind == "DuplicateRoom" and str(r) in ei.value.msg
    c.p[kind].p_send(r, 0, 1)
    assert c.d[kind].wait(r)["state"] == "Success" and c.d[kind].verify(r) == 0
    assert c.p[kind].wait(r)["state"] == "Success"
    for w in (c.p, c.d):  # a cleared room never comes back
        with pytest.raises(RemoteError) as ei:
            w[kind].new_handle(r)
        assert ei.value.kind == "DuplicateRoom" and "already used" in ei.value.msg
    # a second decode (another manager) sending metadata for the same live room is refused
    r2 = room()
    c.p["tiny"].p_open(r2, 1)
    c.d["tiny"].d_open(r2, 1)
    assert c.p["tiny"].poll_until(r2, ["WaitingForInput"]) == "WaitingForInput"
    c.d["mha"].d_open(r2, 1, addr=c.bs["tiny"].address)
    res = c.d["mha"].wait(r2)
    assert res["state"] == "Failed" and res["exc"] == "DuplicateRoom", res
    c.p["tiny"].p_send(r2, 0, 1)
    assert c.d["tiny"].wait(r2)["state"] == "Success" and c.d["tiny"].verify(r2) == 0
    assert c.p["tiny"].wait(r2)["state"] == "Success"
    no_leaks(c, (c.p, kind), (c.d, kind), (c.p, "tiny"), (c.d, "tiny"))


def test_unknown_room_after_clear(cluster, room):
    """Metadata for a room prefill already finished is answered with UnknownRoom."""
    c = cluster
    r = room()
    c.d["tiny"].d_open(r, 1)
    c.p["tiny"].p_open(r, 1)
    c.p["tiny"].p_send(r, 0, 1)
    assert c.p["tiny"].wait(r)["state"] == "Success"
    assert c.d["tiny"].wait(r)["state"] == "Success" and c.d["tiny"].verify(r) == 0
    c.d["mha"].d_open(r, 1, addr=c.bs["tiny"].address)
    res = c.d["mha"].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "UnknownRoom" and str(r) in res["msg"]
    no_leaks(c, (c.p, "tiny"), (c.d, "tiny"), (c.d, "mha"))


def test_layout_mismatch_is_refused(cluster, room):
    c = cluster
    r = room()
    c.d["mismatch"].d_open(r, 2)
    res = c.d["mismatch"].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "LayoutMismatch", res
    assert "page_size" in res["msg"] and "8" in res["msg"] and "4" in res["msg"]
    no_leaks(c, (c.d, "mismatch"), (c.p, "mha"))
