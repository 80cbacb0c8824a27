"""Fused RoPE + KV store (Triton): one launch per layer rotates q in place and writes the rotated k and v into the
KV pool (SGLang fuses the same pair in ``apply_rope_with_cos_sin_cache_inplace`` + ``set_kv_buffer``).

Semantics (= ``engine.model.layers.rope_ref`` then ``KVPool.store``): Neox-style rotation in float32,
``x * cos + rotate_half(x) * sin``, cast back to the pool dtype.

  rope_store(positions [T] int64, qkv [T, (Hq + 2 Hk) D] (q | k | v heads, row stride free, inner
             contiguous), cos_sin [P, D] float32 (cos half, then sin half), kv_cache [slots, 2, Hk, D],
             loc [T] int64, Hq, Hk, D) -> None

Used when :func:`enabled` (CUDA bf16/fp16, Triton importable, ``PPSPEC_ROPE_STORE`` unset or 1).
"""
from __future__ import annotations

import torch

from .. import knobs
from .fused import launch_kwargs, use_fused

try:
    import triton
    import triton.language as tl
except Exception:                                 # noqa: BLE001 - no Triton: callers use the two-kernel path
    triton = None


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernel may run for activations ``x``."""
    kn = knobs.current()
    if triton is None or not kn.rope_store:
        return False
    return kn.triton_interpret or use_fused(x)


if triton is not None:
    @triton.jit
    def _rope_store_kernel(qkv_ptr, stride_t, pos_ptr, cos_sin_ptr, loc_ptr, kv_ptr,
                           HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, HP2: tl.constexpr,
                           USE_PDL: tl.constexpr):
        if USE_PDL:                               # the PDL contract: nothing is read before the wait
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)                      # 0..HQ-1: a q head; HQ..HQ+HK-1: a k head and its v head
        D: tl.constexpr = 2 * HALF
        j = tl.arange(0, HP2)
        m = j < HALF
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c = tl.load(cos_sin_ptr + pos * D + j, mask=m, other=0.0)
        s = tl.load(cos_sin_ptr + pos * D + HALF + j, mask=m, other=0.0)
        row = qkv_ptr + t * stride_t
        src = row + h.to(tl.int64) * D            # q heads, then k heads: contiguous within the row
        x1 = tl.load(src + j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + j, mask=m, other=0.0).to(tl.float32)
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        if h < HQ:
            tl.store(src + j, o1.to(qkv_ptr.dtype.element_ty), mask=m)
            tl.store(src + HALF + j, o2.to(qkv_ptr.dtype.element_ty), mask=m)
        else:
            kh = (h - HQ).to(tl.int64)
            slot = tl.load(loc_ptr + t).to(tl.int64)
            dst = kv_ptr + slot * (2 * HK * D) + kh * D                  # kv_cache[slot, 0, kh]
            tl.store(dst + j, o1.to(kv_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF + j, o2.to(kv_ptr.dtype.element_ty), mask=m)
            vsrc = row + (HQ + HK) * D + kh * D
            vdst = dst + HK * D                                          # kv_cache[slot, 1, kh]
            tl.store(vdst + j, tl.load(vsrc + j, mask=m, other=0.0), mask=m)
            tl.store(vdst + HALF + j, tl.load(vsrc + HALF + j, mask=m, other=0.0), mask=m)


def rope_store(positions: torch.Tensor, qkv: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
               loc: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """See the module docstring. Raises ValueError for a layout the kernel does not handle."""
    T = qkv.shape[0]
    if qkv.stride(-1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"rope_store: qkv {tuple(qkv.shape)} / strides {qkv.stride()} do not match "
                         f"({num_heads} + 2 x {num_kv_heads}) heads x {head_dim}")
    if not kv_cache.is_contiguous() or tuple(kv_cache.shape[1:]) != (2, num_kv_heads, head_dim):
        raise ValueError(f"rope_store: kv_cache {tuple(kv_cache.shape)} is not [slots, 2, {num_kv_heads}, {head_dim}]")
    if T == 0:
        return
    half = head_dim // 2
    _rope_store_kernel[(T, num_heads + num_kv_heads)](
        qkv, qkv.stride(0), positions, cos_sin, loc, kv_cache,
        HQ=num_heads, HK=num_kv_heads, HALF=half, HP2=max(2, 1 << (half - 1).bit_length()), **launch_kwargs(qkv))
