#!/usr/bin/env bash
# A/B: the PD bench alone vs with one SCHED_IDLE spinner per CPU (vCPUs never halt)
cd /work/main
for round in 1 2 3; do
  for v in off on; do
    pids=""
    if [ $v = on ]; then
      for c in $(seq 1 $(nproc)); do chrt -i 0 sh -c 'while :; do :; done' & pids="$pids $!"; done
    fi
    UCX_WARN_UNUSED_ENV_VARS=n timeout 300 .venv/bin/python -m kvxfer bench pd --device cpu --modes none --latency-requests 2000 --throughput-requests 1000 --large-pages 16 --iters 1 --stages > /tmp/idle/r$round-$v.txt 2>&1
    [ -n "$pids" ] && kill $pids
    wait 2>/dev/null
  done
done
