"""tests/kernel_tests: each test skips, with the reason, where Triton's kernels cannot run (neither Triton's CPU
interpreter nor CUDA), as when the package is named explicitly on such a machine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import INTERPRETED

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if INTERPRETED or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1) or CUDA")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)
