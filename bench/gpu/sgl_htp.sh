#!/usr/bin/env bash
# SGLang backend, heterogeneous TP (kvxfer issue 16) on one H200: the backend's pair plans
# (kvxfer.integrations.sglang.tp_pairs) as the engine writes it issues, between processes
# with CUDA buffers (device lane: one PatternWrite launch per write), every byte checked,
# and staged (SliceWrite: gather, one PUT per slot, scatter) against equal TP moving the same
# bytes: bench/sgl_htp.py at page 16 and page 1, Llama-8B-like
# shape (32 layers, 8 KV heads x 128, bf16, 16000 tokens). Also the unit tests of the plans.
# Writes $OUT/sgl-htp.md. Env SGL_HTP_TOKENS (default 16000), SGL_HTP_LAYERS (default 32).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
TOKENS=${SGL_HTP_TOKENS:-16000}
LAYERS=${SGL_HTP_LAYERS:-32}
rc=0
{
echo "# SGLang backend heterogeneous TP on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
echo; echo '```'
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_sgl_tp_pairs.py 2>&1 | tail -2 || rc=1
echo '```'
for page in 16 1; do
    echo
    timeout 480 python3 bench/sgl_htp.py --device cuda --layers "$LAYERS" --tokens "$TOKENS" \
        --page "$page" --iters 5 --check-pages 64 --out "$OUT/sgl-htp-page$page.md" 2>&1 \
        | grep -v "UCX  WARN\|WARNING\|bulk data to same-host" | tail -11 || rc=1
done
exit $rc
} 2>&1 | tee "$OUT/sgl-htp.md"
