#!/usr/bin/env bash
# Prefill/decode on CUDA pools (one H200, two processes): the demo tests with CUDA pools, the demo
# for three layouts, and `kvxfer bench pd --device cuda`. Writes $OUT/pd.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# Prefill/decode on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo
echo "## tests/demo with KVXFER_TEST_DEVICE=cuda"
echo '```'
KVXFER_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/demo 2>&1 | tail -8 || rc=1
echo '```'
echo
echo "## kvxfer demo --device cuda"
echo '```'
for args in "" "--kv-layout per_layer --mamba-layout per_layer" "--kv-layout mla --mamba-layout none"; do
    echo "\$ kvxfer demo --device cuda --error-mode peer $args"
    timeout 90 python3 -m kvxfer demo --device cuda --error-mode peer $args 2>&1 | grep -v "UCX  WARN" | tail -14 || rc=1
done
echo '```'
echo
echo "## kvxfer bench pd --device cuda"
timeout 150 python3 -m kvxfer bench pd --device cuda 2>&1 | grep -v "UCX  WARN" | tail -30 || rc=1
exit $rc
} 2>&1 | tee "$OUT/pd.md"
