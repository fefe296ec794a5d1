"""Different page sizes on the two sides and decode-side prefix reuse, multi-process on real
UCX loopback: every byte of decode's pages checked — tokens [K, n) carry prefill's content,
every other byte (the prefix, past the end) is untouched — plus the fence and leak checks.

Content is token-keyed (pd_harness.Node._token_bytes), so a 16-token page and a 64-token page
of the same tokens hold the same bytes at different places."""

import pytest
from pd_harness import FAST, Worker
from testenv import DEVICE

KINDS = ("mha", "mha_hnd", "page_major", "mla")
TOKEN_MAJOR = ("mha", "mla")  # one segment per kv descriptor (TokenGeometry.token_major)
#: (pool kind, page size, forced patterns) of the nodes on each side: node name = kind + page
#: size, "pat_" first for KVManager(tp_pattern="always") (byte runs as one PatternWrite per
#: piece class, as a same-host CUDA lane takes them; on CPU the engine posts their runs)
NODES = [(kind, ps, pat) for kind in KINDS for ps in (16, 64) for pat in (False, True)]


def _name(kind, ps, pattern=False):
    return f"{'pat_' if pattern else ''}{kind}{ps}"


@pytest.fixture(scope="module")
def pc():
    from kvxfer.disagg import BootstrapServer

    bs = {_name(*k): BootstrapServer(port=0).start_in_thread() for k in NODES}
    spec = {
        _name(k, ps, pat): dict(
            kind=k,
            page_size=ps,
            size=1024,
            timeouts=FAST,
            device=DEVICE,
            tp_pattern="always" if pat else "auto",
        )
        for k, ps, pat in NODES
    }
    p = Worker({n: dict(kw, role="prefill", bootstrap=bs[n].address) for n, kw in spec.items()})
    d = Worker({n: dict(kw, role="decode", bootstrap=bs[n].address) for n, kw in spec.items()})
    p.ready()
    d.ready()
    p.bs = bs
    try:
        yield p, d
    finally:
        for w in (p, d):
            w.request_exit()
        for w in (p, d):
            w.close()
        for s in bs.values():
            s.stop_thread()


def _clean(*nodes):
    for w, n in nodes:
        assert w[n].leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}, n
        f = w[n].fence_check()
        assert f["pages"] == f["slots"] == f["rows"] == f["guards"] == [], (n, f)


