"""The prefill/decode worker-pair demo (`kvxfer demo`) end to end, small: a real bootstrap
server, two spawned processes on UCX loopback, chunked requests, byte-exact verification on
decode, allocators full again on both sides. Plus the verifier itself (it must catch a wrong
byte), the exit status, argument errors, and the pools mode (`kvxfer demo --pools`)."""

import json
import os
import subprocess
import sys

import pytest
from testenv import DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = [
    "--requests",
    "12",
    "--max-len",
    "200",
    "--chunk-tokens",
    "64",
    "--pool-tokens",
    "2048",
    "--head-dim",
    "16",
    "--timeout",
    "60",
    "--device",
    DEVICE,
]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _check_report(r, requests):
    from kvxfer.pd_demo import REQUIRED_KEYS

    missing = [k for k in REQUIRED_KEYS if k not in r]
    assert not missing, missing
    assert r["requests"] == requests
    assert r["failed"] == 0 and r["verified"] == requests, r["failures"]
    assert r["bytes"] == r["expected_bytes"] > 0
    assert r["chunked_requests"] > 0 and r["chunks"] > requests  # chunked prefill happened
    assert not r["leaked"], r["leaks"]
    assert r["lanes"] and r["gbps"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["ops_per_request"] >= 2  # at least one kv run and the aux row


@pytest.mark.timeout(150)
def test_cli_demo_json_last_line():
    """`python -m kvxfer demo ... --json`: the table, then one JSON object on the last line."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer", "demo", *SMALL, "--json"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    _check_report(report, 12)
    # default model: page-major KV (one descriptor) + Mamba envelope (one descriptor):
    # every chunk is one op per page run; the last one adds the state slot and the aux row
    assert report["kv_entries"] == 1 and report["state_entries"] == 1
    assert report["model"]["kv_layout"] == "page_major"
    assert report["model"]["mamba_layout"] == "envelope"
    text = "\n".join(lines[:-1])
    for word in (
        "requests",
        "verified",
        "GB/s",
        "latency p50",
        "latency p99",
        "ops/request",
        "lanes",
    ):
        assert word in text, word


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "kv_layout,mamba_layout,integrity,post_capture",
    [
        ("per_layer", "per_layer", True, False),
        ("mla", "none", False, False),
        ("per_layer", "per_layer", False, True),
    ],
)
def test_demo_other_layouts(kv_layout, mamba_layout, integrity, post_capture):
    """Other layouts; the per-layer run with the integrity check on (`kvxfer demo
    --integrity`): every page, slot and aux row checksummed on both sides, bytes still exact.
    ``post_capture`` (`kvxfer demo --decode-post-capture`): decode's kv pool reserved, then
    backed by ``finalize_backing`` (host mmap on CPU; on CUDA VMM memory, which prefill's
    device lane maps: kvxfer.engine.vmm_share)."""
    from kvxfer.pd_demo import run_demo
    from kvxfer.pd_demo.run import format_table
    from kvxfer.pd_demo.spec import ModelSpec

    spec = ModelSpec(
        kv_layout=kv_layout,
        mamba_layout=mamba_layout,
        attn_layers=2,
        mamba_layers=2,
        head_dim=16,
        pool_tokens=1024,
        mamba_slots=16,
        aux_rows=32,
        device=DEVICE,
    )
    r = run_demo(
        spec,
        requests=8,
        seed=3,
        max_len=120,
        chunk_tokens=32,
        timeout=60,
        integrity=integrity,
        decode_post_capture=post_capture,
    )
    _check_report(r, 8)
    assert r["integrity"] is integrity
    assert ("integrity    on" in format_table(r)) is integrity
    if kv_layout == "per_layer":
        assert r["kv_entries"] == 4 and r["state_entries"] == 2 * 2  # (conv + temporal) x L
    else:
        assert r["kv_entries"] == 2 and r["state_entries"] == 0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kv_layout,integrity", [("page_major", True), ("per_layer", False)])
def test_demo_layerwise(kv_layout, integrity):
    """`kvxfer demo --layerwise`: every chunk streamed layer by layer (hybrid state with the
    last layer), every byte verified on decode, nothing leaked. Prefill computes a request
    only once decode's metadata is attached (``wait_decode``: else, under load, every chunk
    can be declared before decode is there and go queued whole, one write each)."""
    from kvxfer.pd_demo import run_demo
    from kvxfer.pd_demo.run import format_table
    from kvxfer.pd_demo.spec import ModelSpec

    spec = ModelSpec(
        kv_layout=kv_layout,
        mamba_layout="envelope" if kv_layout == "page_major" else "per_layer",
        attn_layers=3,
        mamba_layers=2,
        head_dim=16,
        pool_tokens=1024,
        mamba_slots=16,
        aux_rows=32,
        device=DEVICE,
    )
    r = run_demo(
        spec,
        requests=8,
        seed=5,
        max_len=120,
        chunk_tokens=32,
        timeout=60,
        integrity=integrity,
        layerwise=True,
        wait_decode=True,
    )
    _check_report(r, 8)
    assert r["layerwise"] is True and "layer-wise" in format_table(r)
    # layers moved in writes of their own: decode is there when a request's first layer is
    # declared, no layer write of the room is on the wire yet, so that layer goes alone and
    # the chunk's other layers follow in at least one more write
    assert r["writes"] >= r["chunks"] + r["requests"], (r["writes"], r["chunks"])


@pytest.mark.timeout(150)
def test_demo_page_sizes_and_decode_prefix():
    """`kvxfer demo --page-size 16 --decode-page-size 64 --decode-prefix 37`: decode holds
    each request's first 37 tokens itself and verifies every token row; exactly the bytes of
    the tokens past the prefix move (docs/shapes.md)."""
    from kvxfer.pd_demo import run_demo
    from kvxfer.pd_demo.run import format_table
    from kvxfer.pd_demo.spec import ModelSpec

    spec = ModelSpec(
        attn_layers=2,
        mamba_layers=2,
        head_dim=16,
        page_size=16,
        pool_tokens=2048,
        mamba_slots=16,
        aux_rows=32,
        device=DEVICE,
    )
    r = run_demo(
        spec,
        requests=8,
        seed=5,
        max_len=200,
        chunk_tokens=32,
        timeout=60,
        decode_page_size=64,
        decode_prefix=37,
    )
    _check_report(r, 8)
    assert r["decode_page_size"] == 64 and r["decode_prefix"] == 37
    assert "decode: 64-token pages, holds the first 37 tokens" in format_table(r)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "tp,kv_layout,pages,prefix",
    [((1, 2), "hnd", (16, 64), 37), ((2, 1), "per_layer", (64, 16), 64)],
)
def test_demo_hetero_tp_with_page_sizes_and_decode_prefix(tp, kv_layout, pages, prefix):
    """`kvxfer demo --prefill-tp N --decode-tp M --page-size A --decode-page-size B
    --decode-prefix K`: every decode rank writes its own prefix (and slots past the end),
    then verifies every token row of its heads; exactly the tokens past the prefix move."""
    from kvxfer.pd_demo import run_demo
    from kvxfer.pd_demo.spec import ModelSpec

    spec = ModelSpec(
        kv_layout=kv_layout,
        mamba_layout="per_layer",
        attn_layers=2,
        mamba_layers=2,
        heads=4,
        ssm_heads=4,
        head_dim=16,
        page_size=pages[0],
        pool_tokens=2048,
        mamba_slots=16,
        aux_rows=32,
        device=DEVICE,
    )
    r = run_demo(
        spec,
        requests=6,
        seed=3,
        max_len=200,
        chunk_tokens=64,
        timeout=60,
        decode_page_size=pages[1],
        decode_prefix=prefix,
        prefill_tp=tp[0],
        decode_tp=tp[1],
    )
    _check_report(r, 6)
    assert (r["prefill_tp"], r["decode_tp"]) == tp and r["decode_prefix"] == prefix


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kv_layout,mamba_layout",
    [("page_major", "envelope"), ("per_layer", "per_layer"), ("mla", "none")],
)
def test_verifier_catches_a_wrong_byte(kv_layout, mamba_layout):
    """In one process: prefill-side content copied page by page (the bytes the transfer moves)
    verifies; one flipped byte in a page, a state slot or the first token does not."""
    import torch

    from kvxfer.pd_demo.model import DemoModel
    from kvxfer.pd_demo.spec import ModelSpec

    spec = ModelSpec(
        kv_layout=kv_layout,
        mamba_layout=mamba_layout,
        attn_layers=2,
        mamba_layers=2,
        head_dim=8,
        page_size=4,
        pool_tokens=256,
        mamba_slots=4,
        aux_rows=4,
        device=DEVICE,
    )
    p, d = DemoModel(spec), DemoModel(spec)
    room, length = 123456789, 10  # 3 pages, the last one partly used
    pres = p.alloc(p.pages_for(length))
    d.alloc(1)  # decode's ids differ from prefill's
    dres = d.alloc(d.pages_for(length))
    p.write_tokens(room, pres["pages"], 0, 8, length)  # two chunks, like chunked prefill
    p.write_tokens(room, pres["pages"], 8, 12, length)
    if pres["slot"] is not None:
        p.write_state(room, pres["slot"])
    p.write_aux(room, pres["row"])
    for pv, dv in zip(p.pool.get_item_views(), d.pool.get_item_views()):
        dv[dres["pages"]] = pv[pres["pages"]]
    if pres["slot"] is not None:
        for pv, dv in zip(p.pool.get_state_item_views(), d.pool.get_state_item_views()):
            dv[dres["slot"]] = pv[pres["slot"]]
    d.aux.data[dres["row"]] = p.aux.data[pres["row"]]
    assert d.verify(room, dres, length) == []
    assert d.verify(room + 1, dres, length)  # another room's content differs
    assert d.verify(room, dres, length - 1)  # position 9 must be zero then
    view = d.pool.get_item_views()[-1]
    page = int(dres["pages"][2])
    view[page, -1] ^= 1  # last byte of the last page
    problems = d.verify(room, dres, length)
    assert len(problems) == 1 and f"page {page}" in problems[0], problems
    view[page, -1] ^= 1
    if dres["slot"] is not None:
        d.pool.get_state_item_views()[0][dres["slot"], 0] ^= 0x40
        assert any("state tensor" in x for x in d.verify(room, dres, length))
        d.pool.get_state_item_views()[0][dres["slot"], 0] ^= 0x40
    d.aux.set_output(dres["row"], 7)
    assert any("first token" in x for x in d.verify(room, dres, length))
    p.free(pres)
    assert p.leaks() == {"pages": 0, "slots": 0, "aux": 0}
    assert d.leaks() != {"pages": 0, "slots": 0, "aux": 0}
    assert torch.count_nonzero(p.pool.get_item_views()[0]) > 0


def test_exit_status_reports_failures(monkeypatch, capsys):
    from kvxfer.pd_demo import run as demo_run

    report = {"requests": 2, "failed": 1, "verified": 1, "leaked": False}
    monkeypatch.setattr(demo_run, "run_demo", lambda *a, **k: dict(report))
    monkeypatch.setattr(demo_run, "format_table", lambda r: "table")
    assert demo_run.main(["--json"]) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    report.update(failed=0, verified=2)
    assert demo_run.main([]) == 0
    report.update(leaked=True)
    assert demo_run.main([]) == 1


@pytest.mark.parametrize(
    "argv,text",
    [
        (["--chunk-tokens", "10"], "multiple of --page-size 16"),
        (["--min-len", "50", "--max-len", "10"], "--min-len (50)"),
        (["--kv-layout", "blocked"], "invalid choice"),
        (["--max-len", "5000", "--pool-tokens", "4096"], "--max-len 5000 tokens does not fit"),
        (["--mamba-layout", "envelope", "--mamba-layers", "0"], "mamba_layers >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_starting(argv, text, capsys):
    from kvxfer.pd_demo import main

    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    assert text in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_pools_mode(capsys):
    from kvxfer import demo

    assert demo.main(["--pools", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "MLA latent" in out and "all checks passed" in out
    assert demo.pools_main([]) == 0


@pytest.mark.timeout(150)
def test_raw_ping_seq_takes_only_raw_notifications():
    """The bench's decode handler sees every message: it names a raw write's Ping (seq from
    RAW_SEQ) and nothing else, decoding only payloads that hold the Ping's tag."""
    from kvxfer.disagg.messages import Done, Ping
    from kvxfer.pd_demo.bench import RAW_SEQ, raw_ping_seq

    assert raw_ping_seq(Ping(seq=RAW_SEQ + 5).encode()) == RAW_SEQ + 5
    assert raw_ping_seq(Ping(seq=5).encode()) is None  # a heartbeat
    assert raw_ping_seq(Done(room=5, pages=1, sums=None).encode()) is None
    assert raw_ping_seq(b"not msgpack, but pd.ping") is None


