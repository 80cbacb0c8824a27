"""Batch-1 GEMV kernels (Triton) with fused add-RMSNorm / SiLU-and-mul, for one-row decode (the classic batch-1
decode GEMV of FasterTransformer / gpt-fast; each program streams BLOCK_N weight rows once over K).

  * ``linear(x, W, bias)``: y = x W^T (+ bias).
  * ``norm_linear(x, residual, gamma, eps, W, bias)``: h = x + residual (rounded to x's dtype), y = rmsnorm(h) W^T
    (+ bias); returns (y, h). Without a residual h = x.
  * ``norm_gate_up(x, residual, gamma, eps, W)``: [g | u] = rmsnorm(h) W^T, y = silu(g) * u (W [2I, K]: gate rows
    then up rows); returns (y [1, I], h).

The norm is folded (rmsnorm(h) W^T = rstd * ((h * gamma) W^T)), so results agree with the unfused path within bf16
rounding; h is bit-exact.

Shapes and dtypes: x [1, K] (inner stride 1), residual [1, K] or None, gamma [K], W [N, K] contiguous of x's dtype,
bias [N] or None. Outputs are fresh [1, N] / [1, K] tensors of x's dtype; float32 accumulation.
Dispatch (:func:`enabled`; the op and weight size: engine/model/llama.py): CUDA bf16/fp16, exactly one row,
``PPSPEC_GEMV`` not 0, weights of more than ``PPSPEC_GEMV_MIN_W`` elements; under Triton's interpreter only with
``PPSPEC_GEMV=1``. Raises ValueError for layouts the kernels do not take.
"""
from __future__ import annotations

import torch

from .. import knobs
from .fused import launch_kwargs, use_fused

try:
    import triton
    import triton.language as tl
except Exception:                                 # noqa: BLE001 - no Triton: callers use another path
    triton = None

OPS = ("qkv", "o", "gate_up", "down")
num_launches = 0                                  # kernel launches in this process (tests check the path ran)
# (BLOCK_N, BLOCK_K, num_warps, num_stages, prefetch) per op, from tools.kernel_bench --gemv at the Llama-3-8B shape
DEFAULTS = {"qkv": (2, 1024, 4, 1, 1), "o": (4, 512, 4, 1, 1), "gate_up": (8, 256, 4, 2, 1), "down": (4, 512, 4, 1, 1)}
TUNE: tuple | None = None                         # a config forced on every op (tools.kernel_bench sweeps it)


def enabled(x: torch.Tensor) -> bool:
    """Whether activations ``x`` [M, K] take the GEMV kernels at all (one row, CUDA half precision, knob on)."""
    kn = knobs.current()
    if triton is None or kn.gemv is False or x.dim() != 2 or x.shape[0] != 1:
        return False
    if kn.triton_interpret:                               # CPU interpreter: only when asked for by name (tests)
        return kn.gemv is True
    return use_fused(x)


def pick_config(op: str, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, prefetch) for linear ``op`` with weight [N, K]: :data:`TUNE`, else
    :data:`DEFAULTS` with BLOCK_K capped at K's next power of two."""
    if TUNE:
        return TUNE
    bn, bk, warps, stages, pre = DEFAULTS.get(op, (4, 512, 4, 1, 1))
    return bn, min(bk, max(16, triton.next_power_of_2(K))), warps, stages, pre


