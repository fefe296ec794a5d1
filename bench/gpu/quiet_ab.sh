#!/usr/bin/env bash
# kvxfer issue 15 on one H200: the channel's wait, old (KVXFER_CHANNEL_WAIT=yield: UCXX receive
# requests polled by asyncio.sleep(0), every connected loop spins) vs new (native: channel
# frames as native active messages, the loop sleeps in epoll), alternating in the same call:
# the 1-page PD stage breakdown ("send -> loop pickup", "scheduler sees Success" are thread
# hand-offs to / from the loop thread), a heterogeneous-TP 2 -> 1 row with stages, and the
# idle CPU of an engine pair / a manager pair plus the channel round trip
# (bench/quiet_idle.py, last: the least needed on the GPU machine). Writes $OUT/quiet_ab.md (+ JSON / logs).
#   bash bench/gpu/run_all.sh quiet_ab
# Env QUIET_ROUNDS (default 1: yield native; 2: yield native native yield, ~2x the time: the
# device call's 10 min allow one round next to run_all's setup; run the script twice instead).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# KVXFER_CHANNEL_WAIT A/B ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
order=""
for r in $(seq 1 "${QUIET_ROUNDS:-1}"); do
    if [ $((r % 2)) -eq 1 ]; then order="$order yield native"; else order="$order native yield"; fi
done
i=0
for v in $order; do
    i=$((i + 1))
    echo; echo "## run $i: KVXFER_CHANNEL_WAIT=$v kvxfer bench pd --device cuda --stages --modes none --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2"
    KVXFER_CHANNEL_WAIT=$v timeout 120 python3 -m kvxfer bench pd --device cuda --stages --modes none \
        --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2 \
        --json-out "$OUT/quiet-$i-$v-1page.json" 2>&1 | grep -v "UCX  WARN" | tail -30 || rc=1
    echo; echo "## run $i: KVXFER_CHANNEL_WAIT=$v kvxfer bench pd --device cuda --modes none --prefill-tp 2 --decode-tp 1 --kv-layout hnd --shape-tokens 16000 --stages"
    KVXFER_CHANNEL_WAIT=$v timeout 100 python3 -m kvxfer bench pd --device cuda --modes none \
        --prefill-tp 2 --decode-tp 1 --kv-layout hnd --shape-tokens 16000 --iters 5 --stages \
        --json-out "$OUT/quiet-$i-$v-tp21.json" 2>&1 | grep -v "UCX  WARN\|WARNING" | tail -12 || rc=1
done
echo; echo "## idle CPU and channel round trip (python bench/quiet_idle.py --rounds ${QUIET_ROUNDS:-1} --device cuda)"
timeout 150 python3 bench/quiet_idle.py --rounds "${QUIET_ROUNDS:-1}" --device cuda \
    --json-out "$OUT/quiet-idle.json" 2>&1 | grep -v "UCX  WARN\|^{" | tail -16 || rc=1
exit $rc
} 2>&1 | tee "$OUT/quiet_ab.md"
