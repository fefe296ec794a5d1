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
which one sends, decode replicas that both receive it); ``m2d1`` / ``m1d2``: MLA (the latent
is replicated: one prefill rank writes whole pages, SGLang makes the other a dummy);
``s2d1`` / ``s1d2``: as ``p2d1`` / ``p1d2`` with the staged path forced (the cross-host
path: gather, one PUT per chunk, scatter at decode); ``g2d1`` / ``g1d2``: a hybrid model
(``HybridLinearKVPool`` over a ``MambaPool``) whose Mamba2 conv state is three parts
split by TP on their own (GDN's ``q | k | v``), ``k2d1`` / ``k1d2``: KimiLinear's state
(conv ``[K-1, channels]``: the split dim after the outer rows) - every byte of every state
tensor of the room's slot checked on every decode rank, each rank's state the slice of one
global state its TP holds (:func:`sgl_nodes.state_share`); ``bad``: a decode whose model
has another head count, ``sbad``: a plain Mamba2 state whose conv dim depends on the TP
size (1 group, extended by SGLang over 2 ranks) - refused, the room fails on every rank
with both shapes named. 4:1, 1:4 and 2:4 (four processes a role): test_sglang_hetero_tp4.py.
"""

import pytest

pytest.importorskip(
    "sglang",
    reason="sglang is not installed here: `make test-sglang` runs these tests in .venv-sglang",
)

import sgl_harness as H  # noqa: E402
from sgl_harness import DONE, FAILED, SUCCESS  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SCENARIOS = {  # name: (pool, total kv heads, prefill tp, decode tp)
    "p2d1": ("mha", 4, 2, 1),
    "p1d2": ("mha", 4, 1, 2),
    "p2d1r": ("mha", 1, 2, 1),
    "p1d2r": ("mha", 1, 1, 2),
    "m2d1": ("mla", 1, 2, 1),
    "m1d2": ("mla", 1, 1, 2),
    "s2d1": ("mha", 4, 2, 1),
    "s1d2": ("mha", 4, 1, 2),
    "g2d1": ("gdn", 4, 2, 1),
    "g1d2": ("gdn", 4, 1, 2),
    "k2d1": ("kimi", 4, 2, 1),
    "k1d2": ("kimi", 4, 1, 2),
}
#: the staged path forced (every head-slice chunk of more than 1 PUT: a SliceWrite)
STAGED = {"s2d1", "s1d2"}


@pytest.fixture(scope="module")
def cluster():
    # (without the host lane: with it, 1:2 in host memory on one host goes direct over it)
    forced = {"KVXFER_SGL_TP_STAGE_MIN_OPS": "1", "KVXFER_HOST_COPY": "off"}
    with H.hetero_cluster(SCENARIOS, 2, 2, extra=2, scenario_env={s: forced for s in STAGED}) as c:
        pfs, dcs, port = c["pf"], c["dc"], c["spare"][0]
        # a decode (TP 1) of a model with 2 KV heads against prefill TP 2 of 4 heads
        for r in range(2):
            pfs[r].add("bad", "mha", port, tp=(2, r), heads=4, timeout=120)
        dcs[0].add("bad", "mha", port, tp=(1, 0), heads=2, timeout=120)
        c["ports"]["bad"] = port
        c["scenarios"]["bad"] = ("mha", 4, 2, 1)
        # Mamba2 of 1 group: SGLang extends the groups over 2 ranks, the conv dims differ
        port = c["spare"][1]
        for r in range(2):
            pfs[r].add("sbad", "mamba", port, tp=(2, r), heads=4, timeout=120)
        dcs[0].add("sbad", "mamba", port, tp=(1, 0), heads=4, timeout=120)
        c["ports"]["sbad"] = port
        c["scenarios"]["sbad"] = ("mamba", 4, 2, 1)
        yield c


@pytest.mark.parametrize("scen", list(SCENARIOS))
def test_byte_exact_at_every_ratio(cluster, scen):
    H.byte_exact(cluster, scen, 7000 + list(SCENARIOS).index(scen), staged=scen in STAGED)


def test_mla_dummy_prefill_rank_moves_nothing(cluster):
    """2:1 MLA: SGLang marks decode's second prefill peer a dummy; that rank completes
    without a byte or a completion message of its own, decode succeeds on the first's."""
    scen, room = "m2d1", 7050
    pf0, pf1 = cluster["pf"]
    p_pages, d_pages = H.open_room(cluster, scen, room, 2)
    pf1.send(room, p_pages, True)
    assert pf1.wait(room, DONE, 30) == SUCCESS
    assert pf1.metric(room)[0] == 0 and pf1.write_ops(room) == [0, 0]
    assert cluster["dc"][0].wait(room, DONE, 0.3) not in DONE
    pf0.send(room, p_pages, True)
    H.check_and_clear(cluster, scen, room, 2, d_pages)


def test_decode_waits_for_every_prefill_rank(cluster):
    """2:1: decode's room succeeds only on the completion of both prefill ranks; a failure
    of one of them fails it although the other completed."""
    scen, room = "p2d1", 7101
    pf0, pf1 = cluster["pf"]
    dc = cluster["dc"][0]
    p_pages, d_pages = H.open_room(cluster, scen, room, 2)
    pf0.send(room, p_pages, True)
    assert pf0.wait(room, DONE, 30) == SUCCESS
    assert dc.wait(room, DONE, 0.5) not in DONE  # one of two completions: not yet
    pf1.send(room, p_pages, True)
    H.check_and_clear(cluster, scen, room, 2, d_pages)

    room = 7102
    p_pages, _ = H.open_room(cluster, scen, room, 2)
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
    H.open_room(cluster, scen, room, 2)
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


def test_state_that_cannot_split_is_refused_naming_both(cluster):
    """A state tensor whose rows do not join (Mamba2 conv of 40 channels at TP 1, 48 over
    TP 2): TpShapeMismatch at registration naming both shapes; the room fails on every
    rank before a byte moves, decode's slot as it was."""
    scen, room = "sbad", 7301
    pf0, pf1 = cluster["pf"]
    dc = cluster["dc"][0]
    port = cluster["ports"][scen]
    before = dc.read(scen, [1, 2], 3)
    for pf in (pf0, pf1):
        pf.sender(scen, room, "127.0.0.1", port)
    dc.receiver(scen, room, f"127.0.0.1:{port}")
    dc.metadata(scen, room, [1, 2], 4, 3)
    for pf in (pf0, pf1):
        assert pf.wait(room, DONE, 30) == FAILED
        kind, msg = pf.failure(room)
        assert "TpShapeMismatch" in msg and "state 0: " in msg and "segment 0 differs" in msg
        assert "prefill tp" in msg and "decode tp 0/1" in msg and "split rows" in msg
    assert dc.wait(room, DONE, 30) == FAILED
    assert "TpShapeMismatch" in dc.failure(room)[1]
    assert dc.read(scen, [1, 2], 3) == before
    for node in (pf0, pf1, dc):
        node.clear(room)
        assert node.room_entries(scen, room) == []


def test_state_refusals_at_registration(cluster):
    """What cannot work is named before any room: a decode without per-tensor state TP
    metadata at another TP size, state rows that do not split over the TP sizes."""
    pf0 = cluster["pf"][0]
    d_info = cluster["info"]["g2d1"][1][0]
    kv_d = d_info["item_lens"][0]
    base = {"tp_size": 1, "tp_rank": 0, "total_kv_heads": 4, "kv_item_lens": kv_d}
    state_d = d_info["item_lens"][2]
    meta = d_info["state_meta"]
    dims = [[m[1] for m in meta]]
    ok = dict(base, state_item_lens=state_d, state_dims=dims)
    ok["state_outer"] = [[m[2] for m in meta]]
    ok["state_groups"] = [[m[3] for m in meta]]
    assert pf0.incompatible("g2d1", ok) is None
    msg = pf0.incompatible("g2d1", dict(ok, state_dims=[]))
    assert "decode states no per-tensor TP dims" in msg and "decode tp 0/1" in msg
    odd = [[d + 1 for d in dims[0]]]
    assert "TpShapeMismatch" in pf0.incompatible("g2d1", dict(ok, state_dims=odd))
