#!/usr/bin/env bash
# Issue 17's CPU figures on a quiet machine: `kvxfer bench layerwise` (CPU pools, timed waits
# as the compute) pinned to two cores (`taskset -c 0,1`: the CI machine's size) on the
# accelerator machine, whose CPUs are otherwise idle; then the in-flight A/B (1 vs 8 layer
# writes of a room on the wire). Writes $OUT/layer_cpu.md (+ lwcpu*.json).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
LW="taskset -c 0,1 python3 -m kvxfer bench layerwise --device cpu"
{
echo "# layer-wise on 2 pinned cores of the H200 host ($(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}, $(nproc) cpus, load $(cut -d' ' -f1-3 /proc/loadavg))"
echo; echo "## $LW --iters 5"
timeout 300 $LW --iters 5 --json-out "$OUT/lwcpu.json" 2>&1 | grep -v "UCX  WARN" | tail -20
for n in 1 8; do
echo; echo "## $LW --layers 32 --tokens 2048,8192 --modes whole,layer --iters 5 --max-inflight $n"
timeout 120 $LW --layers 32 --tokens 2048,8192 --modes whole,layer --iters 5 --max-inflight $n \
  --json-out "$OUT/lwcpu-inflight$n.json" 2>&1 | grep -v "UCX  WARN" | tail -8
done
} 2>&1 | tee "$OUT/layer_cpu.md"
