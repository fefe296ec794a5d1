#!/usr/bin/env bash
# Driver for the H200 accelerator machine (run from the repository root there):
#   bash bench/gpu/run_all.sh [area ...]      areas: kernels pools offload backing transfer (default: all)
# Installs the carried wheels (.whl/: ucxx-cu13 & co., pytest-asyncio, setuptools) into /tmp/site, installs kvxfer
# editable (builds the native RMA extension in place), then runs bench/gpu/<area>.sh for each area under a deadline. Every area script writes
# $OUT/<area>.md; this driver tees its whole log to $OUT/log.txt.
# Reports name the measured tree by `git rev-parse` there, which can be a stale .git left on the
# device machine: put KVXFER_COMMIT=<hash> (this checkout's) in the command to name it instead.
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
# The repository's pools/ and kernels/ import as kvxfer.pools / kvxfer.kernels: an editable
# install maps them (setuptools >= 77 comes with the carried wheels) and builds the extension.
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING" | tail -3
python3 -c 'import kvxfer.pools, kvxfer.kernels, kvxfer.transport.ucx_lib as u; u.load_ucx(); print("kvxfer importable:", kvxfer.pools.__file__)'
echo "setup done at ${SECONDS}s"
for a in $AREAS; do
    if [ $SECONDS -ge $DEADLINE ]; then echo "!! deadline ${DEADLINE}s reached: skipping $a"; continue; fi
    if [ ! -f "bench/gpu/$a.sh" ]; then echo "!! no bench/gpu/$a.sh"; continue; fi
    echo; echo "### $a $(date -u +%T) (t=${SECONDS}s)"
    timeout $((DEADLINE - SECONDS + 5)) bash "bench/gpu/$a.sh" 2>&1
    echo "### $a rc=$? (t=${SECONDS}s)"
done
} 2>&1 | tee "$OUT/log.txt"
