#!/usr/bin/env bash
# Issue 15 on the H200: the offload manager's host path step by step and its driver-only floor
# (bench/gpu/offload_prof.py, 16/64/256 MiB), `kvxfer bench offload` on contiguous MHA requests,
# then the 1-page PD stage breakdown (bench/gpu/stages.sh, STAGES_MODES=none unless set).
# Writes $OUT/offload_host.md (+ the stages files).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# offload host path + stages ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-?})"
echo '```'
timeout 150 python3 bench/gpu/offload_prof.py ${PROF_PAGES:-8 32 128} 2>&1 | tail -80 || rc=1
echo '```'
echo; echo "## kvxfer bench offload --device cuda --layouts mha --patterns contig"
timeout 150 python3 -m kvxfer bench offload --device cuda --layouts mha --patterns contig 2>&1 | tail -12 || rc=1
} 2>&1 | tee "$OUT/offload_host.md"
[ -n "${SKIP_STAGES:-}" ] || STAGES_MODES=${STAGES_MODES:-none} bash bench/gpu/stages.sh || rc=1
exit $rc
