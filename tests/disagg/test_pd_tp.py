"""Heterogeneous TP through the prefill/decode protocol, multi-process on real UCX loopback:
every TP rank is its own process (prefill ranks 0-3 and decode ranks 0-3: eight workers,
each hosting its rank of every deployment below). Every byte of every decode rank's pages,
state slot and aux row is checked against what that rank would hold had it computed the
request itself (tp_harness); fences and leaks are checked on every rank."""

import pytest
from pd_harness import FAST
from testenv import DEVICE
from tp_harness import TpWorker

pytestmark = pytest.mark.timeout(120)

#: deployment -> (pool kind, total kv heads, prefill tp, decode tp)
DEPLOY = {
    "mha12": ("mha", 4, 1, 2),  # NHD, decode splits prefill's heads
    "hnd21": ("mha_hnd", 4, 2, 1),  # HND, decode joins two prefill ranks
    "pm14": ("page_major", 4, 1, 4),
    "mla14": ("mla", 1, 1, 4),  # latent replicated: every decode rank gets it
    "mla41": ("mla", 1, 4, 1),  # the four replicas send a block of the pages each
    "hyb24": ("hybrid_per_layer", 4, 2, 4),  # KV heads + Mamba conv x|B|C parts, temporal
    "env21": ("hybrid_envelope", 4, 2, 1),  # page-major KV + envelope state slot
    "rep14": ("mha", 2, 1, 4),  # 2 heads over 4 decode ranks: decode replicates
    "rep41": ("mha_hnd", 2, 4, 1),  # 2 heads over 4 prefill ranks: prefill replicates
    # the staged path forced (tp_stage_min_ops=1: STAGED): head slices of NHD / page-major
    # pages gathered, one PUT per chunk, scattered by decode's own plan
    "st12": ("mha", 4, 1, 2),
    "st21": ("mha", 4, 2, 1),
    "st14": ("page_major", 4, 1, 4),
    "st41": ("mha", 4, 4, 1),
    "st24": ("page_major", 4, 2, 4),
    # staging asked for (tp_stage_min_ops=1) with the host lane on: host memory on one host
    # goes direct over the lane where each decode page gets one whole share (1:2), staged
    # where it gets strided ones (2:1) (on CUDA: the device lane's pattern launch)
    "ln12": ("mha", 4, 1, 2),
    "ln21": ("mha", 4, 2, 1),
    # PatternWrite forced (tp_pattern="always", PATTERN): one launch on a CUDA lane; on CPU
    # the engine posts the expanded runs
    "pat12": ("mha", 4, 1, 2),
    "pat41": ("page_major", 4, 4, 1),
    "pat24": ("mha_hnd", 4, 2, 4),
    # ... and the state slices as PatternWrites in the same launch (Mamba conv parts, an
    # envelope slot)
    "pathyb12": ("hybrid_per_layer", 4, 1, 2),
    "patenv21": ("hybrid_envelope", 4, 2, 1),
    # one rank in its own process, killed by the test (VICTIMS)
    "die21": ("mha_hnd", 4, 2, 1),
    "die12": ("mha", 4, 1, 2),
    # one rank in its own process, frozen (SIGSTOP) and resumed by the test
    "frz21": ("mha_hnd", 4, 2, 1),
    # integrity mode (checksums per prefill -> decode pair)
    "int21": ("mha_hnd", 4, 2, 1),
    "int12": ("hybrid_per_layer", 4, 1, 2),  # staged (NHD kv slices; the path forced)
    "intmla41": ("mla", 1, 4, 1),  # the latent's pages shared out by its four replicas
    # refused at the handshake (TpShapeMismatch naming both shapes)
    "bad_heads_p": ("mha", 6, 2, None),  # prefill: 6 heads over 2 ranks
    "bad_heads_d": ("mha", 4, None, 4),  # decode: 4 heads over 4 ranks
    "bad_form_p": ("mha_hnd", 4, 1, None),  # HND, 4 heads
    "bad_form_d": ("mha", 4, None, 2),  # NHD, 2 heads per rank
}
#: a refused pairing: decode deployment -> the prefill deployment it looks up
REFUSED = {"bad_heads_d": "bad_heads_p", "bad_form_d": "bad_form_p"}
INTEGRITY = {"int21", "int12", "intmla41"}
STAGED = {"st12", "st21", "st14", "st41", "st24"}
PATTERN = {"pat12", "pat41", "pat24", "pathyb12", "patenv21"}
#: (deployment, role, rank) hosted alone in a worker that a test kills
VICTIMS = {("die21", "prefill", 1), ("die12", "decode", 1), ("frz21", "prefill", 1)}


