#!/usr/bin/env bash
# A test tree with CUDA pools (KVXFER_TEST_DEVICE=cuda) in PAR_JOBS pytest processes at once (the
# test files dealt round-robin by size; port 0 everywhere, so they do not collide): one call covers
# what one pytest process could not (tests/disagg alone runs past a call's window on CUDA).
# Env PAR_PATHS (default tests/disagg), PAR_JOBS (default 6), PAR_TIMEOUT (default 420 s).
# Writes $OUT/par_suite.md (each process's summary line, then every failure's tail) and the logs.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT/par"
export PYTHONPATH=${PYTHONPATH:-$PWD}
JOBS=${PAR_JOBS:-6}
mapfile -t files < <(find ${PAR_PATHS:-tests/disagg} -name 'test_*.py' -printf '%s %p\n' | sort -rn | cut -d' ' -f2)
rc=0
{
echo "# ${PAR_PATHS:-tests/disagg} on CUDA in $JOBS processes ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)})"
pids=()
for ((j = 0; j < JOBS; j++)); do
    group=()
    for ((i = j; i < ${#files[@]}; i += JOBS)); do group+=("${files[i]}"); done
    [ ${#group[@]} -eq 0 ] && continue
    echo "group $j: ${group[*]}"
    KVXFER_TEST_DEVICE=cuda timeout ${PAR_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider "${group[@]}" \
        > "$OUT/par/group-$j.log" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo; echo '```'
for f in "$OUT"/par/group-*.log; do echo "$(basename "$f"): $(grep -E '(passed|failed|error)' "$f" | tail -1)"; done
echo '```'
for f in "$OUT"/par/group-*.log; do
    if grep -q "FAILED\|ERROR" "$f"; then echo; echo "## $(basename "$f")"; echo '```'; grep -v "UCX  WARN" "$f" | tail -40; echo '```'; fi
done
echo "par_suite rc=$rc"
exit $rc
} 2>&1 | tee "$OUT/par_suite.md"
