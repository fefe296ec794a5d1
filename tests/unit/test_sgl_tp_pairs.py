"""SGLang backend heterogeneous TP (kvxfer.integrations.sglang.tp_pairs) against a
brute-force byte model: every TP pair in {1,2,3,4,6,8}^2 whose sizes divide one another,
head counts {1,2,3,4,6,8,16}, page sizes {1,4}, K/V descriptors of different head sizes.
Each byte of a prefill page encodes (global head, token, byte, descriptor, page); after
every prefill peer's runs are applied, every decode byte must be the expected one, written
exactly once, from a prefill rank holding that head. Mamba / hybrid state the same way, at
every TP pair in {1,2,4,8}^2: tensors of independently split parts, a split dim after outer
rows, one part, replicated; each decode byte of the slot once, from SGLang's sharding;
refusals naming both shapes; SglRegister's state TP fields validated."""

import itertools

import numpy as np
import pytest

from kvxfer.disagg.errors import LayoutMismatch, TpShapeMismatch
from kvxfer.disagg.tp_plan import decode_peers, owned
from kvxfer.integrations.sglang.tp_pairs import decode_sides, pair_plan, shape, state_shapes

pytestmark = pytest.mark.timeout(120)

TPS = (1, 2, 3, 4, 6, 8)
HEADS = (1, 2, 3, 4, 6, 8, 16)
HEAD_BYTES = (6, 4)  # descriptor 0 (K) and 1 (V): different head sizes


def _fits(total, tp):
    return total % tp == 0 if tp <= total else tp % total == 0


def _heads(rank, tp, total):
    a, b = owned(rank, tp, total)
    return list(range(a, b))


def _item_lens(total, tp, ps):
    n = len(_heads(0, tp, total))
    return [ps * n * hb for hb in HEAD_BYTES]


def _page(total, tp, rank, ps, desc, page):
    """Prefill rank's page ``page`` of descriptor ``desc``: [ps, heads, hb] code bytes."""
    hb = HEAD_BYTES[desc]
    out = np.zeros((ps, len(_heads(rank, tp, total)), hb), dtype=np.int64)
    for j, h in enumerate(_heads(rank, tp, total)):
        for t in range(ps):
            out[t, j, :] = (((h * 64 + t) * 16 + np.arange(hb)) * 4 + desc) * 64 + page
    return out.reshape(-1)


def _cases():
    for tp_p, tp_d, total, ps in itertools.product(TPS, TPS, HEADS, (1, 4)):
        if max(tp_p, tp_d) % min(tp_p, tp_d):
            continue
        if _fits(total, tp_p) and _fits(total, tp_d):
            yield tp_p, tp_d, total, ps


CASES = list(_cases())


def test_case_count():
    assert len(CASES) > 150


