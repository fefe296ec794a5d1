#!/usr/bin/env bash
# Direct calls on the H200 (issue 15): `bash bench/gpu/run_all.sh direct`. Same tree, same
# call, values alternating over ROUNDS rounds (bench/ab/env_rounds.sh), CUDA pools, one GPU:
#  1. KVXFER_DIRECT_PAGES 16 (a small send runs on the scheduler's thread as the loop's
#     guest) vs 0 (every call handed to the loop);
#  2. with direct calls, KVXFER_GUEST_INLINE_US 0 (the guest posts and leaves the chain to
#     the own worker's thread) vs 50 (it progresses the worker for up to 50 µs first).
# 1-page PD p50/p99, req/s, the raw write and the stage breakdown per value.
# Writes $OUT/direct.md and $OUT/direct-*/*.json.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
ARGS=${PD_ARGS:---modes none,peer --stages --latency-requests 1000 --throughput-requests 3000 --large-pages 256 --iters 1}
{
echo "# Direct calls on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) ($(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
echo; echo "kvxfer bench pd --device cuda $ARGS, ROUNDS=${ROUNDS:-2}"
# DIRECT_ABS: the A/Bs to run, as "VAR:values" words (default both)
for ab in ${DIRECT_ABS:-KVXFER_DIRECT_PAGES:16,0 KVXFER_GUEST_INLINE_US:0,50}; do
    var=${ab%%:*}; vals=$(echo "${ab#*:}" | tr , ' ')
    echo; echo "## $var: $vals"; echo; echo '```'
    OUT=$OUT/direct-$var ROUNDS=${ROUNDS:-2} AB_VAR=$var AB_VALUES="$vals" PD_ARGS="$ARGS" \
        bash bench/ab/env_rounds.sh cuda 2>&1 | grep -E "^### round|^!!"
    echo '```'
    python3 bench/ab/env_compare.py "$OUT/direct-$var" "$var" $vals
done
} 2>&1 | tee "$OUT/direct.md"
