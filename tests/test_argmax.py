"""engine.kernels.argmax (Triton two-pass row argmax, issue 7) against torch.argmax: through Triton's CPU interpreter
here (in a subprocess: TRITON_INTERPRET must be set before Triton is imported), compiled on the GPU in
tests/test_cuda_graph.py. Ties across and within blocks must resolve to the first index, as torch's."""
from __future__ import annotations

import torch

from test_rope_store import _run

KERNEL = r'''
import torch
from engine.kernels.argmax import argmax_rows, enabled, BLOCK
g = torch.Generator().manual_seed(0)
cases = []
for R, V in ((1, 7), (3, BLOCK), (2, BLOCK + 1), (4, 3 * BLOCK + 5), (1, 49152 // 8)):
    x = torch.randn(R, V, generator=g)
    cases.append(x)
x = torch.randn(3, 2 * BLOCK + 9, generator=g)
x[0, 5] = x[0, BLOCK + 3] = x[0, 2 * BLOCK + 1] = 99.0        # ties across blocks: the first wins
x[1, 17] = x[1, 18] = 50.0                                  # ties inside a block
x[2] = float("-inf")                                         # all -inf: index 0
cases.append(x)
wide = torch.randn(2, BLOCK + 40, generator=g)[:, 10:BLOCK + 30]   # row stride != V
cases.append(wide)
cases.append(torch.randn(2, 300, generator=g).to(torch.float16))
assert all(enabled(c) for c in cases)
bad = [i for i, c in enumerate(cases) if not torch.equal(argmax_rows(c), c.float().argmax(-1))]
ids = torch.randperm(100000, generator=g)[:3 * BLOCK + 5]              # index_map: a draft vocabulary's hot ids
bad += [f"map{i}" for i, c in enumerate(cases[:4]) if not torch.equal(argmax_rows(c, index_map=ids[:c.shape[1]]),
                                                                        ids[c.float().argmax(-1)])]
print("BAD", bad)
'''


def test_argmax_kernel_matches_torch():
    out = _run(KERNEL, {"TRITON_INTERPRET": "1"})
    assert out.strip().endswith("BAD []"), out[-500:]


def test_argmax_cpu_is_torch(monkeypatch):
    from engine.kernels.argmax import argmax_rows, enabled
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 1000)
    assert not enabled(x) and torch.equal(argmax_rows(x), x.argmax(-1))
    ids = torch.arange(1000) * 7 + 3
    assert torch.equal(argmax_rows(x, index_map=ids), x.argmax(-1) * 7 + 3)
