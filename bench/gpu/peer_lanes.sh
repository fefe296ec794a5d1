#!/usr/bin/env bash
# Lanes of an RMA endpoint made from a worker address, per error mode, worker (UCXX's or
# kvxfer's own) and memory (host, CUDA) on the H200 (bench/peer_lanes.py): can error_mode
# "peer" move to kvxfer's own worker for CUDA memory? Writes $OUT/peer_lanes.md.
#   bash bench/gpu/run_all.sh peer_lanes
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
{
echo "# RMA lanes of address-made endpoints ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo '```'
for d in cpu cuda; do timeout 120 python3 bench/peer_lanes.py --device $d 2>&1 | grep -v "UCX  WARN"; done
echo '```'
} 2>&1 | tee "$OUT/peer_lanes.md"
