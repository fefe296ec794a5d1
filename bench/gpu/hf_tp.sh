#!/usr/bin/env bash
# Issue 16's real-model check at heterogeneous TP on a quiet machine (the H200 host's idle
# CPUs; the check runs the tiny transformers models on CPU, float32, pools in host memory):
# tests/hf, then `kvxfer demo --model all` at 1:2, 2:1 and 2:2 (one process per rank).
# Needs transformers==5.23.0 (the test extra). Writes $OUT/hf_tp.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# real-model check at heterogeneous TP on the H200 host ($(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}, $(nproc) cpus, load $(cut -d' ' -f1-3 /proc/loadavg))"
echo; echo "## pytest tests/hf"; echo '```'
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/hf --durations=6 2>&1 | tail -12 || rc=1
echo '```'
for r in "1 2" "2 1" "2 2"; do
set -- $r
echo; echo "## kvxfer demo --model all --prefill-tp $1 --decode-tp $2"; echo '```'
timeout 150 python3 -m kvxfer demo --model all --prefill-tp "$1" --decode-tp "$2" 2>&1 \
  | grep -v "UCX  WARN" | tail -40 || rc=1
echo '```'
done
exit $rc
} 2>&1 | tee "$OUT/hf_tp.md"