@pytest.mark.parametrize("tp_p,tp_d,total,ps", CASES)
def test_every_head_byte_written_once_from_a_holder(tp_p, tp_d, total, ps):
    pages_p = [3, 0, 5]  # prefill page ids of the room (request order)
    pages_d = [1, 4, 2]
    for d in range(tp_d):
        d_lens = _item_lens(total, tp_d, ps)
        dst = [np.full(6 * n, -1, dtype=np.int64) for n in d_lens]
        writes = [np.zeros(6 * n, dtype=np.int64) for n in d_lens]
        aux = 0
        for p in decode_peers(d, tp_p, tp_d):
            p_lens = _item_lens(total, tp_p, ps)
            plan = pair_plan(shape(tp_p, p, ps, p_lens, total), shape(tp_d, d, ps, d_lens, total))
            aux += plan.sends_aux
            assert plan.whole == (tp_p == tp_d)
            src = [
                np.concatenate([_page(total, tp_p, p, ps, k, g) for g in range(6)])
                for k in range(2)
            ]
            if plan.whole:
                for k in range(2):
                    for sp, dp in zip(pages_p, pages_d):
                        n = p_lens[k]
                        dst[k][dp * n : dp * n + n] = src[k][sp * n : sp * n + n]
                        writes[k][dp * n : dp * n + n] += 1
                continue
            if plan.kv_runs is None:
                assert plan.runs_per_page == 0
                continue
            assert plan.kv_runs.runs_per_item == plan.runs_per_page
            desc, so, do, nb = plan.kv_runs.expand(np.array(pages_p), np.array(pages_d))
            for k, s, t, n in zip(desc, so, do, nb):
                assert s + n <= src[k].size and t + n <= dst[k].size
                dst[k][t : t + n] = src[k][s : s + n]
                writes[k][t : t + n] += 1
        assert aux == 1  # exactly one peer writes the metadata row
        for k in range(2):
            n = d_lens[k]
            room = np.zeros(6 * n, dtype=bool)
            for g in pages_d:
                room[g * n : g * n + n] = True
            assert (writes[k][room] == 1).all() and (writes[k][~room] == 0).all(), (d, k)
            want = np.concatenate(
                [_page(total, tp_d, d, ps, k, g) for g in pages_p]
            )  # decode rank d's heads, of the prefill pages in order
            got = np.concatenate([dst[k][g * d_lens[k] : (g + 1) * d_lens[k]] for g in pages_d])
            assert (got == want).all(), (d, k)


@pytest.mark.parametrize("tp_p,tp_d,total,ps", CASES)
def test_staged_sides_pair_byte_for_byte(tp_p, tp_d, total, ps):
    """The staged path: prefill gathers its side's runs of each page, descriptor-major
    (kvxfer.engine.staging), decode scatters the packed bytes by the runs it derives from
    its own shape alone (decode_sides): every decode byte of the pair's heads lands where
    the PatternWrite would put it."""
    pages_p, pages_d = [3, 0, 5], [1, 4, 2]
    p_lens, d_lens = _item_lens(total, tp_p, ps), _item_lens(total, tp_d, ps)
    for d in range(tp_d):
        dshape = shape(tp_d, d, ps, d_lens, total)
        for p in decode_peers(d, tp_p, tp_d):
            plan = pair_plan(shape(tp_p, p, ps, p_lens, total), dshape)
            mine = decode_sides(dshape, tp_p, p)
            if plan.whole or plan.kv_runs is None:
                assert plan.src_sides is None and plan.dst_sides is None
                assert mine is None
                continue
            assert mine is not None and len(mine) == len(plan.dst_sides) == 2
            for (o1, n1), (o2, n2) in zip(mine, plan.dst_sides):
                assert (o1 == o2).all() and (n1 == n2).all()
            want_desc, so, do, nb = plan.kv_runs.expand(np.array(pages_p), np.array(pages_d))
            for k in range(2):
                src = np.concatenate([_page(total, tp_p, p, ps, k, g) for g in range(6)])
                (s_off, s_len), (d_off, d_len) = plan.src_sides[k], mine[k]
                assert (s_len == d_len).all()
                packed = np.concatenate(
                    [
                        src[g * p_lens[k] + o : g * p_lens[k] + o + n]
                        for g in pages_p
                        for o, n in zip(s_off, s_len)
                    ]
                )
                got = np.full(6 * d_lens[k], -1, dtype=np.int64)
                at = 0
                for g in pages_d:
                    for o, n in zip(d_off, d_len):
                        got[g * d_lens[k] + o : g * d_lens[k] + o + n] = packed[at : at + n]
                        at += n
                assert at == packed.size
                want = np.full(6 * d_lens[k], -1, dtype=np.int64)
                for kk, s_, t_, n_ in zip(want_desc, so, do, nb):
                    if kk == k:
                        want[t_ : t_ + n_] = src[s_ : s_ + n_]
                assert (got == want).all(), (d, p, k)


