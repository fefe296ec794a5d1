#!/usr/bin/env bash
# Heterogeneous TP through the device lane's pattern launch (issue 16: one PatternWrite per kv
# write, kvxfer.kernels.pattern_copy) on one H200: the kernel, engine and TP protocol tests
# with CUDA memory, the TP demo at four shapes (every byte checked), then `kvxfer bench pd`
# per ratio for NHD, page-major, HND and MLA (default path = pattern, against equal TP in the
# same run) and one ratio with --tp-paths (direct / staged / pattern side by side). Writes
# $OUT/pattern.md (+ JSON rows). Env PAT_RATIOS (default "1:2 2:1 4:1 2:4"; empty: none), PAT_TOKENS
# (default 16000), PAT_ITERS (default 5: requests per row), PAT_TESTS=0 skips tests and demos, PAT_TEST_FILES narrows the tests,
# PAT_DEMOS=0 skips the demos, PAT_PATHS=0 skips the --tp-paths run, PAT_BIG=<tokens> adds
# a 2:1 run at that request size, PAT_STAGES=1 prints every rank's stages (--stages),
# PAT_PAGES=1 adds 2:1 with pages 16 -> 64 and decode prefix 37 (direct / staged / pattern;
# its equal 2:2 and 1:1 rows twice: "equal", byte runs as one PatternWrite per piece class,
# and "equal-runs", tp_pattern=off: one PUT per run), PAT_LAYOUTS narrows the per-ratio
# layouts (default per_layer,page_major,hnd,mla), PAT_TIMEOUT the seconds per ratio run (default 100);
# KVXFER_LANE_PROFILE=1 adds each device
# lane's pattern-launch host parts (lane-profile lines).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
RATIOS=${PAT_RATIOS-"1:2 2:1 4:1 2:4"}  # PAT_RATIOS= (set, empty): no ratio runs
TOKENS=${PAT_TOKENS:-16000}
LAYOUTS=${PAT_LAYOUTS:-per_layer,page_major,hnd,mla}
rc=0
{
echo "# Heterogeneous TP, pattern launch on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
if [ "${PAT_TESTS:-1}" != 0 ]; then
echo; echo "## tests with KVXFER_TEST_DEVICE=cuda"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider ${PAT_TEST_FILES:-tests/kernels/test_pattern_copy.py \
    tests/unit/test_pattern_runs.py tests/unit/test_tp_slices.py tests/engine/test_engine.py \
    tests/disagg/test_pd_tp.py} 2>&1 | tee "$OUT/pattern-tests.log" | grep -v "^  \[\|UCX  WARN" | tail -${PAT_TAIL:-8} || rc=1
echo '```'
[ "${PAT_DEMOS:-1}" != 0 ] && for shape in "2 1 per_layer" "1 2 page_major" "4 1 hnd --ssm-heads 4" "2 4 per_layer --ssm-heads 4"; do
    set -- $shape
    echo; echo "## kvxfer demo --device cuda --prefill-tp $1 --decode-tp $2 --kv-layout $3 ${4:-} ${5:-}"; echo '```'
    timeout 60 python3 -m kvxfer demo --device cuda --prefill-tp "$1" --decode-tp "$2" --kv-layout "$3" ${4:-} ${5:-} 2>&1 | grep -v "UCX  WARN" | tail -4 || rc=1
    echo '```'
done
fi
for r in $RATIOS; do
    p=${r%:*}; d=${r#*:}
    echo; echo "## kvxfer bench pd --device cuda --modes none --prefill-tp $p --decode-tp $d --kv-layout $LAYOUTS --shape-tokens $TOKENS"
    timeout ${PAT_TIMEOUT:-100} python3 -m kvxfer bench pd --device cuda --modes none --prefill-tp "$p" --decode-tp "$d" \
        --kv-layout "$LAYOUTS" --shape-tokens "$TOKENS" --iters "${PAT_ITERS:-5}" ${PAT_STAGES:+--stages} \
        --json-out "$OUT/pattern-$p-$d.json" 2>&1 | tee "$OUT/pattern-$p-$d.log" \
        | grep -v "UCX  WARN\|WARNING\|lane-profile" | tail -${PAT_TAIL_BENCH:-16} || rc=1
    grep "lane-profile" "$OUT/pattern-$p-$d.log" | head -40
done
if [ -n "${PAT_BIG:-}" ]; then  # one ratio at a larger request: fixed costs amortised
    echo; echo "## kvxfer bench pd --device cuda --modes none --prefill-tp 2 --decode-tp 1 --kv-layout per_layer,hnd --shape-tokens $PAT_BIG"
    timeout 150 python3 -m kvxfer bench pd --device cuda --modes none --prefill-tp 2 --decode-tp 1 \
        --kv-layout per_layer,hnd --shape-tokens "$PAT_BIG" --iters 5 \
        --json-out "$OUT/pattern-big.json" 2>&1 | tee "$OUT/pattern-big.log" | grep -v "UCX  WARN\|WARNING" | tail -16 || rc=1
fi
if [ -n "${PAT_PAGES:-}" ]; then  # different page sizes + prefix: one launch per piece class
    echo; echo "## kvxfer bench pd --device cuda --modes none --prefill-tp 2 --decode-tp 1 --prefill-page-size 16 --decode-page-size 64 --decode-prefix 37 --kv-layout per_layer,hnd --tp-paths"
    timeout 330 python3 -m kvxfer bench pd --device cuda --modes none --prefill-tp 2 --decode-tp 1 \
        --prefill-page-size 16 --decode-page-size 64 --decode-prefix 37 --kv-layout per_layer,hnd \
        --shape-tokens "$TOKENS" --iters 5 --tp-paths \
        --json-out "$OUT/pattern-pages.json" 2>&1 | tee "$OUT/pattern-pages.log" | grep -v "UCX  WARN\|WARNING" | tail -32 || rc=1
fi
if [ "${PAT_PATHS:-1}" != 0 ]; then
    echo; echo "## kvxfer bench pd --device cuda --modes none --prefill-tp 2 --decode-tp 1 --kv-layout per_layer,hnd --shape-tokens $TOKENS --tp-paths"
    timeout 120 python3 -m kvxfer bench pd --device cuda --modes none --prefill-tp 2 --decode-tp 1 \
        --kv-layout per_layer,hnd --shape-tokens "$TOKENS" --iters 5 --tp-paths \
        --json-out "$OUT/pattern-paths.json" 2>&1 | tee "$OUT/pattern-paths.log" | grep -v "UCX  WARN\|WARNING" | tail -16 || rc=1
fi
exit $rc
} 2>&1 | tee "$OUT/pattern.md"
