"""Backend selection: "auto" follows the device unless force_backend overrides it."""

import pytest
import torch
from _kernels_testlib import DEVICE, ON_CUDA, gen, rand

from kvxfer.kernels import dispatch, store
from kvxfer.kernels.errors import InvalidArgument, UnsupportedOperation

pytestmark = pytest.mark.timeout(30)


def test_resolve_and_force_backend_nesting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert dispatch.resolve("auto", cpu) == "torch"
    assert dispatch.resolve("auto", cuda) == "triton"
    with dispatch.force_backend("triton"):
        assert dispatch.resolve("auto", cpu) == "triton"
        assert dispatch.resolve("torch", cpu) == "torch"  # explicit argument wins
        with dispatch.force_backend("torch"):
            assert dispatch.resolve("auto", cuda) == "torch"
            with dispatch.force_backend("auto"):
                assert dispatch.resolve("auto", cuda) == "triton"
            assert dispatch.forced_backend() == "torch"
        assert dispatch.forced_backend() == "triton"
    assert dispatch.forced_backend() is None


def test_force_backend_restores_on_error():
    with pytest.raises(RuntimeError):
        with dispatch.force_backend("torch"):
            raise RuntimeError("boom")
    assert dispatch.forced_backend() is None


def test_unknown_backend_rejected():
    with pytest.raises(InvalidArgument, match="'gpu'"):
        dispatch.resolve("gpu", torch.device("cpu"))
    with pytest.raises(InvalidArgument):
        with dispatch.force_backend("numpy"):
            pass


def test_auto_routes_by_device_and_override(monkeypatch):
    calls = []
    monkeypatch.setattr(store, "_launch", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(store, "store_kv_reference", lambda *a, **k: calls.append("torch"))
    g = gen(41)
    kc = rand((4, 1, 2), torch.float16, g)
    k = rand((1, 1, 2), torch.float16, g)
    loc = torch.tensor([1], device=DEVICE)
    store.store_kv(kc, None, loc, k, None)
    with dispatch.force_backend("triton"):
        store.store_kv(kc, None, loc, k, None)
    with dispatch.force_backend("torch"):
        store.store_kv(kc, None, loc, k, None)
    assert calls == ["triton" if ON_CUDA else "torch", "triton", "torch"]


def test_require_runnable():
    dispatch.require_runnable(object(), torch.device("cuda", 0))
    with pytest.raises(UnsupportedOperation, match="TRITON_INTERPRET"):
        dispatch.require_runnable(object(), torch.device("cpu"))
    if not ON_CUDA:
        dispatch.require_runnable(store._store_rows_kernel, torch.device("cpu"))
