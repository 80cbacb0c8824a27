"""engine.kernels.argmax off the Triton path: plain CPU tensors take torch.argmax (with and without an index map).
The Triton kernel against torch.argmax: tests/kernel_tests/test_argmax.py (interpreted), tests/test_cuda_graph.py
(compiled)."""
from __future__ import annotations

import torch


def test_argmax_cpu_is_torch(monkeypatch):
    from engine.kernels.argmax import argmax_rows, enabled
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 1000)
    assert not enabled(x) and torch.equal(argmax_rows(x), x.argmax(-1))
    ids = torch.arange(1000) * 7 + 3
    assert torch.equal(argmax_rows(x, index_map=ids), x.argmax(-1) * 7 + 3)
