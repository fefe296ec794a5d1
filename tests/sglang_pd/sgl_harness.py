"""Test-process side of the SGLang integration tests: what every test module shares.

The environment of the node processes, SGLang's ``KVPoll`` values, starting workers, and the
heterogeneous-TP harness (one process per TP rank, scenarios of ``(kind, total KV heads,
prefill TP, decode TP)`` on their own bootstrap servers, a room opened on every rank, the
byte model of which prefill rank writes which decode head). The node processes' side is
:mod:`sgl_nodes`.
"""

from __future__ import annotations

import contextlib
import random
from typing import Dict, Iterator, List, Tuple

import sgl_nodes as N

from kvxfer.procs import Worker

ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "KVXFER_SECRET": "pd-test",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
}
FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
DONE = [SUCCESS, FAILED]

#: a heterogeneous-TP scenario: (pool kind "mha" / "mla" / one of ``sgl_nodes.STATE_KINDS``,
#: total KV heads, prefill TP, decode TP)
Scenario = Tuple[str, int, int, int]


def state_slot(room: int, rank: int = -1) -> int:
    """The Mamba slot of ``room`` on prefill (``rank`` -1: every prefill rank allocates
    alike) or on decode rank ``rank`` (1..MAMBA_SLOTS)."""
    return 1 + (room + 3 * (rank + 1)) % N.MAMBA_SLOTS


def has_state(cluster, scen: str) -> bool:
    return cluster["scenarios"][scen][0] in N.STATE_KINDS


def start(*workers: Worker, timeout: float = 300) -> None:
    """Launch them all at once, then wait (bounded) until each is built."""
    for w in workers:
        w.launch()
    for w in workers:
        w.ready(timeout)


@contextlib.contextmanager
def hetero_cluster(
    scenarios: Dict[str, Scenario],
    n_prefill: int,
    n_decode: int,
    extra: int = 0,
    env=None,
    scenario_env=None,
    start_timeout: float = 300,
) -> Iterator[dict]:
    """One bootstrap process (a server per scenario, plus ``extra`` spare ones), and one
    process per prefill and per decode TP rank; every scenario built on its ranks (a
    process re-publishes its scheduler config per scenario to act as that rank);
    ``scenario_env``: ``{scenario: {variable: value}}`` set for those managers only.
    Yields ``dict(pf=[proxies], dc=[proxies], ports={scenario: port}, spare=[ports],
    info={scenario: (prefill ranks' add() results, decode ranks' add() results)},
    workers=[...])``."""
    env = dict(ENV, **(env or {}))
    workers = [Worker(N.BootstrapServers, len(scenarios) + extra, name="bootstrap", env=env)]
    workers += [Worker(N.node, "prefill", name=f"prefill-{r}", env=env) for r in range(n_prefill)]
    workers += [Worker(N.node, "decode", name=f"decode-{r}", env=env) for r in range(n_decode)]
    try:
        start(*workers, timeout=start_timeout)
        ports = workers[0].proxy(N.BootstrapServers).ports()
        pfs = [w.proxy(N.PrefillNode) for w in workers[1 : 1 + n_prefill]]
        dcs = [w.proxy(N.DecodeNode) for w in workers[1 + n_prefill :]]
        info = {}
        for (name, (kind, heads, tp_p, tp_d)), port in zip(scenarios.items(), ports):
            kw = dict(heads=heads, env=(scenario_env or {}).get(name), timeout=120)
            p = [pfs[r].add(name, kind, port, tp=(tp_p, r), **kw) for r in range(tp_p)]
            d = [dcs[r].add(name, kind, port, tp=(tp_d, r), **kw) for r in range(tp_d)]
            info[name] = (p, d)
        yield dict(
            pf=pfs,
            dc=dcs,
            ports=dict(zip(scenarios, ports)),
            spare=ports[len(scenarios) :],
            info=info,
            scenarios=dict(scenarios),
            workers=workers,
        )
    finally:
        for w in reversed(workers):
            w.close()


