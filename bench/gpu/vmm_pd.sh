#!/usr/bin/env bash
# PD with decode's kv pool in CUDA VMM memory (`--decode-post-capture`: reserved, then backed by
# finalize_backing, as after graph capture) against the same bench with an ordinary pool, rounds
# alternating in one call; then the VMM pool with the device lane off (UCX's emulated PUTs, fewer
# requests). Also the demo with --decode-post-capture (every byte verified) and its CUDA test.
# Env VMM_ROUNDS (default 2), VMM_LARGE (pages, default 2048); VMM_STAGES=1: only the 1-page stage
# breakdowns (`--stages`), plain / VMM alternating ($OUT/vmm_stages.md). Writes $OUT/vmm_pd.md + JSON.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} UCX_WARN_UNUSED_ENV_VARS=n
ROUNDS=${VMM_ROUNDS:-2}; LARGE=${VMM_LARGE:-2048}
if [ "${VMM_STAGES:-0}" = 1 ]; then  # only the 1-page stage breakdowns, plain / VMM alternating
{
echo "# PD stages into a VMM-backed decode pool ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
for r in $(seq 1 "$ROUNDS"); do
    for v in plain vmm; do
        flag=""; [ "$v" = vmm ] && flag="--decode-post-capture"
        echo; echo "## round $r: $v ($flag)"
        timeout 120 python3 -m kvxfer bench pd --device cuda --stages --modes none --latency-requests 200 \
            --throughput-requests 600 --large-pages 256 --iters 2 $flag --json-out "$OUT/vmm_stages-$r-$v.json" 2>&1 \
            | grep -v "UCX  WARN" | tail -45
    done
done
} 2>&1 | tee "$OUT/vmm_stages.md"
exit
fi
{
echo "# PD into a VMM-backed decode pool ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
echo
echo '```'
KVXFER_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/demo/test_pd_demo.py -k "post_capture or bench_smoke" 2>&1 | tail -3
echo "\$ kvxfer demo --device cuda --decode-post-capture --kv-layout per_layer --mamba-layout per_layer"
timeout 120 python3 -m kvxfer demo --device cuda --decode-post-capture --kv-layout per_layer --mamba-layout per_layer 2>&1 | tail -14
echo '```'
COMMON="--device cuda --modes none --latency-requests 300 --throughput-requests 1000 --large-pages $LARGE --iters 5"
for r in $(seq 1 "$ROUNDS"); do
    for v in plain vmm; do
        flag=""; [ "$v" = vmm ] && flag="--decode-post-capture"
        echo; echo "## round $r: $v ($flag)"
        timeout 200 python3 -m kvxfer bench pd $COMMON $flag --json-out "$OUT/vmm_pd-$r-$v.json" 2>&1 | tail -4
    done
done
echo; echo "## VMM pool, device lane off (KVXFER_DEVICE_COPY=off: UCX's emulated PUTs)"
KVXFER_DEVICE_COPY=off timeout 200 python3 -m kvxfer bench pd --device cuda --modes none --latency-requests 100 \
    --throughput-requests 200 --large-pages "$LARGE" --iters 2 --decode-post-capture --json-out "$OUT/vmm_pd-off-vmm.json" 2>&1 | tail -4
} 2>&1 | tee "$OUT/vmm_pd.md"
