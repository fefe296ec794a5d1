#!/usr/bin/env bash
# Kernel tests on CUDA + kernel benchmark (Triton vs torch copy_). Installs nothing.
# Run from the repository root on the accelerator machine; writes $OUT/kernels.md (+ kernels.json).
set -o pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# Kernels on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
echo
echo "## tests/kernels on CUDA"
echo '```'
KVXFER_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -40 || rc=1
echo '```'
echo
python3 -m kvxfer bench kernels --json-out "$OUT/kernels.json" 2>&1 || rc=1
echo
echo "kernels.sh rc=$rc"
exit $rc
} 2>&1 | tee "$OUT/kernels.md"