def test_decode_sides_needs_the_head_count():
    with pytest.raises(TpShapeMismatch, match="total kv head count is unknown"):
        decode_sides(shape(2, 0, 4, [4 * 2 * 6]), 1, 0)
    assert decode_sides(shape(2, 0, 4, [4 * 2 * 6], 4, mla=True), 1, 0) is None
    assert decode_sides(shape(2, 0, 4, [4 * 2 * 6], 4), 2, 0) is None


def test_one_run_per_token_per_descriptor_when_split():
    # 2:1, 8 heads, page 4: prefill rank 1 writes its 4 heads into the second half of
    # every token row of the decode page: 4 runs per page and descriptor
    p = pair_plan(shape(2, 1, 4, [4 * 4 * 6, 4 * 4 * 4], 8), shape(1, 0, 4, [4 * 8 * 6, 4 * 8 * 4]))
    assert p.runs_per_page == 8 and not p.sends_aux
    assert list(p.kv_runs.lens[0]) == [24] * 4 and list(p.kv_runs.dst[0]) == [24, 72, 120, 168]
    # 1:2 with page 1: one contiguous run per page and descriptor
    q = pair_plan(shape(1, 0, 1, [8 * 6, 8 * 4], 8), shape(2, 1, 1, [4 * 6, 4 * 4], 8))
    assert q.runs_per_page == 2 and q.sends_aux
    assert list(q.kv_runs.src[0]) == [24] and list(q.kv_runs.lens[0]) == [24]


def test_prefill_replicas_send_once():
    # 2 heads, prefill tp 4 (replicas 0,1 hold head 0; 2,3 head 1), decode tp 1
    d = shape(1, 0, 1, [2 * 6, 2 * 4], 2)
    plans = [pair_plan(shape(4, r, 1, [6, 4], 2), d) for r in range(4)]
    assert [p.kv_runs is not None for p in plans] == [True, False, True, False]
    assert [p.sends_aux for p in plans] == [True, False, False, False]


def test_mla_is_whole_items_at_any_ratio():
    p = pair_plan(shape(2, 1, 4, [576], mla=True), shape(4, 2, 4, [576], mla=True))
    assert p.whole and p.kv_runs is None and p.sends_aux
    with pytest.raises(TpShapeMismatch, match="kv item sizes differ"):
        pair_plan(shape(2, 1, 4, [576], mla=True), shape(4, 2, 4, [512], mla=True))


@pytest.mark.parametrize(
    "pf,dc,match",
    [
        (shape(2, 0, 4, [96], 4), shape(3, 0, 4, [64], 4), "must divide"),
        (shape(4, 0, 4, [32], 6), shape(2, 0, 4, [96], 6), "do not split"),
        (shape(2, 0, 4, [96], 4), shape(1, 0, 4, [96], 4), "are not pages of"),
        (shape(2, 0, 4, [96], 0), shape(1, 0, 4, [192], 4), "unknown"),
        (shape(2, 0, 4, [96], 4), shape(1, 0, 4, [192], 8), "head counts differ"),
        (shape(2, 0, 4, [96], 4), shape(1, 0, 2, [96], 4), "page sizes"),
        (shape(2, 0, 4, [96, 96], 4), shape(1, 0, 4, [192], 4), "descriptor counts"),
        (shape(4, 0, 4, [48], 4), shape(2, 1, 4, [96], 4), "peers are tp ranks \\[2, 3\\]"),
        (shape(1, 0, 4, [96], 4), shape(2, 1, 4, [48], 4, mla=True), "MLA on one side"),
    ],
)
def test_refused_naming_both_shapes(pf, dc, match):
    with pytest.raises(TpShapeMismatch, match=match) as ei:
        pair_plan(pf, dc)
    assert isinstance(ei.value, LayoutMismatch)
    msg = str(ei.value)
    assert f"prefill tp {pf.tp_rank}/{pf.tp_size}" in msg
    assert f"decode tp {dc.tp_rank}/{dc.tp_size}" in msg


