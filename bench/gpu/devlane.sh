#!/usr/bin/env bash
# Where a device-lane write spends its time on the H200 (bench/gpu/diag_devlane.py: launch wall
# and CPU, GPU after the launch, whole write; DIAG_QUICK=1 for one engine). Writes $OUT/devlane.md.
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} UCX_WARN_UNUSED_ENV_VARS=n
{
echo "# device-lane write steps ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-?})"
echo '```'
timeout ${DIAG_TIMEOUT:-200} python3 bench/gpu/diag_devlane.py 2>&1 | grep -v "UCX  WARN"
echo '```'
} 2>&1 | tee "$OUT/devlane.md"
