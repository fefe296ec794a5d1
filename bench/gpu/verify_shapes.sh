#!/usr/bin/env bash
# Heterogeneous TP x page sizes x decode prefix on CUDA pools (one H200; one process per rank):
# the multi-process tests and the unit brute force with KVXFER_TEST_DEVICE=cuda, the demo for a
# few shapes (every byte verified by every decode rank), and `kvxfer bench pd` rows of the
# combined shapes against the equal shape. Writes $OUT/verify_shapes.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# Heterogeneous TP x page sizes x prefix on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
echo; echo "## tests with KVXFER_TEST_DEVICE=cuda"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider \
    tests/disagg/test_pd_tp_pages.py tests/unit/test_tp_tokens.py tests/unit/test_tp_shape.py \
    2>&1 | tail -8 || rc=1
echo '```'
echo; echo "## kvxfer demo --device cuda (combined shapes)"; echo '```'
for args in \
    "--prefill-tp 1 --decode-tp 2 --prefill-page-size 16 --decode-page-size 64 --decode-prefix 37 --kv-layout hnd" \
    "--prefill-tp 2 --decode-tp 1 --prefill-page-size 64 --decode-page-size 16 --decode-prefix 64 --kv-layout per_layer" \
    "--prefill-tp 4 --decode-tp 1 --prefill-page-size 16 --decode-page-size 64 --decode-prefix 5 --kv-layout mla --mamba-layout none" \
    "--prefill-tp 2 --decode-tp 4 --prefill-page-size 16 --decode-page-size 16 --decode-prefix 100 --kv-layout hnd --ssm-heads 4"; do
    echo "\$ kvxfer demo --device cuda $args"
    timeout 40 python3 -m kvxfer demo --device cuda --requests 32 $args 2>&1 | grep -v "UCX  WARN" \
        | grep -E "verified|failed|bytes|ops/request|leaks|error" || rc=1
done
echo '```'
echo; echo "## kvxfer bench pd --device cuda (heterogeneous TP, page sizes, prefix vs the equal shape)"
for args in \
    "--prefill-tp 2 --decode-tp 1 --prefill-page-size 16 --decode-page-size 64 --decode-prefix 37 --kv-layout hnd,mla" \
    "--prefill-tp 1 --decode-tp 2 --prefill-page-size 64 --decode-page-size 16 --decode-prefix 1000 --kv-layout hnd"; do
    echo; echo "\$ kvxfer bench pd --device cuda --modes none --iters 3 $args"
    timeout 80 python3 -m kvxfer bench pd --device cuda --modes none --iters 3 $args 2>&1 \
        | grep -v "UCX  WARN" | grep -E "^\||total|rror" || rc=1
done
exit $rc
} 2>&1 | tee "$OUT/verify_shapes.md"
