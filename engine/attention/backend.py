"""Forward context and attention backends. A forward reads its batch layout from the module-level
:class:`ForwardContext` (mini-sglang's pattern), so ``model.forward`` takes only ``(input_ids, positions)``.

Layout of one forward (B requests, T new tokens in total):
  * ``qo_indptr``   [B+1] python ints: request i's new tokens are rows qo_indptr[i]:qo_indptr[i+1].
  * ``kv_indices``  list of B int64 tensors: the KV slots request i attends to, in position order,
                    including the slots of its new tokens (written before attention).
  * ``custom_mask`` list of B bool tensors [q_len, kv_len] or None (None = causal, aligned to the end).
  * ``out_cache_loc`` [T] int64: the slot each new token's K/V is written to.
  * ``device_layout`` (optional): a :class:`engine.attention.device.DeviceLayout`; :func:`attend` then runs
                    ``engine.attention.device`` (``kv_indices`` and ``qo_indptr`` unused).
  * ``tree_mask`` [B, n, n] bool (where the tree is: host, or device with ``spec_device_tree``) +
                    ``prefix_lens`` (B host ints): a verify forward; request i's mask is then
                    ``[n, prefix_lens[i] + n]`` (:func:`request_masks`); ``custom_mask`` is None then.
With ``pool=None`` (training / reference) each request attends causally to its own new tokens only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..messages import D2H_COPIES, d2h, h2d, pinned  # noqa: F401  (re-exported)
from .device import attention as device_attention


@dataclass
class ForwardContext:
    qo_indptr: list[int]
    kv_indices: list[torch.Tensor] | None = None
    custom_mask: list[torch.Tensor | None] | None = None
    out_cache_loc: torch.Tensor | None = None
    pool: object = None                    # KVPool (kv_cache [layers][slots, 2, Hk, D]) or None
    mode: str = "extend"                   # extend | decode | verify
    backend_state: dict = field(default_factory=dict)
    tree_mask: torch.Tensor | None = None  # [B, n, n] bool verify tree masks, with prefix_lens
    prefix_lens: list[int] | None = None
    device_layout: object = None           # engine.attention.device.DeviceLayout: the whole layout in device
                                           # tensors (the overlapped EAGLE round); the backend is bypassed


def request_masks(ctx: ForwardContext) -> list[torch.Tensor | None]:
    """Per-request custom masks ``[q_len, kv_len]`` bool (None = causal): ``ctx.custom_mask``, or for a
    verify tree ``cat(ones(n, L_i), tree_mask[i])`` built on ``tree_mask``'s device."""
    B = len(ctx.qo_indptr) - 1
    if ctx.tree_mask is not None:
        tm = ctx.tree_mask
        n = tm.shape[1]
        return [torch.cat([torch.ones(n, int(L), dtype=torch.bool, device=tm.device), tm[i]], 1)
                for i, L in enumerate(ctx.prefix_lens)]
    return list(ctx.custom_mask) if ctx.custom_mask is not None else [None] * B


_CTX: ForwardContext | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _CTX
    _CTX = ctx


def get_context() -> ForwardContext:
    assert _CTX is not None, "no forward context set"
    return _CTX


class TorchBackend:
    """Reference attention: one padded SDPA over K/V gathered from the slot pool (CPU, tests, GPU fallback).

    ``prepare`` builds the padded layout [B, max_q] x [B, max_kv] and the boolean mask once per forward.
    """

    name = "torch"

    def prepare(self, ctx: ForwardContext) -> None:
        qo = ctx.qo_indptr
        B = len(qo) - 1
        qlens = [qo[i + 1] - qo[i] for i in range(B)]
        if ctx.pool is None:
            kvs = [torch.arange(qo[i], qo[i + 1]) for i in range(B)]
        else:
            kvs = [k.cpu() for k in ctx.kv_indices]
        T = qo[-1]
        mq, mk = max(qlens), max(len(k) for k in kvs)
        q_index = torch.full((B, mq), T, dtype=torch.int64)
        kv_index = torch.zeros(B, mk, dtype=torch.int64)
        mask = torch.zeros(B, mq, mk, dtype=torch.bool)
        masks = request_masks(ctx)
        for i in range(B):
            ql, kl = qlens[i], len(kvs[i])
            q_index[i, :ql] = torch.arange(qo[i], qo[i + 1])
            kv_index[i, :kl] = kvs[i]
            m = masks[i]
            mask[i, :ql, :kl] = m.cpu() if m is not None else torch.ones(ql, kl, dtype=torch.bool).tril(kl - ql)
            mask[i, ql:, 0] = True                      # padded query rows: attend somewhere (ignored)
        dev = ctx.out_cache_loc.device if ctx.out_cache_loc is not None else None
        st = ctx.backend_state
        st["q_index"], st["kv_index"], st["mask"] = q_index, kv_index, mask.unsqueeze(1)
        st["valid"] = (q_index < T).reshape(-1)
        st["dev"] = dev

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int,
                scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] (new tokens; None: already in the pool at out_cache_loc, e.g.
        by ``engine.kernels.rope_store``) -> [T, Hq, D]."""
        ctx = get_context()
        st = ctx.backend_state
        dev = q.device
        if st.get("on") != dev:
            for key in ("q_index", "kv_index", "mask", "valid"):
                st[key] = st[key].to(dev)
            st["on"] = dev
        pool = ctx.pool
        if pool is not None:
            if k is not None:
                pool.store(layer, ctx.out_cache_loc, k, v)
            kk, vv = pool.k_cache[layer][st["kv_index"]], pool.v_cache[layer][st["kv_index"]]
        else:
            kk, vv = k[st["kv_index"]], v[st["kv_index"]]
        T, hq, D = q.shape
        hk = kk.shape[2]
        qp = torch.cat([q, q.new_zeros(1, hq, D)])[st["q_index"]]       # [B, mq, Hq, D]
        if hq != hk:
            kk = kk.repeat_interleave(hq // hk, dim=2)
            vv = vv.repeat_interleave(hq // hk, dim=2)
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                           attn_mask=st["mask"], scale=scale)        # [B, Hq, mq, D]
        o = o.transpose(1, 2).reshape(-1, hq, D)[st["valid"]]
        out = q.new_empty(T, hq, D)
        out[st["q_index"].reshape(-1)[st["valid"]]] = o
        return out


_BACKEND = TorchBackend()


def attend(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int, scale: float) -> torch.Tensor:
    """Attention of one layer for the current context: q [T, Hq, D], k/v [T, Hk, D] or None (already stored)
    -> [T, Hq, D]: :func:`engine.attention.device.attention` with ``ctx.device_layout``, else the backend's."""
    ctx = get_context()
    if ctx.device_layout is None:
        return _BACKEND.forward(q, k, v, layer, scale)
    if k is not None:
        ctx.pool.store(layer, ctx.out_cache_loc, k, v)
    return device_attention(q, ctx.pool.kv_cache[layer], ctx.device_layout, scale)


def get_backend():
    return _BACKEND


def set_backend(backend) -> None:
    global _BACKEND
    _BACKEND = backend
