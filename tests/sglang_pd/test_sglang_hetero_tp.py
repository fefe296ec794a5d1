"""Heterogeneous attention TP through the kvxfer SGLang backend, driven as SGLang drives it.

Real SGLang 0.5.23 classes and rank mapping (``_resolve_rank_mapping``: target ranks,
``required_dst_info_num``, ``required_prefill_response_num``), one process per TP rank
(two prefill, two decode processes; a process re-publishes its scheduler config per scenario
to act as another rank or TP size), kvxfer's engine over UCX on loopback. Content: one
global pattern per token row, every rank holding its heads' slice of it
(:func:`sgl_nodes.pattern`), so decode's pages are checked byte for byte against the heads
the prefill ranks hold.

Scenarios (own bootstrap server each): ``p2d1`` / ``p1d2``: 4 KV heads, prefill TP 2 ->
decode TP 1 and 1 -> 2; ``p2d1r`` / ``p1d2r``: 1 KV head (replicated: prefill replicas of
which one sends, decode replicas that both receive it); ``bad``: a decode whose model has
another head count (refused, the room fails on every rank with both shapes named).
"""

import random

import pytest

pytest.importorskip(
    "sglang",
    reason="sglang is not installed here: `make test-sglang` runs these tests in .venv-sglang",
)

import sgl_nodes as N  # noqa: E402

from kvxfer.procs import Worker  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "KVXFER_SECRET": "pd-test",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
}
FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
DONE = [SUCCESS, FAILED]
SCENARIOS = {  # name: (total kv heads, prefill tp, decode tp)
    "p2d1": (4, 2, 1),
    "p1d2": (4, 1, 2),
    "p2d1r": (1, 2, 1),
    "p1d2r": (1, 1, 2),
}


@pytest.fixture(scope="module")
def cluster():
    workers = [
        Worker(N.BootstrapServers, len(SCENARIOS) + 1, name="bootstrap", env=ENV),
        Worker(N.node, "prefill", name="prefill-0", env=ENV),
        Worker(N.node, "prefill", name="prefill-1", env=ENV),
        Worker(N.node, "decode", name="decode-0", env=ENV),
        Worker(N.node, "decode", name="decode-1", env=ENV),
    ]
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.ready(300)
        ports = workers[0].proxy(N.BootstrapServers).ports()
        pfs = [w.proxy(N.PrefillNode) for w in workers[1:3]]
        dcs = [w.proxy(N.DecodeNode) for w in workers[3:5]]
        info = {}
        for (name, (heads, tp_p, tp_d)), port in zip(SCENARIOS.items(), ports):
            p = [
                pfs[r].add(name, "mha", port, tp=(tp_p, r), heads=heads, timeout=120)
                for r in range(tp_p)
            ]
            d = [
                dcs[r].add(name, "mha", port, tp=(tp_d, r), heads=heads, timeout=120)
                for r in range(tp_d)
            ]
            info[name] = (p, d)
        # a decode (TP 1) of a model with 2 KV heads against prefill TP 2 of 4 heads
        for r in range(2):
            pfs[r].add("bad", "mha", ports[-1], tp=(2, r), heads=4, timeout=120)
        dcs[0].add("bad", "mha", ports[-1], tp=(1, 0), heads=2, timeout=120)
        yield dict(pf=pfs, dc=dcs, ports=dict(zip([*SCENARIOS, "bad"], ports)), info=info)
    finally:
        for w in reversed(workers):
            w.close()


def _room(cluster, scen, room, n_pages, tp_p, tp_d, chunks=None):
    """Open ``room`` on every rank of ``scen``, fill prefill's pages (the same page ids on
    every prefill rank, as SGLang's TP ranks allocate alike); returns (p_pages, d_pages)."""
    port = cluster["ports"][scen]
    pfs, dcs = cluster["pf"][:tp_p], cluster["dc"][:tp_d]
    rng = random.Random(room)
    p_pages = rng.sample(range(1, 60), n_pages)
    d_pages = [rng.sample(range(1, 60), n_pages) for _ in dcs]
    for pf in pfs:
        assert pf.sender(scen, room, "127.0.0.1", port) == "KvxferKVSender"
        pf.fill(scen, room, p_pages)
    for d, dc in enumerate(dcs):
        assert dc.receiver(scen, room, f"127.0.0.1:{port}")["dp_size"] == 1
        dc.metadata(scen, room, d_pages[d], 3 + d)
    for pf in pfs:  # complete only once every decode rank's metadata arrived
        assert pf.wait(room, [WAITING, FAILED], 30) == WAITING
        assert pf.start(scen, room, n_pages * N.PAGE, 5, 9000 + room) == {
            "prefix": 0,
            "pages": n_pages,
        }
    return p_pages, d_pages


def _check_and_clear(cluster, scen, room, tp_p, tp_d, n_pages, d_pages):
    pfs, dcs = cluster["pf"][:tp_p], cluster["dc"][:tp_d]
    for d, dc in enumerate(dcs):
        assert dc.wait(room, DONE, 30) == SUCCESS
        assert dc.read(scen, d_pages[d]) == dc.expected(scen, room, n_pages)
        assert dc.first_token(scen, 3 + d) == [9000 + room, room]
    for pf in pfs:
        assert pf.wait(room, DONE, 30) == SUCCESS
    for node in [*pfs, *dcs]:
        node.clear(room)
        assert node.room_entries(scen, room) == []


