"""The TP shares of the real-model check, in one process (no transfer): a whole-model cache
stored as TP ranks' shares (each rank's pool in its own geometry), read back and gathered, is
byte-identical to the cache stored whole; replicas that disagree are counted, a missing share
is refused."""

import pytest
import torch

from kvxfer.errors import InvalidArgument
from kvxfer.pd_demo.hf import PagedModelCache, build_model, prefill

pytestmark = pytest.mark.timeout(120)

LAYOUTS = {"llama": "hnd", "bamba": "nhd+per_layer", "deepseek": "mla"}
N = 11  # tokens: a partial second page


def _cache(model, name, tp=(0, 1)):
    return PagedModelCache(
        model, name, LAYOUTS[name], page_size=8, pool_tokens=64, mamba_slots=2, aux_rows=2, tp=tp
    )


def _stored(pmc, cache):
    res = pmc.alloc(N)
    locs = pmc.locs(res["pages"], N)
    pmc.store_rows(cache, locs, 0, N)
    if res["slot"] is not None:
        pmc.store_state(cache, res["slot"])
    return res, locs


def _snapshot(pmc, res, locs):
    out = [t.clone() for lid in pmc.attn_ids for t in _rows(pmc, lid, locs)]
    if res["slot"] is not None:
        out += [v[res["slot"]].clone() for v in pmc.pool.get_state_item_views()]
    return out


def _rows(pmc, lid, locs):
    if pmc.mla:
        return pmc.pool.get_mla_kv_buffer(lid, locs)
    return pmc.pool.get_kv_rows(lid, locs)


@pytest.fixture(scope="module")
def models():
    return {name: build_model(name) for name in LAYOUTS}


# tp 2: heads, conv parts and SSM heads split; tp 4: llama's 2 heads replicated too
CASES = [("llama", 2), ("llama", 4), ("bamba", 2), ("deepseek", 2)]


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_shares_gather_to_the_whole_cache(models, name, tp):
    model = models[name]
    cache, _ = prefill(model, list(range(3, 3 + N)))
    whole = _cache(model, name)
    res, locs = _stored(whole, cache)
    want = _snapshot(whole, res, locs)

    shares = []
    for r in range(tp):
        rank = _cache(model, name, (r, tp))
        assert rank.kv_args.tp_size == tp and rank.kv_args.tp_rank == r
        if name != "deepseek":  # 2 KV heads: split at tp 2, replicated at tp 4
            assert rank.heads == ((r, r + 1) if tp == 2 else (r // 2, r // 2 + 1))
        rres, rlocs = _stored(rank, cache)
        shares.append(rank.read_share(rlocs, rres["slot"]))

    gathered = _cache(model, name)
    gres = gathered.alloc(N)
    glocs = gathered.locs(gres["pages"], N)
    assert gathered.write_shares(shares, glocs, gres["slot"]) == 0
    got = _snapshot(gathered, gres, glocs)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))

    if tp == 4 or name == "deepseek":  # something is replicated: a disagreeing copy counts
        shares[-1]["k"][0] = shares[-1]["k"][0].clone()
        shares[-1]["k"][0][0, 0, 0] += 1
        assert gathered.write_shares(shares, glocs, gres["slot"]) == 1
    with pytest.raises(InvalidArgument):
        gathered.write_shares(shares[:1] if name != "deepseek" else [], glocs, gres["slot"])
