"""Skinny GEMMs with fused prologues (Triton): the decode-time linears of a Llama layer, few rows each (the idea of
gpt-fast's compiled decode and TensorRT-LLM's GEMV plugins).

  * ``norm_linear(x, residual, gamma, eps, W, bias)``: h = x + residual (bf16 round), y = rmsnorm(h) W^T (+ bias);
    returns (y, h). Without a residual: h = x.
  * ``norm_gate_up(x, residual, gamma, eps, W)``: [g | u] = rmsnorm(h) W^T, y = silu(g) * u, one launch.
  * ``linear(x, W)``: y = x W^T, no prologue (o_proj, down_proj).

Shapes and dtypes: x [M, K] (row stride free, inner contiguous), residual [M, K], gamma [K], W [N, K] contiguous,
bias [N] or None; outputs [M, N] / [M, K] are fresh tensors of x's dtype (the residual is never updated in place).
Float32 accumulation and statistics; the normalised activation is rounded to the input dtype before the product.
Dispatch (:func:`enabled` and :func:`fits`): CUDA bf16/fp16, ``PPSPEC_SKINNY`` not 0, at most :data:`MAX_ROWS`
rows, weights of at most ``PPSPEC_SKINNY_MAX_W`` elements; under Triton's interpreter only with ``PPSPEC_SKINNY=1``.
Raises ValueError for layouts the kernels do not take.
"""
from __future__ import annotations

import torch

from .. import knobs
from .fused import launch_kwargs, use_fused

try:
    import triton
    import triton.language as tl
except Exception:                                 # noqa: BLE001 - no Triton: callers use the unfused path
    triton = None

