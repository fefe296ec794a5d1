#!/usr/bin/env bash
# One environment variable A/B on one tree, values alternating over rounds (the order flips
# each round, so machine drift hits every value alike), then the medians per value:
#   AB_VAR=KVXFER_DIRECT_PAGES AB_VALUES="16 0" ROUNDS=6 bash bench/ab/env_rounds.sh [device]
# Runs `kvxfer bench pd --device DEVICE $PD_ARGS --json-out $OUT/<value>-<round>.json` per value
# and round (run from the repository root, or with kvxfer importable), then
# bench/ab/env_compare.py $OUT: p50 / p99 / req/s / raw and each stage's p50 / p99 (with --stages).
set -u
DEV=${1:-cpu}
VAR=${AB_VAR:?set AB_VAR and AB_VALUES}
VALUES=${AB_VALUES:?}
OUT=${OUT:-/tmp/env_rounds}; mkdir -p "$OUT"
ROUNDS=${ROUNDS:-4}
PD_ARGS=${PD_ARGS:---modes none,peer --stages --latency-requests 1000 --throughput-requests 3000 --large-pages 16 --iters 1}
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
export UCX_WARN_UNUSED_ENV_VARS=n PYTHONUNBUFFERED=1
for r in $(seq 1 "$ROUNDS"); do
    vals=$VALUES; [ $((r % 2)) = 0 ] && vals=$(echo $VALUES | tr ' ' '\n' | tac | tr '\n' ' ')
    for v in $vals; do
        echo "### round $r $VAR=$v"
        env "$VAR=$v" timeout 300 $PY -m kvxfer bench pd --device "$DEV" $PD_ARGS \
            --json-out "$OUT/$v-$r.json" > "$OUT/$v-$r.log" 2>&1 || echo "!! rc=$? (see $OUT/$v-$r.log)"
    done
done
$PY "$HERE/env_compare.py" "$OUT" "$VAR" $VALUES
