#!/usr/bin/env bash
# The opt-in integrity check on CUDA (one H200): the checksum kernel's tests and the
# memory-placement checks on CUDA, the PD integrity tests with CUDA pools, the kernel's
# throughput, and `kvxfer bench pd --integrity --device cuda` (same-run rows, check off vs on).
# Writes $OUT/integrity.md (+ integrity-kernels.json, integrity-pd.json).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# Integrity check on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo
echo "## tests on CUDA"
echo '```'
KVXFER_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_checksum.py \
    tests/gpu/test_integrity_cuda.py tests/disagg/test_integrity_units.py tests/disagg/test_pd_integrity.py 2>&1 | tail -12 || rc=1
echo '```'
echo
echo "## kernel throughput"
timeout 180 python3 -m kvxfer bench kernels --kernels checksum,checksum_paged,move,move_paged --tokens 16,1024,16384 \
    --json-out "$OUT/integrity-kernels.json" 2>&1 | tail -14 || rc=1
echo
echo "## kvxfer bench pd --integrity --device cuda"
timeout 300 python3 -m kvxfer bench pd --integrity --device cuda --json-out "$OUT/integrity-pd.json" 2>&1 \
    | grep -v "UCX  WARN" | tail -16 || rc=1
exit $rc
} 2>&1 | tee "$OUT/integrity.md"
