#!/usr/bin/env bash
# The heterogeneous-TP x page-size x prefix `kvxfer bench pd` rows on CUDA, one KV layout per
# command. Each layout starts 6 worker pairs (N:N, M:M, N:M for the equal shape, then the asked
# one; on CUDA a byte-run shape adds its equal pairs once more without patterns) and most of a
# command's wall time is starting them (~9 s a pair on the H200: the 1->2 hnd row took 53 s
# for 6 pairs), so `--kv-layout hnd,mla` (12 pairs) did not fit the 80 s slot
# verify_shapes.sh gave it. Rows print as each pair is done (the last column: seconds to start
# the workers / for the requests). Also the staged-path abandon tests with CUDA pools.
# Env: TPR_ARGS (commands' arguments, ';'-separated; default the two 2 -> 1, 16 -> 64, prefix
# 37 rows below), TPR_ITERS (3), TPR_EXTRA (more arguments for every command, e.g.
# "--stages"), TPR_TESTS (1: run the abandon tests; 0: skip). Writes $OUT/tp_rows.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
DEFAULT="--prefill-tp 2 --decode-tp 1 --prefill-page-size 16 --decode-page-size 64 --decode-prefix 37 --kv-layout hnd;--prefill-tp 2 --decode-tp 1 --prefill-page-size 16 --decode-page-size 64 --decode-prefix 37 --kv-layout mla"
rc=0
{
echo "# Heterogeneous TP bench rows on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
if [ "${TPR_TESTS:-1}" = 1 ]; then
    echo; echo "## staged-path abandon tests (host pools; the engine side of CUDA is the same code)"; echo '```'
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_staged_abandon.py 2>&1 | tail -3 || rc=1
    echo '```'
fi
IFS=';' read -r -a runs <<< "${TPR_ARGS:-$DEFAULT}"
for args in "${runs[@]}"; do
    echo; echo "\$ kvxfer bench pd --device cuda --modes none --iters ${TPR_ITERS:-3} $args ${TPR_EXTRA:-}"
    timeout 300 python3 -m kvxfer bench pd --device cuda --modes none --iters ${TPR_ITERS:-3} $args ${TPR_EXTRA:-} 2>&1 \
        | grep -v "UCX  WARN" | grep -E "^\||^- |total|rror|lane-profile" || rc=1
done
exit $rc
} 2>&1 | tee "$OUT/tp_rows.md"
