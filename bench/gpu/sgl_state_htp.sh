#!/usr/bin/env bash
# SGLang backend, Mamba / hybrid state at different TP (kvxfer issue 16) on one H200: the
# backend's state plans (kvxfer.integrations.sglang.tp_pairs StatePlan: one PatternWrite per
# state type, one run per conv part / temporal tensor per layer) between processes with CUDA
# buffers (device lane: one launch per write), every byte checked, against equal TP moving
# the same slot (one ItemWrite): bench/sgl_state_htp.py, Qwen3-Next-like GDN state (36
# layers, conv 2048|2048|4096 x 3 bf16, temporal 32 x 128 x 128 fp32). Also the unit tests
# of the plans. Writes $OUT/sgl-state-htp.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# SGLang backend, Mamba state at different TP on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
echo; echo '```'
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_sgl_tp_pairs.py tests/unit/test_tp_plan.py 2>&1 | tail -2 || rc=1
echo '```'
echo
timeout 480 python3 bench/sgl_state_htp.py --device cuda --iters 5 \
    --out "$OUT/sgl-state-htp-cuda.md" 2>&1 \
    | grep -v "UCX  WARN\|WARNING\|bulk data to same-host" | tail -8 || rc=1
exit $rc
} 2>&1 | tee "$OUT/sgl-state-htp.md"
