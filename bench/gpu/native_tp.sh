#!/usr/bin/env bash
# Issue 16 on the H200: heterogeneous TP through the device lane's pattern launch, the native
# launch (kernels/pattern_copy.copy_pattern_native) against Triton's (KVXFER_NATIVE_LAUNCH=0) in
# one call: the pattern kernel / engine / TP protocol tests on CUDA, then bench/gpu/pattern.sh's
# ratio rows (PAT_RATIOS, default "2:1 1:2"; PAT_LAYOUTS default hnd,per_layer) for each, with
# the lane's launch host parts (KVXFER_LANE_PROFILE=1). Writes $OUT/native_tp.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# Native vs Triton pattern launch, heterogeneous TP ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
echo; echo "## tests on CUDA"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout ${NTP_TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider ${NTP_TEST_FILES:-tests/gpu/test_native_launch.py \
    tests/kernels/test_pattern_copy.py tests/disagg/test_pd_tp.py} 2>&1 | grep -v "UCX  WARN" | tail -8 || rc=1
echo '```'
for n in 1 0; do
    echo; echo "## KVXFER_NATIVE_LAUNCH=$n"
    KVXFER_NATIVE_LAUNCH=$n KVXFER_LANE_PROFILE=1 PAT_RATIOS="${PAT_RATIOS:-2:1 1:2}" PAT_TESTS=0 PAT_PATHS=0 \
        PAT_LAYOUTS=${PAT_LAYOUTS:-hnd,per_layer} OUT=$OUT/tp_native$n bash bench/gpu/pattern.sh 2>&1 | grep -v "^# Hetero" | tail -40 || rc=1
done
echo "native_tp rc=$rc"
exit $rc
} 2>&1 | tee "$OUT/native_tp.md"
