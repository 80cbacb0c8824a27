"""FlashInfer's fused ops: RMSNorm, add+RMSNorm, SiLU-and-mul, RoPE (their torch reference twins:
engine/model/layers.py).

On CUDA bfloat16/float16 tensors outside autograd (:func:`use_fused`) these run ``flashinfer.norm.rmsnorm`` /
``fused_add_rmsnorm``, ``flashinfer.activation.silu_and_mul``,
``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace``; for any other tensor, a layout they do not take, or
``PPSPEC_FUSED=0`` they return None and the caller runs the reference.

:func:`launch_kwargs` gates programmatic dependent launch (PDL) of the engine's Triton kernels. Contract of every
``USE_PDL`` kernel: each program calls ``gdc_wait()`` before reading any activation or writing any output, reads
only weights before it, and calls ``gdc_launch_dependents()`` right after. On for CUDA compute capability >= 9,
Triton with ``gdc_wait``, no interpreter, ``PPSPEC_PDL`` not 0.

Semantics (the same as the references):
  * ``rmsnorm(x [T, H], w [H], eps) -> [T, H]``: x / sqrt(mean(x^2) + eps) * w, statistics in float32.
  * ``add_rmsnorm(x, residual, w, eps) -> (normed, residual + x)``: the FlashInfer path updates
    ``x`` and ``residual`` in place (both must be owned by the caller).
  * ``silu_and_mul(x [T, 2I]) -> [T, I]``: silu(x[:, :I]) * x[:, I:].
  * ``rope(positions [T] int64, q [T, Hq, D], k [T, Hk, D], cos_sin [P, D] float32) -> (q, k)``: Neox-style
    (rotate-half) rotation, in place.
"""
from __future__ import annotations

import functools

import torch

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


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    if use_fused(x) and x.dim() == 2:
        return _flashinfer().norm.rmsnorm(x.contiguous(), w, eps)
    return None


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    if use_fused(x) and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() \
            and residual.dtype == x.dtype:
        _flashinfer().norm.fused_add_rmsnorm(x, residual, w, eps)
        return x, residual
    return None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    if use_fused(x) and x.is_contiguous():
        return _flashinfer().activation.silu_and_mul(x)
    return None


def rope(positions, q, k, cos_sin):
    """See the module docstring; ``cos_sin`` [P, D] float32 (cos half, then sin half)."""
    if use_fused(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        T, D = q.shape[0], q.shape[-1]
        _flashinfer().rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.reshape(T, -1), k.reshape(T, -1), D, cos_sin, is_neox=True)
        return q, k
    return None


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
