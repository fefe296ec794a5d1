"""`kvxfer bench pd --prefill-tp N --decode-tp M` prints each row as its worker pair is done
(a run cut short by a timeout keeps the rows it finished): the streamed rows equal the table
formatted from all rows at the end, because every ratio refers to rows run before it."""

import math

import pytest

from kvxfer.pd_demo.bench import TP_HEADER, format_tp, format_tp_row, tp_run_list

pytestmark = pytest.mark.timeout(30)


def _rows():
    """Rows in bench_tp's order: the equal shape, then the asked one; N:N, M:M, N:M each
    (with --tp-paths the N:M pair twice, and the equal pairs of a byte-run shape twice)."""
    out, gbps = [], 1.0
    for d_ps, k in ((16, 0), (64, 37)):
        for tp, path in (
            ((2, 2), "equal"),
            ((2, 2), "equal-runs"),
            ((1, 1), "equal"),
            ((1, 1), "equal-runs"),
            ((2, 1), "direct"),
            ((2, 1), "staged"),
        ):
            if path == "equal-runs" and (d_ps, k) == (16, 0):
                continue  # whole pages: no byte runs
            gbps += 0.25
            out.append(
                {
                    "mode": "none",
                    "lanes": ["cma/memory.0"],
                    "kv_layout": "hnd",
                    "prefill_tp": tp[0],
                    "decode_tp": tp[1],
                    "path": path,
                    "prefill_page_size": 16,
                    "decode_page_size": d_ps,
                    "decode_prefix": k,
                    "tokens": 1024,
                    "bytes": 8 << 20,
                    "ops": 20,
                    "us_median": 1000.0,
                    "prefill_us_median": 900.0,
                    "gbps_best": gbps,
                    "gbps_median": gbps,
                    "send_skew_us": 12.0,
                    "workers_up_s": 5.0,
                    "requests_s": 1.0,
                }
            )
    return out


def test_streamed_rows_equal_the_final_table():
    rows = _rows()
    streamed = [format_tp_row(r, rows[: i + 1]) for i, r in enumerate(rows)]
    assert "\n".join([TP_HEADER] + streamed) == format_tp(rows)
    for line in streamed:  # every ratio found its reference row
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[10] == "900"  # prefill's side
        assert not any(math.isnan(float(c)) for c in cells[12:15]), line
        assert cells[15] == "12"
        assert cells[16] == "5.0 / 1.0"


def test_tp_stages_per_rank_after_the_first_send():
    """``--stages`` with TP: each rank's stages as p50 µs after the room's first prefill
    send; a rank's further records of a room (its legs) are told apart; rooms without a
    send stamp and other rooms are left out."""
    from kvxfer.pd_demo.bench import format_tp_stages, tp_stages

    def rec(room, **st):
        return dict(room=room, role="x", **{k: int(v * 1000) for k, v in st.items()})

    prefill = [
        [rec(1, send=100, write=150), rec(2, send=200, write=260), rec(9, send=0)],
        [rec(1, send=110, write=170), rec(2, send=205, write=275)],
    ]
    decode = [[rec(1, handled=300), rec(1, recv=250), rec(2, handled=400), rec(2, recv=350)]]
    st = tp_stages(prefill, decode, [1, 2, 3])
    assert st["p0.send"] == 0 and st["p1.send"] == 7.5  # (10 + 5) / 2
    assert st["p0.write"] == 55 and st["p1.write"] == 72.5
    assert st["d0.handled"] == 200 and st["d0.leg1.recv"] == 150
    assert list(st) == sorted(st, key=st.get)  # time order
    text = format_tp_stages(
        [dict(kv_layout="hnd", prefill_tp=2, decode_tp=1, path="default", stages=st)]
    )
    assert text.startswith("- hnd 2 → 1 (default)") and "d0.leg1.recv 150" in text
    assert format_tp_stages([dict(kv_layout="hnd")]) == ""


def test_run_list_order_and_paths():
    """Equal shape first, then the asked one; --tp-paths on CUDA: N:M three ways and the equal
    pairs of a byte-run shape also without the pattern launch (equal-runs); CPU: no pattern."""
    cuda = tp_run_list(2, 1, 16, 64, 37, paths=True, cuda=True)
    assert cuda == [
        ((2, 2), (16, 0), None),
        ((1, 1), (16, 0), None),
        ((2, 1), (16, 0), "direct"),
        ((2, 1), (16, 0), "staged"),
        ((2, 1), (16, 0), "pattern"),
        ((2, 2), (64, 37), None),
        ((2, 2), (64, 37), "equal-runs"),
        ((1, 1), (64, 37), None),
        ((1, 1), (64, 37), "equal-runs"),
        ((2, 1), (64, 37), "direct"),
        ((2, 1), (64, 37), "staged"),
        ((2, 1), (64, 37), "pattern"),
    ]
    cpu = tp_run_list(2, 1, 16, 16, 37, paths=True, cuda=False)
    assert [p for _, _, p in cpu] == [None, None, "direct", "staged"] * 2
    aligned = tp_run_list(1, 2, 16, 16, 32, paths=True, cuda=True)  # whole pages: no runs
    assert "equal-runs" not in [p for _, _, p in aligned]
    assert tp_run_list(1, 2, 16, 16, 0, paths=False, cuda=True) == [
        ((1, 1), (16, 0), None),
        ((2, 2), (16, 0), None),
        ((1, 2), (16, 0), None),
    ]


def test_tp_warm_up_plans_every_salt_class():
    """The TP rows' warm-up rooms (numbered from 10**6, as the bench numbers them) reach every
    salt class of every shape, so no timed room plans a class for the first time."""
    import itertools

    from kvxfer.disagg.errors import TpShapeMismatch
    from kvxfer.disagg.tp_plan import plan_axis, salt_period
    from kvxfer.pd_demo.bench import tp_warm_rooms

    for tp_p, tp_d, total in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8, 16)):
        try:
            plan_axis(total, tp_p, tp_d)
        except TpShapeMismatch:
            continue
        period = salt_period(total, tp_p, tp_d)
        warm = range(10**6, 10**6 + tp_warm_rooms(tp_p))
        assert {r % period for r in warm} == set(range(period)), (tp_p, tp_d, total)
