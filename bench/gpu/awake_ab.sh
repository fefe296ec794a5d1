#!/usr/bin/env bash
# Is the lent GPU machine's slow host time (every PD host step 3-10x its cost in one process,
# bench/results/launch-h200.md, join-legs-h100.md) the cost of vCPUs that halted? The machines
# are Firecracker microVMs whose guest idles with cpuidle haltpoll and guest_halt_poll_ns=0:
# an idle vCPU exits to the host at once, and a thread woken on it waits for the host to run
# the vCPU again, then runs on cold caches. This A/B keeps every vCPU busy without changing a
# setting: one SCHED_IDLE spinner per CPU ("on"; any thread of ours preempts it at once),
# against none ("off"), alternating, each run the 1-page PD stage breakdown, the host time of
# one process's device-lane and copy_ enqueues back to back and after 2 ms idle
# (bench/gpu/lane_post.py --gap-ms), and a TP row with its stages on request, with
# /proc/stat's steal and idle deltas. Only on hosts of >= 4 CPUs: below that
# kvxfer's waits yield the CPU (ucx.YIELD_BELOW_CPUS), and a yield hands it to the spinner
# for a whole slice (on the 2-core CPU box the flush + notify stage went 33 -> 90-190 µs:
# bench/results/awake-cpu.md).
# Measured on an H100 host in stop 59 (bench/results/awake-h100.md): no cheaper with the
# spinners, p99 4-5x worse; the in-process knob that came from this hypothesis is removed.
#   bash bench/gpu/run_all.sh awake_ab
# Env: AWAKE_ROUNDS (2), AWAKE_TP (e.g. "1:4": also that TP row with its stages, ~1.5 min a
# run on the H100; unset: the 1-page runs only, ~40 s each), AWAKE_LAYOUT (hnd), AWAKE_ITERS
# (5). Writes $OUT/awake_ab.md (+ JSON per run).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
stat_line() { awk '/^cpu /{print $5+$6, $9}' /proc/stat; }  # idle+iowait, steal (ticks)
{
echo "# vCPUs kept awake A/B ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(nproc) CPUs, $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
echo; echo "cpuidle: $(cat /sys/devices/system/cpu/cpuidle/current_driver 2>&1), guest_halt_poll_ns: $(cat /sys/module/haltpoll/parameters/guest_halt_poll_ns 2>&1)"
echo "cmdline: $(tr ' ' '\n' < /proc/cmdline | grep -E 'halt|idle|vcpu|isolcpus|nohz' | tr '\n' ' ')"
if [ "$(nproc)" -lt 4 ]; then echo "!! fewer than 4 CPUs: the yields would hand the spinners the CPU; not run"; exit 0; fi
SPIN="chrt -i 0"; command -v chrt > /dev/null || SPIN="nice -n 19"  # (SCHED_IDLE, else the lowest nice)
echo "spinners: $SPIN"
for round in $(seq 1 "${AWAKE_ROUNDS:-2}"); do
    for v in off on; do
        pids=""
        if [ $v = on ]; then
            for _ in $(seq 1 "$(nproc)"); do $SPIN sh -c 'while :; do :; done' & pids="$pids $!"; done
        fi
        read -r idle0 steal0 < <(stat_line)
        echo; echo "## round $round, spinners $v: kvxfer bench pd --device cuda --stages --modes none --latency-requests 300 --throughput-requests 600 --large-pages 256 --iters 2"
        timeout 120 python3 -m kvxfer bench pd --device cuda --stages --modes none \
            --latency-requests 300 --throughput-requests 600 --large-pages 256 --iters 2 \
            --json-out "$OUT/awake-$round-$v-1page.json" 2>&1 | grep -v "UCX  WARN" | grep -E "^\|" | head -60 || rc=1
        for gap in 0 2; do
            echo; echo "## round $round, spinners $v: python3 bench/gpu/lane_post.py --iters 10 --sizes-mib 1,125 --runs 1 --gap-ms $gap (one process; each enqueue after $gap ms idle)"
            timeout 90 python3 bench/gpu/lane_post.py --iters 10 --sizes-mib 1,125 --runs 1 --gap-ms $gap 2>&1 | grep -E "^\||^#" || rc=1
        done
        if [ -n "${AWAKE_TP:-}" ]; then
            tp=$AWAKE_TP; p=${tp%:*}; d=${tp#*:}
            echo; echo "## round $round, spinners $v: kvxfer bench pd --device cuda --modes none --prefill-tp $p --decode-tp $d --kv-layout ${AWAKE_LAYOUT:-hnd} --shape-tokens 16000 --iters ${AWAKE_ITERS:-5} --stages"
            timeout 150 python3 -m kvxfer bench pd --device cuda --modes none --prefill-tp "$p" --decode-tp "$d" \
                --kv-layout "${AWAKE_LAYOUT:-hnd}" --shape-tokens 16000 --iters "${AWAKE_ITERS:-5}" --stages \
                --json-out "$OUT/awake-$round-$v-tp$p$d.json" 2>&1 | grep -v "UCX  WARN\|WARNING" | grep -E "^\|" | head -40 || rc=1
        fi
        read -r idle1 steal1 < <(stat_line)
        echo; echo "/proc/stat over the run: idle+iowait $((idle1 - idle0)) ticks, steal $((steal1 - steal0)) ticks (all CPUs)"
        [ -n "$pids" ] && kill $pids 2>/dev/null
        wait 2>/dev/null
    done
done
exit $rc
} 2>&1 | tee "$OUT/awake_ab.md"
