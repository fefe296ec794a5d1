"""Multi-process engine tests over real UCX on loopback (spawn children, port 0).

Processes: A (target, module scope), B (initiator engines, module scope), C (a second
peer, module scope) and V (a victim killed mid-transfer, one test). Every engine is a
kvxfer.sync.SyncEngine inside kvxfer.bench.engine_node.EngineNode; buffers are numpy host
memory, or torch CUDA memory when KVXFER_TEST_DEVICE=cuda (the same tests on the GPU machine).
"""

import time

import numpy as np
import pytest
from testenv import DEVICE

from kvxfer import plan
from kvxfer.bench.engine_node import EngineNode
from kvxfer.procs import Worker, post

pytestmark = pytest.mark.timeout(90)

FAST_LANES = ("cuda_ipc",) if DEVICE == "cuda" else ("cma",)

SECRET = b"test-secret"
L = 3  # layers -> 2*L per-layer descriptors
ITEM = 256  # bytes per page per descriptor
A_ITEMS, B_ITEMS = 64, 48  # pools are sized independently on each side
BIG_ITEM, BIG_ITEMS = 1 << 20, 16


def groups(items, item=ITEM, big=False):
    g = {
        "kv": {"item_lens": [item] * (2 * L), "items": items, "contiguous": True},
        "pm": {"item_lens": [2 * L * item], "items": items},
        "state": {"item_lens": [96, 32], "items": 8},
    }
    if big:
        g["big"] = {"item_lens": [BIG_ITEM], "items": BIG_ITEMS}
    return g


def eng(config, groups_):
    return {"config": config, "groups": groups_, "device": DEVICE}


def cfg(name, mode="peer", secret=SECRET, **kw):
    kw.setdefault("device_min_ops", 1)  # on CUDA every write of the default engines takes the lane
    return dict(
        secret=secret,
        name=name,
        error_mode=mode,
        connect_timeout_s=10.0,
        transfer_timeout_s=10.0,
        **kw,
    )


def _port(w: Worker) -> int:
    """Start ``w`` (an EngineNode worker); its "main" engine's port."""
    return w.start().proxy(EngineNode).ports()["main"]


@pytest.fixture(scope="module")
def nodes():
    a = Worker(EngineNode, {"engines": {"main": eng(cfg("A"), groups(A_ITEMS))}}, name="A")
    b = Worker(
        EngineNode,
        {
            "engines": {
                "main": eng(cfg("B"), groups(B_ITEMS, big=True)),
                # UCX-only engines (device_copy="off"): on CUDA they keep the cuda_ipc PUT path tested
                "fast": eng(
                    cfg("B-fast", mode="none", device_copy="off"), groups(B_ITEMS, big=True)
                ),
                "spin": eng(
                    cfg("B-spin", flush_progress="spin", device_copy="off"),
                    groups(B_ITEMS, big=True),
                ),
                "badsecret": eng(cfg("B-bad", secret=b"wrong"), groups(B_ITEMS)),
                "badlayout": eng(cfg("B-layout"), groups(B_ITEMS, item=128)),
            }
        },
        name="B",
    )
    c = Worker(EngineNode, {"engines": {"main": eng(cfg("C"), groups(B_ITEMS))}}, name="C")
    try:
        ports = {"A": _port(a)}
        b.start()
        c.start()
        pid = b.proxy(EngineNode).connect("main", "127.0.0.1", ports["A"])
        assert "ok" in pid, pid
        yield {
            "A": a.proxy(EngineNode),
            "B": b.proxy(EngineNode),
            "C": c.proxy(EngineNode),
            "ports": ports,
            "B->A": pid["ok"],
        }
    finally:
        for w in (b, c, a):  # initiators first: their endpoints point at A
            w.close()


