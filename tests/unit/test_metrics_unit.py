"""kvxfer.metrics: in-process counters, and their Prometheus export when available."""

import pytest

from kvxfer.errors import InvalidArgument, TransferTimeout
from kvxfer.metrics import TransferMetrics, prometheus_available

pytestmark = pytest.mark.timeout(30)


def test_counts_and_histogram():
    m = TransferMetrics("unit-a")
    m.add_bytes(100)
    m.add_bytes(28)
    m.succeeded(0.003)
    m.succeeded(20.0)
    m.succeeded()
    m.failed(TransferTimeout("x"))
    m.failed("PeerClosed")
    m.failed("PeerClosed")
    s = m.snapshot()
    assert s["bytes"] == 128
    assert s["requests"] == {"success": 3, "failed": 3}
    assert s["failures"] == {"TransferTimeout": 1, "PeerClosed": 2}
    assert s["latency_s"]["count"] == 2 and s["latency_s"]["sum"] == pytest.approx(20.003)
    assert s["latency_s"]["buckets"]["0.0025"] == 0
    assert s["latency_s"]["buckets"]["0.005"] == 1
    assert s["latency_s"]["buckets"]["10"] == 1 and s["latency_s"]["buckets"]["30"] == 2


def test_bad_input():
    with pytest.raises(InvalidArgument):
        TransferMetrics("")
    with pytest.raises(InvalidArgument):
        TransferMetrics("unit-b").add_bytes(-1)


def test_prometheus_export():
    if not prometheus_available():
        pytest.skip("prometheus-client is not installed (pip install kvxfer[metrics])")
    from prometheus_client import REGISTRY, generate_latest

    m = TransferMetrics("unit-prom")
    m.add_bytes(4096)
    m.succeeded(0.02)
    m.failed("PeerClosed")
    TransferMetrics("unit-prom").add_bytes(1)  # a second instance shares the series
    get = REGISTRY.get_sample_value
    assert get("kvxfer_transfer_bytes_total", {"role": "unit-prom"}) == 4097
    assert get("kvxfer_requests_total", {"role": "unit-prom", "outcome": "success"}) == 1
    assert get("kvxfer_failures_total", {"role": "unit-prom", "cause": "PeerClosed"}) == 1
    assert get("kvxfer_transfer_latency_seconds_count", {"role": "unit-prom"}) == 1
    assert b"kvxfer_transfer_latency_seconds_bucket" in generate_latest(REGISTRY)
