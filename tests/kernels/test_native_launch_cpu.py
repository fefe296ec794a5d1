"""The native launch path's fallbacks on a machine without CUDA (CI): nothing is launched
natively, every caller keeps Triton's launch, and the reasons are typed errors, not crashes.
The path itself runs in tests/gpu/test_native_launch.py on the GPU machine."""

import pytest
import torch

from kvxfer.kernels import native_launch, piece_copy
from kvxfer.kernels.errors import CudaError, UnsupportedOperation

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA fallbacks"),
]


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(native_launch.NATIVE_ENV, raising=False)
    assert native_launch.enabled()
    monkeypatch.setenv(native_launch.NATIVE_ENV, "0")
    assert not native_launch.enabled()
    monkeypatch.setenv(native_launch.NATIVE_ENV, "1")
    assert native_launch.enabled()


def test_task_launcher_refuses_without_cuda():
    with pytest.raises((UnsupportedOperation, CudaError)):
        piece_copy.TaskLauncher(0)
    why = piece_copy.native_kernel(0, 16)
    assert isinstance(why, str) and why  # the reason, cached
    assert piece_copy.native_kernel(0, 16) is why
    assert piece_copy.task_launcher(0, "the test") is None  # logged, not raised


def test_fused_copier_on_cpu_keeps_the_triton_launch():
    from kvxfer.pools.offload.fused import FusedCopier

    assert not FusedCopier(torch.device("cpu"), True, 0).native
