#!/usr/bin/env bash
# One-to-many heterogeneous TP with and without overlapped decode legs (KVXFER_OVERLAP_LEGS,
# kvxfer/disagg/tp_rooms.py prefill_send), then a large PD request with and without guest
# runs of large sends (KVXFER_DIRECT_PAGES), each A/B in the same call on one H200. Writes
# $OUT/legs_ab.md (+ JSON per run). Env LEGS_RATIOS (default "1:2 2:4"), LEGS_ROUNDS (values
# of KVXFER_OVERLAP_LEGS in order, default "1 0 2": all but the last leg / none / all start
# without inline waits), LEGS_LAYOUTS (default hnd,per_layer), LEGS_ITERS (default 10),
# LEGS_TOKENS (default 16000), DIRECT_VALUES (default "16 65536"; empty: skip),
# DIRECT_PAGES_LARGE (default 2048: the large request's pages).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# Overlapped decode legs and large guest sends, A/B ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
n=0
for v in ${LEGS_ROUNDS-1 0 2}; do
    for r in ${LEGS_RATIOS-1:2 2:4}; do
        p=${r%:*}; d=${r#*:}; n=$((n + 1))
        echo; echo "## $n. KVXFER_OVERLAP_LEGS=$v kvxfer bench pd --device cuda --modes none --prefill-tp $p --decode-tp $d --kv-layout ${LEGS_LAYOUTS:-hnd,per_layer} --shape-tokens ${LEGS_TOKENS:-16000} --iters ${LEGS_ITERS:-10} --stages"
        KVXFER_OVERLAP_LEGS=$v timeout 110 python3 -m kvxfer bench pd --device cuda --modes none \
            --prefill-tp "$p" --decode-tp "$d" --kv-layout "${LEGS_LAYOUTS:-hnd,per_layer}" \
            --shape-tokens "${LEGS_TOKENS:-16000}" --iters "${LEGS_ITERS:-10}" --stages \
            --json-out "$OUT/legs-$n-$v-$p-$d.json" 2>&1 | grep -v "UCX  WARN\|WARNING\|lane-profile" | tail -14 || rc=1
    done
done
for v in ${DIRECT_VALUES-16 65536}; do
    n=$((n + 1))
    echo; echo "## $n. KVXFER_DIRECT_PAGES=$v kvxfer bench pd --device cuda --modes none --latency-requests 100 --throughput-requests 300 --large-pages ${DIRECT_PAGES_LARGE:-2048} --iters 5 --stages"
    KVXFER_DIRECT_PAGES=$v timeout 90 python3 -m kvxfer bench pd --device cuda --modes none \
        --latency-requests 100 --throughput-requests 300 --large-pages "${DIRECT_PAGES_LARGE:-2048}" \
        --iters 5 --stages --json-out "$OUT/direct-$n-$v.json" 2>&1 | grep -v "UCX  WARN" | tail -30 || rc=1
done
exit $rc
} 2>&1 | tee "$OUT/legs_ab.md"
