#!/usr/bin/env bash
# Issue 15, large requests on one H200: how the device lane should issue a write's copies, and
# from which size a write should take it. (1) bench/gpu/copy_methods.py: copy_ vs per-run
# cuMemcpyDtoDAsync vs one cuMemcpyBatchAsync vs the Triton tile kernel, one process, with
# and without a 2 ms gap between iterations; (2) the engine tests on CUDA with every write on
# the lane (KVXFER_DEVICE_MIN_BYTES=1); (3) `kvxfer bench transfer --device cuda --modes none`
# for VARIANTS (name:env,env ...) in one run; (4) the PD bandwidth rows (`kvxfer bench pd
# --large-pages`) for the same variants; (5) offload with the manager's batch copy against the
# kernel only (--batch-min-piece-kib 0). bench/results/lane-copy-h200.md ran it at 99e8950,
# whose variant "batch" (KVXFER_LANE_COPY, removed since) and offload switch
# (KVXFER_OFFLOAD_COPY, now OffloadManager(batch_min_piece_bytes=)) are gone.
# Skip parts with NO_TESTS / NO_PD / NO_OFFLOAD. Writes $OUT/lane_copy.md and JSON files.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} UCX_WARN_UNUSED_ENV_VARS=n
VARIANTS=${VARIANTS:-"base: bytes:KVXFER_DEVICE_MIN_BYTES=4194304"}
rc=0
{
echo "# Device lane copy methods on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
python3 setup.py -q build_ext --inplace 2>&1 | grep -E "error|Error"
echo; echo "## copy_methods.py (no gap)"; echo '```'
timeout 150 python3 bench/gpu/copy_methods.py --json "$OUT/copy_methods.json" 2>&1 || rc=1
echo '```'
for v in $VARIANTS; do
    name=${v%%:*}; envs=${v#*:}
    echo; echo "## bench transfer, variant $name (${envs:-defaults})"
    env ${envs//,/ } timeout 200 python3 -m kvxfer bench transfer --device cuda --layers 8 --page-kib 64 \
        --pages 2048 --sizes ${SIZES:-16,128,512} --iters 5 --paths direct --modes none \
        --device-copy $( [ "$name" = base ] && echo auto,off || echo auto ) \
        --json-out "$OUT/transfer_$name.json" --plot /dev/null 2>&1 | grep -v "UCX  WARN" | grep "^|\|rc=\|Error" || rc=1
done
if [ -z "${NO_PD:-}" ]; then
for v in $VARIANTS; do
    name=${v%%:*}; envs=${v#*:}
    echo; echo "## bench pd bandwidth, variant $name (${envs:-defaults})"
    env ${envs//,/ } timeout 200 python3 -m kvxfer bench pd --device cuda --modes none --latency-requests 50 \
        --throughput-requests 200 --large-pages ${PD_PAGES:-2048} --iters 5 --json-out "$OUT/pd_$name.json" 2>&1 \
        | grep -v "UCX  WARN" | tail -12 || rc=1
done
fi
if [ -z "${NO_OFFLOAD:-}" ]; then
for oc in default 0; do
    echo; echo "## bench offload, batch_min_piece: $oc"
    timeout 200 python3 -m kvxfer bench offload --device cuda --layouts mha,mha_hnd --pages 8,32,128,512 \
        $( [ $oc = 0 ] && echo --batch-min-piece-kib 0 ) --json-out "$OUT/offload_$oc.json" 2>&1 | grep "^|" || rc=1
done
fi
if [ -z "${NO_TESTS:-}" ]; then
echo; echo "## engine tests on CUDA, every write on the lane"; echo '```'
KVXFER_TEST_DEVICE=cuda KVXFER_DEVICE_MIN_BYTES=1 timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/engine/test_engine.py tests/engine/test_devcopy_unit.py tests/gpu 2>&1 | tail -8 || rc=1
echo '```'
fi
if [ -z "${NO_TESTS:-}" ] && [ -z "${NO_OFFLOAD:-}" ]; then
echo; echo "## offload tests on CUDA"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/offload 2>&1 | tail -6 || rc=1
echo '```'
fi
echo; echo "## copy_methods.py --gap-ms 2"; echo '```'
timeout 150 python3 bench/gpu/copy_methods.py --gap-ms 2 --iters 10 --json "$OUT/copy_methods_gap.json" 2>&1 || rc=1
echo '```'
echo "lane_copy rc=$rc"
exit $rc
} 2>&1 | tee "$OUT/lane_copy.md"
