#!/usr/bin/env bash
# One environment variable A/B on one H200, in the same call: the 1-page PD stage breakdown
# and a heterogeneous-TP 2 -> 1 row (stages + the device lane's pattern-launch host parts,
# KVXFER_LANE_PROFILE), once per value. Writes $OUT/env_ab.md (+ JSON).
#   AB_VAR=KVXFER_FLUSH_PROGRESS AB_VALUES="spin event" bash bench/gpu/run_all.sh env_ab
# Env AB_LAYOUTS (default hnd). Candidates for the slow pattern-launch host time
# (bench/results/tp-pattern-h200.md): KVXFER_FLUSH_PROGRESS, KVXFER_PROGRESS_MODE,
# UCX_MEM_EVENTS, UCX_MEM_MALLOC_HOOKS.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} KVXFER_LANE_PROFILE=1
VAR=${AB_VAR:?set AB_VAR and AB_VALUES}
rc=0
{
echo "# $VAR A/B ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
for v in ${AB_VALUES:?}; do
    echo; echo "## $VAR=$v kvxfer bench pd --device cuda --stages --modes none --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2"
    env "$VAR=$v" timeout 120 python3 -m kvxfer bench pd --device cuda --stages --modes none \
        --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2 \
        --json-out "$OUT/ab-$v-1page.json" 2>&1 | grep -v "UCX  WARN" | tail -30 || rc=1
    echo; echo "## $VAR=$v kvxfer bench pd --device cuda --modes none --prefill-tp 2 --decode-tp 1 --kv-layout ${AB_LAYOUTS:-hnd} --shape-tokens 16000 --stages"
    env "$VAR=$v" timeout 100 python3 -m kvxfer bench pd --device cuda --modes none --prefill-tp 2 \
        --decode-tp 1 --kv-layout "${AB_LAYOUTS:-hnd}" --shape-tokens 16000 --iters 5 --stages \
        --json-out "$OUT/ab-$v-tp21.json" 2>&1 | tee "$OUT/ab-$v-tp21.log" \
        | grep -v "UCX  WARN\|WARNING\|lane-profile" | tail -12 || rc=1
    grep "lane-profile" "$OUT/ab-$v-tp21.log"
done
exit $rc
} 2>&1 | tee "$OUT/env_ab.md"
