#!/usr/bin/env bash
# One H200 call for the session's merged work: the native chain, heterogeneous TP and
# layer-wise streaming on CUDA pools (tests), the 1-page PD stages after the chain
# (bench/gpu/stages.sh), `kvxfer bench layerwise --device cuda` (a matmul per layer), the
# layer-wise and TP demos on CUDA, and `kvxfer bench pd` TP rows. Writes $OUT/verify.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
{
echo "# Session verification on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
echo; echo "## tests with KVXFER_TEST_DEVICE=cuda"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/transport/test_chain.py \
    tests/engine/test_engine.py tests/disagg/test_pd_layerwise.py tests/disagg/test_pd_tp.py -x 2>&1 | tail -8
echo '```'
echo; echo "## kvxfer demo --device cuda --layerwise / --prefill-tp 2 --decode-tp 1"; echo '```'
timeout 60 python3 -m kvxfer demo --device cuda --layerwise 2>&1 | grep -v "UCX  WARN" | tail -4
timeout 60 python3 -m kvxfer demo --device cuda --prefill-tp 2 --decode-tp 1 --kv-layout hnd 2>&1 | grep -v "UCX  WARN" | tail -4
echo '```'
echo; echo "## kvxfer bench layerwise --device cuda"
timeout 150 python3 -m kvxfer bench layerwise --device cuda --layers 8,32 --tokens 2048,8192 --iters 3 --json-out "$OUT/layerwise.json" 2>&1 | grep -v "UCX  WARN" | tail -30
} 2>&1 | tee "$OUT/verify.md"
STAGES_MODES=none STAGES_TIMEOUT=120 bash bench/gpu/stages.sh > /dev/null 2>&1
