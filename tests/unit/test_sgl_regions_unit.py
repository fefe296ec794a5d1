"""SGLang backend: the regions check (kvxfer.integrations.sglang.regions.check_regions) -
dense, disjoint descriptors pass in any order; any two descriptors of one group sharing a
byte are refused naming both and (for a state group) SGLang's envelope layout; groups may
overlap one another. Exhaustive over small layouts against a brute-force byte model."""

import itertools
import random

import pytest

from kvxfer.errors import UnsupportedOperation
from kvxfer.integrations.sglang.regions import check_regions

pytestmark = pytest.mark.timeout(60)


def _overlaps(spans):
    seen = set()
    for p, n in spans:
        bytes_ = set(range(p, p + n))
        if bytes_ & seen:
            return True
        seen |= bytes_
    return False


def test_plain_layouts_pass():
    # SGLang's per-layer buffers: K and V of 3 layers, separate allocations
    kv = ([0x1000, 0x9000, 0x2000, 0xA000, 0x3000, 0xB000], [0x800] * 6, [64] * 6)
    aux = ([0x20000, 0x30000], [256, 1024], [16, 64])
    state = ([0x40000, 0x40000 + 2160], [2160, 2160], [240, 240])  # touching: fine
    check_regions({"kv": kv, "aux": aux, "state0": state})
    check_regions({"kv": ([], [], [])})


def test_envelope_layout_is_refused_naming_it():
    """The offsets SGLang's MambaPool(envelope_layout=True) gives for Mamba2 over 2 layers
    (conv of 240-byte slots, temporal of 512, a 1504-byte entry, 9 slots)."""
    base = 0x7F0000000000
    ptrs = [base, base + 240, base + 480, base + 992]
    state = (ptrs, [2160, 2160, 4608, 4608], [240, 240, 512, 512])
    with pytest.raises(UnsupportedOperation) as ei:
        check_regions({"state0": state})
    msg = str(ei.value)
    assert "'state0'" in msg and "descriptors 0 and 1 overlap" in msg
    assert "envelope (page-major) Mamba state layout" in msg
    assert f"[{base:#x}, +2160) of 240-byte items" in msg


def test_other_groups_name_strided_views():
    with pytest.raises(UnsupportedOperation, match="'kv'.*strided views of one buffer"):
        check_regions({"kv": ([0, 100], [200, 200], [10, 10])})


def test_groups_may_overlap_each_other():
    # SGLang's unified memory pool: the KV envelope and the state envelope are one buffer
    check_regions({"kv": ([0], [1 << 20], [4096]), "state0": ([0], [1 << 20], [8192])})


def test_counts_must_agree():
    with pytest.raises(UnsupportedOperation, match="2 pointers, 1 lengths"):
        check_regions({"kv": ([0, 10], [10], [5, 5])})


def test_empty_descriptors_are_ignored():
    check_regions({"state0": ([0, 5, 5], [10, 0, 0], [5, 1, 1])})


@pytest.mark.parametrize("seed", range(20))
def test_against_the_byte_model(seed):
    """Every assignment of 1..4 descriptors to small spans: refused iff two share a byte;
    the two named do."""
    rng = random.Random(seed)
    for n in range(1, 5):
        for _ in range(60):
            spans = [(rng.randrange(0, 40), rng.randrange(0, 12)) for _ in range(n)]
            group = ([p for p, _ in spans], [m for _, m in spans], [1] * n)
            if _overlaps(spans):
                with pytest.raises(UnsupportedOperation) as ei:
                    check_regions({"state1": group})
                a, b = (
                    int(x)
                    for x in str(ei.value)
                    .split("descriptors ")[1]
                    .split(" overlap")[0]
                    .split(" and ")
                )
                (pa, na), (pb, nb) = spans[a], spans[b]
                assert set(range(pa, pa + na)) & set(range(pb, pb + nb))
            else:
                check_regions({"state1": group})


def test_order_does_not_matter():
    spans = [(0, 10), (10, 5), (30, 2), (15, 15)]
    for perm in itertools.permutations(spans):
        check_regions({"g": ([p for p, _ in perm], [n for _, n in perm], [1] * 4)})
    bad = spans + [(29, 2)]
    for perm in itertools.permutations(bad):
        with pytest.raises(UnsupportedOperation):
            check_regions({"g": ([p for p, _ in perm], [n for _, n in perm], [1] * 5)})


def test_unified_memory_envelopes_are_refused_at_other_tp():
    """SGLang's unified memory pool passes the regions check (one dense descriptor of whole
    page / slot envelopes per group) but carries no per-tensor state TP dims: at another
    TP size the pair is refused by the state plan - the KV plan alone would take the page
    envelope (every layer's K and V) for NHD pages of fatter heads."""
    from kvxfer.disagg.errors import TpShapeMismatch
    from kvxfer.integrations.sglang.tp_pairs import pair_plan, shape, state_shapes

    ps, hb = 4, 2 * 2 * 16  # 2 layers' K and V of 16-byte heads, 4 heads over all ranks
    p = shape(2, 0, ps, [ps * 2 * hb], 4, False, state_shapes([[1504]], [[]]))
    d = shape(1, 0, ps, [ps * 4 * hb], 4, False, state_shapes([[3008]], [[]]))
    with pytest.raises(TpShapeMismatch, match="no per-tensor TP dims"):
        pair_plan(p, d)
    same = shape(1, 0, ps, [ps * 4 * hb], 4, False, state_shapes([[3008]], [[]]))
    assert pair_plan(same, d).whole  # equal TP: whole envelopes, item for item
