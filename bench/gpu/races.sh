#!/usr/bin/env bash
# PD races on CUDA pools (one H200): tests/disagg/test_pd_races.py once with
# KVXFER_TEST_DEVICE=cuda, then the two close-vs-senders tests 5 more rounds (the first met
# decode rooms that succeed before close() under load: they must verify byte-exact on the
# device and be freed by the scheduler, never by close()). Writes $OUT/races.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# PD races on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo '```'
KVXFER_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/disagg/test_pd_races.py 2>&1 | tail -8 || rc=1
for i in 1 2 3 4 5; do
    KVXFER_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider \
        tests/disagg/test_pd_races.py -k "decode_close_while or decode_close_after" 2>&1 \
        | tail -1 || rc=1
done
echo '```'
exit $rc
} 2>&1 | tee "$OUT/races.md"
