#!/usr/bin/env bash
# Heterogeneous-TP rows of `kvxfer bench pd` with the host lane on (default) and off
# (KVXFER_HOST_COPY=off), alternating per ratio, CPU, error mode "none" (cma).
# Usage: [LANES="on off nopack"] bash bench/host_lane_tp.sh OUTDIR [ratios] [layouts] [tokens]
#   ratios: "1:2 2:1 1:4 4:1 2:4" by default; layouts: "hnd,per_layer,page_major,mla";
#   LANES: "on off" by default; nopack: the lane on, nothing packed (KVXFER_HOST_PACK_BYTES=0);
#   keep: the lane on and freed heap memory kept (KVXFER_MALLOC=keep); nosplit: the lane on,
#   no write cut into parts for several threads (KVXFER_HOST_SPLIT_BYTES=0); expand: the lane
#   on, PatternWrites expanded into runs by the planner (KVXFER_HOST_PATTERNS=0)
set -u
out=${1:?outdir}; ratios=${2:-"1:2 2:1 1:4 4:1 2:4"}; layouts=${3:-hnd,per_layer,page_major,mla}
tokens=${4:-16000}
mkdir -p "$out"
py=${PY:-.venv/bin/python}
for r in $ratios; do
  p=${r%:*}; d=${r#*:}
  for lane in ${LANES:-on off}; do
    env=()
    [ "$lane" = off ] && env=(KVXFER_HOST_COPY=off)
    [ "$lane" = nopack ] && env=(KVXFER_HOST_PACK_BYTES=0)
    [ "$lane" = keep ] && env=(KVXFER_MALLOC=keep)
    [ "$lane" = nosplit ] && env=(KVXFER_HOST_SPLIT_BYTES=0)
    [ "$lane" = expand ] && env=(KVXFER_HOST_PATTERNS=0)
    echo "== $r lane $lane $(date -u +%T)" >&2
    env "${env[@]}" UCX_WARN_UNUSED_ENV_VARS=n "$py" -m kvxfer bench pd --device cpu --modes none \
      --prefill-tp "$p" --decode-tp "$d" --kv-layout "$layouts" --shape-tokens "$tokens" \
      --iters 5 > "$out/tp-$p-$d-$lane.md" 2>&1
  done
done
