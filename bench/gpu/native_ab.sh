#!/usr/bin/env bash
# The native steps of the 1-page path on one H200, one call (bash bench/gpu/run_all.sh
# native_ab): the 1-page PD stage breakdown (bench/gpu/env_ab.sh, alternating 0 1 0 1) for
# KVXFER_NATIVE_PLAN (the write planned in one native call, bench/results/native-plan-cpu.md),
# KVXFER_NATIVE_TAKES (receipts on the native receive thread, native-takes-cpu.md) and
# KVXFER_NOTE_SPIN (the own worker's thread never sleeps: what a thread wake-up costs there),
# then bench/plan_cost.py with the native planner off and on. NATIVE_AB_VARS picks the
# variables (default the first two: NOTE_SPIN was measured in the sixth session),
# NATIVE_AB_VALUES their values (default "0 1 0 1"; e.g. NATIVE_AB_VARS=KVXFER_SPIN_LINGER_US
# NATIVE_AB_VALUES="0 1000 0 1000 0 1000"), NATIVE_AB_S bounds each variable's A/B (default
# 170 s), NATIVE_AB_PLAN=0 skips plan_cost. Writes $OUT/native_ab.md and $OUT/<var>/.
set -u
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
base=$OUT
{
echo "# Native steps A/B ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
for var in ${NATIVE_AB_VARS:-KVXFER_NATIVE_PLAN KVXFER_NATIVE_TAKES}; do
    mkdir -p "$base/$var"
    echo; echo "## $var (t=${SECONDS}s)"
    OUT=$base/$var AB_VAR=$var AB_VALUES="${NATIVE_AB_VALUES:-0 1 0 1}" AB_RATIOS=" " timeout "${NATIVE_AB_S:-170}" bash bench/gpu/env_ab.sh \
        | grep -E "^## |^\| (cma|cuda)|^\| (send|page map|room|engine plan|native post|flush|decode|protocol|scheduler|raw|\*\*sum|path|end-to-end|ucx_perftest|receipts)" \
        || echo "!! $var rc=$?"
done
if [ "${NATIVE_AB_PLAN:-1}" != 0 ]; then
    echo; echo "## bench/plan_cost.py, KVXFER_NATIVE_PLAN 0 1 0 1 (t=${SECONDS}s)"
    for v in 0 1 0 1; do
        echo "### $v"
        KVXFER_NATIVE_PLAN=$v timeout 40 python3 bench/plan_cost.py 2>&1 | grep -E "^(engine|write|disagg)\." || echo "!! rc=$?"
    done
fi
} 2>&1 | tee "$base/native_ab.md"
