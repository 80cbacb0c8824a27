"""Tensor-parallel building blocks: linears, vocab-parallel embedding/head, RMSNorm, RoPE, SiLU-and-mul; the torch
reference ops (the twins of engine/kernels/) and :class:`Kernels`, the fast kernels a model may take.

Parameter names follow the Hugging Face checkpoint keys; each parameter carries a ``weight_loader``
that takes the full checkpoint tensor and keeps this TP rank's shard.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import fused
from ..dist import ps, tp_all_gather, tp_all_reduce


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The fast kernels (engine/kernels/) a model's modules may take, chosen once before the first forward: the
    runner applies the plan's choice (:meth:`from_plan`, :func:`use_kernels`); a model built directly keeps the
    default, every kernel allowed where its per-tensor gate (device, dtype, rows, knobs) lets it run. A kernel off
    here is never entered: its torch reference runs."""

    fused: bool = True                    # FlashInfer RMSNorm / add-RMSNorm / SiLU-and-mul / RoPE
    rope_store: bool = True               # RoPE + KV store in one Triton kernel
    argmax: bool = True                   # Triton row argmax of the LM head
    gemv: bool = True                     # one-row GEMV linears
    skinny: bool = True                   # few-row fused linears

    @classmethod
    def from_plan(cls, plan) -> "Kernels":
        """The choice of an ``engine.plan.ExecutionPlan`` (its ``kernels`` and ``linear``)."""
        k, li = plan.kernels, plan.linear
        return cls(k["fused_ops"], k["rope_store"], k["triton_argmax"], li["gemv"], li["skinny"])


def use_kernels(model: nn.Module, kernels: Kernels) -> nn.Module:
    """Give every module of ``model`` that takes a :class:`Kernels` choice this one; returns ``model``."""
    for m in model.modules():
        if hasattr(m, "kernels"):
            m.kernels = kernels
    return model


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (or [T, heads, D]) -> x / sqrt(mean(x^2) + eps) * w, statistics in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox-style (rotate-half) RoPE of q [T, Hq, D] and k [T, Hk, D] at positions [T] int64 in float32, cast back;
    ``cos`` / ``sin`` [P, D/2] float32. Returns new (q, k)."""
    c = torch.cat([cos[positions], cos[positions]], -1).unsqueeze(1)
    s = torch.cat([sin[positions], sin[positions]], -1).unsqueeze(1)
    out = []
    for x in (q, k):
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        out.append((xf * c + torch.cat([-x2, x1], -1) * s).to(x.dtype))
    return tuple(out)


def fused_linear_ref(x, w, residual=None, gamma=None, eps: float = 0.0, bias=None, norm: bool = False,
                     gated: bool = False):
    """The unfused computation of engine.kernels.gemv / skinny (their tests' oracle): h = x + residual (or x),
    y = (rmsnorm(h) if ``norm`` else h) W^T + bias, then silu(g) * u of y's halves when ``gated``.
    Returns (y, h or None without a residual)."""
    h = x + residual if residual is not None else x
    y = F.linear(rmsnorm_ref(h, gamma, eps) if norm else h, w, bias)
    if gated:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    return y, (h if residual is not None else None)


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+b), W split by output rows across TP ranks; ``sections`` fuse several HF weights.

    sections: list of (hf_suffix, full_out_features, replicate_when_tp_exceeds) in output order.
    """

    def __init__(self, in_features: int, sections: list[tuple[str, int, int]], bias: bool, dtype):
        super().__init__()
        s = ps()
        self.sections = []
        off = 0
        for name, full, n_heads in sections:
            # n_heads: head count of this section (for KV replication when tp > kv heads), 0 = plain
            if n_heads and s.tp_size > n_heads:
                local = full // n_heads
                rank_src, size_src = s.tp_rank * n_heads // s.tp_size, n_heads
            else:
                local = full // s.tp_size
                rank_src, size_src = s.tp_rank, s.tp_size
            self.sections.append((name, off, local, rank_src, size_src))
            off += local
        self.weight = nn.Parameter(torch.empty(off, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(off, dtype=dtype), requires_grad=False) if bias else None

    def load(self, section: str, param: str, full: torch.Tensor) -> None:
        for name, off, local, r, sz in self.sections:
            if name == section:
                dst = self.weight if param == "weight" else self.bias
                dst.data[off:off + local].copy_(_shard(full, 0, r, sz))
                return
        raise KeyError(section)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T), W split by input columns across TP ranks."""

    def __init__(self, in_features: int, out_features: int, dtype):
        super().__init__()
        s = ps()
        self.weight = nn.Parameter(torch.empty(out_features, in_features // s.tp_size, dtype=dtype),
                                   requires_grad=False)

    def load(self, full: torch.Tensor) -> None:
        s = ps()
        self.weight.data.copy_(_shard(full, 1, s.tp_rank, s.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; out-of-shard ids contribute zeros, then all-reduce."""

    def __init__(self, vocab_size: int, hidden: int, dtype):
        super().__init__()
        s = ps()
        self.vocab_size = vocab_size
        self.shard = math.ceil(vocab_size / s.tp_size)
        self.start = s.tp_rank * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden, dtype=dtype), requires_grad=False)

    def load(self, full: torch.Tensor) -> None:
        rows = full[self.start:self.start + self.shard]
        self.weight.data.zero_()
        self.weight.data[:rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ps().tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out = out.masked_fill(mask.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """LM head split by vocabulary rows; logits all-gathered so every TP rank holds the full row."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.weight)
        if ps().tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)
        return logits[..., :self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF Llama); ``forward(x, residual)`` fuses the residual add."""

    kernels = Kernels()

    def __init__(self, dim: int, eps: float, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [T, H] (or [T, heads, D] for q/k norm) -> normed; with ``residual``: (normed, x + residual).
        On CUDA bf16/fp16 the FlashInfer kernel may update ``x`` and ``residual`` in place."""
        if self.kernels.fused:
            out = (fused.rmsnorm(x, self.weight, self.eps) if residual is None
                   else fused.add_rmsnorm(x, residual, self.weight, self.eps))
            if out is not None:
                return out
        if residual is None:
            return rmsnorm_ref(x, self.weight, self.eps)
        s = x + residual
        return rmsnorm_ref(s, self.weight, self.eps), s


def _llama3_inv_freq(inv_freq: torch.Tensor, rs: dict) -> torch.Tensor:
    factor = rs.get("factor", 8.0)
    low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with optional llama3 / linear scaling; cos/sin cached per position."""

    kernels = Kernels()

    def __init__(self, head_dim: int, max_pos: int, base: float, rope_scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        rtype = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rtype == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rtype == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        t = torch.arange(max_pos, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], -1).float(), persistent=False)

    @classmethod
    def for_model(cls, cfg, max_pos: int) -> "RotaryEmbedding":
        """The RoPE of a ``ModelConfig`` (its head_dim, rope_theta and rope_scaling) cached for ``max_pos``
        positions: the one a target stage and its draft layers share the layout of."""
        return cls(cfg.head_dim, max_pos, cfg.rope_theta, dict(cfg.rope_scaling) if cfg.rope_scaling else None)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T] int64 -> rotated (q, k), same dtype
        (on CUDA bf16/fp16 rotated in place by FlashInfer's kernel)."""
        if self.kernels.fused and (out := fused.rope(positions, q, k, self.cos_sin)) is not None:
            return out
        return rope_ref(positions, q, k, self.cos, self.sin)


def silu_and_mul(x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] [T, I] (FlashInfer's kernel when ``kernels.fused`` and x takes it)."""
    if kernels.fused and (out := fused.silu_and_mul(x)) is not None:
        return out
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u
