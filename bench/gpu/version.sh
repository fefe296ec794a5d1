#!/usr/bin/env bash
# The versioned channel opening on one H200 (kvxfer task `version`): every connection now
# opens with versioned hellos in both channel modes, so check on the GPU machine's UCX build
# (cuda_ipc / rc lanes present) that mixed modes and versions fail fast on both ends, that
# matching connections, the PD paths with CUDA pools and the idle-CPU property are unchanged,
# and what `kvxfer info` reports. Writes $OUT/version.md.
#   bash bench/gpu/run_all.sh version
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# Versioned channel opening ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo
echo '## kvxfer info (protocol, channel_wait)'
echo '```'
timeout 60 python3 -m kvxfer info 2>&1 | grep -E "^(kvxfer|protocol|channel_wait|ucx|ucxx) " || rc=1
echo '```'
echo
echo "## opening, mixed modes / versions, protocol-1 peers, engines (CPU groups, GPU host's UCX)"
echo '```'
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/test_opening_unit.py \
    tests/transport tests/engine/test_version.py tests/engine/test_handshake_unit.py \
    tests/disagg/test_pd_bootstrap.py 2>&1 | tail -8 || rc=1
echo '```'
echo
echo "## matching connections unchanged: PD flow and idle CPU with CUDA pools"
echo '```'
KVXFER_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/disagg/test_pd_flow.py \
    tests/engine/test_idle_cpu.py 2>&1 | tail -8 || rc=1
echo '```'
exit $rc
} 2>&1 | tee "$OUT/version.md"
