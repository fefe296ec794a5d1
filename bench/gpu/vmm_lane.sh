#!/usr/bin/env bash
# The device lane into CUDA VMM memory (kvxfer.engine.vmm_share): its tests on CUDA, the engine
# tests beside them, then bench/gpu/vmm_lane.py (lane vs UCX's emulated PUTs, and the same writes
# into cudaMalloc memory, same run). Writes $OUT/vmm_lane.md and $OUT/vmm_lane.json. Run from the
# repository root (bench/gpu/run_all.sh sets PYTHONPATH).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export KVXFER_TEST_DEVICE=cuda PYTHONPATH=${PYTHONPATH:-$PWD}
{
echo "# Device lane into CUDA VMM memory ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
echo
echo '```'
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_vmm_lane.py \
    tests/engine/test_vmm_share_unit.py tests/engine/test_lane_standin.py tests/engine/test_engine.py \
    tests/gpu/test_vmm_share.py 2>&1 | grep -v '^$' | tail -30
echo '```'
echo
timeout 300 python3 bench/gpu/vmm_lane.py --json "$OUT/vmm_lane.json" 2>&1 | tail -30
} | tee "$OUT/vmm_lane.md"
