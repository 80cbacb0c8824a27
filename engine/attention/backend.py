"""Forward context and attention backends.

A forward pass reads its batch layout from the module-level :class:`ForwardContext` (mini-sglang's
pattern), so ``model.forward`` takes only ``(input_ids, positions)``.

Layout of one forward (B requests, T new tokens in total):
  * ``qo_indptr``   [B+1] python ints: request i's new tokens are rows qo_indptr[i]:qo_indptr[i+1].
  * ``kv_indices``  list of B int64 tensors: the KV slots request i attends to, in position order,
                    including the slots of its new tokens (written before attention).
  * ``custom_mask`` list of B bool tensors [q_len, kv_len] or None (None = causal, aligned to the end).
  * ``out_cache_loc`` [T] int64: the slot each new token's K/V is written to.
  * ``device_layout`` (optional): a :class:`engine.attention.device.DeviceLayout` (page table, lengths, tail
                    slots and masks as device tensors, nothing planned on the host); :func:`attend` then runs
                    ``engine.attention.device`` instead of the backend (``kv_indices`` and ``qo_indptr`` unused).
  * ``tree_mask`` [B, n, n] bool (where the tree is: host, or device with ``spec_device_tree``) +
                    ``prefix_lens`` (B host ints): a verify forward; request i's mask is then
                    ``[n, prefix_lens[i] + n]`` = all committed tokens, then its tree block
                    (see :func:`request_masks`). ``custom_mask`` is None in that case.
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


def pinned(t: torch.Tensor, dev) -> torch.Tensor:
    """``t`` in pinned memory when it is a host tensor bound for a CUDA ``dev`` (so a ``non_blocking``
    copy is truly asynchronous); ``t`` itself otherwise."""
    return t.pin_memory() if torch.device(dev).type == "cuda" and t.device.type == "cpu" else t


def h2d(t: torch.Tensor, dev) -> torch.Tensor:
    """Host tensor -> ``dev`` without a stream sync: on CUDA the copy goes from pinned memory with
    ``non_blocking`` (a blocking copy from pageable memory waits for every queued kernel first)."""
    if torch.device(dev).type != "cuda" or t.device.type != "cpu":
        return t.to(dev)
    return pinned(t, dev).to(dev, non_blocking=True)


D2H_COPIES = [0]                           # device->host copies made through d2h (the PP metrics count them)


def d2h(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host; an accelerator tensor is copied (blocking: it waits for the work producing ``t``) and
    counted in ``D2H_COPIES``."""
    if t.device.type == "cpu":
        return t
    D2H_COPIES[0] += 1
    return t.cpu()


def set_context(ctx: ForwardContext | None) -> None:
    global _CTX
    _CTX = ctx


def get_context() -> ForwardContext:
    assert _CTX is not None, "no forward context set"
    return _CTX


class TorchBackend:
    """Reference attention: one padded SDPA over K/V gathered from the slot pool (CPU, tests, GPU fallback).

    ``prepare`` builds, once per forward, the padded layout [B, max_q] x [B, max_kv] and the boolean
    mask (causal or the request's custom tree mask); each layer then does one gather and one SDPA.
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


RAGGED_VIEW_MAX_Q = 16                     # requests with at most this many new tokens: segmented attention on views


def _head_run(slots: torch.Tensor) -> int:
    """Length of the leading run of consecutive slot ids in ``slots`` (1-D int64, host)."""
    if slots.numel() < 2:
        return int(slots.numel())
    brk = torch.nonzero(slots[1:] - slots[:-1] != 1)
    return int(brk[0, 0]) + 1 if brk.numel() else int(slots.numel())


class RaggedTorchBackend(TorchBackend):
    """Per-request attention over the slot pool (the CPU default); :class:`TorchBackend` is its reference twin.

    Same inputs and semantics as :class:`TorchBackend` (causal aligned to the end, or the request's custom / tree
    mask), but nothing is padded and no B x max_q x max_kv mask is built: each request runs alone.

    * Many new tokens (prefill, more than ``RAGGED_VIEW_MAX_Q``): one SDPA per request (``is_causal`` when the
      request's new tokens are its whole context, the end-aligned mask otherwise), K/V read as a view of the pool
      when the request's slots are one run of consecutive ids, else gathered; GQA without repeating heads.
    * Few new tokens (decode, verify): the leading run of consecutive slots (the prompt, allocated at admission) is
      read in place as a view and only the rest is gathered; scores of both parts are concatenated, masked,
      softmaxed once and applied to each part (exact, no K/V copy of the prompt).
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


_BACKEND = TorchBackend()


def attend(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int, scale: float) -> torch.Tensor:
    """Attention of one layer for the current context: q [T, Hq, D], k/v [T, Hk, D] or None (already stored)
    -> [T, Hq, D]. With ``ctx.device_layout`` the new K/V are stored at ``out_cache_loc`` and
    :func:`engine.attention.device.attention` runs over the device layout; otherwise the backend's ``forward``."""
    ctx = get_context()
    if ctx.device_layout is None:
        return _BACKEND.forward(q, k, v, layer, scale)
    from .device import attention
    if k is not None:
        ctx.pool.store(layer, ctx.out_cache_loc, k, v)
    return attention(q, ctx.pool.kv_cache[layer], ctx.device_layout, scale)


def get_backend():
    return _BACKEND


def set_backend(backend) -> None:
    global _BACKEND
    _BACKEND = backend
