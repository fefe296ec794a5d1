#!/usr/bin/env bash
# A/B of the SGLang backend's 1-page path between two source trees, alternating rounds:
#   BASE=/path/to/other/checkout ROUNDS=3 MODES="none peer" OUT=/tmp/sgl-ab bash bench/ab/sgl_trees.sh
# Runs bench/sgl_latency.py (this tree's copy) in .venv-sglang with PYTHONPATH set to each tree
# (its kvxfer package first on the path; the other tree needs its own built _rma extension),
# writes $OUT/<tree>-<mode>-<round>.json and prints medians per tree and mode.
set -eu
BASE=${BASE:?set BASE to the other checkout}
ROUNDS=${ROUNDS:-3}; MODES=${MODES:-none peer}; OUT=${OUT:-/tmp/sgl-ab}
PY=${PY:-.venv-sglang/bin/python}; ARGS=${ARGS:---requests 300 --throughput 400}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for m in $MODES; do
    order="new base"; [ $((r % 2)) -eq 0 ] && order="base new"
    for t in $order; do
      tree=$PWD; [ "$t" = base ] && tree=$BASE
      echo "### round $r mode $m tree $t"
      KVXFER_ERROR_MODE=$m UCX_WARN_UNUSED_ENV_VARS=n PYTHONPATH=$tree \
        timeout 600 "$PY" bench/sgl_latency.py $ARGS --json 2>/dev/null | tail -1 > "$OUT/$t-$m-$r.json"
    done
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
rows = {}
for f in glob.glob(os.path.join(out, "*.json")):
    t, m, _ = os.path.basename(f)[:-5].split("-")
    try:
        rows.setdefault((m, t), []).append(json.load(open(f)))
    except ValueError:
        print("unreadable:", f)
keys = ["sgl_p50_us", "sgl_p99_us", "raw_p50_us", "raw_notify_p50_us", "sgl_over_raw_notify",
        "req_per_s", "direct_share"]
for m in sorted({m for m, _ in rows}):
    print(f"\n### {m}\n\n| figure | new (n={len(rows.get((m, 'new'), []))}) | base (n={len(rows.get((m, 'base'), []))}) | new/base |")
    print("|---|---|---|---|")
    for k in keys:
        a = [r[k] for r in rows.get((m, "new"), []) if k in r]
        b = [r[k] for r in rows.get((m, "base"), []) if k in r]
        if not a:
            continue
        ma = statistics.median(a)
        mb = statistics.median(b) if b else float("nan")
        ratio = ma / mb if mb else float("nan")
        print(f"| {k} | {ma:.2f} | {mb:.2f} | {ratio:.2f} |")
PY