@pytest.fixture(scope="module")
def tpc():
    from kvxfer.disagg import BootstrapServer

    bs = {}
    for name in DEPLOY:
        if DEPLOY[name][2] is not None:
            bs[name] = BootstrapServer(port=0).start_in_thread()
    for d, p in REFUSED.items():
        bs[d] = bs[p]
    specs = {("prefill", r): {} for r in range(4)}
    specs.update({("decode", r): {} for r in range(4)})
    for name, (kind, heads, tp_p, tp_d) in DEPLOY.items():
        for role, tp in (("prefill", tp_p), ("decode", tp_d)):
            for r in range(tp or 0):
                if name.startswith("bad") and r:
                    continue  # a refusal needs rank 0 only
                key = ("victim", name) if (name, role, r) in VICTIMS else (role, r)
                specs.setdefault(key, {})[name] = dict(
                    kind=kind,
                    role=role,
                    bootstrap=bs[name].address,
                    timeouts=FAST,
                    device=DEVICE,
                    size=512,
                    page_size=4,
                    aux_rows=64,
                    name=f"{name}-{role[0]}{r}",
                    tp=(r, tp, heads),
                    integrity=name in INTEGRITY,
                    tp_stage_min_ops=1
                    if name in STAGED or name in ("int12", "ln12", "ln21")
                    else 0,
                    # the staged deployments without the host lane (with it, host memory
                    # on one host goes direct: its runs in a few calls)
                    host_copy="off" if name in STAGED or name == "int12" else None,
                    # the staged deployments keep the staged path on CUDA too (the others
                    # take the device lane's pattern launch there)
                    tp_pattern=(
                        "off" if name in STAGED else "always" if name in PATTERN else "auto"
                    ),
                )
    workers = {k: TpWorker(v, name=f"tp-{k[0]}{k[1]}") for k, v in specs.items() if v}
    for w in workers.values():
        w.ready()
    try:
        yield workers, bs
    finally:
        for w in workers.values():
            w.request_exit()
        for w in workers.values():
            w.close()
        for name, s in bs.items():
            if name not in REFUSED:
                s.stop_thread()


def _ranks(tpc, name):
    workers, _ = tpc
    kind, heads, tp_p, tp_d = DEPLOY[name]

    def at(role, r):
        key = ("victim", name) if (name, role, r) in VICTIMS else (role, r)
        return workers[key][name]

    return [at("prefill", r) for r in range(tp_p)], [at("decode", r) for r in range(tp_d)]


def _clean(nodes):
    for n in nodes:
        assert n.leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}
        f = n.fence_check()
        assert f["pages"] == f["slots"] == f["rows"] == f["guards"] == [], f


def _request(tpc, name, room, pages=7, decode_first=False):
    """One request of ``pages`` pages through every rank of deployment ``name``; two
    chunks; every byte checked on every decode rank."""
    p, d = _ranks(tpc, name)
    before = [n.stats()["bytes"] for n in p]
    if decode_first:  # decode's metadata waits on prefill ('pending') for the KVSender
        for n in d:
            n.d_open(room, pages)
        for n in p:
            assert n.record(room) in ("pending", None)
    for n in p:
        n.p_open_tp(room, pages)
    if not decode_first:
        for n in d:
            n.d_open(room, pages)
    for n in p:
        n.p_send(room, 0, 3)
    for n in p:
        n.p_send(room, 3, pages)
    for n in d:
        res = n.wait(room)
        assert res is not None and res["state"] == "Success", (name, res)
    for n in p:
        res = n.wait(room)
        assert res is not None and res["state"] == "Success", (name, res)
    for i, n in enumerate(d):
        assert n.verify_tp(room) == {"kv": 0, "state": 0, "aux": 0}, (name, i)
    _clean(p + d)
    return [n.stats()["bytes"] - b for n, b in zip(p, before)]


