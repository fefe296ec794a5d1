"""The kvxfer backend's heterogeneous-TP mapping (kvxfer.integrations.sglang.tp_pairs) is
SGLang's: its own ``CommonKVManager._resolve_rank_mapping`` (target ranks and response
counts, run on a stand-in manager) and ``compute_head_slice_params`` (which heads each
pair moves), for every TP pair in {1,2,4,8}^2 and 1..16 KV heads. No processes: pure calls.

One deliberate difference: where several prefill peers hold the same head (prefill TP >
KV heads), SGLang has every replica write it (identical bytes, several times); kvxfer has the
first replica write it and the others only complete the room."""

import itertools
from types import SimpleNamespace

import pytest

pytest.importorskip(
    "sglang",
    reason="sglang is not installed here: `make test-sglang` runs these tests in .venv-sglang",
)

from sglang.srt.disaggregation.common.conn import CommonKVManager  # noqa: E402
from sglang.srt.disaggregation.common.staging_buffer import (  # noqa: E402
    compute_head_slice_params,
)

from kvxfer.disagg.tp_plan import decode_peers, prefill_peers  # noqa: E402
from kvxfer.integrations.sglang.tp_pairs import pair_plan, shape  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8, 16)
HB = 4  # bytes of one head of one token


def _sglang_mapping(tp_p, tp_d, d):
    mgr = SimpleNamespace(
        is_mla_backend=False,
        is_hybrid_mla_backend=False,
        attn_tp_size=tp_d,
        attn_cp_size=1,
        attn_cp_rank=0,
        pp_size=1,
        pp_rank=0,
        enable_all_cp_ranks_for_transfer=False,
        kv_args=SimpleNamespace(engine_rank=d),
    )
    info = SimpleNamespace(
        attn_tp_size=tp_p, attn_cp_size=1, pp_size=1, enable_kv_cache_sharding=False
    )
    CommonKVManager._resolve_rank_mapping(mgr, info)
    return info


def _fits(total, tp):
    return total % tp == 0 if tp <= total else tp % total == 0


@pytest.mark.parametrize("tp_p,tp_d", list(itertools.product(TPS, TPS)))
def test_ranks_and_heads_are_sglangs(tp_p, tp_d):
    for d in range(tp_d):
        info = _sglang_mapping(tp_p, tp_d, d)
        peers = decode_peers(d, tp_p, tp_d)
        assert list(info.target_tp_ranks) == list(peers)
        assert info.required_prefill_response_num == len(peers)
        for p in peers:  # prefill rank p awaits metadata from its decode peers
            assert info.required_dst_info_num == len(prefill_peers(p, tp_p, tp_d))
        for total in HEADS:
            if not (_fits(total, tp_p) and _fits(total, tp_d)):
                continue
            h_p, h_d = max(1, total // tp_p), max(1, total // tp_d)
            ours, theirs = set(), set()
            for p in peers:
                s0, n, d0, _ = compute_head_slice_params(tp_p, tp_d, p, d, total)
                theirs |= {(p, s0 + i, d0 + i) for i in range(n)}
                plan = pair_plan(
                    shape(tp_p, p, 1, [h_p * HB] * 2, total),
                    shape(tp_d, d, 1, [h_d * HB] * 2, total),
                )
                if plan.whole:
                    ours |= {(p, i, i) for i in range(h_p)}
                    continue
                if plan.kv_runs is None:
                    continue
                for so, do, n in zip(
                    *(a[0] for a in (plan.kv_runs.src, plan.kv_runs.dst, plan.kv_runs.lens))
                ):
                    ours |= {(p, so // HB + i, do // HB + i) for i in range(n // HB)}
            # every decode head once, each (prefill rank, its head -> decode head) one of SGLang's
            assert ours <= theirs, (d, total)
            assert sorted(h for _, _, h in ours) == list(range(h_d)), (d, total)


# ------------------------------------------------------------------ Mamba / hybrid state
#: per-tensor state descriptors at TP 1: (bytes of one row of the split dim, full rows,
#: outer rows, parts (full sizes) or None); the dim of a replicated tensor is 0 at every TP
STATE_TENSORS = (
    (6, 64, 1, [32, 16, 16]),  # GDN conv x|B|C, each part split on its own
    (4, 32, 3, [16, 8, 8]),  # Kimi conv [K-1, q|k|v]: the split dim after 3 outer rows
    (2, 16, 3, None),  # a one-part [3, dim] conv
    (10, 8, 1, None),  # temporal: heads
    (24, 0, 1, None),  # replicated (no split dim)
)


def _state_shape(tp):
    from kvxfer.integrations.sglang.tp_pairs import state_shapes

    lens, dims, outer, groups = [], [], [], []
    for row, full, o, g in STATE_TENSORS:
        lens.append(row if full == 0 else o * (full // tp) * row)
        dims.append(full // tp)
        outer.append(o)
        groups.append(g)
    return state_shapes([lens], [dims], [outer], [groups])


@pytest.mark.parametrize("tp_p,tp_d", list(itertools.product(TPS, TPS)))
def test_state_slices_are_sglangs(tp_p, tp_d):
    """Every byte block of every state tensor of every (prefill, decode) pair is SGLang's
    own (``compute_mamba_state_slice_byte_blocks``, the Mooncake / NIXL backends' state
    slicing): the same blocks, no more, no fewer; equal TP: the whole slot."""
    from sglang.srt.disaggregation.utils import compute_mamba_state_slice_byte_blocks

    sp, sd = _state_shape(tp_p), _state_shape(tp_d)
    for d in range(tp_d):
        for p in decode_peers(d, tp_p, tp_d):
            plan = pair_plan(
                shape(tp_p, p, 1, [8 // tp_p * HB], 8, states=sp),
                shape(tp_d, d, 1, [8 // tp_d * HB], 8, states=sd),
            )
            (st,) = plan.state
            if tp_p == tp_d:
                assert st.whole
                continue
            for i, (_, full, o, g) in enumerate(STATE_TENSORS):
                theirs = compute_mamba_state_slice_byte_blocks(
                    src_item_len=sp[0].item_lens[i],
                    dst_item_len=sd[0].item_lens[i],
                    src_dim=full // tp_p,
                    dst_dim=full // tp_d,
                    outer_count=o,
                    src_attn_tp_size=tp_p,
                    dst_attn_tp_size=tp_d,
                    dst_tp_rank_in_group=d,
                    local_tp_rank_in_group=p,
                    conv_shard_groups=g,
                )
                ours = []
                if st.runs is not None:
                    ours = list(
                        zip(*(a[i].tolist() for a in (st.runs.src, st.runs.dst, st.runs.lens)))
                    )

                def split(blocks, unit):  # runs merged differently: compare unit by unit
                    return sorted((s + k, t + k) for s, t, n in blocks for k in range(0, n, unit))

                unit = STATE_TENSORS[i][0]
                assert split(ours, unit) == split(theirs, unit), (p, d, i)
                assert len(ours) <= max(1, len(theirs))
