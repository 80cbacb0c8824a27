"""engine.kernels.argmax (Triton two-pass row argmax) against torch.argmax, on CPU through Triton's interpreter or
compiled on the GPU. Ties across and within blocks must resolve to the first index, as torch's; with an index map
(a draft vocabulary's hot ids) the mapped index of the first maximum."""
from __future__ import annotations

import torch

from helpers import kernel_device


def test_argmax_kernel_matches_torch():
    from engine.kernels.argmax import BLOCK, argmax_rows, enabled
    dev = kernel_device()
    g = torch.Generator().manual_seed(0)
    cases = []
    for R, V in ((1, 7), (3, BLOCK), (2, BLOCK + 1), (4, 3 * BLOCK + 5), (1, 49152 // 8)):
        cases.append(torch.randn(R, V, generator=g).to(dev))
    x = torch.randn(3, 2 * BLOCK + 9, generator=g)
    x[0, 5] = x[0, BLOCK + 3] = x[0, 2 * BLOCK + 1] = 99.0        # ties across blocks: the first wins
    x[1, 17] = x[1, 18] = 50.0                                  # ties inside a block
    x[2] = float("-inf")                                         # all -inf: index 0
    cases.append(x.to(dev))
    wide = torch.randn(2, BLOCK + 40, generator=g).to(dev)[:, 10:BLOCK + 30]   # row stride != V
    cases.append(wide)
    cases.append(torch.randn(2, 300, generator=g).to(torch.float16).to(dev))
    assert all(enabled(c) for c in cases)
    bad = [i for i, c in enumerate(cases) if not torch.equal(argmax_rows(c), c.float().argmax(-1))]
    ids = torch.randperm(100000, generator=g)[:3 * BLOCK + 5].to(dev)     # index_map: a draft vocabulary's hot ids
    bad += [f"map{i}" for i, c in enumerate(cases[:4]) if not torch.equal(argmax_rows(c, index_map=ids[:c.shape[1]]),
                                                                            ids[c.float().argmax(-1)])]
    assert bad == []