@pytest.mark.parametrize(
    "name", [n for n in DEPLOY if not n.startswith(("bad", "die", "frz", "int"))]
)
def test_hetero_tp_byte_exact(tpc, room, name):
    kind, heads, tp_p, tp_d = DEPLOY[name]
    p, _ = _ranks(tpc, name)
    for pages, decode_first in ((7, False), (5, True)):
        dev = [n.stats()["device_bytes"] for n in p]
        moved = _request(tpc, name, room(), pages, decode_first)
        dev = [n.stats()["device_bytes"] - b for n, b in zip(p, dev)]
        if DEVICE == "cuda" and kind != "mla" and name not in STAGED:
            # same host, CUDA pools: head slices go as one device-lane pattern launch
            lanes = [n.device_lanes() for n in p]
            assert all(d > 0 for d, b in zip(dev, moved) if b > 64), (dev, moved, lanes)
        elif DEVICE != "cuda":
            assert not any(dev), dev
        if kind == "mla" and tp_p > tp_d:
            # the replicated latent (whole pages): the replicas cut the room's pages into
            # blocks of ceil(pages / replicas), each block from one of them
            block = -(-pages // (tp_p // tp_d))
            assert sum(1 for b in moved if b > 64) == -(-pages // block), moved
        elif tp_p > tp_d and heads < tp_p:
            # replicated units inside items: of each group of replicas one sends (the room
            # picks it), the others take part moving nothing (at most the 64-byte aux row)
            assert sum(1 for b in moved if b > 64) == heads, moved


def test_ops_proportional_to_pages_not_tokens(tpc, room):
    """HND 2:1: each prefill rank posts one run per page per descriptor (its heads are one
    block of each page), plus state / aux; never one per token."""
    p, _ = _ranks(tpc, "hnd21")
    before = [n.stats()["ops"] for n in p]
    _request(tpc, "hnd21", room(), pages=7)
    ops = [n.stats()["ops"] - b for n, b in zip(p, before)]
    descs = 4  # 2 layers x K, V
    assert ops[0] <= 7 * descs + 1 and ops[1] <= 7 * descs + 1, ops  # + the aux row
    assert sum(ops) >= 2 * 7 * descs, ops


def test_one_to_many_large_send_every_byte_lands(tpc, room):
    """1:2, a room with two decode legs, one send of 20 pages (above the 16-page guest bound
    multi-leg sends had until the ninth H200 session; now a guest up to direct_pages like a
    single-peer send, when the loop is idle, else handed over): both legs' bytes land,
    every rank's room succeeds, nothing leaks."""
    p, d = _ranks(tpc, "mha12")
    r, pages = room(), 20
    for n in d:
        n.d_open(r, pages)
    assert p[0].record(r) == "pending"  # decode's metadata waits for the KVSender
    p[0].p_open_tp(r, pages)
    p[0].drained()  # its adoption ran: the room has its legs
    p[0].p_send(r, 0, pages)
    for n in d + p:
        res = n.wait(r)
        assert res is not None and res["state"] == "Success", res
    for n in d:
        assert n.verify_tp(r) == {"kv": 0, "state": 0, "aux": 0}
    _clean(p + d)


@pytest.mark.skipif(DEVICE != "cpu", reason="host memory: on CUDA the device lane takes them")
def test_head_slices_in_host_memory_go_over_the_host_lane_one_to_many(tpc, room):
    """NHD on one host, host memory, staging asked for. 1:2: each decode page gets one whole
    share, so the head slices (one run per token row) are not staged but copied by the host
    lane (kvxfer.engine.hostcopy: a few system calls for all the runs, each decode page one
    segment). 2:1: each decode page gets strided shares, staged as before (decode scatters
    its own pages). Every byte exact; the forced-staged deployments (host_copy="off") keep
    the staged path (test_staged_ops_per_chunk_not_per_token)."""
    p, _ = _ranks(tpc, "ln12")
    before = p[0].stats()
    moved = _request(tpc, "ln12", room(), pages=20)
    after = p[0].stats()
    host = after["host_bytes"] - before["host_bytes"]
    assert 0 < host <= moved[0], (host, moved)
    assert after["ops"] - before["ops"] > 20 * 4, "not one run per token row and head range"
    p, _ = _ranks(tpc, "ln21")
    before = [n.stats() for n in p]
    _request(tpc, "ln21", room(), pages=20)
    for n, b in zip(p, before):
        a = n.stats()
        assert a["host_bytes"] == b["host_bytes"], "many-to-one slices went over the lane"
        assert a["ops"] - b["ops"] <= 4, "not staged: one PUT per chunk (two) and the aux row"


@pytest.mark.parametrize("dname", list(REFUSED))
def test_impossible_shape_refused_at_handshake(tpc, room, dname):
    workers, bs = tpc
    pname = REFUSED[dname]
    p = workers[("prefill", 0)][pname]
    d = workers[("decode", 0)][dname]
    r = room()
    p.p_open_tp(r, 3)
    d.d_open(r, 3)
    res = d.wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TpShapeMismatch", res
    assert "tp 2" in res["msg"] or "tp 1" in res["msg"], res
    pres = p.wait(r)
    assert pres["state"] == "Failed", pres
    _clean([p, d])


def test_one_prefill_rank_aborts(tpc, room):
    """2:1: prefill rank 1 aborts after rank 0 sent a chunk: decode's room fails, and rank 0
    (told by decode) fails and releases too; nothing leaks, nothing lands late."""
    p, d = _ranks(tpc, "hnd21")
    r = room()
    for n in p:
        n.p_open_tp(r, 6)
    d[0].d_open(r, 6)
    p[0].p_send(r, 0, 3)
    p[1].abort(r)
    res = d[0].wait(r)
    # TransferAborted, or UnknownRoom when rank 1's abort came before decode's metadata
    assert res["state"] == "Failed" and res["exc"] in ("TransferAborted", "UnknownRoom"), res
    for n in p:
        assert n.wait(r)["state"] == "Failed"
    _clean(p + d)


def test_one_decode_rank_aborts(tpc, room):
    """1:2: decode rank 1 aborts: prefill's room fails, decode rank 0 hears it; all release."""
    p, d = _ranks(tpc, "mha12")
    r = room()
    p[0].p_open_tp(r, 6)
    for n in d:
        n.d_open(r, 6)
    p[0].p_send(r, 0, 3)
    d[1].abort(r)
    assert p[0].wait(r)["state"] == "Failed"
    res = d[0].wait(r)
    assert res["state"] == "Failed", res
    assert d[1].wait(r)["state"] == "Failed"
    _clean(p + d)


def _transferring_21(tpc, name, r):
    """A 6-page room of 2:1 deployment ``name`` whose first chunk (from rank 0) landed."""
    p, d = _ranks(tpc, name)
    for n in p:
        n.p_open_tp(r, 6)
    d[0].d_open(r, 6)
    p[0].p_send(r, 0, 3)
    assert d[0].poll_until(r, ["Transferring"]) == "Transferring"
    return p, d, r


def test_prefill_rank_dies(tpc, room):
    """2:1: prefill rank 1's process is killed mid-room: decode's room fails (its leg to rank
    1 saw the peer go), rank 0 is told and fails too; both survivors release everything."""
    workers, _ = tpc
    p, d, r = _transferring_21(tpc, "die21", room())
    workers[("victim", "die21")].kill()
    res = d[0].wait(r, timeout=FAST["heartbeat_timeout_s"] + 10)
    assert res is not None and res["state"] == "Failed", res
    assert res["exc"] in ("PeerClosed", "TransferTimeout"), res
    res = p[0].wait(r, timeout=FAST["abort_ack_s"] + 10)
    assert res is not None and res["state"] == "Failed", res
    _clean([p[0], d[0]])


def test_prefill_rank_frozen(tpc, room):
    """2:1: prefill rank 1's process freezes (SIGSTOP) mid-room. Decode gives up on it: the
    room fails at once, but its leg to rank 1 stays held (on_done does not run) while rank 0
    is told and fails. Rank 1 resumes and its scheduler sends the whole request: whatever
    lands, lands in held pages; once it answered, decode releases; every rank clean."""
    workers, _ = tpc
    p, d, r = _transferring_21(tpc, "frz21", room())
    victim = workers[("victim", "frz21")]
    victim.freeze()
    try:
        bound = FAST["heartbeat_timeout_s"] + 10
        assert d[0].poll_until(r, ["Failed"], bound) == "Failed"
        assert d[0].held(r)
        res = p[0].wait(r, timeout=FAST["abort_ack_s"] + 10)
        assert res is not None and res["state"] == "Failed", res
    finally:
        victim.resume()
    p[1].p_send(r, 0, 6)
    res = d[0].wait(r, timeout=FAST["abort_ack_s"] + 10)
    assert res is not None and res["state"] == "Failed", res
    res = p[1].wait(r, timeout=FAST["transfer_s"] + 10)
    assert res is not None and res["state"] in ("Success", "Failed"), res
    _clean(p + d)


def test_decode_rank_dies(tpc, room):
    """1:2: decode rank 1's process is killed: prefill's room fails, decode rank 0 is told;
    prefill and decode rank 0 release everything."""
    workers, _ = tpc
    p, d = _ranks(tpc, "die12")
    r = room()
    p[0].p_open_tp(r, 6)
    for n in d:
        n.d_open(r, 6)
    p[0].p_send(r, 0, 3)
    assert d[0].poll_until(r, ["Transferring"]) == "Transferring"
    workers[("victim", "die12")].kill()
    res = p[0].wait(r, timeout=FAST["heartbeat_timeout_s"] + 10)
    assert res is not None and res["state"] == "Failed", res
    res = d[0].wait(r, timeout=FAST["abort_ack_s"] + 10)
    assert res is not None and res["state"] == "Failed", res
    _clean([p[0], d[0]])


def test_decode_peers_arrive_apart(tpc, room):
    """1:4: decode rank 0's metadata waits in prefill's pending record, the KVSender adopts
    it and sends a first chunk, then the other decode ranks' metadata arrives: the chunk sent
    so far is replayed to each new leg; every byte checked on every rank."""
    p, d = _ranks(tpc, "pm14")
    r, pages = room(), 6
    d[0].d_open(r, pages)
    assert p[0].record(r) == "pending"
    p[0].p_open_tp(r, pages)
    p[0].p_send(r, 0, 2)
    for n in d[1:3]:
        n.d_open(r, pages)
    p[0].p_send(r, 2, 4)
    d[3].d_open(r, pages)
    p[0].p_send(r, 4, pages)
    for n in d:
        assert n.wait(r)["state"] == "Success"
    assert p[0].wait(r)["state"] == "Success"
    for n in d:
        assert n.verify_tp(r) == {"kv": 0, "state": 0, "aux": 0}
    _clean(p + d)


@pytest.mark.parametrize("name", sorted(INTEGRITY))
def test_integrity_per_pair(tpc, room, name):
    """Integrity mode: each pair's bytes checksummed on both ends (byte-exact rooms pass);
    one flipped byte in a decode page fails the room on decode and on every prefill rank.
    MLA 4:1: the replicas share the room's pages out (each page summed on both ends from the
    replica whose block holds it, 0 from the others), the page's sender's leg finds it."""
    _request(tpc, name, room())  # two chunks, every rank sending: Success, exact
    p, d = _ranks(tpc, name)
    r = room()
    for n in p:
        n.p_open_tp(r, 4)
    for n in d:
        n.d_open(r, 4)
    # byte 3 of page 1: head 0, which prefill rank 0 sends; with MLA 4:1 (4 pages over 4
    # replicas) block 1, sent by the rank of salt class (r + 1) % 4 (of decode's peers
    # [0, 1, 2, 3], class c picks rank c). Only that rank sends (a byte the hook flips
    # before its writer's bytes landed would be overwritten: no corruption)
    sender = (r + 1) % 4 if name == "intmla41" else 0
    d[0].corrupt_before_check(r, "kv", index=1, entry=0, byte=3)
    p[sender].p_send(r, 0, 4)
    res = d[0].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "IntegrityError", res
    for n in p:  # the sender from decode's verdict, the others from decode's Abort
        res = n.wait(r)
        assert res["state"] == "Failed", res
    for n in d[1:]:
        if n.wait(r)["state"] == "Success":
            assert n.verify_tp(r) == {"kv": 0, "state": 0, "aux": 0}
    _clean(p + d)


@pytest.mark.parametrize("name", sorted(STAGED))
def test_staged_ops_per_chunk_not_per_token(tpc, room, name):
    """The staged path (forced): each prefill rank posts one PUT per chunk per decode rank
    it feeds (two chunks here) plus its aux rows, not one per token row and head range; the
    bytes are exact (checked in _request) and pages return to the allocators."""
    kind, heads, tp_p, tp_d = DEPLOY[name]
    p, _ = _ranks(tpc, name)
    before = [n.stats()["ops"] for n in p]
    _request(tpc, name, room(), pages=7)
    ops = [n.stats()["ops"] - b for n, b in zip(p, before)]
    targets = max(1, tp_d // tp_p)
    assert all(o <= 3 * targets for o in ops), ops
