#!/usr/bin/env bash
# Issue 15 A/B on the H200: 1-page PD throughput with notifications kept in call order
# (EngineConfig.notify_order, default) and without (KVXFER_NOTIFY_ORDER=0), twice each,
# interleaved. Writes $OUT/notify_order.md (+ pd-order*.json).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
{
echo "# 1-page PD, notify order on/off ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
for round in 1 2; do
for order in 1 0; do
  echo; echo "## round $round, KVXFER_NOTIFY_ORDER=$order"
  KVXFER_NOTIFY_ORDER=$order timeout 60 python3 -m kvxfer bench pd --device cuda --modes none \
    --latency-requests 200 --throughput-requests 2000 --large-pages 256 --iters 2 \
    --json-out "$OUT/pd-order$order-$round.json" 2>&1 | grep -v "UCX  WARN" | grep "^|" | tail -2
done
done
} 2>&1 | tee "$OUT/notify_order.md"
