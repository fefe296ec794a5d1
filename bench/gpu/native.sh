#!/usr/bin/env bash
# Issue 15 on the H200: the native launch path (kernels/native_launch.py: the copy kernel by
# cuLaunchKernel, its table in a pinned ring) against Triton's launch (KVXFER_NATIVE_LAUNCH=0),
# in one call: (1) tests/gpu/test_native_launch.py + tests/kernels/test_copy_pieces.py on CUDA,
# bench/gpu/copy_methods.py; (2) bench/gpu/diag_devlane.py (DIAG_QUICK=1), order DEVLANE_ORDER
# (default "1 0 1"); (3) `kvxfer bench transfer --device-copy auto` both ways; with THRESH=1 also
# `KVXFER_DEVICE_SMALL_OPS=127` (every write of < 128 runs on the lane) with --device-copy
# auto,off: lane against UCX PUTs in one run; (4) `kvxfer bench offload` single pages and runs
# of 4 with the batch copy off (the kernel path), ROUNDS alternating rounds; (5) the PD bench
# with large writes on the lane (device_min_bytes 4 MiB) both ways; (6) tests/offload and the
# engine tests on CUDA with every write on the lane; (7) with TP=1, bench/gpu/native_tp.sh.
# Skip: copy_methods NO_COPY=1, (3) NO_TRANSFER=1, (4) and tests/offload NO_OFFLOAD=1, (6)
# NO_TESTS=1 (the engine tests alone NO_ENGINE_TESTS=1). Writes $OUT/native.md + JSON files.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} UCX_WARN_UNUSED_ENV_VARS=n
rc=0
{
echo "# Native launch vs Triton's launch ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
echo; echo "## tests/gpu/test_native_launch.py"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_native_launch.py \
    tests/kernels/test_copy_pieces.py 2>&1 | tail -25 || rc=1
echo '```'
[ -n "${NO_COPY:-}" ] || { echo; echo "## copy_methods.py (one process; kernel = Triton launch + upload, native = cuLaunchKernel + pinned ring)"; echo '```'
timeout 120 python3 bench/gpu/copy_methods.py --iters 10 --json "$OUT/copy_methods.json" 2>&1 | grep -v "^host" || rc=1
echo '```'; }
for n in ${DEVLANE_ORDER:-1 0 1}; do
    echo; echo "## diag_devlane (DIAG_QUICK=1), KVXFER_NATIVE_LAUNCH=$n"; echo '```'
    DIAG_QUICK=1 KVXFER_NATIVE_LAUNCH=$n timeout 90 python3 bench/gpu/diag_devlane.py 2>&1 | grep -v "UCX  WARN" | tail -6 || rc=1
    echo '```'
done
[ -n "${NO_TRANSFER:-}" ] || for n in 1 0; do
    echo; echo "## bench transfer --device-copy auto, KVXFER_NATIVE_LAUNCH=$n"
    KVXFER_NATIVE_LAUNCH=$n timeout 150 python3 -m kvxfer bench transfer --device cuda --layers 8 --page-kib 64 \
        --pages 2048 --sizes ${SIZES:-16,128,512} --iters 5 --paths direct --modes none --device-copy auto \
        --json-out "$OUT/transfer_native$n.json" --plot /dev/null 2>&1 | grep -v "UCX  WARN" | grep "^|\|rc=\|Error" || rc=1
done
if [ -n "${THRESH:-}" ]; then  # every write of <= 127 runs on the lane vs UCX PUTs, same run
    echo; echo "## bench transfer, KVXFER_DEVICE_SMALL_OPS=127 (lane for every write of < 128 runs), --device-copy auto,off"
    KVXFER_DEVICE_SMALL_OPS=127 timeout 150 python3 -m kvxfer bench transfer --device cuda --layers 8 --page-kib 64 \
        --pages 2048 --sizes ${THRESH_SIZES:-16,128} --iters 5 --paths direct --modes none --device-copy auto,off \
        --json-out "$OUT/transfer_small127.json" --plot /dev/null 2>&1 | grep -v "UCX  WARN" | grep "^|\|rc=\|Error" || rc=1
fi
[ -n "${NO_OFFLOAD:-}" ] || for r in $(seq 1 "${ROUNDS:-2}"); do
    for n in $( [ $((r % 2)) = 1 ] && echo "1 0" || echo "0 1"); do
        echo; echo "## round $r: bench offload (kernel path: --batch-min-piece-kib 0), KVXFER_NATIVE_LAUNCH=$n"
        KVXFER_NATIVE_LAUNCH=$n timeout 120 python3 -m kvxfer bench offload --device cuda --layouts ${OFF_LAYOUTS:-mha} \
            --patterns scatter,runs4 --pages 8,32,128,512 --batch-min-piece-kib 0 \
            --json-out "$OUT/offload_native${n}_r$r.json" 2>&1 | grep "^|" || rc=1
    done
done
for n in 1 0; do
    echo; echo "## bench pd, large writes on the lane (KVXFER_DEVICE_MIN_BYTES=4194304), KVXFER_NATIVE_LAUNCH=$n"
    KVXFER_NATIVE_LAUNCH=$n KVXFER_DEVICE_MIN_BYTES=4194304 timeout 120 python3 -m kvxfer bench pd --device cuda --modes none \
        --latency-requests 100 --throughput-requests 400 --large-pages 2048 --iters 5 \
        --json-out "$OUT/pd_native$n.json" 2>&1 | grep -v "UCX  WARN" | tail -4 || rc=1
done
if [ -z "${NO_TESTS:-}" ]; then
echo; echo "## tests/offload on CUDA"; echo '```'
[ -n "${NO_OFFLOAD:-}" ] || KVXFER_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/offload 2>&1 | tail -6 || rc=1
echo '```'
[ -n "${NO_ENGINE_TESTS:-}" ] || { echo; echo "## engine tests on CUDA, every write on the lane"; echo '```'
KVXFER_TEST_DEVICE=cuda KVXFER_DEVICE_MIN_BYTES=1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
    tests/engine/test_engine.py tests/engine/test_devcopy_unit.py 2>&1 | tail -8 || rc=1
echo '```'; }
fi
if [ -n "${TP:-}" ]; then  # the pattern launch too (bench/gpu/native_tp.sh, shortened)
    PAT_RATIOS=${PAT_RATIOS:-2:1} PAT_LAYOUTS=${PAT_LAYOUTS:-hnd} bash bench/gpu/native_tp.sh 2>&1 | tail -60 || rc=1
fi
echo "native rc=$rc"
exit $rc
} 2>&1 | tee "$OUT/native.md"
