"""Plain-torch reference of :func:`engine.attention.device.attention` (the CPU path), and the shape checks both
paths share. The layout is an :class:`engine.attention.device.DeviceLayout` (see that module's docstring).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .device import DeviceLayout


def check_layout(q: torch.Tensor, kv_cache: torch.Tensor, layout: DeviceLayout,
           out: torch.Tensor | None = None) -> tuple[int, int, int, int, int, int]:
    """Shape checks shared by both paths -> (B, Q, Qt, Hq, Hk, D). Raises ValueError (one line)."""
    lay = layout
    if q.dim() != 3:
        raise ValueError(f"dev_attention: q must be [B*Q, Hq, D], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 4 or kv_cache.shape[1] != 2:
        raise ValueError(f"dev_attention: kv_cache must be [num_slots, 2, Hk, D], got shape {tuple(kv_cache.shape)}")
    if lay.tail_mask.dim() != 3 or lay.tail_slots.dim() != 2 or lay.rows.dim() != 1 \
            or lay.prefix_lens.dim() != 1 or lay.req_to_token.dim() != 2:
        raise ValueError("dev_attention: layout ranks must be req_to_token [R, max_len], rows [B], prefix_lens [B], "
                         "tail_slots [B, Qt], tail_mask [B, Q, Qt]")
    B, Q, Qt = lay.tail_mask.shape
    Hq, D = q.shape[1], q.shape[2]
    Hk = kv_cache.shape[2]
    if tuple(lay.rows.shape) != (B,) or tuple(lay.prefix_lens.shape) != (B,) or tuple(lay.tail_slots.shape) != (B, Qt):
        raise ValueError(f"dev_attention: rows {tuple(lay.rows.shape)}, prefix_lens {tuple(lay.prefix_lens.shape)}, "
                         f"tail_slots {tuple(lay.tail_slots.shape)} do not match tail_mask [B={B}, Q={Q}, Qt={Qt}]")
    if lay.tail_mask.dtype != torch.bool:
        raise ValueError(f"dev_attention: tail_mask must be bool, got {lay.tail_mask.dtype}")
    for name in ("req_to_token", "rows", "prefix_lens", "tail_slots"):
        t = getattr(lay, name)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"dev_attention: layout.{name} must be an integer tensor, got {t.dtype}")
    if q.shape[0] != B * Q:
        raise ValueError(f"dev_attention: q has {q.shape[0]} rows, expected B*Q = {B}*{Q} = {B * Q}")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"dev_attention: Hq = {Hq} query heads is not a multiple of Hk = {Hk} KV heads")
    if kv_cache.shape[3] != D:
        raise ValueError(f"dev_attention: head dim of q ({D}) != head dim of kv_cache ({kv_cache.shape[3]})")
    if not isinstance(lay.num_splits, int) or lay.num_splits < 1:
        raise ValueError(f"dev_attention: num_splits must be a python int >= 1, got {lay.num_splits!r}")
    if out is not None and (tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype):
        raise ValueError(f"dev_attention: out {tuple(out.shape)} {out.dtype} must be {tuple(q.shape)} {q.dtype}")
    return B, Q, Qt, Hq, Hk, D


def attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, layout: DeviceLayout, scale: float) -> torch.Tensor:
    """Plain-torch :func:`attention` (same shapes and result; the CPU path): one batched gather of the prefix slots,
    padded to the longest prefix of the batch (read on the host), then the tail slots; a boolean mask; a float32
    softmax. Not CUDA-graph capturable (the host read).

    Args:
        q: [B*Q, Hq, D] (any strides), kv_cache: [num_slots, 2, Hk, D], layout: :class:`DeviceLayout`,
        scale: softmax scale (typically D ** -0.5).
    Returns:
        [B*Q, Hq, D] in q's dtype; zeros for a query row that sees no key.
    Raises:
        ValueError: inconsistent shapes (q rows != B*Q, Hq % Hk != 0, head dims differ, layout shapes disagree).
    """
    B, Q, Qt, Hq, Hk, D = check_layout(q, kv_cache, layout)
    G = Hq // Hk
    lay = layout
    dev = kv_cache.device
    lens = lay.prefix_lens.to(dev, torch.int64)
    Lmax = int(lens.max()) if B else 0
    Lmax = min(Lmax, lay.req_to_token.shape[1])
    pos = torch.arange(Lmax, device=dev)
    valid = pos[None, :] < lens[:, None]                                         # [B, Lmax]
    pre = lay.req_to_token[lay.rows.to(lay.req_to_token.device, torch.int64), :Lmax].to(dev, torch.int64)
    slots = torch.cat([torch.where(valid, pre, torch.zeros_like(pre)), lay.tail_slots.to(dev, torch.int64)], 1)
    mask = torch.cat([valid[:, None, :].expand(B, Q, Lmax), lay.tail_mask.to(dev)], 2)   # [B, Q, Lmax + Qt]
    kv = kv_cache[slots].float()                                                  # [B, Lk, 2, Hk, D]: one gather
    k, v = kv[:, :, 0], kv[:, :, 1]
    qf = q.float().reshape(B, Q, Hk, G, D)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qf, k) * scale
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)                      # rows that see nothing: -inf max
    e = torch.exp(s - m)
    p = e / e.sum(-1, keepdim=True).clamp_min(1.0)     # a non-empty row's sum is >= 1 (its max gives exp(0)); empty: 0
    o = torch.einsum("bhgqk,bkhd->bqhgd", p, v)
    return o.reshape(B * Q, Hq, D).to(q.dtype)
