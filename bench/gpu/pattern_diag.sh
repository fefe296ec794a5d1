#!/usr/bin/env bash
# The pattern launch's host and GPU costs and a kernel-variant sweep (bench/gpu/pattern_diag.py)
# on one H200. Writes $OUT/pattern_diag.md. Env PDIAG_ARGS: extra arguments (--contention-only:
# only the launch under contention, seconds).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
{
echo "# Pattern launch diagnostics ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo '```'
timeout ${PDIAG_TIMEOUT:-240} python3 bench/gpu/pattern_diag.py ${PDIAG_ARGS:-} 2>&1 | grep -v "UCX  WARN"
echo '```'
} 2>&1 | tee "$OUT/pattern_diag.md"
