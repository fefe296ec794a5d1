#!/usr/bin/env bash
# Before/after benchmark of two kvxfer trees in the same run (a refactor must not move the
# figures): `bash bench/ab/run_ab.sh OLD_TREE NEW_TREE [device]`, from anywhere.
# Rounds alternate the order (old new, new old, ...) so that an order effect (a warm GPU, the
# previous process's teardown) hits both trees alike.
# Each tree is copied to $WORK/{old,new} (the originals stay untouched), gets its native extension
# built in place and kvxfer/pools, kvxfer/kernels links (no install: PYTHONPATH picks the tree). The benchmarks alternate A B A B (ROUNDS, default 2), so
# machine drift hits both; bench/ab/compare.py prints the table. Writes $OUT/ab-*.json.
# Env: ROUNDS, BENCH (pd,transfer by default), PD_ARGS, TR_ARGS (extra arguments for `kvxfer bench pd` / `bench transfer`).
set -eu
DEV=${3:-cpu}
OUT=${OUT:-/tmp/ab_out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/ab_trees}; rm -rf "$WORK"; mkdir -p "$WORK/old" "$WORK/new"
for side in old new; do
    src=$1; [ $side = new ] && src=$2
    tar -C "$src" --exclude='./.venv*' --exclude=./.git --exclude=./.whl --exclude=./build -cf - . | tar -C "$WORK/$side" -xf -
done
OLD=$WORK/old; NEW=$WORK/new
ROUNDS=${ROUNDS:-2}
BENCH=${BENCH:-pd,transfer}
PD_ARGS=${PD_ARGS:-}
TR_ARGS=${TR_ARGS:---sizes 1,16,128,512 --paths direct --pagesets random,contiguous --iters 5}
export UCX_WARN_UNUSED_ENV_VARS=n PYTHONUNBUFFERED=1
for t in "$OLD" "$NEW"; do
    (cd "$t" && python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || { echo "build failed in $t"; exit 1; })
    for p in pools kernels; do [ -e "$t/kvxfer/$p" ] || ln -s ../$p "$t/kvxfer/$p"; done
done
base=${PYTHONPATH:-}
for r in $(seq 1 "$ROUNDS"); do
    order="old new"; [ $((r % 2)) = 0 ] && order="new old"
    for side in $order; do
        t=$OLD; [ $side = new ] && t=$NEW
        echo "### round $r $side ($t)"
        [[ $BENCH == *pd* ]] && (cd /tmp && PYTHONPATH="$t${base:+:$base}" timeout 300 python3 -m kvxfer bench pd --device "$DEV" $PD_ARGS \
            --json-out "$OUT/ab-pd-$side-$r.json" 2>&1 | grep -v "UCX  WARN" | tail -12)
        [[ $BENCH == *transfer* ]] && (cd /tmp && PYTHONPATH="$t${base:+:$base}" timeout 400 python3 -m kvxfer bench transfer --device "$DEV" $TR_ARGS \
            --json-out "$OUT/ab-transfer-$side-$r.json" 2>&1 | grep -v "UCX  WARN" | tail -25)
    done
done
python3 "$NEW/bench/ab/compare.py" "$OUT"
