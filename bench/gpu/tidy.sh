#!/usr/bin/env bash
# Branch tidy on the H200 (one call, ~5 min): layer-wise writes started eagerly
# (kvxfer.eager in LayerStream._issue) on CUDA pools — the layer-wise PD tests (incl. the
# posted-before-return test, which counts device-lane launches as posts, and the
# layers-after-failure test), the eager unit tests, the demo's layer-wise run (deterministic
# write count: wait_decode) — then `kvxfer bench layerwise --device cuda --stages` to set
# against bench/results' earlier layer-wise stage numbers (tail and per-layer write stages).
# Writes $OUT/tidy.md (+ lw-tidy.json).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# tidy: eager layer writes on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
echo; echo "## CUDA tests"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider -rxXf \
  tests/disagg/test_pd_layerwise.py tests/unit/test_eager.py \
  "tests/demo/test_pd_demo.py::test_demo_layerwise" 2>&1 | grep -v "UCX  WARN" | tail -25 || rc=1
echo '```'
echo; echo "## kvxfer bench layerwise --device cuda --stages --layers 32 --tokens 2048,8192 --iters 3"
timeout 150 python3 -m kvxfer bench layerwise --device cuda --stages --layers 32 \
  --tokens 2048,8192 --iters 3 --json-out "$OUT/lw-tidy.json" 2>&1 | grep -v "UCX  WARN" | tail -20 || rc=1
exit $rc
} 2>&1 | tee "$OUT/tidy.md"
