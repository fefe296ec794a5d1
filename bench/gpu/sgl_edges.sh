#!/usr/bin/env bash
# SGLang backend edges on one H200: (1) the regions check that refuses SGLang's envelope
# (page-major) Mamba layout (kvxfer.integrations.sglang.regions) - its unit tests, and, where
# sglang is importable, SGLang's own MambaPool(envelope_layout=True) built on CUDA (the path
# SGLang supports it on) refused at the check while the plain pool passes; (2) the unit
# tests of refused_sender (a decode of another kvxfer version answered by prefill). Writes
# $OUT/sgl-edges.md.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
rc=0
{
echo "# SGLang backend edges on CUDA ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), ${KVXFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)})"
echo; echo '```'
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_sgl_regions_unit.py \
    tests/unit/test_sgl_messages_unit.py 2>&1 | tail -2 || rc=1
timeout 300 python3 - <<'PY' 2>&1 | grep -v "Warn\|warn" || rc=1
import importlib.util, sys
if importlib.util.find_spec("sglang") is None:
    print("sglang not installed here: the CUDA envelope pool was not built (skipped)")
    sys.exit(0)
sys.path.insert(0, "tests/sglang_pd/_stubs")
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.mem_cache.memory_pool import MambaPool
from kvxfer.errors import UnsupportedOperation
from kvxfer.integrations.sglang.regions import check_regions
shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=2048, n_groups=1,
                                num_heads=32, head_dim=64, state_size=128, conv_kernel=4)
params = Mamba2CacheParams(shape=shape, layers=list(range(36)))
for envelope in (False, True):
    pool = MambaPool(size=64, spec_state_size=0, device="cuda", cache_params=params,
                     mamba_layer_ids=list(range(36)), envelope_layout=envelope)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    try:
        check_regions({"state0": (ptrs, lens, items)})
        print(f"envelope={envelope}: {len(ptrs)} descriptors pass")
        assert not envelope, "the envelope layout was not refused"
    except UnsupportedOperation as exc:
        print(f"envelope={envelope}: refused: {str(exc)[:160]}...")
        assert envelope, "the plain layout was refused"
PY
echo '```'
exit $rc
} 2>&1 | tee "$OUT/sgl-edges.md"
