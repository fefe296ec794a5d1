#!/usr/bin/env bash
# Post-capture backing on CUDA (issue 4): the CUDA-only tests (VMM lifecycle vs the driver's
# memory count, handle-type probe, CUDA graph captured before finalize, OOM rollback), the
# device-parametrised backing and post-capture pool tests on CUDA, the cross-process VMM share
# (a child process writes into the pool; GB/s vs a same-process D2D copy), then the
# measurements. Writes $OUT/backing.md and $OUT/backing.json. Run from the repository root
# (bench/gpu/run_all.sh sets PYTHONPATH).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export KVXFER_TEST_DEVICE=cuda PYTHONPATH=${PYTHONPATH:-$PWD}
{
echo "# Post-capture backing on CUDA ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), $(date -u +%F))"
echo
echo "## Tests"
echo '```'
timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_backing_cuda.py \
    tests/pools/test_backing.py tests/pools/test_post_capture.py 2>&1 | grep -v '^$' | tail -40
echo '```'
echo
echo "## Cross-process writes into a VMM-backed pool (POSIX-FD export + SCM_RIGHTS + import)"
echo
echo '```'
timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_vmm_share.py \
    tests/pools/test_backing_share_wire.py 2>&1 | grep -v '^$' | tail -60
echo '```'
echo
echo "## Measurements"
echo
timeout 240 python3 bench/gpu/backing_bench.py --out "$OUT" 2>&1 | tail -30
} | tee "$OUT/backing.md"
