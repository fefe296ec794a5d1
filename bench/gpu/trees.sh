#!/usr/bin/env bash
# A/B of two source trees on the H200 in one call: `bash bench/gpu/run_all.sh trees` with
# the other tree carried as .whl/base.tar (`git archive --prefix=base/ -o .whl/base.tar REV`).
# Builds the base tree's native extension in place, then runs `kvxfer bench pd --device cuda`
# ROUNDS times per tree, alternating (PYTHONPATH picks the tree's kvxfer, and its pools/ and
# kernels/ through kvxfer/pools and kvxfer/kernels links made in each copy), and
# bench/ab/env_compare.py on the JSON files.
# TESTS=1 first runs the loop-thread, delivery, transport and direct-call tests on CUDA pools.
# PD_ARGS: one argument set, or several separated by ';' (each run ROUNDS times per tree);
# heterogeneous-TP sets (--prefill-tp / --decode-tp) are summarised by bench/ab/tp_compare.py.
# Writes $OUT/trees.md and $OUT/trees/<tree>-<set><round>.json.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT/trees"
SITE=${PYTHONPATH:-$PWD}; SITE=${SITE%%:*}  # /tmp/site (run_all.sh's wheels) or the repo
ARGS=${PD_ARGS:---modes none --stages --latency-requests 1000 --throughput-requests 3000 --large-pages 256 --iters 1}
ROOT=/tmp/trees; rm -rf "$ROOT"; mkdir -p "$ROOT"
{
echo "# Trees A/B on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) ($(date -u +%F); new = ${KVXFER_COMMIT:-this checkout}, base = ${BASE_NAME:-.whl/base.tar})"
if [ "${TESTS:-0}" = 1 ]; then
    echo '```'
    KVXFER_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider \
        tests/unit/test_loop_thread.py tests/engine/test_deliver.py tests/transport \
        tests/disagg/test_direct_calls.py tests/disagg/test_pd_flow.py 2>&1 | tail -4
    echo '```'
fi
# both trees copied to $ROOT and built alike there: the same place for each build (a first
# version ran "new" from the checkout: its pure-Python stages came out 3-18 % slower)
tar -xf .whl/base.tar -C "$ROOT"
mkdir -p "$ROOT/new" && cp -r kvxfer pools kernels setup.py pyproject.toml "$ROOT/new/" && rm -f "$ROOT"/new/kvxfer/transport/*.so
for t in new base; do
    for pkg in pools kernels; do [ -e "$ROOT/$t/kvxfer/$pkg" ] || ln -s "../$pkg" "$ROOT/$t/kvxfer/$pkg"; done
    (cd "$ROOT/$t" && find . -name __pycache__ -prune -exec rm -rf {} + ; PYTHONPATH=$SITE python3 setup.py -q build_ext --inplace 2>&1 | grep -iE "^error|error:" ; ls kvxfer/transport/*.so)
done
IFS=';' read -ra SETS <<< "$ARGS"
for k in "${!SETS[@]}"; do
    A=${SETS[$k]}
    echo; echo "kvxfer bench pd --device cuda $A, ROUNDS=${ROUNDS:-3}"; echo '```'
    for r in $(seq 1 "${ROUNDS:-3}"); do
        order="new base"; [ $((r % 2)) = 0 ] && order="base new"
        for t in $order; do
            echo "### round $r $t"
            (cd "$ROOT" && PYTHONPATH=$SITE:$ROOT/$t UCX_WARN_UNUSED_ENV_VARS=n timeout 240 python3 -m kvxfer bench pd \
                --device cuda $A --json-out "$OUT/trees/$t-$k$r.json" > "$OUT/trees/$t-$k$r.log" 2>&1) \
                || { echo "!! rc=$?"; tail -5 "$OUT/trees/$t-$k$r.log"; }
            grep "lane-profile" "$OUT/trees/$t-$k$r.log" | head -4
        done
    done
    echo '```'
done
case "$ARGS" in
    *--prefill-tp*|*--decode-tp*) python3 bench/ab/tp_compare.py "$OUT/trees" new base ;;
    *) python3 bench/ab/env_compare.py "$OUT/trees" tree new base ;;
esac
} 2>&1 | tee "$OUT/trees.md"
