#!/usr/bin/env bash
# Direct calls' tests with CUDA pools (one H200): tests/disagg/test_direct_calls.py and the
# guest-run unit tests, then bench/gpu/races.sh's PD races. Writes $OUT/direct_tests.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
{
echo "# Direct-call tests on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo '```'
KVXFER_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider \
    tests/disagg/test_direct_calls.py tests/unit/test_loop_thread.py tests/disagg/test_pd_flow.py 2>&1 | tail -4
echo '```'
} 2>&1 | tee "$OUT/direct_tests.md"
bash bench/gpu/races.sh
