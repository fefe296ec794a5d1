#!/usr/bin/env bash
# Transfer engine on the GPU machine: CUDA tensors on both sides, two processes, one H200.
# Run from the repository root; assumes `python3 -c "import ucxx"` works (wheels in
# PYTHONPATH=/tmp/site). Builds the native extension, runs the engine/transport tests on CUDA,
# then `kvxfer bench transfer --device cuda` (per-layer vs page-major, error modes peer/none,
# ratio to a raw 1-op PUT and to a torch device-to-device copy_ in the same run) and
# ucx_perftest ucp_put_bw cuda->cuda at the same sizes. Each lane config runs with the device lane
# (DEVCOPY=auto,off: same-host one-launch copies vs UCX PUTs) and flush progress FLUSH (auto: the
# native poller spins during CUDA flushes; add ",event" for UCXX's progress thread alone);
# PATHS=direct,staged adds the staged path. Writes $OUT/transfer.md (+ .json, .png).
# Budget: ~4-6 min. Env: SIZES (pages, default 16,128,512,2048), ITERS (5).
set -o pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export UCX_WARN_UNUSED_ENV_VARS=n
SIZES=${SIZES:-16,128,512,2048}
ITERS=${ITERS:-5}
PATHS=${PATHS:-direct}
FLUSH=${FLUSH:-auto}
DEVCOPY=${DEVCOPY:-auto,off}
LAYERS=8; PAGE_KIB=64; POOL=2048   # 1 MiB per page over 2*L descriptors; 2 GiB pools
rc=0
{
echo "# Transfer engine on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
echo
echo '```'
python3 setup.py build_ext --inplace 2>&1 | grep -E "error|Error" ; echo "build rc=${PIPESTATUS[0]}"
python3 -m kvxfer info 2>&1
echo '```'
echo
if [ -z "${ONLY_INFLIGHT:-}" ]; then
echo "## tests/engine + tests/transport with KVXFER_TEST_DEVICE=cuda"
echo '```'
KVXFER_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine tests/transport tests/unit/test_plan.py 2>&1 | tail -25 || rc=1
echo '```'
echo
echo "## kvxfer bench transfer --device cuda"
timeout 420 python3 -m kvxfer bench transfer --device cuda --layers $LAYERS --page-kib $PAGE_KIB \
    --pages $POOL --sizes "$SIZES" --iters "$ITERS" --paths "$PATHS" --flush "$FLUSH" --device-copy "$DEVCOPY" --json-out "$OUT/transfer.json" --plot "$OUT/transfer.png" 2>&1 \
    | grep -v "UCX  WARN" || rc=1
echo
fi
echo "## same, ${INFLIGHT:-8} writes in flight (a window, as ucx_perftest keeps), page-major contiguous, UCX lanes"
timeout 200 python3 -m kvxfer bench transfer --device cuda --layers $LAYERS --page-kib $PAGE_KIB \
    --pages $POOL --sizes "${INFLIGHT_SIZES:-16,128,512}" --iters "$ITERS" --paths direct --device-copy off \
    --modes peer,none --pagesets contiguous --inflight "${INFLIGHT:-8}" --json-out "$OUT/transfer_inflight.json" 2>&1 \
    | grep -v "UCX  WARN" | grep -v "per-layer" || rc=1
echo
echo "## ucx_perftest ucp_put_bw cuda->cuda (same host, same sizes, default lanes)"
SP=$(python3 -c 'import libucx, os; print(os.path.dirname(libucx.__file__))')
PT=$SP/bin/ucx_perftest
PORT=13517
echo "| bytes | perftest MB/s (2^20) overall | GB/s (1e9) | lanes |" > "$OUT/perftest.md"
echo "|---|---|---|---|" >> "$OUT/perftest.md"
for pages in $( [ -n "${ONLY_INFLIGHT:-}" ] && echo "${INFLIGHT_SIZES:-16,128,512}" | tr , ' ' || echo "${SIZES//,/ }"); do
    bytes=$((pages * 2 * LAYERS * PAGE_KIB * 1024))
    PORT=$((PORT + 1))
    LD_LIBRARY_PATH=$SP/lib timeout 60 "$PT" -p $PORT > "$OUT/perftest_srv_$pages.log" 2>&1 &
    S=$!; sleep 1
    n=$(( bytes >= 536870912 ? 20 : 100 ))
    LD_LIBRARY_PATH=$SP/lib UCX_PROTO_INFO=y timeout 60 "$PT" 127.0.0.1 -p $PORT -t ucp_put_bw -m cuda,cuda \
        -s $bytes -n $n -w 5 -f > "$OUT/perftest_cli_$pages.log" 2>&1
    kill $S 2>/dev/null; wait $S 2>/dev/null
    python3 - "$OUT/perftest_cli_$pages.log" $bytes >> "$OUT/perftest.md" <<'PY'
import re, sys
txt = open(sys.argv[1], errors="replace").read()
nums = [ln.split() for ln in txt.splitlines() if re.match(r"^\s+\d+\s+[\d.]+\s", ln)]
mbs = nums[-1][5] if nums and len(nums[-1]) >= 6 else "-"
gb = f"{float(mbs) * 1048576 / 1e9:.1f}" if mbs != "-" else "-"
lanes = sorted(set(re.findall(r"(cuda_ipc|cuda_copy|cma|tcp|rc_mlx5|gdr_copy)/", txt)))
print(f"| {sys.argv[2]} | {mbs} | {gb} | {','.join(lanes)} |")
PY
done
cat "$OUT/perftest.md"
echo
echo "## ratios (same run): engine page-major / per-layer vs ucx_perftest and torch D2D copy_"
[ -f "$OUT/transfer.json" ] && python3 - "$OUT/transfer.json" "$OUT/perftest.md" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
pt = {}
for ln in open(sys.argv[2]):
    c = [x.strip() for x in ln.strip().strip("|").split("|")]
    if c and c[0].isdigit() and c[2] != "-":
        pt[int(c[0])] = float(c[2])
print("| mode (lanes) | dev | flush | layout | page ids | MiB | path | ops | GB/s | raw 1-PUT GB/s | perftest GB/s | x perftest | raw x perftest | D2D copy_ GB/s | x D2D |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    b = int(round(r["MiB"] * 2**20)); p = pt.get(b)
    f = lambda v: f"{v:.2f}" if isinstance(v, float) else "-"
    print(f"| {r['mode']} ({r['lanes']}) | {r.get('device_copy', 'off')} | {r.get('flush', '-')} | {r['layout']} | {r['pageset']} | {r['MiB']:.0f} | {r.get('path', 'direct')} | {r['ops']} | {r['GBps']:.1f} | {r['raw_GBps']:.1f} | "
          f"{f(p)} | {f(r['GBps'] / p) if p else '-'} | {f(r['raw_GBps'] / p) if p else '-'} | {r['memcpy_GBps']:.1f} | {r['vs_memcpy']:.3f} |")
PY
echo
echo "transfer.sh rc=$rc"
exit $rc
} 2>&1 | tee "$OUT/transfer.md"