def _run(pc, room, kind, pp, pd, tokens, prefix, declare=True, decode_first=False, pattern=False):
    """One request ``kind`` from page size ``pp`` to ``pd``, every byte checked.
    ``decode_first``: decode's metadata reaches prefill before its KVSender exists.
    ``pattern``: through the nodes that force PatternWrites (byte runs go as those only)."""
    p, d = pc
    pn, dn = _name(kind, pp, pattern), _name(kind, pd, pattern)
    kinds = p[pn].kv_write_kinds()
    if decode_first:
        d[dn].d_open_tokens(room, tokens, prefix, addr=p.bs[pn].address, declare=declare)
        assert p[pn].record(room) == "pending"
    p[pn].p_open_tokens(room, tokens)
    if not decode_first:
        d[dn].d_open_tokens(room, tokens, prefix, addr=p.bs[pn].address, declare=declare)
    n_src = -(-tokens // pp)
    p[pn].p_send(room, 0, min(2, n_src))  # two chunks: the first ends mid decode page
    if n_src > 2:
        p[pn].p_send(room, 2, n_src)
    res = d[dn].wait(room)
    assert res["state"] == "Success", res
    assert p[pn].wait(room)["state"] == "Success"
    whole = pp == pd and prefix % pp == 0
    n_dst = -(-tokens // pd)
    if whole:
        upto = n_dst * pd  # whole pages: the last page's slots past the end come along
    elif declare:
        upto = tokens
    else:
        upto = min(n_src * pp, n_dst * pd)
    bad = d[dn].verify_tokens(room, prefix, upto)
    assert bad == {"content": 0, "untouched": 0, "state_aux": 0}, (kind, pp, pd, prefix, bad)
    after = p[pn].kv_write_kinds()
    new = {k: v - kinds.get(k, 0) for k, v in after.items() if v != kinds.get(k, 0)}
    if whole:
        assert set(new) == {"ItemWrite"}, new
    else:  # byte runs: PatternWrites when forced or (auto) the device lane takes them,
        # except token-major rows (one segment per descriptor), which merge into fewer runs
        # than device_min_ops in requests this small and go as those (RoomPages.few_runs)
        lanes = p[pn].device_lanes()
        lane = bool(lanes) and all(can for _, _, can in lanes.values())
        few = kind in TOKEN_MAJOR
        want = "PatternWrite" if pattern or (lane and not few) else "RawWrite"
        assert set(new) == {want}, (new, lanes)
    _clean((p, pn), (d, dn))


CASES = [
    # kind, prefill page, decode page, tokens, decode prefix
    ("mha", 16, 64, 150, 0),  # 16 -> 64, partial last pages on both sides
    ("mha", 64, 16, 150, 0),  # 64 -> 16
    ("mha", 16, 64, 150, 37),  # prefix not aligned to either page size
    ("mha", 64, 16, 150, 64),  # prefix aligned to both
    ("mha", 64, 16, 150, 149),  # K = n - 1: one token moves
    ("mha", 16, 16, 150, 37),  # equal page sizes, unaligned prefix: byte runs
    ("mha", 16, 16, 150, 32),  # equal page sizes, aligned prefix: whole pages
    ("mha", 16, 64, 128, 0),  # no partial page
    ("mha_hnd", 16, 64, 150, 37),  # H segments per page
    ("mha_hnd", 64, 16, 150, 0),
    ("page_major", 16, 64, 130, 5),
    ("page_major", 64, 16, 130, 70),
    ("page_major", 64, 64, 130, 100),
    ("mla", 16, 64, 100, 17),
    ("mla", 64, 16, 100, 0),
]


@pytest.mark.parametrize("kind,pp,pd,tokens,prefix", CASES)
def test_pages_and_prefix_byte_exact(pc, room, kind, pp, pd, tokens, prefix):
    _run(pc, room(), kind, pp, pd, tokens, prefix)


#: byte runs as PatternWrites (tp_pattern="always", equal TP): both directions, prefixes
#: unaligned / aligned / the last token, partial last pages, equal page sizes with an
#: unaligned prefix, every pool form
PATTERN_CASES = [
    ("mha_hnd", 16, 64, 150, 37),  # the H200 gap's shape: HND, 16 -> 64, prefix 37
    ("mha_hnd", 64, 16, 150, 0),
    ("mha", 16, 64, 150, 37),
    ("mha", 64, 16, 150, 149),
    ("mha", 16, 16, 150, 37),
    ("mha", 16, 64, 128, 0),
    ("page_major", 16, 64, 130, 5),
    ("page_major", 64, 16, 130, 70),
    ("mla", 16, 64, 100, 17),
    ("mla", 64, 64, 100, 33),
    ("mha", 64, 64, 150, 64),  # whole pages: still an ItemWrite
]


@pytest.mark.parametrize("kind,pp,pd,tokens,prefix", PATTERN_CASES)
def test_pages_and_prefix_as_patterns_byte_exact(pc, room, kind, pp, pd, tokens, prefix):
    _run(pc, room(), kind, pp, pd, tokens, prefix, pattern=True)


def test_undeclared_token_count_moves_the_shared_slots(pc, room):
    """SGLang's unchanged call (no num_tokens): the slots both sides' pages hold move."""
    _run(pc, room(), "mha", 16, 64, 150, 0, declare=False)
    _run(pc, room(), "mha", 64, 16, 150, 20, declare=False, decode_first=True)
    _run(pc, room(), "mha_hnd", 64, 16, 150, 20, declare=False, pattern=True)


def test_shape_reaches_prefill_before_its_sender(pc, room):
    """Decode's prefix and token count wait in prefill's 'pending' record."""
    _run(pc, room(), "page_major", 16, 64, 100, 33, decode_first=True)


def test_bad_shapes_are_refused(pc, room):
    p, d = pc
    from kvxfer.errors import RemoteError

    # decode-side checks: send_metadata raises, nothing is sent
    for prefix, pages, err in ((151, None, "InvalidArgument"), (10, 4, "ShapeMismatch")):
        r = room()
        with pytest.raises(RemoteError, match=err):
            d["mha64"].d_open_tokens(r, 150, prefix, addr=p.bs["mha16"].address, pages=pages)
        d["mha64"].abort(r)
        assert d["mha64"].wait(r)["state"] == "Failed"
    r = room()
    # prefill holds 150 tokens at 16 (10 pages), decode declares 250 at 64 (4 pages)
    p["mha16"].p_open_tokens(r, 150)
    d["mha64"].d_open_tokens(r, 250, 0, addr=p.bs["mha16"].address)
    for w, n in ((p, "mha16"), (d, "mha64")):
        res = w[n].wait(r)
        assert res["state"] == "Failed" and res["exc"] == "ShapeMismatch", res
        assert "250 tokens" in res["msg"], res
    _clean((p, "mha16"), (d, "mha64"))
