#!/usr/bin/env bash
# Issue 15 on the H200: the 1-page PD stage breakdown (`kvxfer bench pd --device cuda --stages`)
# and, when .whl/old.tar holds an older tree, the driver layer's pointer queries old vs new
# (bench/gpu/driver_diag.py). Writes $OUT/stages.md and $OUT/stages.json.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# 1-page PD stages on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
if [ -f .whl/old.tar ]; then
    rm -rf /tmp/oldtree && mkdir -p /tmp/oldtree && tar -xf .whl/old.tar -C /tmp/oldtree
    echo; echo "## driver layer: old ($(cat /tmp/oldtree/.commit 2>/dev/null)) vs new"; echo '```'
    (cd /tmp/oldtree && PYTHONPATH=/tmp/site:/tmp/oldtree timeout 60 python3 "$OLDPWD/bench/gpu/driver_diag.py" old) 2>&1 | tail -12
    timeout 60 python3 bench/gpu/driver_diag.py new 2>&1 | tail -12
    echo '```'
fi
echo; echo "## kvxfer bench pd --device cuda --stages ${STAGES_ARGS:-}"
timeout ${STAGES_TIMEOUT:-300} python3 -m kvxfer bench pd --device cuda --stages --modes ${STAGES_MODES:-none,peer} \
    --latency-requests 300 --throughput-requests 1000 --large-pages 1024 --iters 3 \
    --json-out "$OUT/stages.json" ${STAGES_ARGS:-} 2>&1 | grep -v "UCX  WARN" || rc=1
exit $rc
} 2>&1 | tee "$OUT/stages.md"
