"""FlashInfer's bit-packed custom-mask format, and the packing of EAGLE verify masks into it.

Each request's bool mask ``[q_len, kv_len]`` is flattened row-major, packed little-endian by bit (element i is bit
``i % 8`` of byte ``i // 8``) and padded to whole bytes; a byte indptr int32 ``[B+1]`` gives each request's start.

:func:`pack_masks` packs host masks (numpy); :func:`pack_verify_mask` packs verify masks (committed tokens, then
the tree block): Triton for CUDA tensors when :func:`triton_enabled`, numpy for host tensors, torch otherwise.
"""
from __future__ import annotations

from .. import knobs

import numpy as np
import torch
from torch import Tensor

from .backend import h2d

try:                                              # optional: CPU-only installs have no Triton
    import triton
    import triton.language as tl
except Exception:                                 # noqa: BLE001 - any import failure: torch path
    triton = None


def triton_enabled(x: Tensor) -> bool:
    """True when ``x``'s kernels may run in Triton: Triton importable, ``PPSPEC_TRITON`` != 0, and
    ``x`` on CUDA (or any device under ``TRITON_INTERPRET=1``, Triton's CPU interpreter)."""
    kn = knobs.current()
    if triton is None or not kn.tree_triton:
        return False
    return x.is_cuda or kn.triton_interpret


def pack_masks(masks: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Bit-pack per-request bool masks [q_len, kv_len] (row-major, little bit order, each request padded
    to a whole byte) -> (packed uint8 [sum ceil(q*kv/8)], byte indptr int32 [B+1]); FlashInfer's layout."""
    parts, indptr = [], [0]
    for m in masks:
        p = np.packbits(m.reshape(-1).numpy().astype(np.uint8), bitorder="little")
        parts.append(p)
        indptr.append(indptr[-1] + p.size)
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8), np.asarray(indptr, dtype=np.int32)


if triton is not None:
    @triton.jit
    def _pack_mask_kernel(tree_mask_ptr, prefix_ptr, byte_indptr_ptr, out_ptr, N: tl.constexpr,
                          BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1).to(tl.int64)
        L = tl.load(prefix_ptr + b).to(tl.int64)
        start = tl.load(byte_indptr_ptr + b).to(tl.int64)
        end = tl.load(byte_indptr_ptr + b + 1).to(tl.int64)
        j = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        row_len = L + N
        total = N * row_len
        byte = tl.zeros([BLOCK], tl.int32)
        for t in tl.static_range(8):
            i = j * 8 + t
            row = i // row_len
            col = i - row * row_len
            inr = i < total
            tm = tl.load(tree_mask_ptr + b * N * N + row * N + (col - L), mask=inr & (col >= L), other=0)
            bit = inr & ((col < L) | (tm != 0))
            byte = byte | (bit.to(tl.int32) << t)
        tl.store(out_ptr + start + j, byte.to(tl.uint8), mask=j < end - start)



def mask_byte_indptr(prefix_lens: list[int], n: int) -> np.ndarray:
    """int32 [B+1]: request b's verify mask ``[n, L_b + n]`` bit-packed and padded to whole bytes
    (FlashInfer's per-request packed layout) starts at byte ``indptr[b]``."""
    nbytes = [(n * (int(L) + n) + 7) // 8 for L in prefix_lens]
    return np.concatenate([[0], np.cumsum(nbytes)]).astype(np.int32)


def pack_verify_mask(tree_mask: Tensor, prefix_lens: list[int]) -> tuple[Tensor, np.ndarray]:
    """Bit-pack the verify attention masks on ``tree_mask``'s device, without a host copy.

    Request b's mask is ``[n, L_b + n]``: its L_b committed tokens, then the ``tree_mask [B, n, n]`` bool block,
    in the module's packed layout.
    ``prefix_lens``: the L_b (host ints).
    Returns (packed uint8 [indptr[-1]] on the device, byte indptr int32 [B+1] numpy).
    """
    B, n, _ = tree_mask.shape
    dev = tree_mask.device
    indptr = mask_byte_indptr(prefix_lens, n)
    total = int(indptr[-1])
    packed = torch.empty(total, dtype=torch.uint8, device=dev)
    if triton_enabled(tree_mask):                 # prefix lengths and indptr: one pinned, asynchronous copy
        meta = h2d(torch.from_numpy(np.concatenate([np.asarray(prefix_lens, np.int64), indptr])), dev)
        prefix_dev, ind_dev = meta[:B], meta[B:]
        block = 256
        most = int(np.max(np.diff(indptr))) if B else 0
        _pack_mask_kernel[(B, max(1, -(-most // block)))](tree_mask.contiguous().view(torch.int8), prefix_dev,
                                                         ind_dev, packed, N=n, BLOCK=block)
        return packed, indptr
    if dev.type == "cpu":                         # host tree: numpy, one packbits per request
        tmn = tree_mask.numpy()
        buf = np.empty(total, dtype=np.uint8)
        for b, L in enumerate(prefix_lens):
            m = np.ones((n, int(L) + n), dtype=bool)
            m[:, int(L):] = tmn[b]
            buf[indptr[b]:indptr[b + 1]] = np.packbits(m.reshape(-1), bitorder="little")
        packed.copy_(torch.from_numpy(buf))
        return packed, indptr
    weights = (1 << torch.arange(8, device=dev, dtype=torch.int32))
    for b, L in enumerate(prefix_lens):
        m = torch.cat([torch.ones(n, int(L), dtype=torch.bool, device=dev), tree_mask[b]], 1).reshape(-1)
        pad = (-m.numel()) % 8
        bits = torch.cat([m, m.new_zeros(pad)]).view(-1, 8).to(torch.int32)
        packed[int(indptr[b]):int(indptr[b + 1])] = (bits * weights).sum(1).to(torch.uint8)
    return packed, indptr
