#!/usr/bin/env bash
# What the GIL costs the 1-page PD path (issue 15): `kvxfer bench pd` with and without a
# Python thread per worker that never leaves the interpreter (--busy-thread: a scheduler busy
# in Python beside the manager's loop thread), at the workers' 0.5 ms switch interval and at
# Python's default 5 ms; CUDA pools and host pools on the H200 machine's 16 cores.
# Writes $OUT/gil.md.   bash bench/gpu/run_all.sh gil
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
{
echo "# GIL A/B on the 1-page PD path ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
for dev in ${GIL_DEVICES:-cuda cpu}; do
  for variant in "" "--busy-thread" "--busy-thread --switch-interval 0.005" "--switch-interval 0.005"; do
    echo; echo "## kvxfer bench pd --device $dev --modes none,peer $variant"
    timeout 120 python3 -m kvxfer bench pd --device $dev --modes none,peer --latency-requests 300 \
        --throughput-requests 600 --large-pages 256 --iters 3 $variant 2>&1 \
        | grep -v "UCX  WARN\|WARNING" | grep -E "^\| (cma|tcp|cuda)" 
  done
done
} 2>&1 | tee "$OUT/gil.md"