MAX_ROWS = 16                                     # one BLOCK_M tile
num_launches = 0                                  # kernel launches in this process (tests check the path ran)
TUNE: tuple | None = None                         # (BLOCK_N, BLOCK_K, warps, stages) forced (tools.kernel_bench)


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused skinny kernels take activations ``x`` [M, K] (see the module docstring)."""
    kn = knobs.current()
    if triton is None or kn.skinny is False or x.dim() != 2:
        return False
    if kn.triton_interpret:                              # CPU interpreter: only when asked for by name (tests)
        if kn.skinny is not True:
            return False
    elif not use_fused(x):
        return False
    return x.shape[0] <= MAX_ROWS


def fits(w: torch.Tensor) -> bool:
    """Whether weight ``w`` [N, K] has at most ``PPSPEC_SKINNY_MAX_W`` elements."""
    return w.numel() <= knobs.current().skinny_max_w


def pick_config(N: int, K: int, gated: bool = False, norm: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for weight [N, K]: :data:`TUNE`, else narrow column strips (16; 32
    for the gated gate_up) and 256-wide K tiles; plain GEMMs with K <= 1024 take 128-wide tiles with 4 stages."""
    if TUNE:
        return TUNE
    bn = 32 if gated else 16
    if K < 256:
        return bn, max(16, triton.next_power_of_2(K)), 4, 3
    if not (gated or norm) and K <= 1024:
        return bn, 128, 4, 4
    return bn, 256, 4, 3


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, stride_xm, r_ptr, stride_rm, h_ptr, g_ptr, w_ptr, stride_wn, b_ptr, y_ptr,
                       stride_ym, M, N, K, eps,
                       NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:                               # the PDL contract: nothing is read before the wait
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mm = rm < M
        mn = rn < N
        xrow = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        rrow = r_ptr + rm.to(tl.int64)[:, None] * stride_rm
        hrow = h_ptr + rm.to(tl.int64)[:, None] * K
        wrow = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        urow = w_ptr + (rn + N).to(tl.int64)[:, None] * stride_wn          # GATED: the up half of W
        dt = x_ptr.dtype.element_ty
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM:
            # statistics pass first: a row reduction inside the GEMM loop stalls its weight pipeline
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                m2 = mm[:, None] & (kk < K)[None, :]
                h = tl.load(xrow + kk[None, :], mask=m2, other=0.0).to(tl.float32)
                if HAS_RES:
                    h = h + tl.load(rrow + kk[None, :], mask=m2, other=0.0).to(tl.float32)
                    h = h.to(dt).to(tl.float32)
                ss += tl.sum(h * h, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            mk = kk < K
            m2 = mm[:, None] & mk[None, :]
            if NORM:
                h = tl.load(xrow + kk[None, :], mask=m2, other=0.0).to(tl.float32)
                if HAS_RES:
                    h = h + tl.load(rrow + kk[None, :], mask=m2, other=0.0).to(tl.float32)
                    if pid_n == 0:
                        tl.store(hrow + kk[None, :], h.to(dt), mask=m2)
                    h = h.to(dt).to(tl.float32)
                g = tl.load(g_ptr + kk, mask=mk, other=0.0).to(tl.float32)
                a = ((h * rstd[:, None]).to(dt).to(tl.float32) * g[None, :]).to(dt)
            else:
                a = tl.load(xrow + kk[None, :], mask=m2, other=0.0)
            w = tl.load(wrow + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            acc += tl.dot(a, tl.trans(w))
            if GATED:
                u = tl.load(urow + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
                acc_u += tl.dot(a, tl.trans(u))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
        if GATED:
            gq = acc.to(dt).to(tl.float32)
            acc = gq / (1.0 + tl.exp(-gq)) * acc_u.to(dt).to(tl.float32)
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & mn[None, :])


def _launch(x: torch.Tensor, w: torch.Tensor, norm: bool, gated: bool, residual=None, gamma=None,
            eps: float = 0.0, bias=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if triton is None:
        raise ValueError("skinny GEMM: Triton is not importable")
    M = x.shape[0]
    N, K = w.shape
    if gated:
        if N % 2:
            raise ValueError(f"skinny GEMM: gate_up weight {tuple(w.shape)} has an odd row count")
        N //= 2
    if x.dim() != 2 or x.shape[1] != K or x.stride(1) != 1:
        raise ValueError(f"skinny GEMM: x {tuple(x.shape)} / strides {x.stride()} do not match W {tuple(w.shape)}")
    if not w.is_contiguous() or w.dtype != x.dtype:
        raise ValueError("skinny GEMM: W must be contiguous and of x's dtype")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"skinny GEMM: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    h = torch.empty(M, K, dtype=x.dtype, device=x.device) if residual is not None else None
    if M == 0:
        return y, h
    global num_launches
    num_launches += 1
    bn, bk, warps, stages = pick_config(N, K, gated, norm)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, 16))
    _skinny_kernel[grid](
        x, x.stride(0), residual if residual is not None else x,
        residual.stride(0) if residual is not None else 0, h if h is not None else y,
        gamma if gamma is not None else w, w, w.stride(0), bias if bias is not None else w, y, y.stride(0),
        M, N, K, float(eps), NORM=norm, GATED=gated, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **launch_kwargs(x))
    return y, h


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, gamma: torch.Tensor, eps: float,
                w: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) W^T + bias [M, N], x + residual [M, K]); without residual the second item is x."""
    y, h = _launch(x, w, True, False, residual=residual, gamma=gamma, eps=eps, bias=bias)
    return y, (h if h is not None else x)


def norm_gate_up(x: torch.Tensor, residual: torch.Tensor | None, gamma: torch.Tensor, eps: float,
                 w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(g) * u [M, I], x + residual [M, K]) where [g | u] = rmsnorm(x + residual) W^T, W [2I, K]
    (gate rows, then up rows: ColumnParallelLinear's gate_up layout)."""
    y, h = _launch(x, w, True, True, residual=residual, gamma=gamma, eps=eps)
    return y, (h if h is not None else x)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias): x [M, K], W [N, K] -> [M, N]."""
    return _launch(x, w, False, False, bias=bias)[0]

