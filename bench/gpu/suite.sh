#!/usr/bin/env bash
# The engine, transport, PD protocol, security and CUDA-only tests with CUDA pools/memory
# (KVXFER_TEST_DEVICE=cuda). Writes $OUT/suite.md.
set -o pipefail
{
echo "# Engine / transport / PD / security tests on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo '```'
KVXFER_TEST_DEVICE=cuda timeout ${SUITE_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider \
    ${SUITE_PATHS:-tests/gpu tests/transport tests/engine tests/disagg tests/security} ${SUITE_EXTRA:-} 2>&1 | tail -25
echo '```'
} | tee "$OUT/suite.md"
