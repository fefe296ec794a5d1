#!/usr/bin/env bash
# Where a 1-page send's host time goes on this machine: `bash bench/gpu/run_all.sh profile_send`.
# `kvxfer bench pd --modes none --stages` with KVXFER_BENCH_PROFILE (cProfile around each
# sequential send on prefill's scheduler thread: with direct calls that is the request's
# path up to its post), once with host pools (--device cpu) and once with CUDA pools, so the
# same host's Python is compared with itself. Writes $OUT/profile_send.md (+ .prof files).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} UCX_WARN_UNUSED_ENV_VARS=n
{
echo "# Send-path profile ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo cpu), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
for dev in cpu cuda; do
    [ "$dev" = cuda ] && ! nvidia-smi >/dev/null 2>&1 && continue
    echo; echo "## --device $dev"; echo
    KVXFER_BENCH_PROFILE=$OUT/prof-$dev timeout 200 python3 -m kvxfer bench pd --device $dev \
        --modes none --stages --latency-requests 1000 --throughput-requests 500 --large-pages 16 \
        --iters 1 2>&1 | grep -v "UCX  WARN" | sed -n '/| stage/,/perftest/p'
    echo; python3 bench/prof_table.py "$OUT/prof-$dev.prof" _send 30
done
} 2>&1 | tee "$OUT/profile_send.md"
