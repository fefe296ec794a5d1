#!/usr/bin/env bash
# One environment variable A/B on one H200, in the same call: the 1-page PD stage breakdown
# and heterogeneous-TP rows (stages + the device lane's pattern-launch host parts,
# KVXFER_LANE_PROFILE), once per value, in the order given (repeat values to alternate).
# Writes $OUT/env_ab.md (+ JSON per run, numbered).
#   AB_VAR=KVXFER_NOTE_SPIN AB_VALUES="0 1 0 1" AB_RATIOS="1:2 2:4" bash bench/gpu/run_all.sh env_ab
# Env AB_LAYOUTS (default hnd), AB_TOKENS (default 16000), AB_RATIOS (prefill:decode TP, default "2:1"), AB_ITERS
# (default 5), AB_1PAGE (default 1; 0 skips the 1-page run), AB_FLAGS (more `kvxfer bench pd`
# flags for every run, e.g. --poll-scheduler). Candidates tried for the slow
# pattern-launch host time (bench/results/tp-pattern-h200.md): KVXFER_FLUSH_PROGRESS,
# KVXFER_PROGRESS_MODE, UCX_MEM_EVENTS, UCX_MEM_MALLOC_HOOKS; for the notification's delivery:
# KVXFER_NOTE_SPIN (kvxfer/transport/ucx.py).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} KVXFER_LANE_PROFILE=1
VAR=${AB_VAR:?set AB_VAR and AB_VALUES}
rc=0
n=0
{
echo "# $VAR A/B ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
for v in ${AB_VALUES:?}; do
    n=$((n + 1))
    if [ "${AB_1PAGE:-1}" != 0 ]; then
        echo; echo "## $n. $VAR=$v kvxfer bench pd --device cuda --stages --modes none --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2 ${AB_FLAGS:-}"
        env "$VAR=$v" timeout 120 python3 -m kvxfer bench pd --device cuda --stages --modes none \
            --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2 ${AB_FLAGS:-} \
            --json-out "$OUT/ab-$n-$v-1page.json" 2>&1 | grep -v "UCX  WARN" | tail -60 || rc=1
    fi
    for r in ${AB_RATIOS:-2:1}; do
        p=${r%:*}; d=${r#*:}
        echo; echo "## $n. $VAR=$v kvxfer bench pd --device cuda --modes none --prefill-tp $p --decode-tp $d --kv-layout ${AB_LAYOUTS:-hnd} --shape-tokens ${AB_TOKENS:-16000} --iters ${AB_ITERS:-5} --stages ${AB_FLAGS:-}"
        env "$VAR=$v" timeout 110 python3 -m kvxfer bench pd --device cuda --modes none \
            --prefill-tp "$p" --decode-tp "$d" --kv-layout "${AB_LAYOUTS:-hnd}" --shape-tokens ${AB_TOKENS:-16000} \
            --iters "${AB_ITERS:-5}" --stages ${AB_FLAGS:-} --json-out "$OUT/ab-$n-$v-tp$p$d.json" 2>&1 \
            | tee "$OUT/ab-$n-$v-tp$p$d.log" | grep -v "UCX  WARN\|WARNING\|lane-profile" | tail -14 || rc=1
        grep "lane-profile" "$OUT/ab-$n-$v-tp$p$d.log" | head -4
        rm -f "$OUT/ab-$n-$v-tp$p$d.log"
    done
done
exit $rc
} 2>&1 | tee "$OUT/env_ab.md"
