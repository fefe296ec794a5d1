#!/usr/bin/env bash
# kvxfer on one H200: who progresses the UCX worker during a CUDA flush. "before": the native
# poller and a chain's starting call called ucp_worker_progress themselves (which let UCXX's
# listener callback run on them: every accept during a CUDA flush stalled 3 x 3 s); "after":
# they only wake UCXX's progress thread (ucp_worker_signal every KVXFER_POLL_SIGNAL_US).
# Alternating in the same call: the 1-page PD stage breakdown (p50, raw write, requests/s,
# 32 MiB), then the transport tests on CUDA (the accept-while-spinning check among them). Writes $OUT/accept_ab.md.
#   here (.ab/ git-ignored): for f in kvxfer/transport/_rma.c kvxfer/transport/ucx.py; do
#     mkdir -p .ab/before/$(dirname $f); git show 0ea55f1:$f > .ab/before/$f; done
#   carry [".whl", ".ab"];  bash bench/gpu/run_all.sh accept_ab
# Env AB_ROUNDS (default 1: before after; 2: before after after before), AB_SIGNAL_US (values
# of KVXFER_POLL_SIGNAL_US tried in "after" runs, default "5"), AB_TESTS (test files run on
# CUDA at the end).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
NEW_PP=${PYTHONPATH:-$PWD}
rc=0
{
echo "# poller: progress (before) vs signal (after) ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
if [ -d .ab/before ]; then
    rm -rf /tmp/before && mkdir -p /tmp/before && cp -r kvxfer pools kernels setup.py pyproject.toml /tmp/before/
    cp -r .ab/before/. /tmp/before/; rm -f /tmp/before/kvxfer/transport/_rma*.so
    (cd /tmp/before && python3 setup.py build_ext --inplace -q 2>&1 | grep -i " error" ; true)
    OLD_PP=${NEW_PP/$PWD//tmp/before}
else
    echo "!! no .ab/before/: after only"; OLD_PP=""
fi
order=""
for r in $(seq 1 "${AB_ROUNDS:-1}"); do
    if [ $((r % 2)) -eq 1 ]; then order="$order before after"; else order="$order after before"; fi
done
i=0
for v in $order; do
    if [ "$v" = before ] && [ -z "$OLD_PP" ]; then continue; fi
    for sig in $([ "$v" = after ] && echo "${AB_SIGNAL_US:-5}" || echo "-"); do
        i=$((i + 1))
        pp=$([ "$v" = before ] && echo "$OLD_PP" || echo "$NEW_PP")
        dir=$([ "$v" = before ] && echo /tmp/before || echo "$PWD")  # python -m: the cwd first
        cd "$dir"
        PYTHONPATH=$pp python3 -c 'import kvxfer.transport.ucx_lib as u; print("rma:", u.load_ucx()[1].__file__)' 2>&1 | tail -1
        echo; echo "## run $i: $v (KVXFER_POLL_SIGNAL_US=$sig) kvxfer bench pd --device cuda --stages --modes none --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2"
        PYTHONPATH=$pp KVXFER_POLL_SIGNAL_US=${sig/-/5} timeout 120 python3 -m kvxfer bench pd --device cuda --stages --modes none \
            --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2 \
            --json-out "$OUT/ab-$i-$v-$sig.json" 2>&1 | grep -v "UCX  WARN" | tail -30 || rc=1
        cd - > /dev/null
    done
done
echo; echo "## accept while the poller spins, transport tests on CUDA (after); then \$AB_TESTS"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/transport 2>&1 | tail -4 || rc=1
for f in ${AB_TESTS:-}; do
    echo; echo "## $f on CUDA (after)"
    timeout 200 python3 -m pytest -q -p no:cacheprovider "$f" 2>&1 | grep -v "UCX  WARN" | tail -6 || rc=1
done
exit $rc
} 2>&1 | tee "$OUT/accept_ab.md"
