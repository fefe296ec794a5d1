#!/usr/bin/env bash
# The staged heterogeneous-TP path (issue 16: gather head slices -> one PUT per chunk ->
# scatter by decode's own plan) on one H200: the slice tests with CUDA memory (the torch
# strided index_select / index_copy_ gather and scatter), the TP protocol tests with CUDA
# pools (staged deployments st12/st21/st14/st41/st24 included), the TP demo with an NHD
# pool, and `kvxfer bench pd --tp-paths` (direct vs staged vs equal TP, same run) per ratio
# for NHD, page-major and HND. Writes $OUT/stage.md (+ JSON rows). Env STAGE_RATIOS to
# narrow the ratios (default "1:2 2:1 4:1 2:4"), STAGE_TOKENS (default 16000); STAGE_TESTS=0
# skips the tests and the demo (bench rows only, $OUT/stage-bench.md).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
RATIOS=${STAGE_RATIOS:-"1:2 2:1 4:1 2:4"}
TOKENS=${STAGE_TOKENS:-16000}
rc=0
{
echo "# Staged heterogeneous TP on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
if [ "${STAGE_TESTS:-1}" != 0 ]; then
echo; echo "## tests with KVXFER_TEST_DEVICE=cuda"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/test_tp_slices.py \
    tests/engine/test_staged.py tests/disagg/test_pd_tp.py 2>&1 | tail -8 || rc=1
echo '```'
echo; echo "## kvxfer demo --device cuda --prefill-tp 2 --decode-tp 1 --kv-layout per_layer (every byte checked)"; echo '```'
timeout 60 python3 -m kvxfer demo --device cuda --prefill-tp 2 --decode-tp 1 --kv-layout per_layer 2>&1 | grep -v "UCX  WARN" | tail -4 || rc=1
echo '```'
fi
for r in $RATIOS; do
    p=${r%:*}; d=${r#*:}
    echo; echo "## kvxfer bench pd --device cuda --modes none --prefill-tp $p --decode-tp $d --kv-layout per_layer,page_major,hnd --shape-tokens $TOKENS --tp-paths"
    timeout 110 python3 -m kvxfer bench pd --device cuda --modes none --prefill-tp "$p" --decode-tp "$d" \
        --kv-layout per_layer,page_major,hnd --shape-tokens "$TOKENS" --iters 5 --tp-paths \
        --json-out "$OUT/stage-$p-$d.json" 2>&1 | grep -v "UCX  WARN\|WARNING" | tail -16 || rc=1
done
exit $rc
} 2>&1 | tee "$OUT/$([ "${STAGE_TESTS:-1}" != 0 ] && echo stage || echo stage-bench).md"
