"""Per-request attention over the KV slot pool, the CPU default (:class:`RaggedTorchBackend`); the padded
:class:`engine.attention.backend.TorchBackend` is its reference twin (tests/test_ragged_attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import ForwardContext, TorchBackend, get_context, request_masks


RAGGED_VIEW_MAX_Q = 16                     # requests with at most this many new tokens: segmented attention on views


def _head_run(slots: torch.Tensor) -> int:
    """Length of the leading run of consecutive slot ids in ``slots`` (1-D int64, host)."""
    if slots.numel() < 2:
        return int(slots.numel())
    brk = torch.nonzero(slots[1:] - slots[:-1] != 1)
    return int(brk[0, 0]) + 1 if brk.numel() else int(slots.numel())


class RaggedTorchBackend(TorchBackend):
    """Per-request attention over the slot pool (the CPU default); :class:`TorchBackend` is its reference twin.
    Same inputs and semantics as :class:`TorchBackend`, without padding: each request runs alone (one SDPA per
    request above ``RAGGED_VIEW_MAX_Q`` new tokens; below it the leading run of consecutive slots is read as a view
    of the pool and only the rest gathered).
    """

    name = "ragged"

    def prepare(self, ctx: ForwardContext) -> None:
        qo = ctx.qo_indptr
        B = len(qo) - 1
        masks = request_masks(ctx)
        dev = ctx.out_cache_loc.device if ctx.out_cache_loc is not None else None
        plan = []
        for i in range(B):
            q0, q1 = qo[i], qo[i + 1]
            ql = q1 - q0
            if ctx.pool is None:
                slots, kl, head = None, ql, ql
            else:
                slots = ctx.kv_indices[i].cpu()
                kl = int(slots.numel())
                head = _head_run(slots)
            m = masks[i]
            causal = False
            if m is None and ql > 1:
                if ql == kl and ql > RAGGED_VIEW_MAX_Q:
                    causal = True
                else:
                    m = torch.ones(ql, kl, dtype=torch.bool).tril(kl - ql)
            a = int(slots[0]) if slots is not None and kl else 0
            tail = slots[head:] if slots is not None and head < kl else None
            plan.append([q0, q1, kl, a, head, tail, m, causal])
        st = ctx.backend_state
        st["plan"], st["dev"], st["on"] = plan, dev, None

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int,
                scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] (new tokens; None: already in the pool at out_cache_loc) -> [T, Hq, D]."""
        ctx = get_context()
        st = ctx.backend_state
        dev = q.device
        if st.get("on") != dev:
            for e in st["plan"]:
                e[5] = e[5].to(dev) if e[5] is not None else None
                e[6] = e[6].to(dev) if e[6] is not None else None
            st["on"] = dev
        pool = ctx.pool
        if pool is not None:
            if k is not None:
                pool.store(layer, ctx.out_cache_loc, k, v)
            kc, vc = pool.k_cache[layer], pool.v_cache[layer]
        T, hq, D = q.shape
        out = q.new_empty(T, hq, D)
        for q0, q1, kl, a, head, tail, m, causal in st["plan"]:
            ql = q1 - q0
            if pool is None:
                parts = [(k[q0:q1], v[q0:q1])]
            else:
                parts = [(kc[a:a + head], vc[a:a + head])]
                if tail is not None:
                    parts.append((kc[tail], vc[tail]))
            qi = q[q0:q1]
            if ql <= RAGGED_VIEW_MAX_Q:
                out[q0:q1] = _segmented(qi, parts, m, scale)
                continue
            if len(parts) > 1:
                parts = [(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))]
            kk, vv = parts[0]
            hk = kk.shape[1]
            o = F.scaled_dot_product_attention(qi.transpose(0, 1).unsqueeze(0), kk.transpose(0, 1).unsqueeze(0),
                                               vv.transpose(0, 1).unsqueeze(0), attn_mask=m, is_causal=causal,
                                               scale=scale, enable_gqa=hq != hk)
            out[q0:q1] = o[0].transpose(0, 1)
        return out


def _segmented(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """Exact attention of q [ql, Hq, D] over K/V given as consecutive segments [(k [n, Hk, D], v [n, Hk, D]), ...]
    (views or copies), with an optional bool mask [ql, sum n] (True = attend; None = every key) -> [ql, Hq, D]."""
    ql, hq, D = q.shape
    hk = parts[0][0].shape[1]
    g = hq // hk
    qg = (q * scale).view(ql, hk, g, D).permute(1, 2, 0, 3).reshape(hk, g * ql, D)
    s = torch.cat([torch.matmul(qg, kk.permute(1, 2, 0)) for kk, _ in parts], -1)      # [Hk, g*ql, kv]
    if mask is not None:
        s.view(hk, g, ql, -1).masked_fill_(~mask, float("-inf"))
    p = torch.softmax(s, -1)
    o, off = None, 0
    for kk, vv in parts:
        n = kk.shape[0]
        t = torch.matmul(p[:, :, off:off + n], vv.transpose(0, 1))                     # [Hk, g*ql, D]
        o = t if o is None else o.add_(t)
        off += n
    return o.view(hk, g, ql, D).permute(2, 0, 1, 3).reshape(ql, hq, D)
