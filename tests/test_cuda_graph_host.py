"""Host-side pieces of the CUDA-graph runner that run on CPU: the batch-size ladder and the bit-packed
tree masks handed to FlashInfer's graph-mode verify wrapper (byte-offset indptr, little bit order)."""
from __future__ import annotations

import numpy as np
import torch

from engine.cuda_graph import ladder, pack_masks


def test_ladder():
    assert ladder(1) == [1]
    assert ladder(32) == [1, 2, 4, 8, 12, 16, 24, 32]
    assert ladder(20) == [1, 2, 4, 8, 12, 16, 20]


def test_pack_masks_layout():
    a = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)               # 6 bits -> 1 byte
    b = torch.ones(3, 4, dtype=torch.bool)                                    # 12 bits -> 2 bytes
    packed, indptr = pack_masks([a, b])
    assert indptr.tolist() == [0, 1, 3]
    # little bit order: element i of a segment is bit (i % 8) of byte i // 8
    assert packed.tolist() == [0b011101, 0xFF, 0x0F]
    # the kernel's read: (mask[indptr[r] + off // 8] >> (off % 8)) & 1 with off = q * kv_len + k
    for r, m in enumerate([a, b]):
        q_len, kv_len = m.shape
        for q in range(q_len):
            for k in range(kv_len):
                off = q * kv_len + k
                assert (packed[indptr[r] + off // 8] >> (off % 8)) & 1 == int(m[q, k])
    empty, ind = pack_masks([])
    assert empty.size == 0 and ind.tolist() == [0] and ind.dtype == np.int32
