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
