#!/usr/bin/env bash
# Offload on the H200, this tree against .whl/base.tar (`git archive --prefix=base/ -o
# .whl/base.tar REV`) in one call: tests/offload on CUDA (this tree), then ROUNDS (default 2)
# alternating rounds of `kvxfer bench offload --device cuda` per tree (NEW_EXTRA="flags": this
# tree once more with those flags), and each tree's host path step by step
# (bench/gpu/offload_prof.py). Writes $OUT/offload_ab.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
SITE=${PYTHONPATH:-$PWD}; SITE=${SITE%%:*}
ARGS=${OFF_ARGS:---layouts mha,mha_hnd --patterns contig,runs4}
ROOT=/tmp/trees; rm -rf "$ROOT"; mkdir -p "$ROOT"
{
echo "# Offload trees A/B on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) ($(date -u +%F); new = ${KVXFER_COMMIT:-this checkout}, base = ${BASE_NAME:-.whl/base.tar})"
echo '```'
KVXFER_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/offload 2>&1 | tail -4
echo '```'
tar -xf .whl/base.tar -C "$ROOT"
mkdir -p "$ROOT/new" && cp -r kvxfer pools kernels setup.py pyproject.toml "$ROOT/new/" && rm -f "$ROOT"/new/kvxfer/transport/*.so
for t in new base; do
    for pkg in pools kernels; do [ -e "$ROOT/$t/kvxfer/$pkg" ] || ln -s "../$pkg" "$ROOT/$t/kvxfer/$pkg"; done
    (cd "$ROOT/$t" && find . -name __pycache__ -prune -exec rm -rf {} + ; PYTHONPATH=$SITE python3 setup.py -q build_ext --inplace 2>&1 | grep -iE "^error|error:")
done
# variants: a tree, optionally with extra bench flags after a '+' (NEW_EXTRA: this tree again
# with those flags, e.g. "--batch-first 0")
variants="new base"; [ -n "${NEW_EXTRA:-}" ] && variants="new new+ base"
for r in $(seq 1 "${ROUNDS:-2}"); do
    order=$variants; [ $((r % 2)) = 0 ] && order=$(echo $variants | tr ' ' '\n' | tac | tr '\n' ' ')
    for v in $order; do
        t=${v%+}; extra=""; [ "$v" != "$t" ] && extra=$NEW_EXTRA
        echo; echo "## round $r $v: kvxfer bench offload --device cuda $ARGS $extra"
        (cd "$ROOT" && PYTHONPATH=$SITE:$ROOT/$t timeout 150 python3 -m kvxfer bench offload --device cuda $ARGS $extra 2>&1 | grep "^|" | tail -100)
    done
done
for t in new base; do
    echo; echo "## $t: bench/gpu/offload_prof.py ${PROF_PAGES:-8 32 128}"; echo '```'
    (cd "$ROOT" && PYTHONPATH=$SITE:$ROOT/$t timeout 120 python3 "$OLDPWD/bench/gpu/offload_prof.py" ${PROF_PAGES:-8 32 128} 2>&1 | tail -80)
    echo '```'
done
} 2>&1 | tee "$OUT/offload_ab.md"
