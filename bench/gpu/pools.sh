#!/usr/bin/env bash
# Pool tests (KV, Mamba, hybrid) on CUDA tensors. Writes $OUT/pools.md.
set -o pipefail
{
echo "# Pools on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo '```'
KVXFER_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/pools tests/unit 2>&1 | tail -25
echo '```'
} | tee "$OUT/pools.md"
