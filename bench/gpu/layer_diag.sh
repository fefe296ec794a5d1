#!/usr/bin/env bash
# Issue 17 / 15 on the H200 (one call, ~8 min): layer-wise stages of single-layer writes
# (`kvxfer bench layerwise --device cuda --stages`, 1 and 8 matmuls per layer, the device
# lanes' status), the 1-page PD stages with KVXFER_DEVICE_SMALL_OPS=0 and 4 (LD_PD=1), and
# the CUDA-only tests: IPC export off the main thread, the chain tests, layer-wise on CUDA
# pools. Writes $OUT/layer_diag.md (+ lw1.json, lw8.json, pd-small*.json).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
LW="python3 -m kvxfer bench layerwise --device cuda --stages"
{
echo "# layer-wise / small-write diagnosis ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
echo; echo "## $LW --layers 32 --tokens 2048,8192 --iters 3"
timeout 120 $LW --layers 32 --tokens 2048,8192 --iters 3 --json-out "$OUT/lw1.json" 2>&1 | grep -v "UCX  WARN" | tail -20
echo; echo "## same, --matmul-reps 8"
timeout 120 $LW --layers 32 --tokens 2048,8192 --iters 3 --matmul-reps 8 --json-out "$OUT/lw8.json" 2>&1 | grep -v "UCX  WARN" | tail -16
if [ -n "${LD_PD:-}" ]; then
for small in 0 4; do
  echo; echo "## 1-page PD stages, KVXFER_DEVICE_SMALL_OPS=$small"
  KVXFER_DEVICE_SMALL_OPS=$small timeout 90 python3 -m kvxfer bench pd --device cuda --stages --modes none \
    --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2 \
    --json-out "$OUT/pd-small$small.json" 2>&1 | grep -v "UCX  WARN" | tail -40
done
fi
echo; echo "## CUDA tests: IPC export, chain, layer-wise"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -rxXf \
  tests/engine/test_ipc_unit.py "tests/engine/test_engine.py::test_notify_is_chained" \
  "tests/engine/test_engine.py::test_peer_killed_mid_chain" tests/disagg/test_pd_layerwise.py 2>&1 | tail -25
echo '```'
} 2>&1 | tee "$OUT/layer_diag.md"
