"""The host (numpy) path of engine.attention.packed_mask.pack_verify_mask. The Triton spec-loop kernels against the
torch references: tests/kernel_tests/test_tree_kernels.py (interpreted), tests/test_cuda_graph.py (compiled)."""
from __future__ import annotations


def test_pack_verify_mask_host_matches_pack_masks():
    """The host (numpy) path of pack_verify_mask, used for host trees by the verify graph: the same bytes as
    packing each request's full [n, L + n] mask, padding requests (L = 0, all-ones block) included."""
    import numpy as np
    import torch
    from engine.attention.packed_mask import pack_masks, pack_verify_mask
    g = torch.Generator().manual_seed(3)
    for B, n in ((1, 4), (5, 6), (3, 12)):
        tm = torch.rand(B, n, n, generator=g) < 0.5
        L = [int(x) for x in torch.randint(0, 70, (B,), generator=g)]
        L[0] = 0
        packed, indptr = pack_verify_mask(tm, L)
        want, wind = pack_masks([torch.cat([torch.ones(n, L[b], dtype=torch.bool), tm[b]], 1) for b in range(B)])
        assert packed.dtype == torch.uint8 and np.array_equal(packed.numpy(), want) and np.array_equal(indptr, wind)
