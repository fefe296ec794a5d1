#!/usr/bin/env bash
# Follow-up of lane_copy.sh on the H200: (1) the allocator, offload and engine tests on CUDA;
# (2) `kvxfer bench offload` with the manager's batch copy (default batch_min_piece_bytes)
# against the kernel only (--batch-min-piece-kib 0), twice, alternating; (3) the trees A/B
# (bench/gpu/trees.sh: this tree against .whl/base.tar) of `kvxfer bench pd`, which moves the
# demo pool's allocator too. Writes $OUT/batch_confirm.md (+ trees.md, JSON).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} UCX_WARN_UNUSED_ENV_VARS=n
rc=0
{
echo "# Batch-copy follow-up on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
python3 setup.py -q build_ext --inplace 2>&1 | grep -E "error|Error"
echo; echo "## tests on CUDA: allocator, offload, device lane"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/pools/test_allocator.py \
    tests/offload tests/engine/test_devcopy_unit.py tests/engine/test_engine.py 2>&1 | tail -6 || rc=1
echo '```'
for r in 1 2; do
    for k in default 0; do
        echo; echo "## bench offload round $r, batch_min_piece: $k"
        timeout 150 python3 -m kvxfer bench offload --device cuda --layouts mha,mha_hnd --pages 8,32,128,512 \
            $( [ $k = 0 ] && echo --batch-min-piece-kib 0 ) --json-out "$OUT/offload_${k}_$r.json" 2>&1 | grep "^|" || rc=1
    done
done
} 2>&1 | tee "$OUT/batch_confirm.md"
ROUNDS=${ROUNDS:-2} PD_ARGS=${PD_ARGS:---modes none --latency-requests 300 --throughput-requests 2000 --large-pages 256 --iters 3} \
    bash bench/gpu/trees.sh || rc=1
exit $rc
