"""Tensor-parallel building blocks: linears, vocab-parallel embedding/head, RMSNorm, RoPE, SiLU-and-mul.

Parameter names follow the Hugging Face checkpoint keys; each parameter carries a ``weight_loader``
that takes the full checkpoint tensor and keeps this TP rank's shard.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import fused as kernels
from ..dist import ps, tp_all_gather, tp_all_reduce


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

    def __init__(self, dim: int, eps: float, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [T, H] (or [T, heads, D] for q/k norm) -> normed; with ``residual``: (normed, x + residual).
        On CUDA bf16/fp16 the FlashInfer kernel may update ``x`` and ``residual`` in place."""
        if residual is None:
            return kernels.rmsnorm(x, self.weight, self.eps)
        return kernels.add_rmsnorm(x, residual, self.weight, self.eps)


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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T] int64 -> rotated (q, k), same dtype
        (on CUDA bf16/fp16 rotated in place by FlashInfer's kernel)."""
        return kernels.rope(positions, q, k, self.cos, self.sin, self.cos_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] [T, I]."""
    return kernels.silu_and_mul(x)
