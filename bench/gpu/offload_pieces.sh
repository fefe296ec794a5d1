#!/usr/bin/env bash
# Offload on the H200: from which piece size the batch copy (cuMemcpyBatchAsync, posted in
# growing chunks) beats the fused kernel. `kvxfer bench offload --device cuda` on requests of
# runs of 4 pages (128 KiB pieces) and scattered pages, with the default batch_min_piece_bytes
# against each of PIECE_KIBS (default "32 64"), ROUNDS (default 2) alternating rounds.
# Writes $OUT/offload_pieces.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
ARGS=${OFF_ARGS:---layouts mha,mha_hnd --patterns runs4,scatter}
{
echo "# Offload batch threshold ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-?}): kvxfer bench offload --device cuda $ARGS"
for r in $(seq 1 "${ROUNDS:-2}"); do
    for kib in default ${PIECE_KIBS:-32 64}; do
        echo; echo "## round $r, batch_min_piece_kib $kib"
        timeout 150 python3 -m kvxfer bench offload --device cuda $ARGS \
            $( [ $kib = default ] || echo --batch-min-piece-kib $kib ) 2>&1 | grep "^|"
    done
done
} 2>&1 | tee "$OUT/offload_pieces.md"
