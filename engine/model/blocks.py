"""The decoder layer's linears with their fusions: add-RMSNorm + QKV, add-RMSNorm + gate_up + SiLU-and-mul, and
the row-parallel o_proj / down_proj, each choosing its kernel path once per weight.

Paths (engine/plan.py's ``linear`` policy): ``gemv`` (engine/kernels/gemv.py: one row, a weight above
``PPSPEC_GEMV_MIN_W`` elements), ``skinny`` (engine/kernels/skinny.py: at most 16 rows, a weight of at most
``PPSPEC_SKINNY_MAX_W`` elements), else ``unfused`` (FlashInfer / torch norm and activation, cuBLAS / torch linear).
The weight-size test is resolved once per :class:`engine.knobs.Knobs`; the row / device / dtype test runs per call.
The modules hold their norm and linear by reference: checkpoint names stay those of ``self_attn`` / ``mlp`` / norms.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import knobs
from ..dist import tp_all_reduce
from ..kernels import gemv, skinny
from .layers import silu_and_mul


class _Routed(nn.Module):
    """A fused linear over ``linear`` (weight [N, K]) named ``op`` (one of gemv.OPS)."""

    def __init__(self, linear: nn.Module, op: str):
        super().__init__()
        self._refs = (linear,)            # a tuple: not registered, so no second copy of the parameters
        self.op = op
        self._kn = None
        self._gemv_w = self._skinny_w = False

    @property
    def linear(self) -> nn.Module:
        return self._refs[0]

    def path(self, x: torch.Tensor) -> str:
        """``gemv``, ``skinny`` or ``unfused`` for activations ``x`` [M, K]."""
        kn = knobs.current()
        if self._kn is not kn:            # once per weight and knob set
            w = self.linear.weight
            self._kn, self._gemv_w, self._skinny_w = kn, w.numel() > kn.gemv_min_w and self.op in gemv.OPS, skinny.fits(w)
        if self._gemv_w and gemv.enabled(x):
            return "gemv"
        if self._skinny_w and skinny.enabled(x):
            return "skinny"
        return "unfused"


class NormLinear(_Routed):
    """add-RMSNorm then a column-parallel linear (QKV): (hidden [T, K], residual [T, K] or None) ->
    (linear(rmsnorm(hidden + residual)) [T, N], hidden + residual [T, K]). ``norm`` None: identity norm."""

    def __init__(self, norm: nn.Module | None, linear: nn.Module, op: str = "qkv"):
        super().__init__(linear, op)
        self._norm = (norm,)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        norm, lin = self._norm[0], self.linear
        if norm is None:
            hidden = hidden if residual is None else hidden + residual
            return lin(hidden), hidden
        path = self.path(hidden)
        if path == "gemv":
            return gemv.norm_linear(hidden, residual, norm.weight, norm.eps, lin.weight, lin.bias, op=self.op)
        if path == "skinny":
            return skinny.norm_linear(hidden, residual, norm.weight, norm.eps, lin.weight, lin.bias)
        if residual is None:
            return lin(norm(hidden)), hidden
        x, residual = norm(hidden, residual)
        return lin(x), residual


class NormGateUp(_Routed):
    """add-RMSNorm, the gate_up linear (weight [2I, K]: gate rows then up rows) and SiLU-and-mul:
    (hidden [T, K], residual [T, K]) -> (silu(g) * u [T, I], hidden + residual [T, K])."""

    def __init__(self, norm: nn.Module, linear: nn.Module, op: str = "gate_up"):
        super().__init__(linear, op)
        self._norm = (norm,)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor):
        norm, lin = self._norm[0], self.linear
        path = self.path(hidden)
        if path == "gemv":
            return gemv.norm_gate_up(hidden, residual, norm.weight, norm.eps, lin.weight, op=self.op)
        if path == "skinny":
            return skinny.norm_gate_up(hidden, residual, norm.weight, norm.eps, lin.weight)
        x, residual = norm(hidden, residual)
        return silu_and_mul(lin(x)), residual


class RowLinear(_Routed):
    """A row-parallel linear (o_proj, down_proj): x [T, K / tp] -> all-reduced x W^T [T, N]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path(x)
        if path == "gemv":
            return tp_all_reduce(gemv.linear(x, self.linear.weight, op=self.op))
        if path == "skinny":
            return tp_all_reduce(skinny.linear(x, self.linear.weight))
        return self.linear(x)