def _check_write(nodes, group, src, dst, peer="B->A", node="B", seed=1):
    a, b = nodes["A"], nodes[node]
    b.fill("main", group, seed)
    a.zero("main", group)
    res = b.write("main", nodes[peer], [(group, src, dst)], b"done-" + group.encode())
    assert "ok" in res, res
    msgs = a.messages("main", 1, 10.0)
    assert [p for _, p in msgs] == [b"done-" + group.encode()]
    assert a.items("main", group, dst) == b.items("main", group, src)
    untouched = sorted(set(range(A_ITEMS if group != "state" else 8)) - set(dst))
    if untouched:
        assert not any(a.items("main", group, untouched)), "bytes outside dst written"
    return res["ok"]


@pytest.mark.parametrize("group", ["kv", "pm"])
def test_random_pages_byte_exact(nodes, group):
    rng = np.random.default_rng(7)
    n = 30
    src = rng.choice(B_ITEMS, n, replace=False)
    # half contiguous runs, half scattered
    dst = np.concatenate(
        [np.arange(10, 10 + n // 2), rng.choice(np.arange(40, A_ITEMS), n - n // 2, replace=False)]
    )
    src[: n // 2] = np.arange(3, 3 + n // 2)
    stats = _check_write(nodes, group, src.tolist(), dst.tolist())
    runs = len(plan.merge_runs(src.astype(np.int64), dst.astype(np.int64))[0])
    descs = 2 * L if group == "kv" else 1
    assert stats["ops"] == runs * descs
    assert stats["bytes"] == n * 2 * L * ITEM
    assert stats["lanes"], "lanes must be reported"
    if DEVICE == "cuda":  # peer error handling keeps CUDA IPC
        assert any(lane.startswith("cuda_ipc") for lane in stats["lanes"]), stats["lanes"]
        # same host, CUDA on both sides: every run went over the device lane (one launch)
        assert stats["device_bytes"] == stats["bytes"] and stats["device_ops"] == stats["ops"], (
            stats["device_lane"]
        )
    else:
        assert stats["device_bytes"] == 0


def test_page_major_needs_2L_fewer_ops(nodes):
    ids = list(range(0, 40, 2))  # 20 single-page runs
    kv = _check_write(nodes, "kv", ids, ids)
    pm = _check_write(nodes, "pm", ids, ids)
    assert kv["ops"] == 2 * L * pm["ops"] == 2 * L * 20


def test_state_group(nodes):
    _check_write(nodes, "state", [0, 5, 7], [7, 1, 2])


def test_raw_form(nodes):
    a, b = nodes["A"], nodes["B"]
    b.fill("main", "kv", 21)
    a.zero("main", "kv")
    # descriptor 4 (layer 2, K): 1000 bytes from offset 77 to offset 5000
    res = b.write("main", nodes["B->A"], [("kv", 77, 5000, 1000, 4)], b"raw")
    assert "ok" in res and res["ok"]["ops"] == 1, res
    assert a.messages("main", 1, 10.0)[0][1] == b"raw"
    assert a.bytes("main", "kv", 4, 5000, 1000) == b.bytes("main", "kv", 4, 77, 1000)
    assert sum(a.checksum("main", "kv")) == sum(a.bytes("main", "kv", 4, 5000, 1000))
    too_far = b.write("main", nodes["B->A"], [("kv", 0, A_ITEMS * ITEM - 10, 11, 0)])
    assert too_far.get("error") == "IndexOutOfRange", too_far


def test_registrations_merged(nodes):
    # kv's 6 descriptors are carved from one buffer -> one registration; pm, state separate
    assert nodes["A"].registrations("main") <= 1 + 1 + 2


def test_many_transfers_in_flight(nodes):
    a, b = nodes["A"], nodes["B"]
    b.fill("main", "kv", 3)
    a.zero("main", "kv")
    batches = [([("kv", [i], [A_ITEMS - 1 - i])], b"n%d" % i) for i in range(24)]
    res = b.write_many("main", nodes["B->A"], batches)
    assert all("ok" in r for r in res), res
    msgs = a.messages("main", 24, 10.0)
    # each notify leaves when its own flush completes: all arrive, in completion order
    assert sorted(p for _, p in msgs) == sorted(b"n%d" % i for i in range(24))
    src, dst = list(range(24)), [A_ITEMS - 1 - i for i in range(24)]
    assert a.items("main", "kv", dst) == b.items("main", "kv", src)


def test_two_peers_at_once(nodes):
    a, b, c = nodes["A"], nodes["B"], nodes["C"]
    pid = c.connect("main", "127.0.0.1", nodes["ports"]["A"])["ok"]
    b.fill("main", "pm", 11)
    c.fill("main", "pm", 12)
    a.zero("main", "pm")
    b_batches = [([("pm", [i], [i])], b"b%d" % i) for i in range(16)]
    c_batches = [([("pm", [i], [32 + i])], b"c%d" % i) for i in range(16)]
    pb = post(b.write_many, "main", nodes["B->A"], b_batches)
    pc = post(c.write_many, "main", pid, c_batches)
    rb, rc = pb.result(60), pc.result(60)
    assert all("ok" in r for r in rb + rc), (rb, rc)
    msgs = a.messages("main", 32, 10.0)
    assert sorted(p for _, p in msgs) == sorted([m for _, m in b_batches + c_batches])
    assert len({peer for peer, _ in msgs}) == 2
    ids = list(range(16))
    assert a.items("main", "pm", ids) == b.items("main", "pm", ids)
    assert a.items("main", "pm", [32 + i for i in ids]) == c.items("main", "pm", ids)


@pytest.mark.parametrize(
    "parts,error",
    [
        ([("kv", [0, 1], [2, A_ITEMS])], "IndexOutOfRange"),  # dst beyond A's pool
        ([("kv", [B_ITEMS], [0])], "IndexOutOfRange"),  # src beyond B's pool
        ([("kv", [-1], [0])], "IndexOutOfRange"),
        ([("kv", [0], [3]), ("nope", [0], [0])], "UnknownGroup"),  # one bad part: nothing moves
        ([("big", [0], [0])], "UnknownGroup"),  # A has no "big"
        ([("kv", [0, 1], [5, 5])], "InvalidArgument"),  # duplicate destination
        ([("kv", [0, 1, 2], [5, 6])], "InvalidArgument"),  # length mismatch
    ],
)
def test_rejected_before_any_byte_moves(nodes, parts, error):
    a, b = nodes["A"], nodes["B"]
    b.fill("main", "kv", 5)
    a.zero("main", "kv")
    res = b.write("main", nodes["B->A"], parts, b"should-not-arrive")
    assert res.get("error") == error, res
    assert sum(a.checksum("main", "kv")) == 0
    assert a.messages("main", 0, 0.0) == []


def test_mismatched_layout_rejected(nodes):
    res = nodes["B"].connect("badlayout", "127.0.0.1", nodes["ports"]["A"])
    assert res.get("error") == "IncompatiblePeer", res
    assert "item_lens" in res["msg"] and "kv" in res["msg"]


def test_wrong_secret_rejected(nodes):
    before = nodes["A"].peers("main")
    res = nodes["B"].connect("badsecret", "127.0.0.1", nodes["ports"]["A"])
    assert res.get("error") == "AuthenticationFailed", res
    assert nodes["A"].peers("main") == before


def _peer_of(nodes, key):
    """B's engine ``key`` connected to A (connects once)."""
    if key == "main":
        return nodes["B->A"]
    if f"B-{key}->A" not in nodes:
        res = nodes["B"].connect(key, "127.0.0.1", nodes["ports"]["A"])
        assert "ok" in res, res
        nodes[f"B-{key}->A"] = res["ok"]
    return nodes[f"B-{key}->A"]


def test_error_mode_none_uses_shared_memory(nodes):
    b = nodes["B"]
    pid = _peer_of(nodes, "fast")
    src = dst = list(range(0, 40, 3))
    b.fill("fast", "kv", 9)
    nodes["A"].zero("main", "kv")
    w = b.write("fast", pid, [("kv", src, dst)], b"fast")
    assert "ok" in w, w
    assert any(lane.startswith(FAST_LANES) for lane in w["ok"]["lanes"]), w
    assert nodes["A"].messages("main", 1, 10.0)[0][1] == b"fast"
    assert nodes["A"].items("main", "kv", dst) == b.items("fast", "kv", src)


def test_mixed_error_modes_write_both_ways(nodes):
    """B-fast (error_mode "none") registers on kvxfer's own UCP context: its keys are valid
    only on a bulk endpoint to its own worker (Layout.bulk_only). A (error_mode "peer")
    therefore writes to it over a bulk endpoint too (shared-memory / CUDA IPC lanes, not the
    channel's tcp), and both directions are byte-exact."""
    a, b = nodes["A"], nodes["B"]
    pid = _peer_of(nodes, "fast")
    back = b.engine_id("fast")
    deadline = time.monotonic() + 10  # A registers the peer when its side of the handshake ends
    while back not in a.peers("main"):
        assert time.monotonic() < deadline, (a.peers("main"), a.closed("main"))
    src, dst = list(range(1, 30, 4)), list(range(2, 40, 5))[:8]
    a.fill("main", "kv", 21)
    b.zero("fast", "kv")
    w = a.write("main", back, [("kv", src, dst)], b"back")
    assert "ok" in w, w
    assert any(lane.startswith(FAST_LANES) for lane in w["ok"]["lanes"]), w
    assert b.messages("fast", 1, 10.0)[0][1] == b"back"
    assert b.items("fast", "kv", dst) == a.items("main", "kv", src)
    b.fill("fast", "kv", 22)
    a.zero("main", "kv")
    w = b.write("fast", pid, [("kv", dst, src)], b"forth")
    assert "ok" in w, w
    assert a.messages("main", 1, 10.0)[0][1] == b"forth"
    assert a.items("main", "kv", src) == b.items("fast", "kv", dst)


@pytest.mark.parametrize("key", ["main", "fast", "spin"])
def test_notify_is_chained(nodes, key):
    """A plain PUT write's notify goes through the native chain (flush -> active message),
    arrives once, after the bytes, and in order with the writes before it."""
    a, b = nodes["A"], nodes["B"]
    pid = _peer_of(nodes, key)
    before = b.chain_state(key, pid)["sent"]
    b.fill(key, "pm", 17)
    a.zero("main", "pm")
    pend = [([("pm", [i], [i])], b"n%d" % i) for i in range(20)]
    assert b.write_many(key, pid, pend) == [{"ok": 2 * L * ITEM}] * 20
    msgs = a.messages("main", 20, 10.0)
    assert [p for _, p in msgs] == [b"n%d" % i for i in range(20)]
    assert a.items("main", "pm", list(range(20))) == b.items(key, "pm", list(range(20)))
    st = b.chain_state(key, pid)
    assert st["sent"] == before + 20, st
    assert st["flushes"] == 0 and st["waiters"] == 0, st


def test_spin_flush_byte_exact(nodes):
    """flush_progress="spin": the transport's native poller progresses the worker during
    the flush (on CPU it is optional; on CUDA it is what "auto" picks)."""
    a, b = nodes["A"], nodes["B"]
    pid = _peer_of(nodes, "spin")
    rng = np.random.default_rng(5)
    for i in range(3):
        src = rng.choice(B_ITEMS, 12, replace=False).tolist()
        dst = rng.choice(A_ITEMS, 12, replace=False).tolist()
        b.fill("spin", "pm", 40 + i)
        a.zero("main", "pm")
        w = b.write("spin", pid, [("pm", src, dst)], b"spin%d" % i)
        assert "ok" in w, w
        assert 0.0 <= w["ok"]["flush_s"] <= w["ok"]["complete_s"], w
        assert w["ok"]["device_bytes"] == 0, w  # device_copy="off": all over UCX
        assert a.messages("main", 1, 10.0)[0][1] == b"spin%d" % i
        assert a.items("main", "pm", dst) == b.items("spin", "pm", src)


KILL_KEYS = pytest.mark.parametrize(
    "key",
    ["main", "fast", "spin"],
    ids=["error_mode=peer", "error_mode=none", "flush_progress=spin"],
)


def _victim():
    return Worker(
        EngineNode, {"engines": {"main": eng(cfg("V"), groups(B_ITEMS, big=True))}}, name="V"
    )


@KILL_KEYS
def test_peer_killed_mid_transfer(nodes, key):
    """The survivor's write fails within the deadline; it keeps serving other peers.
    In error_mode="none" the bulk endpoint has no UCX error handling (shared-memory lanes),
    and a death mid-PUT must still be reported, not abort the survivor. The stream is not
    stopped from outside: it must end by itself, with the error of a write (a stop flag
    set after the kill let a write that completed before the death end it cleanly)."""
    b = nodes["B"]
    v = _victim()
    try:
        vport = _port(v)
        vid = b.connect(key, "127.0.0.1", vport)["ok"]
        first = b.write(key, vid, [("big", [0], [0])])
        if key == "fast":  # the data really moves over shared memory / CUDA IPC
            assert any(lane.startswith(FAST_LANES) for lane in first["ok"]["lanes"]), first
        b.stream_start(key, vid, "big", BIG_ITEMS, 10.0)
        deadline = time.monotonic() + 30
        while b.stream_status(key)["count"] < 2:
            assert time.monotonic() < deadline, "stream did not start"
        t_kill = time.monotonic()
        v.kill()
        st = b.stream_join(key, 20.0)
        assert not st["alive"], st
        assert st["error"] and st["error"][0] in ("PeerClosed", "TransferTimeout"), st
        assert st["t_end"] - t_kill < 10.0 + 1.0
        assert (vid, "PeerClosed") in b.closed(key)  # handler ran, once
        assert vid not in b.peers(key)
        # nobody listens there any more: connecting fails within the deadline (UCXX reports
        # the refused connection only through its peer-info exchange timeout)
        t0 = time.monotonic()
        res = b.connect(key, "127.0.0.1", vport, 2.0)
        assert res.get("error") in ("PeerClosed", "TransferTimeout"), res
        assert time.monotonic() - t0 < 2.0 + 3.0
    finally:
        v.kill()
    # the survivor still works with A (same engine)
    a = nodes["A"]
    b.fill(key, "pm", 31)
    a.zero("main", "pm")
    res = b.write(key, _peer_of(nodes, key), [("pm", [1, 2, 3], [4, 5, 6])], b"alive")
    assert "ok" in res, res
    assert a.messages("main", 1, 10.0)[0][1] == b"alive"
    assert a.items("main", "pm", [4, 5, 6]) == b.items(key, "pm", [1, 2, 3])


@KILL_KEYS
def test_peer_killed_mid_chain(nodes, key):
    """Writes with chained notifications in flight when the peer dies: the stream ends
    with a typed error within the deadline, the death is reported once, and the
    survivor's transport holds no chain of that peer any more."""
    b = nodes["B"]
    v = _victim()
    try:
        vid = b.connect(key, "127.0.0.1", _port(v))["ok"]
        b.stream_start(key, vid, "big", BIG_ITEMS, 10.0, 0, b"chained")
        deadline = time.monotonic() + 30
        while b.stream_status(key)["count"] < 2:
            assert time.monotonic() < deadline, "stream did not start"
        assert b.chain_state(key, vid)["sent"] >= 2  # the chain was in use
        t_kill = time.monotonic()
        v.kill()
        st = b.stream_join(key, 20.0)
    finally:
        v.kill()
    assert not st["alive"], st
    assert st["error"] and st["error"][0] in ("PeerClosed", "TransferTimeout"), st
    assert st["t_end"] - t_kill < 10.0 + 1.0
    assert (vid, "PeerClosed") in b.closed(key)
    deadline = time.monotonic() + 10
    while b.chain_state(key)["flushes"]:  # late native completions drain (bounded)
        assert time.monotonic() < deadline, b.chain_state(key)
        time.sleep(0.01)


@KILL_KEYS
def test_write_to_killed_peer_never_succeeds(nodes, key):
    """Deterministic order: two writes complete, the peer is killed and reaped, only then
    does the next write start. It must fail (PeerClosed / TransferTimeout): no write that
    starts after the peer died may be reported successful, whichever lane or flush."""
    b = nodes["B"]
    v = _victim()
    try:
        vid = b.connect(key, "127.0.0.1", _port(v))["ok"]
        b.stream_start(key, vid, "big", BIG_ITEMS, 10.0, 2)
        assert b.stream_held(key, 30.0), b.stream_status(key)
        v.kill()  # SIGKILL and reaped: dead before the third write starts
        b.stream_release(key)
        st = b.stream_join(key, 20.0)
    finally:
        v.kill()
    assert not st["alive"], st
    assert st["count"] == 2, st
    assert st["error"] and st["error"][0] in ("PeerClosed", "TransferTimeout"), st


def _pattern_runs(seed):
    """Per kv descriptor, a few item-relative runs with disjoint destinations."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2 * L):
        dst = np.sort(rng.choice(np.arange(0, ITEM, 32), 3, replace=False))
        n = rng.integers(1, 3, 3) * 16
        src = rng.integers(0, ITEM - 32, 3) // 16 * 16
        out.append((src.tolist(), dst.tolist(), n.tolist()))
    return out


def test_pattern_write_byte_exact(nodes):
    """A PatternWrite moves exactly its runs of every item pair (one device-lane launch on
    CUDA, PUTs of the expanded runs on CPU) and nothing else."""
    a, b = nodes["A"], nodes["B"]
    runs = _pattern_runs(5)
    src, dst = [3, 4, 5, 40, 7], [60, 2, 3, 9, 33]
    b.fill("main", "kv", 9)
    a.zero("main", "kv")
    res = b.write("main", nodes["B->A"], [("kv", src, dst, runs)], b"pattern")
    assert "ok" in res, res
    assert a.messages("main", 1, 10.0)[0][1] == b"pattern"
    total = 0
    for d, (so, do, n) in enumerate(runs):
        for s, t in zip(src, dst):
            for x, y, k in zip(so, do, n):
                assert a.bytes("main", "kv", d, t * ITEM + y, k) == b.bytes(
                    "main", "kv", d, s * ITEM + x, k
                )
                total += k
    # nothing outside the runs: the checksum of A is that of the copied bytes alone
    moved = [
        sum(sum(a.bytes("main", "kv", d, t * ITEM + y, k)) for t in dst for y, k in zip(do, n))
        for d, (_, do, n) in enumerate(runs)
    ]
    assert a.checksum("main", "kv") == moved
    st = res["ok"]
    assert st["bytes"] == total
    if DEVICE == "cuda":
        assert st["device_bytes"] == total, st["device_lane"]
    else:
        assert st["device_bytes"] == 0 and st["ops"] >= 1


@pytest.mark.parametrize(
    "case,error",
    [
        ("run_leaves_item", "InvalidArgument"),
        ("overlapping_destinations", "InvalidArgument"),
        ("duplicate_destination_items", "InvalidArgument"),
        ("destination_item_out_of_range", "IndexOutOfRange"),
        ("descriptor_count", "InvalidArgument"),
    ],
)
def test_pattern_write_refused_before_any_byte(nodes, case, error):
    a, b = nodes["A"], nodes["B"]
    runs, src, dst = _pattern_runs(6), [1, 2], [3, 4]
    if case == "run_leaves_item":
        runs[2] = ([0], [ITEM - 16], [32])
    elif case == "overlapping_destinations":
        runs[0] = ([0, 64], [0, 16], [32, 32])
    elif case == "duplicate_destination_items":
        dst = [3, 3]
    elif case == "destination_item_out_of_range":
        dst = [3, A_ITEMS]
    else:
        runs = runs[:-1]
    b.fill("main", "kv", 3)
    a.zero("main", "kv")
    res = b.write("main", nodes["B->A"], [("kv", src, dst, runs)], b"never")
    assert res.get("error") == error, res
    assert not any(a.checksum("main", "kv")), "a refused write moved bytes"
    assert a.messages("main", 0, 0.2) == []