def test_pd_bench_smoke(tmp_path, capsys):
    """The PD benchmark (demo workers) end to end, tiny: every request succeeds, the raw
    comparison moves exactly the PD request's bytes, 1-page requests cost 3 ops."""
    from kvxfer.pd_demo import bench

    out = tmp_path / "pd.json"
    assert (
        bench.main(
            [
                "--device",
                DEVICE,
                "--modes",
                "none",
                "--latency-requests",
                "10",
                "--throughput-requests",
                "20",
                "--large-pages",
                "16",
                "--iters",
                "1",
                "--json-out",
                str(out),
            ]
        )
        == 0
    )
    row = json.loads(out.read_text())["rows"][0]
    assert row["lat_ok"] == row["lat_n"] == 10 and row["tput_ok"] == row["tput_n"] == 20
    assert row["ops_1page"] == 3  # page run + state slot + aux row
    assert row["large_bytes"] == row["request_bytes_1page"] + 15 * row["page_bytes"]
    assert row["large_ops"] >= 3 and row["req_per_s"] > 0 and row["ratio_median"] > 0
    assert "× raw" in capsys.readouterr().out


def test_pd_bench_stages_of_large_requests(tmp_path, capsys):
    """``--stages`` traces the large requests too: every one of them has each stage of the
    path, the stages add up to about the request's time, and the raw write's post and flush
    are printed beside them."""
    from kvxfer.pd_demo import bench

    out = tmp_path / "pd.json"
    argv = ["--device", DEVICE, "--modes", "none", "--stages", "--latency-requests", "10"]
    argv += ["--throughput-requests", "20", "--large-pages", "16", "--iters", "3"]
    assert bench.main(argv + ["--json-out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    st = row["large_stages"]
    assert st["requests"] == 3  # the warm-up request is not among them
    assert all(s["n"] == 3 for s in st["rows"] if s["on_path"])
    assert 0 < st["sum_p50_us"] <= 3 * st["path_p50_us"]
    assert row["raw_large_post_p50_us"] > 0 and row["raw_large_flush_p50_us"] > 0
    text = capsys.readouterr().out
    assert "the same run's 3 requests of 16 pages" in text
    assert "raw write: native post p50 / post → flush reported p50" in text


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["yield", "spin"])
def test_pd_bench_polling_schedulers(tmp_path, capsys, mode):
    """``--poll-scheduler``: the workers' schedulers poll their rooms instead of blocking on
    on_done; every request still succeeds, and the row says how many of decode's polls took
    a Done themselves (KVManager.take_arrived: between none and one per request)."""
    from kvxfer.pd_demo import bench

    out = tmp_path / "pd.json"
    argv = ["--device", DEVICE, "--modes", "none", "--latency-requests", "20"]
    argv += ["--throughput-requests", "20", "--large-pages", "16", "--iters", "1"]
    assert bench.main(argv + ["--poll-scheduler", mode, "--json-out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["lat_ok"] == row["lat_n"] == 20 and row["tput_ok"] == row["tput_n"] == 20
    assert 0 <= row["poll_takes_1page"] <= 1
    assert f"polling schedulers ({mode})" in capsys.readouterr().out


@pytest.mark.timeout(150)
def test_pd_bench_decode_post_capture(tmp_path, capsys):
    """``kvxfer bench pd --decode-post-capture`` (the demo with it: test_demo_other_layouts):
    every request of the run succeeds."""
    from kvxfer.pd_demo import bench

    out = tmp_path / "pd.json"
    argv = ["--device", DEVICE, "--modes", "none", "--latency-requests", "10"]
    argv += ["--throughput-requests", "10", "--large-pages", "16", "--iters", "1"]
    assert bench.main(argv + ["--decode-post-capture", "--json-out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["lat_ok"] == row["lat_n"] == 10 and row["tput_ok"] == row["tput_n"] == 10
    assert "decode pool backed after construction" in capsys.readouterr().out


def test_pd_bench_mixed_phase(tmp_path, capsys):
    """``--mixed`` with ``--coalesce-after 2,0``: one row per value, every small and large
    request of the mixed phase succeeds (the bench raises otherwise), the small ones are
    counted and timed, nothing coalesces with coalescing off."""
    from kvxfer.pd_demo import bench

    out = tmp_path / "pd.json"
    argv = ["--device", DEVICE, "--modes", "none", "--latency-requests", "10"]
    argv += ["--throughput-requests", "20", "--large-pages", "16", "--iters", "1"]
    argv += ["--mixed", "12", "--mixed-depth", "1", "--coalesce-after", "2,0"]
    assert bench.main(argv + ["--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["coalesce_after"] for r in rows] == [2, 0]
    for r in rows:
        assert r["mixed_n"] == 12 and r["mixed_large"] == 3 and 1 <= r["mixed_behind"] <= 12
        assert r["mixed_p50_us"] > 0 and r["mixed_max_us"] >= r["mixed_p99_us"]
    assert rows[1]["mixed_coalesced_rooms"] == rows[1]["mixed_coalesced_writes"] == 0
    assert "1-page requests with large ones in flight" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--coalesce-after", "2,x"], ["--mixed", "-1"], ["--mixed-depth", "0"]],
)
def test_pd_bench_refuses_bad_mixed_arguments(argv, capsys):
    from kvxfer.pd_demo import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", DEVICE] + argv)
    assert exc.value.code == 2 and "--" in capsys.readouterr().err


def test_layerwise_bench_smoke(tmp_path):
    """`kvxfer bench layerwise`, tiny: every mode's request succeeds on both sides, the
    streaming runs measure one layer's transfer, the table has a row per size."""
    from kvxfer.bench import layerwise

    out = tmp_path / "lw.json"
    argv = ["--device", DEVICE, "--kv-layout", "page_major", "--layers", "4"]
    argv += ["--tokens", "64,256", "--iters", "1", "--per-layer-ms", "2"]
    argv += ["--mamba-layout", "envelope", "--json-out", str(out)]
    assert layerwise.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [64, 256]
    for r in rows:
        assert set(r["tail_ms"]) == {"whole", "layer", "group4"}
        assert r["t1_ms"] is not None and r["t1_ms"] > 0
        if DEVICE == "cpu":  # a timed wait per layer (on CUDA: a matmul of its own length)
            assert r["compute_ms"]["layer"] >= 4 * 2.0


@pytest.mark.timeout(240)
def test_pd_bench_tp_smoke(tmp_path):
    """`kvxfer bench pd --prefill-tp 2 --decode-tp 1`, tiny: equal TP at both sizes, then
    2 -> 1, fresh workers each; every request succeeds (the bench raises otherwise), the same
    kv and state bytes move in every row, and the send skew is reported (0 for one rank)."""
    from kvxfer.pd_demo import bench

    out = tmp_path / "tp.json"
    argv = ["--device", DEVICE, "--modes", "none", "--prefill-tp", "2", "--decode-tp", "1"]
    argv += ["--kv-layout", "hnd", "--shape-tokens", "64", "--iters", "1"]
    assert bench.main(argv + ["--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prefill_tp"], r["decode_tp"]) for r in rows] == [(2, 2), (1, 1), (2, 1)]
    assert all(r["us_median"] > 0 and r["prefill_us_median"] > 0 for r in rows)
    # the same kv and state bytes; one aux row per decode rank (2 -> 2: one more)
    assert rows[2]["bytes"] == rows[1]["bytes"] and 0 < rows[0]["bytes"] - rows[1]["bytes"] <= 256
    assert rows[1]["send_skew_us"] == 0  # one prefill rank
    assert all(0 <= r["send_skew_us"] < 1e6 for r in rows)


def test_pd_bench_tp_stages_trace_every_leg(tmp_path):
    """`--stages` with one prefill rank and two decode ranks: decode announces before prefill
    opens the sender, so the sender's room adopts both legs as it is made; each leg has its
    own record (the room's record exists before the adoption), and every request's legs are
    in the stage table, posted after they were picked up."""
    from kvxfer.pd_demo import bench

    out = tmp_path / "tp.json"
    argv = ["--device", DEVICE, "--modes", "none", "--prefill-tp", "1", "--decode-tp", "2"]
    argv += ["--kv-layout", "hnd", "--shape-tokens", "64", "--iters", "3", "--stages"]
    assert bench.main(argv + ["--json-out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][-1]
    assert (row["prefill_tp"], row["decode_tp"]) == (1, 2)
    st = row["stages"]
    for leg in ("p0.leg1", "p0.leg2"):
        assert st[f"{leg}.loop"] <= st[f"{leg}.posted"], st
    assert st["p0.loop"] <= st["p0.leg1.loop"] and "p0.last_notified" in st
