#!/usr/bin/env bash
# Busy-polling managers A/B on one H200 (KVManager(busy_poll=), $KVXFER_BUSY_POLL): the 1-page
# PD stage breakdown and a heterogeneous-TP 2 -> 1 row (stages + the device lane's pattern-
# launch host parts, KVXFER_LANE_PROFILE), each with the loops sleeping (0) and busy (1), in
# the same call. Writes $OUT/busy.md (+ JSON). Env BUSY_LAYOUTS (default hnd), BUSY_ROUNDS
# (default "0 1").
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} KVXFER_LANE_PROFILE=1
rc=0
{
echo "# Busy-polling managers A/B ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
for b in ${BUSY_ROUNDS:-0 1}; do
    echo; echo "## KVXFER_BUSY_POLL=$b kvxfer bench pd --device cuda --stages --modes none --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2"
    KVXFER_BUSY_POLL=$b timeout 120 python3 -m kvxfer bench pd --device cuda --stages --modes none \
        --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2 \
        --json-out "$OUT/busy-$b-1page.json" 2>&1 | grep -v "UCX  WARN" | tail -30 || rc=1
    echo; echo "## KVXFER_BUSY_POLL=$b kvxfer bench pd --device cuda --modes none --prefill-tp 2 --decode-tp 1 --kv-layout ${BUSY_LAYOUTS:-hnd} --shape-tokens 16000 --stages"
    KVXFER_BUSY_POLL=$b timeout 100 python3 -m kvxfer bench pd --device cuda --modes none --prefill-tp 2 \
        --decode-tp 1 --kv-layout "${BUSY_LAYOUTS:-hnd}" --shape-tokens 16000 --iters 5 --stages \
        --json-out "$OUT/busy-$b-tp21.json" 2>&1 | tee "$OUT/busy-$b-tp21.log" \
        | grep -v "UCX  WARN\|WARNING\|lane-profile" | tail -12 || rc=1
    grep "lane-profile" "$OUT/busy-$b-tp21.log"
done
exit $rc
} 2>&1 | tee "$OUT/busy.md"
