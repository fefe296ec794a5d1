#!/usr/bin/env bash
# The held release on one H200 (docs/RELIABILITY.md, "Held release"): the scenarios of
# tests/disagg/test_pd_fence.py and test_pd_hold.py with CUDA pools (cuda_ipc / device lane),
# error modes peer and none — a frozen writer's bytes must land only in pages decode still
# holds, also over the one-sided CUDA lanes. Writes $OUT/fence.md.
#   bash bench/gpu/run_all.sh fence
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
{
echo "# Held release with CUDA pools ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo '```'
KVXFER_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider -rfxX \
    tests/disagg/test_pd_fence.py tests/disagg/test_pd_hold.py 2>&1 | grep -v "UCX  WARN" | grep -E "passed|failed|FAILED|XFAIL|XPASS|^E  .*(pages|rows|slots)" | cut -c1-300
echo '```'
} 2>&1 | tee "$OUT/fence.md"
