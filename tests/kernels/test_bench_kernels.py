"""Smoke test of `kvxfer bench kernels` at toy sizes (the real run is on the GPU)."""

import gc
import json

import pytest
import torch
from _kernels_testlib import DEVICE, ON_CUDA

from kvxfer.bench import kernels as bench
from kvxfer.bench import main as bench_main

pytestmark = pytest.mark.timeout(60)


def test_bench_kernels_reports_every_kernel(tmp_path, capsys):
    out = tmp_path / "k.json"
    rc = bench.main(
        [
            "--device",
            DEVICE.type,
            "--tokens",
            "32",
            "--layers",
            "2",
            "--heads",
            "1",
            "--head-dim",
            "8",
            "--mla-nope",
            "8",
            "--mla-rope",
            "4",
            "--rep-ms",
            "1",
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "| kernel | tokens |" in text and "| graph us | host us |" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == list(bench.KERNELS)
    for r in rows:
        assert r["bytes"] > 0 and r["copy_gbps"] > 0 and r["torch_gbps"] > 0
        assert (r["ratio"] is not None) == ON_CUDA
        # on CUDA every Triton call is captured in a CUDA graph (the launchers never sync
        # with the host) and its host-side cost is reported; neither exists on CPU
        assert (r["graph_s"] is not None) == ON_CUDA and (r["host_s"] is not None) == ON_CUDA
    if not ON_CUDA:
        assert "CPU run" in text


def test_bench_dispatch_errors(capsys):
    assert bench_main(["nosuch"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err
    assert bench_main([]) == 0
    assert "kernels" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["checksum", "checksum_paged"])
def test_checksum_cases_own_the_buffers_their_table_reads(kind, monkeypatch):
    """The task table holds raw addresses: a case that dropped its buffers read freed memory
    (an illegal address on the H200 once CUDA-graph capture emptied the allocator's cache)."""
    seen = []
    real = bench.checksum.item_tasks

    def spy(ptrs, *args, **kw):
        seen.append([int(p) for p in ptrs])
        return real(ptrs, *args, **kw)

    monkeypatch.setattr(bench.checksum, "item_tasks", spy)
    a = bench._parser().parse_args(["--layers", "2", "--heads", "1", "--head-dim", "8"])
    case = bench._build(kind, 32, a, DEVICE)
    gc.collect()
    live = {t.data_ptr() for t in gc.get_objects() if issubclass(type(t), torch.Tensor)}
    assert seen and set(seen[-1]) <= live
    assert case.payload > 0