if triton is not None:
    @triton.jit
    def _act_tile(x_ptr, r_ptr, h_ptr, g_ptr, kk, K, write_h, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                  EVEN_K: tl.constexpr):
        """Activation tile for K offsets ``kk``: (a = h * gamma (NORM) or x, sum of h^2 over the tile)."""
        dt = x_ptr.dtype.element_ty
        if EVEN_K:
            a = tl.load(x_ptr + kk).to(tl.float32)
        else:
            a = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        if HAS_RES:
            if EVEN_K:
                a = (a + tl.load(r_ptr + kk).to(tl.float32)).to(dt)
            else:
                a = (a + tl.load(r_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)).to(dt)
            if write_h:
                tl.store(h_ptr + kk, a, mask=kk < K)
            a = a.to(tl.float32)
        sq = a * a
        if NORM:
            if EVEN_K:
                a = a * tl.load(g_ptr + kk).to(tl.float32)
            else:
                a = a * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        return a, sq

    @triton.jit
    def _gemv_kernel(x_ptr, r_ptr, h_ptr, g_ptr, w_ptr, stride_wn, b_ptr, y_ptr, N, K, eps,
                     NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                     USE_PDL: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = rn < N
        rows = tl.where(mn, rn, 0).to(tl.int64)          # rows past N re-read row 0 (no mask on the weight stream)
        rk = tl.arange(0, BLOCK_K)
        wp = w_ptr + rows[:, None] * stride_wn + rk[None, :]
        up = w_ptr + (rows + N)[:, None] * stride_wn + rk[None, :]   # GATED: the up half of W
        dt = x_ptr.dtype.element_ty
        # the first weight tile(s) before the PDL wait: weights are never written (the PDL contract)
        if EVEN_K:
            w = tl.load(wp, eviction_policy="evict_first")
        else:
            w = tl.load(wp, mask=(rk < K)[None, :], other=0.0, eviction_policy="evict_first")
        u = w
        if GATED:
            if EVEN_K:
                u = tl.load(up, eviction_policy="evict_first")
            else:
                u = tl.load(up, mask=(rk < K)[None, :], other=0.0, eviction_policy="evict_first")
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            nk = k0 + BLOCK_K + rk
            if PREFETCH:        # the next tile is in flight while this one is multiplied (two tiles in flight)
                w_next = tl.load(wp + k0 + BLOCK_K, mask=(nk < K)[None, :], other=0.0, eviction_policy="evict_first")
                u_next = w_next
                if GATED:
                    u_next = tl.load(up + k0 + BLOCK_K, mask=(nk < K)[None, :], other=0.0,
                                     eviction_policy="evict_first")
            a, sq = _act_tile(x_ptr, r_ptr, h_ptr, g_ptr, k0 + rk, K, pid == 0, NORM, HAS_RES, EVEN_K)
            if NORM:
                ss += sq
            acc += w.to(tl.float32) * a[None, :]
            if GATED:
                acc_u += u.to(tl.float32) * a[None, :]
            if PREFETCH:
                w = w_next
                u = u_next
            else:
                w = tl.load(wp + k0 + BLOCK_K, mask=(nk < K)[None, :], other=0.0, eviction_policy="evict_first")
                if GATED:
                    u = tl.load(up + k0 + BLOCK_K, mask=(nk < K)[None, :], other=0.0, eviction_policy="evict_first")
        y = tl.sum(acc, axis=1)
        rstd = 1.0
        if NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
            y = y * rstd
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)
        if GATED:
            gq = y.to(dt).to(tl.float32)
            uq = (tl.sum(acc_u, axis=1) * rstd).to(dt).to(tl.float32)
            y = gq / (1.0 + tl.exp(-gq)) * uq
        tl.store(y_ptr + rn, y.to(dt), mask=mn)


def _launch(op: str, x: torch.Tensor, w: torch.Tensor, norm: bool, gated: bool, residual=None, gamma=None,
            eps: float = 0.0, bias=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if triton is None:
        raise ValueError("GEMV: Triton is not importable")
    N, K = w.shape
    if gated:
        if N % 2:
            raise ValueError(f"GEMV: gate_up weight {tuple(w.shape)} has an odd row count")
        N //= 2
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != K or x.stride(1) != 1:
        raise ValueError(f"GEMV: x {tuple(x.shape)} / strides {x.stride()} is not one row matching W {tuple(w.shape)}")
    if not w.is_contiguous() or w.dtype != x.dtype:
        raise ValueError("GEMV: W must be contiguous and of x's dtype")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"GEMV: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if norm and (gamma is None or gamma.shape != (K,)):
        raise ValueError(f"GEMV: the norm weight must be [{K}]")
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    h = torch.empty(1, K, dtype=x.dtype, device=x.device) if residual is not None else None
    global num_launches
    num_launches += 1
    bn, bk, warps, stages, pre = pick_config(op, N, K)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, residual if residual is not None else x, h if h is not None else y,
        gamma if gamma is not None else w, w, w.stride(0), bias if bias is not None else w, y, N, K, float(eps),
        NORM=norm, HAS_RES=residual is not None, GATED=gated, HAS_BIAS=bias is not None, EVEN_K=K % bk == 0,
        BLOCK_N=bn, BLOCK_K=bk, PREFETCH=bool(pre), num_warps=warps, num_stages=stages, **launch_kwargs(x))
    return y, h


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, op: str = "o") -> torch.Tensor:
    """x [1, K] W^T (+ bias) -> [1, N] (``op`` picks the block config)."""
    return _launch(op, x, w, False, False, bias=bias)[0]


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, gamma: torch.Tensor, eps: float,
                w: torch.Tensor, bias: torch.Tensor | None = None,
                op: str = "qkv") -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) W^T + bias [1, N], x + residual [1, K]); without residual the second item is x."""
    y, h = _launch(op, x, w, True, False, residual=residual, gamma=gamma, eps=eps, bias=bias)
    return y, (h if h is not None else x)


def norm_gate_up(x: torch.Tensor, residual: torch.Tensor | None, gamma: torch.Tensor, eps: float,
                 w: torch.Tensor, op: str = "gate_up") -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(g) * u [1, I], x + residual [1, K]) where [g | u] = rmsnorm(x + residual) W^T, W [2I, K]."""
    y, h = _launch(op, x, w, True, True, residual=residual, gamma=gamma, eps=eps)
    return y, (h if h is not None else x)
