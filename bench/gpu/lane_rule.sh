#!/usr/bin/env bash
# Issue 15 on the H200: where the device lane beats UCX PUTs, by runs and bytes per run
# (bench/gpu/lane_rule.py), RULE_ROUNDS (default 1) sweeps in one call. Writes $OUT/lane_rule.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} UCX_WARN_UNUSED_ENV_VARS=n
rc=0
{
echo "# Lane vs UCX PUTs by runs x bytes per run ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
for r in $(seq 1 "${RULE_ROUNDS:-1}"); do
    echo; echo "## round $r"
    timeout 240 python3 bench/gpu/lane_rule.py ${RULE_ARGS:-} 2>&1 | grep -v "UCX  WARN" | tail -50 || rc=1
done
echo "lane_rule rc=$rc"
exit $rc
} 2>&1 | tee "$OUT/lane_rule.md"