# ------------------------------------------------------------------ Mamba / hybrid state
#: state tensors as SGLang's MambaPool states them at TP 1: (bytes of one row of the split
#: dim, full rows (0: replicated, then the slot's bytes are ``row``), outer rows, full
#: part sizes or None)
TENSORS = (
    (6, 48, 1, [32, 8, 8]),  # Mamba2 / GDN conv: parts split on their own
    (2, 32, 3, [16, 8, 8]),  # KimiLinear conv [K-1, q|k|v]
    (3, 16, 2, None),  # one-part [2, dim]
    (10, 8, 1, None),  # temporal (heads)
    (20, 0, 1, None),  # replicated
    (4, 8, 1, [6, 4]),  # parts not summing to the dim: one part (SGLang's rule)
)
STATE_TPS = (1, 2, 4, 8)


def _state_meta(tp):
    lens, dims, outer, groups = [], [], [], []
    for row, full, o, g in TENSORS:
        lens.append(row if full == 0 else o * (full // tp) * row)
        dims.append(full // tp)
        outer.append(o)
        groups.append(g)
    return lens, dims, outer, groups


def _slot(tp, rank, i):
    """Codes of rank ``rank``'s slot of tensor ``i``: each byte (outer row, global row,
    byte) once, from SGLang's sharding: every part split on its own, parts back to back."""
    row, full, o, g = TENSORS[i]
    if full == 0:
        return np.arange(row, dtype=np.int64) + 10**6
    parts = g if g and sum(g) == full else [full]
    rows, base = [], 0
    for n in parts:
        k = n // tp
        rows += list(range(base + rank * k, base + rank * k + k))
        base += n
    out = [((oi * full + r) * row + b) for oi in range(o) for r in rows for b in range(row)]
    return np.asarray(out, dtype=np.int64)


def _state_shape(tp, rank):
    return shape(
        tp, rank, 1, [8 // tp * 4], 8, states=state_shapes(*map(lambda x: [x], _state_meta(tp)))
    )


@pytest.mark.parametrize("tp_p,tp_d", list(itertools.product(STATE_TPS, STATE_TPS)))
def test_every_state_byte_written_once_from_a_holder(tp_p, tp_d):
    slots = 5
    src_slot, dst_slot = 3, 1
    for d in range(tp_d):
        lens_d = _state_meta(tp_d)[0]
        dst = [np.full(slots * n, -1, dtype=np.int64) for n in lens_d]
        writes = [np.zeros(slots * n, dtype=np.int64) for n in lens_d]
        for p in decode_peers(d, tp_p, tp_d):
            lens_p = _state_meta(tp_p)[0]
            plan = pair_plan(_state_shape(tp_p, p), _state_shape(tp_d, d))
            (st,) = plan.state
            src = []
            for i, n in enumerate(lens_p):
                buf = np.full(slots * n, -2, dtype=np.int64)
                buf[src_slot * n : (src_slot + 1) * n] = _slot(tp_p, p, i)
                src.append(buf)
            if tp_p == tp_d:
                assert st.whole and st.runs is None
                for i, n in enumerate(lens_p):
                    dst[i][dst_slot * n : (dst_slot + 1) * n] = src[i][src_slot * n :][:n]
                    writes[i][dst_slot * n : (dst_slot + 1) * n] += 1
                continue
            assert not st.whole
            if st.runs is None:
                continue
            desc, so, do, nb = st.runs.expand(np.array([src_slot]), np.array([dst_slot]))
            for i, s, t, n in zip(desc, so, do, nb):
                dst[i][t : t + n] = src[i][s : s + n]
                writes[i][t : t + n] += 1
            # runs: one per part per outer row of a split tensor at most, one for the rest
            for i, (_, full, o, g) in enumerate(TENSORS):
                n_parts = len(g) if g and sum(g) == full else 1
                assert st.runs.lens[i].size <= (o * n_parts if full else 1)
        for i, n in enumerate(lens_d):
            w = writes[i][dst_slot * n : (dst_slot + 1) * n]
            assert (w == 1).all() and writes[i].sum() == n, (d, i)
            got = dst[i][dst_slot * n : (dst_slot + 1) * n]
            assert (got == _slot(tp_d, d, i)).all(), (d, i)


def test_state_plan_is_one_run_per_part_per_outer_row():
    plan = pair_plan(_state_shape(1, 0), _state_shape(2, 1))
    (st,) = plan.state
    assert [n.size for n in st.runs.lens] == [3, 9, 2, 1, 1, 1]
    assert st.runs.lens[0].tolist() == [16 * 6, 4 * 6, 4 * 6]  # x, B, C halves
    # the replicated tensor: from the first peer only (2:1: prefill rank 0)
    (s0,) = pair_plan(_state_shape(2, 0), _state_shape(1, 0)).state
    (s1,) = pair_plan(_state_shape(2, 1), _state_shape(1, 0)).state
    assert s0.runs.lens[4].tolist() == [20] and s1.runs.lens[4].size == 0


def _with_states(tp, rank, **changes):
    lens, dims, outer, groups = _state_meta(tp)
    meta = {**dict(lens=lens, dims=dims, outer=outer, groups=groups), **changes}
    st = state_shapes([meta["lens"]], [meta["dims"]], [meta["outer"]], [meta["groups"]])
    return shape(tp, rank, 1, [8 // tp * 4], 8, states=st)


@pytest.mark.parametrize(
    "dc,match",
    [
        (_with_states(1, 0, dims=[]), "decode states no per-tensor TP dims"),
        (_with_states(1, 0, dims=[49, 32, 16, 8, 0, 8]), "state 0: .*do not fit"),
        (_with_states(1, 0, outer=[1, 1, 2, 1, 1, 1]), "state 0: .*segment 0 differs"),
        (_with_states(1, 0, lens=[288, 192, 96, 80, 24, 32]), "state 0: .*differ"),
        (
            _with_states(1, 0, groups=[[32, 8, 8], [16, 8, 8], None, None, None, [5, 3]]),
            "state 0: .*segments",
        ),
        (shape(1, 0, 1, [32], 8), "state type counts differ"),
    ],
)
def test_state_refused_naming_both_shapes(dc, match):
    with pytest.raises(TpShapeMismatch, match=match) as ei:
        pair_plan(_state_shape(2, 0), dc)
    msg = str(ei.value)
    assert "prefill tp 0/2" in msg and "decode tp 0/1" in msg


def test_state_equal_tp_needs_equal_slots():
    (st,) = pair_plan(_state_shape(2, 1), _state_shape(2, 1)).state
    assert st.whole
    other = _with_states(2, 1, lens=[144, 96, 48, 40, 24, 16])
    with pytest.raises(TpShapeMismatch, match="state 0: item sizes differ"):
        pair_plan(_state_shape(2, 1), other)


def test_register_checks_state_tp_fields():
    from kvxfer.errors import ProtocolError
    from kvxfer.integrations.sglang.messages import SglRegister

    base = dict(
        endpoint="h",
        port=1,
        engine_host="h",
        engine_port=2,
        name="n",
        tp_size=2,
        tp_rank=0,
        page_size=1,
        dtype="bf16",
        kv_item_lens=[8],
        aux_item_lens=[8],
        state_types=["mamba"],
        state_item_lens=[[12, 8]],
    )
    ok = SglRegister(
        **base, state_dims=[[2, 1]], state_outer=[[1, 1]], state_groups=[[[2, 2], None]]
    )
    assert ok.check() is ok
    assert SglRegister(**base).check()  # a decode that states none: equal TP only
    for bad in (
        dict(state_dims=[[2]]),
        dict(state_dims=[[2, -1]]),
        dict(state_dims=[[2, True]]),
        dict(state_outer=[[1, 1], [1]]),
        dict(state_groups=[[3, None]]),
        dict(state_groups=[[["x"], None]]),
        dict(state_dims=[2]),
    ):
        with pytest.raises(ProtocolError):
            SglRegister(**base, **bad).check()