@pytest.mark.parametrize("scen", list(SCENARIOS))
def test_byte_exact_at_every_ratio(cluster, scen):
    heads, tp_p, tp_d = SCENARIOS[scen]
    room = 7000 + list(SCENARIOS).index(scen)
    n = 3
    p_pages, d_pages = _room(cluster, scen, room, n, tp_p, tp_d)
    for pf in cluster["pf"][:tp_p]:
        assert pf.send(room, p_pages[:2], False) is True
        assert pf.send(room, p_pages[2:], True) is True
    for pf in cluster["pf"][:tp_p]:
        assert pf.wait(room, DONE, 30) == SUCCESS
    # bytes and PUTs per prefill rank: its heads' runs (one per token of each K/V page of
    # a layer; none from a prefill replica that another rank covers), the metadata row
    # from the decode rank's first peer only
    p_info, d_info = cluster["info"][scen]
    kv_p = sum(p_info[0]["item_lens"][0])
    kv_d = sum(d_info[0]["item_lens"][0])
    aux = sum(p_info[0]["item_lens"][1])
    got = [pf.metric(room)[0] for pf in cluster["pf"][:tp_p]]
    if tp_p > tp_d:
        if heads >= tp_p:
            assert got == [n * kv_p + aux, n * kv_p]
            # one run per token row of every page of every layer's K and V
            assert cluster["pf"][1].write_ops(room) == [n * 2 * N.LAYERS * N.PAGE, 2]
        else:  # prefill replicas: rank 1's head is rank 0's, it moves nothing
            assert got == [n * kv_d + aux, 0]
            assert cluster["pf"][1].write_ops(room) == [0, 0]
    else:
        assert got == [tp_d * (n * kv_d + aux)]
    _check_and_clear(cluster, scen, room, tp_p, tp_d, n, d_pages)


def test_decode_waits_for_every_prefill_rank(cluster):
    """2:1: decode's room succeeds only on the completion of both prefill ranks; a failure
    of one of them fails it although the other completed."""
    scen, room = "p2d1", 7101
    pf0, pf1 = cluster["pf"]
    dc = cluster["dc"][0]
    p_pages, d_pages = _room(cluster, scen, room, 2, 2, 1)
    pf0.send(room, p_pages, True)
    assert pf0.wait(room, DONE, 30) == SUCCESS
    assert dc.wait(room, DONE, 0.5) not in DONE  # one of two completions: not yet
    pf1.send(room, p_pages, True)
    _check_and_clear(cluster, scen, room, 2, 1, 2, d_pages)

    room = 7102
    p_pages, _ = _room(cluster, scen, room, 2, 2, 1)
    pf0.send(room, p_pages, True)
    assert pf0.wait(room, DONE, 30) == SUCCESS
    pf1.abort(room)
    assert dc.wait(room, DONE, 30) == FAILED
    kind, msg = dc.failure(room)
    assert kind == "KVTransferError" and "Aborted by prefill" in msg
    assert pf1.failure(room)[0] == "KVTransferError"  # as a scheduler reads it
    for node in (pf0, pf1, dc):
        node.clear(room)
        assert node.room_entries(scen, room) == []
        assert node.room_entries(scen, room) == []


def test_decode_abort_needs_every_prefill_ranks_ack(cluster):
    """2:1: decode may release an aborted room's pages only once both prefill ranks acked
    (each after its own writes of the room settled)."""
    scen, room = "p2d1", 7103
    pf0, pf1 = cluster["pf"]
    dc = cluster["dc"][0]
    _room(cluster, scen, room, 2, 2, 1)
    dc.abort(room)
    assert dc.poll(room) == FAILED
    for pf in (pf0, pf1):
        assert pf.wait(room, [FAILED], 30) == FAILED
    for _ in range(3000):
        if dc.release_safe(scen, room, 2):
            break
    assert dc.release_safe(scen, room, 2) is True
    assert dc.release_safe(scen, room, 3) is False
    for node in (pf0, pf1, dc):
        node.failure(room)  # as a scheduler reads it (pops SGLang's failure record)
        node.clear(room)
        assert node.room_entries(scen, room) == []


def test_refused_shape_fails_the_room_naming_both(cluster):
    scen, room = "bad", 7201
    pf0, pf1 = cluster["pf"]
    dc = cluster["dc"][0]
    port = cluster["ports"][scen]
    before = dc.read(scen, [1, 2])
    for pf in (pf0, pf1):
        pf.sender(scen, room, "127.0.0.1", port)
    dc.receiver(scen, room, f"127.0.0.1:{port}")
    dc.metadata(scen, room, [1, 2], 4)
    for pf in (pf0, pf1):
        assert pf.wait(room, DONE, 30) == FAILED
        kind, msg = pf.failure(room)
        assert "TpShapeMismatch" in msg and "total kv head counts differ" in msg
        assert "prefill tp" in msg and "decode tp 0/1, 2 kv heads" in msg
    assert dc.wait(room, DONE, 30) == FAILED
    assert "TpShapeMismatch" in dc.failure(room)[1]
    assert dc.read(scen, [1, 2]) == before
    # what cannot work is named at registration, before any room: the reasons
    assert "must divide" in pf0.incompatible("p2d1", {"tp_size": 3, "tp_rank": 0})
    assert "are not pages of" in pf0.incompatible("p2d1", {"total_kv_heads": 4})
    assert "peers are tp ranks [1]" in pf0.incompatible(
        "p2d1", {"tp_size": 2, "tp_rank": 1, "total_kv_heads": 4}
    )
    for node in (pf0, pf1, dc):
        node.clear(room)
        assert node.room_entries(scen, room) == []
