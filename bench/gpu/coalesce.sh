#!/usr/bin/env bash
# Issue 15 on the H200: coalesced last chunks (kvxfer.disagg.coalesce) and the lane rule by
# runs and bytes per run (kvxfer.engine.devcopy.lane_wanted), one call:
# (1) the coalescing and lane-rule tests on CUDA (+ CO_TESTS, default tests/disagg/test_pd_pages.py);
# (2) `kvxfer bench pd` ROUNDS (default 2) rounds of KVXFER_COALESCE_AFTER in CO_AFTER
#     (default "0 2 1 4"; order reversed in even rounds), 1-page latency + throughput;
# (3) one PD run with --stages (default coalescing) and one with KVXFER_DEVICE_MIN_OPS=128
#     (the old lane threshold);
# (4) bench/gpu/lane_rule.py --rule: the default rule's choice against PUTs.
# Skip (2) NO_PD=1, (3) NO_EXTRA=1, (4) NO_RULE=1; CO_TEST_TIMEOUT (default 240 s) bounds (1).
# Writes $OUT/coalesce.md + JSON files.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} UCX_WARN_UNUSED_ENV_VARS=n
rc=0
PD="python3 -m kvxfer bench pd --device cuda --modes none --latency-requests ${LAT:-200} --throughput-requests ${THR:-2000} --large-pages 256 --iters 5"
{
echo "# Coalesced last chunks + lane rule ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
echo; echo "## tests on CUDA"; echo '```'
KVXFER_TEST_DEVICE=cuda timeout ${CO_TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/disagg/test_pd_coalesce.py \
    tests/engine/test_devcopy_unit.py tests/engine/test_lane_standin.py ${CO_TESTS:-tests/disagg/test_pd_pages.py} 2>&1 | tail -8 || rc=1
echo '```'
[ -n "${NO_PD:-}" ] || for r in $(seq 1 "${ROUNDS:-2}"); do
    order=${CO_AFTER:-0 2 1 4}
    [ $((r % 2)) = 0 ] && order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
    for c in $order; do
        echo; echo "## round $r: KVXFER_COALESCE_AFTER=$c"
        KVXFER_COALESCE_AFTER=$c timeout 120 $PD --json-out "$OUT/pd_c${c}_r$r.json" 2>&1 | grep "^| cma\|^| lanes\|Error" || rc=1
    done
done
[ -n "${NO_EXTRA:-}" ] || { echo; echo "## stages, default coalescing"
timeout 120 $PD --stages --json-out "$OUT/pd_stages.json" 2>&1 | grep -v "UCX  WARN" | tail -28 || rc=1
echo; echo "## KVXFER_DEVICE_MIN_OPS=128 (the old lane threshold), default coalescing"
KVXFER_DEVICE_MIN_OPS=128 timeout 120 $PD --json-out "$OUT/pd_minops128.json" 2>&1 | grep "^| cma\|^| lanes\|Error" || rc=1; }
[ -n "${NO_RULE:-}" ] || { echo; echo "## lane_rule.py --rule (the default rule against PUTs)"
timeout 200 python3 bench/gpu/lane_rule.py --rule ${RULE_ARGS:-} 2>&1 | grep -v "UCX  WARN" | tail -45 || rc=1; }
echo "coalesce rc=$rc"
exit $rc
} 2>&1 | tee "$OUT/coalesce.md"
