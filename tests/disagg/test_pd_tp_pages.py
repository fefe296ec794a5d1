"""Heterogeneous TP combined with different page sizes and decode-side prefixes (aligned or
not) and a last partial page, multi-process on real UCX loopback: every TP rank is its own
process (prefill ranks 0-3, decode ranks 0-3: eight workers, each hosting its rank of every
deployment below). Content is token-keyed per global head (tp_harness._fill_tokens), so each
decode rank checks every byte of its pages against what it would hold had it computed the
request itself: tokens [K, n) its heads' content, every other byte (its own prefix K, the
slots past n) untouched; the state slot and aux row as prefill's; fences and leaks on every
rank."""

import pytest
from pd_harness import FAST
from testenv import DEVICE
from tp_harness import TpWorker

pytestmark = pytest.mark.timeout(120)

#: deployment -> (pool kind, total kv heads, prefill tp, decode tp, prefill page, decode page);
#: every ratio, both page-size directions and equal pages, every pool form (NHD, HND,
#: page-major, MLA latent, hybrid with Mamba state), heads replicated on decode (pm14)
DEPLOY = {
    "nhd12_16_64": ("mha", 4, 1, 2, 16, 64),
    "hnd21_64_16": ("mha_hnd", 4, 2, 1, 64, 16),
    "pm14_64_16": ("page_major", 2, 1, 4, 64, 16),  # 2 heads over 4 decode ranks
    "mla41_16_64": ("mla", 1, 4, 1, 16, 64),  # one of four prefill ranks sends
    "hyb24_16_64": ("hybrid_per_layer", 4, 2, 4, 16, 64),  # + conv x|B|C and temporal rows
    "hnd12_16_16": ("mha_hnd", 4, 1, 2, 16, 16),  # equal pages: unaligned prefix, partial end
    "int12_16_64": ("mha_hnd", 4, 1, 2, 16, 64),  # integrity mode: byte runs refused
    # PatternWrite forced (tp_pattern="always", PATTERN): one per piece class (a device-lane
    # launch each on CUDA, where "auto" picks it for every deployment; expanded runs on CPU)
    "pat12_16_64": ("mha", 4, 1, 2, 16, 64),
    "pat41_64_16": ("page_major", 4, 4, 1, 64, 16),
    # equal TP (no TP pair: the token geometry's byte runs) with PatternWrites forced
    "pat22_16_64": ("hybrid_per_layer", 4, 2, 2, 16, 64),
}
INTEGRITY = {"int12_16_64"}
PATTERN = {"pat12_16_64", "pat41_64_16", "pat22_16_64"}
#: (tokens, decode prefix): whole pages on both sides; a prefix aligned to both page sizes;
#: an unaligned prefix with a partial last page on both sides; a request inside one page of
#: either size; only the last token left to move
REQUESTS = ((256, 0), (200, 64), (150, 37), (33, 17), (100, 99))


@pytest.fixture(scope="module")
def tpc():
    from kvxfer.disagg import BootstrapServer

    bs = {name: BootstrapServer(port=0).start_in_thread() for name in DEPLOY}
    specs = {}
    for name, (kind, heads, tp_p, tp_d, ps_p, ps_d) in DEPLOY.items():
        for role, tp, ps in (("prefill", tp_p, ps_p), ("decode", tp_d, ps_d)):
            for r in range(tp):
                specs.setdefault((role, r), {})[name] = dict(
                    kind=kind,
                    role=role,
                    bootstrap=bs[name].address,
                    timeouts=FAST,
                    device=DEVICE,
                    size=1024,
                    page_size=ps,
                    aux_rows=64,
                    name=f"{name}-{role[0]}{r}",
                    tp=(r, tp, heads),
                    integrity=name in INTEGRITY,
                    tp_pattern="always" if name in PATTERN else "auto",
                )
    workers = {k: TpWorker(v, name=f"tpg-{k[0]}{k[1]}") for k, v in specs.items()}
    for w in workers.values():
        w.ready()
    try:
        yield workers
    finally:
        for w in workers.values():
            w.request_exit()
        for w in workers.values():
            w.close()
        for s in bs.values():
            s.stop_thread()


def _ranks(workers, name):
    _, _, tp_p, tp_d, _, _ = DEPLOY[name]
    return (
        [workers[("prefill", r)][name] for r in range(tp_p)],
        [workers[("decode", r)][name] for r in range(tp_d)],
    )


def _clean(nodes):
    for n in nodes:
        assert n.leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}
        f = n.fence_check()
        assert f["pages"] == f["slots"] == f["rows"] == f["guards"] == [], f


def _open(workers, name, room, tokens, prefix, decode_first):
    p, d = _ranks(workers, name)
    if decode_first:
        for n in d:
            n.d_open_tokens(room, tokens, prefix)
    for n in p:
        n.p_open_tp_tokens(room, tokens)
    if not decode_first:
        for n in d:
            n.d_open_tokens(room, tokens, prefix)
    n_src = -(-tokens // DEPLOY[name][4])
    cut = 1 if n_src > 1 else 0  # two chunks (the first ends inside a decode page when the
    for n in p:  # sizes differ), one when the request is one page
        if cut:
            n.p_send(room, 0, cut)
    for n in p:
        n.p_send(room, cut, n_src)
    return p, d


@pytest.mark.parametrize("tokens,prefix", REQUESTS)
@pytest.mark.parametrize("name", [n for n in DEPLOY if n not in INTEGRITY])
def test_hetero_tp_pages_prefix_byte_exact(tpc, room, name, tokens, prefix):
    _, _, tp_p, tp_d, ps_p, ps_d = DEPLOY[name]
    r = room()
    before = [n.kv_write_kinds() for n in _ranks(tpc, name)[0]]
    p, d = _open(tpc, name, r, tokens, prefix, decode_first=(tokens + prefix) % 2 == 1)
    for n in d + p:
        res = n.wait(r)
        assert res is not None and res["state"] == "Success", (name, res)
    if name in PATTERN:  # (page sizes differ there: never whole pages) every kv write a pattern
        for n, was in zip(p, before):
            now = n.kv_write_kinds()
            new = {k for k, v in now.items() if v != was.get(k, 0)}
            assert new == {"PatternWrite"}, (name, now, was)
    # whole pages (equal sizes, aligned prefix) carry the last page's slots past the end
    whole = ps_p == ps_d and prefix % ps_p == 0
    upto = -(-tokens // ps_d) * ps_d if whole else tokens
    for i, n in enumerate(d):
        assert n.verify_tp_tokens(r, prefix, upto) == {"kv": 0, "state": 0, "aux": 0}, (name, i)
    _clean(p + d)


def test_integrity_refuses_byte_runs_naming_the_shape(tpc, room):
    """Integrity checksums whole pages: a hetero-TP room that needs byte runs fails on every
    rank with UnsupportedOperation naming both TP sizes and page sizes (never silently)."""
    r = room()
    p, d = _open(tpc, "int12_16_64", r, 150, 0, decode_first=False)
    for n in p + d:
        res = n.wait(r)
        assert res is not None and res["state"] == "Failed", res
    msg = p[0].wait(r)
    assert msg["exc"] == "UnsupportedOperation", msg
    assert "prefill tp 1, decode tp 2" in msg["msg"] and "page size 16, decode 64" in msg["msg"]
    for n in d:
        n.verify_tp_tokens(r, 0, 0)  # frees
    _clean(p + d)