def open_room(
    cluster, scen: str, room: int, n_pages: int, connected: bool = False
) -> Tuple[List[int], List[List[int]]]:
    """Open ``room`` on every rank of ``scen``, fill prefill's pages (the same page ids on
    every prefill rank, as SGLang's TP ranks allocate alike); returns (p_pages, d_pages).
    ``connected``: each decode rank's metadata leaves only once its prefill peers' engines
    reached it (the staged path registers slices with connected peers only)."""
    _, _, tp_p, tp_d = cluster["scenarios"][scen]
    port = cluster["ports"][scen]
    pfs, dcs = cluster["pf"][:tp_p], cluster["dc"][:tp_d]
    rng = random.Random(room)
    p_pages = rng.sample(range(1, 60), n_pages)
    d_pages = [rng.sample(range(1, 60), n_pages) for _ in dcs]
    state = has_state(cluster, scen)
    for pf in pfs:
        assert pf.sender(scen, room, "127.0.0.1", port) == "KvxferKVSender"
        pf.fill(scen, room, p_pages, state_slot(room) if state else None)
    for d, dc in enumerate(dcs):
        assert dc.receiver(scen, room, f"127.0.0.1:{port}")["dp_size"] == 1
        if connected:
            n = len(prefill_peers(d, tp_p, tp_d))
            assert dc.peers(scen, n) == n
        dc.metadata(scen, room, d_pages[d], 3 + d, state_slot(room, d) if state else None)
    for pf in pfs:  # complete only once every decode rank's metadata arrived
        assert pf.wait(room, [WAITING, FAILED], 30) == WAITING
        assert pf.start(scen, room, n_pages * N.PAGE, 5, 9000 + room) == {
            "prefix": 0,
            "pages": n_pages,
        }
    return p_pages, d_pages


def check_and_clear(cluster, scen: str, room: int, n_pages: int, d_pages) -> None:
    """Every decode rank's pages byte for byte, its first token and room; every rank
    Success; then cleared with no table of any rank still holding the room."""
    _, _, tp_p, tp_d = cluster["scenarios"][scen]
    pfs, dcs = cluster["pf"][:tp_p], cluster["dc"][:tp_d]
    state = has_state(cluster, scen)
    for d, dc in enumerate(dcs):
        assert dc.wait(room, DONE, 30) == SUCCESS
        slot = state_slot(room, d) if state else None
        assert dc.read(scen, d_pages[d], slot) == dc.expected(scen, room, n_pages, 0, state)
        assert dc.first_token(scen, 3 + d) == [9000 + room, room]
    for pf in pfs:
        assert pf.wait(room, DONE, 30) == SUCCESS
    clear(cluster, scen, room)


def clear(cluster, scen: str, room: int) -> None:
    _, _, tp_p, tp_d = cluster["scenarios"][scen]
    for node in [*cluster["pf"][:tp_p], *cluster["dc"][:tp_d]]:
        node.clear(room)
        assert node.room_entries(scen, room) == []


# ---------------------------------------------------------------------- the byte model
def heads_of(rank: int, tp: int, total: int) -> List[int]:
    """SGLang's split: ``total/tp`` consecutive heads per rank, or (``tp > total``) the one
    head ``rank // (tp/total)``."""
    if tp <= total:
        n = total // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (tp // total)]


