#!/usr/bin/env bash
# Offload / restore of retracted requests on CUDA (issue 7): the offload tests on CUDA tensors
# (pinned host pool, copy streams + events, no device-wide synchronize), the retract/restore
# example, then `kvxfer bench offload` (GB/s vs one pinned copy_ of the same bytes, target
# >= 0.9x both ways). Run from the repository root; writes $OUT/offload.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export KVXFER_TEST_DEVICE=cuda PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# Offload / restore on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo
echo "## tests/offload on CUDA"
echo '```'
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/offload 2>&1 | tail -25 || rc=1
echo '```'
echo
echo "## examples/retract_restore.py"
echo '```'
for kind in hybrid page_major mha; do
    timeout 60 python3 examples/retract_restore.py --kind "$kind" --device cuda 2>&1 | tail -3 || rc=1
done
echo '```'
echo
timeout 300 python3 -m kvxfer bench offload --device cuda 2>&1 || rc=1
echo
echo "## same sweep with the fused path off (copy_ per run per buffer), for comparison"
timeout 200 python3 -m kvxfer bench offload --device cuda --fused off 2>&1 | tail -50 || rc=1
exit $rc
} | tee "$OUT/offload.md"
