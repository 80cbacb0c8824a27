"""Fused GPU kernels with torch reference fallbacks: RMSNorm, add+RMSNorm, SiLU-and-mul, RoPE.

On CUDA bfloat16/float16 tensors outside autograd these dispatch to FlashInfer (``flashinfer.norm.rmsnorm`` /
``fused_add_rmsnorm``, ``flashinfer.activation.silu_and_mul``,
``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace``); elsewhere, or with ``PPSPEC_FUSED=0``, the torch
reference runs.

:func:`launch_kwargs` gates programmatic dependent launch (PDL) of the engine's Triton kernels. Contract of every
``USE_PDL`` kernel: each program calls ``gdc_wait()`` before reading any activation or writing any output, reads
only weights before it, and calls ``gdc_launch_dependents()`` right after. On for CUDA compute capability >= 9,
Triton with ``gdc_wait``, no interpreter, ``PPSPEC_PDL`` not 0.

Semantics (both paths):
  * ``rmsnorm(x [T, H], w [H], eps) -> [T, H]``: x / sqrt(mean(x^2) + eps) * w, statistics in float32.
  * ``add_rmsnorm(x, residual, w, eps) -> (normed, residual + x)``: the FlashInfer path updates
    ``x`` and ``residual`` in place (both must be owned by the caller).
  * ``silu_and_mul(x [T, 2I]) -> [T, I]``: silu(x[:, :I]) * x[:, I:].
  * ``rope(positions [T] int64, q [T, Hq, D], k [T, Hk, D], cos_sin [P, D] float32)``: Neox-style
    (rotate-half) rotation; the FlashInfer path rotates q and k in place.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import knobs

try:
    import triton.language as tl
    _HAS_GDC = hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")
except Exception:                                 # noqa: BLE001 - no Triton / an old one: plain launches
    _HAS_GDC = False

_FI = None
_FI_TRIED = False


def _flashinfer():
    global _FI, _FI_TRIED
    if not _FI_TRIED:
        _FI_TRIED = True
        try:
            import flashinfer  # noqa: F401
            import flashinfer.activation
            import flashinfer.norm
            import flashinfer.rope
            _FI = flashinfer
        except Exception:                         # noqa: BLE001 - no flashinfer: reference path
            _FI = None
    return _FI


def use_fused(x: torch.Tensor) -> bool:
    """True when ``x`` can take the FlashInfer kernels (CUDA, bf16/fp16, no autograd, flashinfer importable)."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        return False
    if not knobs.current().fused:
        return False
    return _flashinfer() is not None


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if use_fused(x) and x.dim() == 2:
        return _flashinfer().norm.rmsnorm(x.contiguous(), w, eps)
    return rmsnorm_ref(x, w, eps)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    if use_fused(x) and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() \
            and residual.dtype == x.dtype:
        _flashinfer().norm.fused_add_rmsnorm(x, residual, w, eps)
        return x, residual
    s = x + residual
    return rmsnorm_ref(s, w, eps), s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_fused(x) and x.is_contiguous():
        return _flashinfer().activation.silu_and_mul(x)
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c = torch.cat([cos, cos], -1)
    s = torch.cat([sin, sin], -1)
    return (xf * c + torch.cat([-x2, x1], -1) * s).to(x.dtype)


def rope(positions, q, k, cos, sin, cos_sin):
    """See module docstring; ``cos``/``sin`` [P, D/2] float32 for the reference, ``cos_sin`` = cat of both."""
    if use_fused(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        T, D = q.shape[0], q.shape[-1]
        _flashinfer().rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.reshape(T, -1), k.reshape(T, -1), D, cos_sin, is_neox=True)
        return q, k
    return rope_ref(positions, q, k, cos, sin)


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether Triton kernels on ``t``'s device launch with PDL (see the module docstring)."""
    kn = knobs.current()
    if not kn.pdl or not _HAS_GDC or not t.is_cuda or kn.triton_interpret:
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_kwargs(t: torch.Tensor) -> dict:
    """``{"USE_PDL": True, "launch_pdl": True}`` when :func:`pdl_enabled`, else ``{"USE_PDL": False}``: splat into
    the launch of a kernel that takes a ``USE_PDL`` constexpr and keeps the PDL contract."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(t) else {"USE_PDL": False}
