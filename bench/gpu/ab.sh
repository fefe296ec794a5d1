#!/usr/bin/env bash
# Before/after on the GPU machine: `bash bench/gpu/run_all.sh ab` with the old tree carried as
# .whl/old.tar (`git archive <commit> -o .whl/old.tar`). Runs bench/ab/run_ab.sh on CUDA pools
# (bench pd + bench transfer, old/new alternating) and writes $OUT/ab.md.
set -o pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
rm -rf /tmp/ab_old && mkdir -p /tmp/ab_old && tar -C /tmp/ab_old -xf .whl/old.tar || exit 1
export PYTHONPATH=${PYTHONPATH:-}
{
echo "# Before/after on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) ($(date -u +%F))"
echo
echo "old: $(cat /tmp/ab_old/.commit 2>/dev/null || echo 'see .whl/old.tar'), new: this tree"
echo
echo '```'
OUT=$OUT/ab ROUNDS=${ROUNDS:-2} \
  TR_ARGS="${TR_ARGS:---layers 8 --page-kib 64 --pages 2048 --sizes 1,16,128,512 --paths direct --device-copy auto,off --iters 5}" \
  bash bench/ab/run_ab.sh /tmp/ab_old . cuda 2>&1 | grep -v "UCX  WARN" | grep -v "^|" | tail -40
echo '```'
python3 bench/ab/compare.py "$OUT/ab"
} 2>&1 | tee "$OUT/ab.md"
