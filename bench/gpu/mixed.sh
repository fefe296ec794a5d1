#!/usr/bin/env bash
# Issue 15 on the H200: (1) small requests behind large ones, coalescing on and off in one
# run (`kvxfer bench pd --mixed --coalesce-after 2,0`), MIX_ROUNDS rounds (default 2, the
# order of the values reversed in even rounds), large requests of MIX_PAGES pages (default
# 512; a list runs each) and MIX_N small requests (default 300); (2) one `--stages` run
# with large requests of STAGE_PAGES (default 2048; MIX_STAGES=0 skips): where a large PD
# request's time goes against its raw write, stage by stage; (3) the coalescing tests on
# CUDA (MIX_TESTS=0 skips). Writes $OUT/mixed.md + JSON files.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} UCX_WARN_UNUSED_ENV_VARS=n
rc=0
PD="python3 -m kvxfer bench pd --device cuda --modes none"
{
echo "# Small requests behind large ones, large-request stages ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
for pages in ${MIX_PAGES:-512}; do
for r in $(seq 1 "${MIX_ROUNDS:-2}"); do
    co="2,0"; [ $((r % 2)) = 0 ] && co="0,2"
    echo; echo "## round $r: --mixed ${MIX_N:-300} --coalesce-after $co --large-pages $pages"
    timeout 150 $PD --latency-requests 200 --throughput-requests 2000 --large-pages "$pages" \
        --iters 3 --mixed "${MIX_N:-300}" --coalesce-after "$co" --json-out "$OUT/mixed_p${pages}_r$r.json" 2>&1 \
        | grep -v "UCX  WARN\|WARNING" | tail -14 || rc=1
done
done
[ "${MIX_STAGES:-1}" != 0 ] && { echo; echo "## --stages, large requests of ${STAGE_PAGES:-2048} pages"
timeout 150 $PD --stages --latency-requests 200 --throughput-requests 2000 --large-pages "${STAGE_PAGES:-2048}" \
    --iters 5 --json-out "$OUT/stages_large.json" 2>&1 | grep -v "UCX  WARN\|WARNING" | tail -50 || rc=1; }
if [ "${MIX_TESTS:-1}" != 0 ]; then
    echo; echo "## coalescing tests on CUDA"; echo '```'
    KVXFER_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/disagg/test_pd_coalesce.py \
        tests/disagg/test_coalesce_units.py 2>&1 | tail -4 || rc=1
    echo '```'
fi
echo "mixed rc=$rc"
exit $rc
} 2>&1 | tee "$OUT/mixed.md"
