"""Greedy token selection (Triton): row-wise argmax over the vocabulary in two launches (pass 1: max and first
index per ``BLOCK`` slice; pass 2: the largest value, ties to the smallest index), in the logits' own dtype.

  argmax_rows(x [R, V] float (row stride free, inner contiguous)) -> [R] int64

Semantics = ``torch.argmax(x, -1)`` for finite and -inf values (a row of -inf gives 0; NaN is not ordered).
Used when :func:`enabled` (CUDA + Triton, or ``TRITON_INTERPRET=1``); otherwise ``torch.argmax``.
"""
from __future__ import annotations

import torch

from .. import knobs

try:
    import triton
    import triton.language as tl
except Exception:                                 # noqa: BLE001 - no Triton: torch.argmax
    triton = None

BLOCK = 2048


def enabled(x: torch.Tensor) -> bool:
    kn = knobs.current()
    if triton is None or not kn.triton_argmax:
        return False
    if kn.triton_interpret:
        return True
    return x.is_cuda and x.dim() == 2 and x.stride(-1) == 1


if triton is not None:
    @triton.jit
    def _block_max_kernel(x_ptr, stride_r, V, val_ptr, idx_ptr, NB, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r * stride_r + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        i = tl.min(tl.where(x == m, offs, 2147483647), 0)      # first index of the block's max
        tl.store(val_ptr + r * NB + b, m)
        tl.store(idx_ptr + r * NB + b, i.to(tl.int64))

    @triton.jit
    def _final_kernel(val_ptr, idx_ptr, NB, out_ptr, map_ptr, NBP2: tl.constexpr, MAP: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, NBP2)
        ok = j < NB
        v = tl.load(val_ptr + r * NB + j, mask=ok, other=float("-inf"))
        i = tl.load(idx_ptr + r * NB + j, mask=ok, other=9223372036854775807)
        m = tl.max(v, 0)
        best = tl.min(tl.where(ok & (v == m), i, 9223372036854775807), 0)
        if MAP:
            best = tl.load(map_ptr + best)
        tl.store(out_ptr + r, best)


def argmax_rows(x: torch.Tensor, index_map: torch.Tensor | None = None) -> torch.Tensor:
    """``x.argmax(-1)`` for ``x [R, V]`` (see the module doc): [R] int64 on x's device, no host sync.
    ``index_map`` [V] int64 (optional): return ``index_map[argmax]`` instead (looked up in the final launch)."""
    if not enabled(x) or x.dim() != 2:
        best = x.argmax(-1)
        return best if index_map is None else index_map[best]
    R, V = x.shape
    nb = max(1, triton.cdiv(V, BLOCK))
    val = torch.empty(R, nb, dtype=torch.float32, device=x.device)
    idx = torch.empty(R, nb, dtype=torch.int64, device=x.device)
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R == 0:
        return out
    _block_max_kernel[(R, nb)](x, x.stride(0), V, val, idx, nb, BLOCK=BLOCK)
    _final_kernel[(R,)](val, idx, nb, out, index_map if index_map is not None else out,
                        NBP2=triton.next_power_of_2(nb), MAP=index_map is not None)
    return out
