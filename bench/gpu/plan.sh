#!/usr/bin/env bash
# Issues 15/16 on the H200 host: the fixed host cost of planning a write (bench/plan_cost.py,
# CPU only: real engines over UCX loopback) and the PD stage traces it feeds (`kvxfer bench pd
# --device cuda --stages`: 1-page and 1000-page equal TP, then 2 -> 1 per_layer and MLA).
# With .whl/old.tar holding an older tree, plan_cost.py runs against both, alternately.
# Writes $OUT/plan.md, $OUT/plan-stages.json and $OUT/plan-tp.json.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# plan cost on the H200 host ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)}, load $(cut -d' ' -f1-3 /proc/loadavg))"
if [ -f .whl/old.tar ]; then
    rm -rf /tmp/oldtree && mkdir -p /tmp/oldtree && tar -xf .whl/old.tar -C /tmp/oldtree
    (cd /tmp/oldtree && python3 setup.py build_ext --inplace -q >/dev/null 2>&1)
fi
for i in 1 2 3; do
    if [ -d /tmp/oldtree ]; then
        echo; echo "## bench/plan_cost.py, old tree ($(cat /tmp/oldtree/.commit 2>/dev/null)), run $i"
        (cd /tmp/oldtree && PYTHONPATH=/tmp/site:/tmp/oldtree timeout 120 python3 "$OLDPWD/bench/plan_cost.py" --iters 2000) 2>&1 | grep -v "UCX  WARN"
    fi
    echo; echo "## bench/plan_cost.py, this tree, run $i"
    timeout 120 python3 bench/plan_cost.py --iters 2000 2>&1 | grep -v "UCX  WARN" || rc=1
done
echo; echo "## kvxfer bench pd --device cuda --stages (1-page, 1000-page)"
timeout ${PLAN_TIMEOUT:-240} python3 -m kvxfer bench pd --device cuda --stages --modes none \
    --latency-requests 300 --throughput-requests 1000 --large-pages 1000 --iters 3 \
    --json-out "$OUT/plan-stages.json" 2>&1 | grep -v "UCX  WARN" || rc=1
echo; echo "## kvxfer bench pd --device cuda --stages --prefill-tp 2 --decode-tp 1 (per_layer, mla)"
timeout ${PLAN_TIMEOUT:-240} python3 -m kvxfer bench pd --device cuda --stages --modes none \
    --prefill-tp 2 --decode-tp 1 --kv-layout per_layer,mla --shape-tokens 16000 \
    --json-out "$OUT/plan-tp.json" 2>&1 | grep -v "UCX  WARN" || rc=1
exit $rc
} 2>&1 | tee "$OUT/plan.md"
