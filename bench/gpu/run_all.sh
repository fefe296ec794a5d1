#!/usr/bin/env bash
# Driver for the H200 accelerator machine (run from the repository root there):
#   bash bench/gpu/run_all.sh [area ...]      areas: kernels pools offload backing transfer (default: all)
# Installs the carried wheels (.whl/: ucxx-cu13 & co., pytest-asyncio) into /tmp/site, builds the native RMA
# extension in place, then runs bench/gpu/<area>.sh for each area under a deadline. Every area script writes
# $OUT/<area>.md; this driver tees its whole log to $OUT/log.txt.
set -u
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVXFER_TEST_DEVICE=cuda
DEADLINE=${DEADLINE:-540}
AREAS=${*:-kernels pools offload backing transfer}
{
echo "### setup $(date -u +%FT%TZ)"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/site/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
python3 -c 'import ucxx; print("ucxx", ucxx.__version__, "ucx", ucxx.get_ucx_version())' 2>&1 | tail -1
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
echo "setup done at ${SECONDS}s"
for a in $AREAS; do
    if [ $SECONDS -ge $DEADLINE ]; then echo "!! deadline ${DEADLINE}s reached: skipping $a"; continue; fi
    if [ ! -f "bench/gpu/$a.sh" ]; then echo "!! no bench/gpu/$a.sh"; continue; fi
    echo; echo "### $a $(date -u +%T) (t=${SECONDS}s)"
    timeout $((DEADLINE - SECONDS + 5)) bash "bench/gpu/$a.sh" 2>&1
    echo "### $a rc=$? (t=${SECONDS}s)"
done
} 2>&1 | tee "$OUT/log.txt"
