#!/usr/bin/env bash
# Heterogeneous-TP rows of `kvxfer bench pd` (CPU, error mode "none") from two source trees,
# alternating per round and ratio: this checkout ("new") and BASE (a checkout whose native
# extension is built in place: `python setup.py build_ext --inplace`); PYTHONPATH picks the tree.
# Usage: BASE=/path/to/base [ROUNDS=2] bash bench/ab/pd_trees_tp.sh OUTDIR [ratios] [layouts] [tokens]
set -u
out=${1:?outdir}; ratios=${2:-"1:2 1:4 2:4"}; layouts=${3:-hnd,per_layer,page_major}
tokens=${4:-16000}; base=${BASE:?BASE=<base checkout>}
mkdir -p "$out"
py=${PY:-$PWD/.venv/bin/python}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for r in $ratios; do
    p=${r%:*}; d=${r#*:}
    for tree in new base; do
      src=$PWD; [ "$tree" = base ] && src=$base
      echo "== round $round $r $tree $(date -u +%T)" >&2
      (cd "$src" && PYTHONPATH="$src" UCX_WARN_UNUSED_ENV_VARS=n "$py" -m kvxfer bench pd --device cpu \
        --modes none --prefill-tp "$p" --decode-tp "$d" --kv-layout "$layouts" \
        --shape-tokens "$tokens" --iters 5) > "$out/r$round-tp-$p-$d-$tree.md" 2>&1
    done
  done
done
