"""The skip conditions the GPU and real-model tests share, as session fixtures (tests/conftest.py imports them, so
every test module can request them by name).

A GPU test module sets ``pytestmark = GPU`` (or ``GPU_FLASHINFER``): the ``gpu`` marker (``pytest -m gpu`` selects
it) and the fixtures below, requested before any of the module's own fixtures (session scope is set up first), so on
a machine without CUDA or FlashInfer each test is collected and then skipped with the reason, before a module
fixture builds a model or touches the device.
"""
from __future__ import annotations

import pytest

QWEN05B_MISSING = ("Qwen2.5-Coder-0.5B GGUF not on disk (ppspec model fetch qwen2.5-coder-0.5b, or "
                   "~/.cache/ppspec/models/qwen2.5-coder-0.5b/model.gguf)")


@pytest.fixture(scope="session")
def cuda_device():
    """``torch.device("cuda")``; skips the test (reason "needs a CUDA device") where torch sees no CUDA device."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.fixture(scope="session")
def flashinfer_module(cuda_device):
    """The ``flashinfer`` package (after :func:`cuda_device`); skips the test (reason "needs flashinfer ...") where
    it is not installed."""
    try:
        import flashinfer
    except ImportError as e:
        pytest.skip(f"needs flashinfer (pip install -e .[gpu]): {e}")
    return flashinfer


@pytest.fixture(scope="session")
def qwen05b_gguf() -> str:
    """Path of the Qwen2.5-Coder-0.5B GGUF (:func:`helpers.qwen05b_path`); skips the test (:data:`QWEN05B_MISSING`)
    when it is not on disk."""
    from helpers import qwen05b_path
    p = qwen05b_path()
    if p is None:
        pytest.skip(QWEN05B_MISSING)
    return str(p)


GPU = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_device")]
"""``pytestmark`` of a test module that needs a CUDA device."""
GPU_FLASHINFER = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_device", "flashinfer_module")]
"""``pytestmark`` of a test module that needs a CUDA device and FlashInfer."""
