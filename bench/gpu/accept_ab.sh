#!/usr/bin/env bash
# kvxfer on one H200: who progresses the UCX worker during a CUDA flush, alternating in one call.
#   before  the native poller and a chain's starting call called ucp_worker_progress on UCXX's
#           worker themselves (which let UCXX's listener callback run on them: every accept
#           during a CUDA flush stalled 3 x 3 s); needs .ab/before/ (the files of 0ea55f1)
#   signal  they only wake UCXX's progress thread (ucp_worker_signal every
#           KVXFER_POLL_SIGNAL_US); KVXFER_OWN_WORKER=0
#   own     KVXFER_OWN_WORKER=1: bulk endpoints on kvxfer's own UCP context + worker,
#           progressed only by kvxfer's threads (the queue's thread, a chain's starter inline),
#           in both error modes ("peer": peer error handling on both ends; what "auto" picks
#           for CUDA pools)
#   auto    KVXFER_OWN_WORKER=auto (the default)
# Each run: kvxfer bench pd --stages (1-page PD p50, raw write, requests/s, 8 MiB) for the
# modes in AB_MODES; then the transport tests and $AB_TESTS on CUDA. Writes $OUT/accept_ab.md.
#   here (.ab/ git-ignored): mkdir -p .ab/before && git archive 0ea55f1 kvxfer pools kernels \
#     setup.py pyproject.toml | tar -x -C .ab/before
#   carry [".whl", ".ab"];  bash bench/gpu/run_all.sh accept_ab
# Env AB_VARIANTS (default "before signal own"), AB_ROUNDS (default 1; 2 runs the variants
# again in reverse order), AB_MODES (default "none"), AB_TESTS (test files run on CUDA).
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
NEW_PP=${PYTHONPATH:-$PWD}
rc=0
{
echo "# worker progress: before / signal / own ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
OLD_PP=""
if [ -d .ab/before ]; then  # a whole tree (setup.py there), or files laid over this one
    rm -rf /tmp/before && mkdir -p /tmp/before
    [ -f .ab/before/setup.py ] || cp -r kvxfer pools kernels setup.py pyproject.toml /tmp/before/
    cp -r .ab/before/. /tmp/before/; rm -f /tmp/before/kvxfer/transport/_rma*.so
    (cd /tmp/before && python3 setup.py build_ext --inplace -q 2>&1 | grep -i " error" ; true)
    OLD_PP=${NEW_PP/$PWD//tmp/before}
fi
variants=${AB_VARIANTS:-before signal own}
order=""
for r in $(seq 1 "${AB_ROUNDS:-1}"); do
    if [ $((r % 2)) -eq 1 ]; then order="$order $variants"; else order="$order $(echo $variants | tr ' ' '\n' | tac | tr '\n' ' ')"; fi
done
i=0
for v in $order; do
    if [ "$v" = before ] && [ -z "$OLD_PP" ]; then echo "!! no .ab/before/: skipping before"; continue; fi
    i=$((i + 1))
    pp=$([ "$v" = before ] && echo "$OLD_PP" || echo "$NEW_PP")
    dir=$([ "$v" = before ] && echo /tmp/before || echo "$PWD")  # python -m: the cwd first
    own=$(case "$v" in own) echo 1 ;; auto) echo auto ;; *) echo 0 ;; esac)
    for m in ${AB_MODES:-none}; do
        echo; echo "## run $i: $v, mode $m (KVXFER_OWN_WORKER=$own) kvxfer bench pd --device cuda --stages --modes $m --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2"
        (cd "$dir" && PYTHONPATH=$pp KVXFER_OWN_WORKER=$own timeout 120 python3 -m kvxfer bench pd --device cuda --stages --modes "$m" \
            --latency-requests 200 --throughput-requests 600 --large-pages 256 --iters 2 \
            --json-out "/tmp/ab-$i-$v-$m.json" 2>&1 | grep -v "UCX  WARN" | tail -30) || rc=1
    done
done
echo; echo "## transport tests on CUDA; then \$AB_TESTS"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/transport 2>&1 | tail -4 || rc=1
for f in ${AB_TESTS:-}; do
    echo; echo "## $f on CUDA"
    timeout 200 python3 -m pytest -q -p no:cacheprovider "$f" 2>&1 | grep -v "UCX  WARN" | tail -6 || rc=1
done
exit $rc
} 2>&1 | tee "$OUT/accept_ab.md"
