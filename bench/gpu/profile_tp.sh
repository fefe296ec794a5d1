#!/usr/bin/env bash
# Where a heterogeneous-TP send's host time goes: `bash bench/gpu/run_all.sh profile_tp`.
# `kvxfer bench pd --prefill-tp 1 --decode-tp 2 --stages` with KVXFER_BENCH_PROFILE (cProfile
# around each prefill rank's send + settle; on Python 3.12 that sees every thread's Python,
# so legs handed to the manager's loop are in it too), once as the loop's guests
# (KVXFER_LEG_DIRECT_PAGES=65536: as by default) and once handed over (16). Each row of the run
# (1 → 1, 2 → 2, 1 → 2) writes one .prof per prefill rank, in that order.
# Env: PTP_LAYOUTS (hnd), PTP_TOKENS (16000), PTP_ITERS (30), PTP_LEG (65536 16).
# Writes $OUT/profile_tp.md (+ .prof files).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} UCX_WARN_UNUSED_ENV_VARS=n
dev=cuda; nvidia-smi >/dev/null 2>&1 || dev=cpu
{
echo "# Heterogeneous-TP send profile ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo cpu), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
for leg in ${PTP_LEG:-65536 16}; do
    for layout in ${PTP_LAYOUTS:-hnd}; do
        d=$OUT/prof-tp-$layout-$leg; mkdir -p "$d"
        echo; echo "## $layout, KVXFER_LEG_DIRECT_PAGES=$leg"; echo
        KVXFER_LEG_DIRECT_PAGES=$leg KVXFER_BENCH_PROFILE=$d/p timeout 300 python3 -m kvxfer bench pd \
            --device $dev --modes none --prefill-tp 1 --decode-tp 2 --kv-layout $layout \
            --shape-tokens ${PTP_TOKENS:-16000} --iters ${PTP_ITERS:-30} --stages 2>&1 | grep -v "UCX  WARN"
        n=0
        for f in $(ls -tr "$d"/*.prof 2>/dev/null); do
            n=$((n + 1)); echo; echo "### profile $n ($(basename "$f")): own time"; echo
            python3 bench/prof_table.py "$f" _send 30 own
            echo; echo "### profile $n: cumulative"; echo
            python3 bench/prof_table.py "$f" _send 45 cum
        done
    done
done
} 2>&1 | tee "$OUT/profile_tp.md"
