"""The launchers' host-side helpers (kernels._common): unit choice, memoised tile choice and
the row-contiguity check, each against its plain definition (they run on every launch, so
they were rewritten for speed; these tests pin their meaning)."""

import itertools
import random

import pytest
import torch

from kvxfer.kernels import _common as C

pytestmark = pytest.mark.timeout(60)


def _unit_by_definition(values):
    """Largest power of two <= MAX_UNIT dividing every value."""
    return max(u for u in (1, 2, 4, 8, 16) if u <= C.MAX_UNIT and all(v % u == 0 for v in values))


def test_pick_unit_is_the_largest_common_power_of_two():
    rng = random.Random(0)
    pool = [0, 1, 2, 3, 4, 6, 8, 12, 16, 1024, 2050, 4098]
    for values in itertools.chain(([],), itertools.product(pool, repeat=2)):
        assert C.pick_unit(values) == _unit_by_definition(values), values
    for _ in range(2000):
        values = [rng.choice(pool + [rng.randrange(1 << 48)]) for _ in range(rng.randrange(1, 10))]
        assert C.pick_unit(values) == _unit_by_definition(values), values
    assert C.pick_unit(iter([8, 16, 4096])) == C.MAX_UNIT  # any iterable, consumed once


def test_pick_tile_memo_and_clamp_do_not_change_the_choice():
    assert C.TILE_BYTES & (C.TILE_BYTES - 1) == 0  # the clamp relies on a power of two
    plain = C._pick_tile.__wrapped__
    for row_units, unit, n in itertools.product(
        (1, 3, 17, 32, 64, 100, 144, 288, 512, 576, 1024, 2048, 5000),
        (1, 2, 4),
        (1, 2, 3, 7, 100, 4095, 8191, 8192, 8193, 65536, 10**7),
    ):
        tok, block, warps = C.pick_tile(row_units, unit, n)
        assert (tok, block, warps) == plain(row_units, unit, n)
        assert tok * block * unit <= max(C.TILE_BYTES, block * unit)
        assert 1 <= warps <= 8 and block & (block - 1) == 0 and tok & (tok - 1) == 0
    assert C._pick_tile.cache_info().currsize <= C._pick_tile.cache_info().maxsize


def _rows_contiguous_by_definition(t, lead):
    expected = 1
    for size, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@pytest.mark.parametrize("lead", [1, 2])
def test_rows_contiguous_fast_path_agrees(lead):
    base = torch.empty(6, 4, 3, 5)
    views = [
        base,
        base[::2],
        base[:, 1:3],
        base.transpose(0, 1),
        base[..., ::2],
        base.transpose(2, 3),
        base[:, :, :1],
        base.permute(1, 0, 2, 3)[:2],
        torch.empty(0, 3, 4, 5),
        torch.empty(1, 1, 1, 1).expand(3, 1, 1, 1),
    ]
    for v in views:
        assert C.rows_contiguous(v, lead) == _rows_contiguous_by_definition(v, lead), (
            tuple(v.shape),
            v.stride(),
        )
    # no elements, no bytes to address: any strides are acceptable
    assert C.rows_contiguous(torch.empty_strided((0, 3, 4, 5), (1, 1, 1, 1)), lead)