def prefill_peers(d: int, tp_p: int, tp_d: int) -> List[int]:
    """SGLang's ``_resolve_rank_mapping``: the prefill ranks decode rank ``d`` bootstraps with."""
    if tp_p >= tp_d:
        k = tp_p // tp_d
        return list(range(d * k, (d + 1) * k))
    return [d // (tp_d // tp_p)]


def expected_moves(
    scenario: Scenario,
    n_pages: int,
    kv_p: int,
    kv_d: int,
    aux: int,
    staged: bool = False,
    chunks: int = 2,
    descs: int = 0,
):
    """Per prefill rank: ``(bytes it writes, kv PUTs when it writes no metadata row else
    None, the kv PUTs of the direct path)`` for a room of ``n_pages`` pages in ``chunks``
    chunks: each decode head is written once, by the first of the decode rank's peers
    holding it (MLA: the first peer writes whole pages, the others are SGLang's dummies);
    the metadata row by the first peer. A pair that moves part of a page costs one PUT per
    token row of every layer's K and V (NHD pages), whole pages one per layer and K/V;
    ``staged``: one PUT per chunk instead (a landing slot holds a chunk). ``descs``: KV
    descriptors (default: every layer's K and V, or latent)."""
    kind, total, tp_p, tp_d = scenario
    descs = descs or N.LAYERS * (1 if kind == "mla" else 2)
    out = []
    for p in range(tp_p):
        nbytes, ops, direct, sends_aux = 0, 0, 0, False
        for d in range(tp_d):
            peers = prefill_peers(d, tp_p, tp_d)
            if p not in peers:
                continue
            sends_aux |= p == peers[0]
            nbytes += aux if p == peers[0] else 0
            if kind == "mla":
                if p == peers[0]:
                    nbytes += n_pages * kv_d
                    ops += n_pages * descs
                    direct += n_pages * descs
                continue
            hd = heads_of(d, tp_d, total)
            mine = [h for h in hd if next(q for q in peers if h in heads_of(q, tp_p, total)) == p]
            if mine:
                nbytes += n_pages * kv_d * len(mine) // len(hd)
                whole = len(mine) == len(hd) == len(heads_of(p, tp_p, total))
                direct += n_pages * descs * (1 if whole else N.PAGE)
                ops += (
                    chunks if staged and not whole else n_pages * descs * (1 if whole else N.PAGE)
                )
        out.append((nbytes, None if sends_aux else ops, direct))
    return out


def byte_exact(cluster, scen: str, room: int, n_pages: int = 3, staged: bool = False) -> None:
    """A room of ``n_pages`` pages in two chunks on every rank of ``scen``: every byte of
    every decode rank checked, bytes (and PUTs) per prefill rank as :func:`expected_moves`
    says, every table of every rank empty after clear. ``staged``: the scenario's managers
    stage every head-slice chunk (its prefill engines connected before the metadata)."""
    scenario = cluster["scenarios"][scen]
    _, _, tp_p, _ = scenario
    p_pages, d_pages = open_room(cluster, scen, room, n_pages, connected=staged)
    slot = state_slot(room) if has_state(cluster, scen) else None
    for pf in cluster["pf"][:tp_p]:
        assert pf.send(room, p_pages[:2], False) is True
        assert pf.send(room, p_pages[2:], True, slot) is True
    for pf in cluster["pf"][:tp_p]:
        assert pf.wait(room, DONE, 30) == SUCCESS
    p_info, d_info = cluster["info"][scen]
    kv_p = sum(p_info[0]["item_lens"][0])
    kv_d = sum(d_info[0]["item_lens"][0])
    aux = sum(p_info[0]["item_lens"][1])
    descs = len(p_info[0]["item_lens"][0])  # (a hybrid pool: its full-attention layers)
    want = expected_moves(scenario, n_pages, kv_p, kv_d, aux, staged, descs=descs)
    if slot is not None:  # plus each prefill rank's slices of the Mamba slot
        runs = [state_runs(scenario, d_info[d]["state_meta"]) for d in range(len(d_info))]
        want = [
            (b + sb, None if ops is None else ops + sr, direct + sr)
            for (b, ops, direct), (sb, sr) in zip(want, _state_moves(scenario, d_info, runs))
        ]
    got = [pf.metric(room)[0] for pf in cluster["pf"][:tp_p]]
    assert got == [b for b, _, _ in want]
    for pf, (_, ops, direct) in zip(cluster["pf"][:tp_p], want):
        if ops is not None:
            assert pf.write_ops(room)[0] == ops
        elif staged:  # the metadata row's PUTs on top of the staged chunks
            assert pf.write_ops(room)[0] < direct
    check_and_clear(cluster, scen, room, n_pages, d_pages)


def state_runs(scenario: Scenario, meta) -> List[Tuple[int, int, bool]]:
    """Per state tensor of a decode rank (its ``state_meta``: ``[item bytes, dim, outer,
    groups]`` each): ``(bytes, runs one prefill peer writes of it, replicated)``: a split
    tensor takes one run per outer row per part from each peer that holds part of it
    (prefill TP above decode's: each of the ``k`` peers writes 1/k of every part), a
    replicated one (dim 0) one run, from the first peer."""
    _, _, tp_p, tp_d = scenario
    out = []
    for nbytes, dim, outer, groups in meta:
        if dim == 0:
            out.append((nbytes, 1, True))
            continue
        parts = groups if groups and sum(groups) == dim * tp_d else [dim * tp_d]
        out.append((nbytes, outer * len(parts), False))
    return out


def _state_moves(scenario: Scenario, d_info, runs) -> List[Tuple[int, int]]:
    """Per prefill rank: (state bytes it writes, state runs) over the decode ranks it is a
    peer of (:func:`state_runs`)."""
    _, _, tp_p, tp_d = scenario
    out = []
    for p in range(tp_p):
        nbytes = nruns = 0
        for d in range(tp_d):
            peers = prefill_peers(d, tp_p, tp_d)
            if p not in peers:
                continue
            for b, r, repl in runs[d]:
                if repl:
                    nbytes, nruns = nbytes + (b if p == peers[0] else 0), nruns + (p == peers[0])
                else:
                    nbytes, nruns = nbytes + b // len(peers), nruns + r
        out.append((nbytes, nruns))
    return out
