"""Forward context and attention backends.

A forward pass reads its batch layout from the module-level :class:`ForwardContext` (mini-sglang's
pattern), so ``model.forward`` takes only ``(input_ids, positions)``.

Layout of one forward (B requests, T new tokens in total):
  * ``qo_indptr``   [B+1] python ints: request i's new tokens are rows qo_indptr[i]:qo_indptr[i+1].
  * ``kv_indices``  list of B int64 tensors: the KV slots request i attends to, in position order,
                    including the slots of its new tokens (written before attention).
  * ``custom_mask`` list of B bool tensors [q_len, kv_len] or None (None = causal, aligned to the end).
  * ``out_cache_loc`` [T] int64: the slot each new token's K/V is written to.
With ``pool=None`` (training / reference) each request attends causally to its own new tokens only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class ForwardContext:
    qo_indptr: list[int]
    kv_indices: list[torch.Tensor] | None = None
    custom_mask: list[torch.Tensor | None] | None = None
    out_cache_loc: torch.Tensor | None = None
    pool: object = None                    # KVPool (k_cache/v_cache [layers, slots, Hk, D]) or None
    mode: str = "extend"                   # extend | decode | verify
    backend_state: dict = field(default_factory=dict)


_CTX: ForwardContext | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _CTX
    _CTX = ctx


def get_context() -> ForwardContext:
    assert _CTX is not None, "no forward context set"
    return _CTX


class TorchBackend:
    """Reference attention: SDPA per request over K/V gathered from the slot pool (CPU and tests)."""

    name = "torch"

    def prepare(self, ctx: ForwardContext) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] (new tokens) -> [T, Hq, D]."""
        ctx = get_context()
        pool = ctx.pool
        if pool is not None:
            pool.k_cache[layer][ctx.out_cache_loc] = k
            pool.v_cache[layer][ctx.out_cache_loc] = v
        out = torch.empty_like(q)
        hq, hk = q.shape[1], k.shape[1]
        for i in range(len(ctx.qo_indptr) - 1):
            s, e = ctx.qo_indptr[i], ctx.qo_indptr[i + 1]
            if e == s:
                continue
            if pool is None:
                kk, vv = k[s:e], v[s:e]
            else:
                idx = ctx.kv_indices[i]
                kk, vv = pool.k_cache[layer][idx], pool.v_cache[layer][idx]
            ql, kl = e - s, kk.shape[0]
            mask = ctx.custom_mask[i] if ctx.custom_mask is not None else None
            if mask is None:
                mask = torch.ones(ql, kl, dtype=torch.bool, device=q.device).tril(kl - ql)
            if hq != hk:
                kk = kk.repeat_interleave(hq // hk, dim=1)
                vv = vv.repeat_interleave(hq // hk, dim=1)
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                               attn_mask=mask, scale=scale)
            out[s:e] = o.transpose(0, 1)
        return out


_BACKEND = TorchBackend()


def get_backend():
    return _BACKEND


def set_backend(backend) -> None:
    global _BACKEND
    _BACKEND = backend
